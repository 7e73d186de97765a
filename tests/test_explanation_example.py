"""examples/explanation.py in its quick form: it trains every kind, measures every column,
writes its table and heat map; softmax's weights are never zero, sparsemax's often are, and
the marked tokens the data generator plants decide the label."""
import torch

from test_tools import load_script


def test_the_quick_run_measures_every_kind(tmp_path):
    example = load_script("examples/explanation.py")
    rows = example.main(["--quick", "--out", str(tmp_path)])
    assert [row["kind"] for row in rows] == list(example.KINDS)
    for row in rows:
        for name, value in row.items():
            if name not in ("kind", "alpha"):
                assert 0.0 <= value <= 1.0, (row["kind"], name, value)
    by_kind = {row["kind"]: row for row in rows}
    assert by_kind["softmax"]["zero share"] == 0.0 and by_kind["softmax"]["support recall"] == 1.0
    assert by_kind["sparsemax"]["zero share"] > 0.3
    assert (tmp_path / "explanation.md").read_text().count("\n") == len(example.KINDS) + 2
    assert (tmp_path / "explanation.png").exists()


def test_the_marked_tokens_decide_the_label():
    example = load_script("examples/explanation.py")
    tokens, labels, marked = example.make_data(64, 24, 16, torch.Generator().manual_seed(1))
    assert tokens.shape == (64, 25) and (tokens[:, 0] == example.CLS).all()
    assert (marked.sum(1) == example.VOTES).all()
    votes = tokens[marked].view(64, example.VOTES) - example.VOTE_0
    assert ((votes.sum(1) * 2 > example.VOTES).long() == labels).all()
    assert not ((tokens[~marked] == example.VOTE_0) | (tokens[~marked] == example.VOTE_1)).any()
