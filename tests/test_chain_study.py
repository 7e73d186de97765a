"""examples/chain_study.py: the span-vote task it trains on is what its docstring says (one
span, isolated noise votes, the label the span's majority), its measures count what they
name, and the quick run trains every model, prints both tables and writes both figures;
on the synthetic rows the fixed chain prior does what the study reports."""
import pytest
import torch

from test_tools import load_script


@pytest.fixture(scope="module")
def example():
    return load_script("examples/chain_study.py")


def test_span_votes_has_one_span_and_isolated_noise_votes(example):
    tokens, labels, span, noise = example.span_votes(200, torch.Generator().manual_seed(3))
    assert tokens.shape == span.shape == noise.shape == (200, example.LENGTH) and labels.shape == (200,)
    assert (example.runs(span) == 1).all()
    assert sorted(set(span.sum(1).tolist())) == sorted(example.SPAN_LENGTHS)
    assert (noise.sum(1) == example.NOISE_VOTES).all() and not (noise & span).any()
    # Noise votes touch neither the span nor each other: every run of vote tokens but the span has length 1.
    assert (example.runs(span | noise) == 1 + example.NOISE_VOTES).all()
    is_vote = (tokens == example.VOTE_0) | (tokens == example.VOTE_1)
    assert torch.equal(is_vote, span | noise)
    ones_in_span = ((tokens == example.VOTE_1) & span).sum(1)
    assert torch.equal(labels, (2 * ones_in_span > span.sum(1)).long())
    assert 0.3 < labels.float().mean() < 0.7


def test_runs_and_head_measures_count_what_they_name(example):
    selected = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert example.runs(selected).tolist() == [2, 0, 1]
    weights = torch.tensor([[0.5, 0.25, 0.0, 0.25, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    span = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    noise = torch.tensor([[0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    measures = example.head_measures(weights, span, noise)
    expected = {"support": 2.5, "runs": 1.5, "span recall": (2 / 3 + 2 / 3) / 2, "span precision": (2 / 3 + 1) / 2,
                "noise votes kept": (1 / 2 + 0) / 2, "mass on span": (0.75 + 1) / 2, "exact 0": 7 / 12,
                "exact 1": 2 / 12}
    assert measures == pytest.approx(expected)


def test_all_votes_rule_counts_span_and_noise_votes(example):
    tokens, labels, span, noise = example.span_votes(300, torch.Generator().manual_seed(4))
    expected = []
    for row in range(300):
        votes = [int(t) for t, v in zip(tokens[row], span[row] | noise[row]) if v]
        expected.append(int(2 * sum(t == example.VOTE_1 for t in votes) > len(votes)) == int(labels[row]))
    assert example.all_votes_accuracy((tokens, labels, span, noise)) == pytest.approx(sum(expected) / 300)


def test_models_start_from_the_stated_transitions(example):
    for config, (attention, initial_w) in example.CONFIGS.items():
        model = example.SpanClassifier(attention, initial_w)
        transitions = model.attn.chain_transitions
        if initial_w is None:
            assert transitions is None, config
        else:
            assert transitions.shape == (example.HEADS, 2, 2)
            assert torch.allclose(example.transition_w(transitions), torch.full((example.HEADS,), initial_w))


def test_quick_run_trains_every_model_and_writes_the_figures(example, tmp_path, capsys):
    result = example.main(["--quick", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert (tmp_path / "chain_study.png").exists() and (tmp_path / "chain_study_rows.png").exists()
    trained = result["trained"]
    assert list(trained) == list(example.CONFIGS)
    for config, r in trained.items():
        assert f"| {config} | 0 | 0 |" in printed
        run = r["seeds"][0]
        assert 0.0 <= r["accuracy"] <= 1.0 and len(run["heads"]) == example.HEADS
        if example.CONFIGS[config][1] is None:
            assert run["history"] is None and run["w"] is None
        else:
            assert run["history"].shape == (2 + 1, example.HEADS)  # the initial w, then one per epoch
            assert torch.allclose(run["history"][0], torch.full((example.HEADS,), example.CONFIGS[config][1]))
            assert run["history"][-1].tolist() == pytest.approx(run["w"])
    assert trained["CRF, w0 = 0"]["span head"]["exact 0"] == 0  # CRF marginals are dense
    assert 0.5 < result["all votes"] < 1.0


def test_rows_fixed_chain_prior_fuses_neighbours(example):
    rows, maps, span = example.rows_study(rows=150, noise=1.0, signal=0.5, coupling=0.5)
    results = {row["mapping"]: row for row in rows}
    assert list(maps) == list(results) and span.shape == (12, example.ROW_KEYS)
    chain = results["SparseMAP, chain T (c = 0.5)"]
    assert chain["runs"] < results["1.5-entmax"]["runs"]
    assert chain["runs"] < results["SparseMAP, T = 0 (clip)"]["runs"]
    assert chain["exact 0"] > 0.5 and results["SparseMAP, T = 0 (clip)"]["exact 1"] > 0
    assert results["CRF, chain T (c = 0.5)"]["exact 0"] == 0  # dense: every key gets a weight
