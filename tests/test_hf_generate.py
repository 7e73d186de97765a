"""Hugging Face ``generate`` decodes through entmax_attention_with_kvcache: greedy decoding of
tiny random Llama, Qwen2 and GPT-OSS (sinks, a sliding-window layer) models with a
DynamicCache and a StaticCache gives the masked path's tokens at α = 1.5 and "eager"'s at
α = 1; the kvcache op runs every decoding step it can; a left-padded batch (masked path)
decodes as each sequence alone (kvcache path)."""
import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason="transformers >= 5 is not installed (pip install transformers)")

import entmax_fast.hf  # noqa: E402  (registers "entmax")

entmax_fast.hf.register("entmax_masked_decoding", alpha=1.5, decode_with_kvcache=False)
entmax_fast.hf.register("entmax_softmax_decoding", alpha=1.0)

FAMILIES = ["llama", "qwen2", "gpt_oss"]
CACHES = [pytest.param(None, id="dynamic"), pytest.param("static", id="static")]
LAYERS = 2
WINDOW = 4
NEW_TOKENS = 5
PROMPT = [[5, 9, 3, 17, 2, 8]]
GENERATE = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True)
# Scores of one model through two exact computations, a different summation order: float64
# models, and GPT-OSS in float32 (its experts' grouped matmul has no float64).
TOLERANCES = {"llama": {"atol": 1e-9, "rtol": 1e-7}, "qwen2": {"atol": 1e-9, "rtol": 1e-7},
              "gpt_oss": {"atol": 1e-4, "rtol": 0}}
# "eager" computes its softmax in float32 whatever the model's dtype.
TOL_EAGER = {"atol": 1e-4, "rtol": 0}


def _model(family, attn_implementation):
    """A tiny float64 model (GPT-OSS: float32); GPT-OSS with a window of WINDOW keys on its first layer and sinks that
    take a share of the weight comparable to a key's."""
    sizes = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    else:
        config = transformers.GptOssConfig(**sizes, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1,
                                           layer_types=["sliding_attention", "full_attention"])
        model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)  # scores large enough for entmax to zero some keys
            if family == "gpt_oss":
                layer.self_attn.sinks.normal_(1.0, 1.0)
    if family != "gpt_oss":
        model = model.to(torch.float64)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def _count_kvcache_calls(monkeypatch):
    calls = []
    original = entmax_fast.hf.entmax_attention_with_kvcache

    def counting(query, key, value, **kwargs):
        calls.append((query.shape[2], key.shape[2], kwargs["cache_seqlens"].tolist(), kwargs["window_size"]))
        return original(query, key, value, **kwargs)

    monkeypatch.setattr(entmax_fast.hf, "entmax_attention_with_kvcache", counting)
    return calls


def _generate(family, implementation, cache, ids=None, **kwargs):
    ids = torch.tensor(PROMPT) if ids is None else ids
    with torch.no_grad():
        return _model(family, implementation).generate(ids, cache_implementation=cache, **GENERATE, **kwargs)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_kvcache_decoding_gives_the_masked_paths_tokens(monkeypatch, family, cache):
    calls = _count_kvcache_calls(monkeypatch)
    got = _generate(family, "entmax", cache)
    decoding_calls = len(calls)
    expected = _generate(family, "entmax_masked_decoding", cache)
    assert len(calls) == decoding_calls  # the switch keeps every step on the masked path
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), **TOLERANCES[family])
    # Every layer of every decoding step (the prompt's is a prefill): one query, the keys, the
    # valid ones. A StaticCache's keys run to its capacity. GPT-OSS's sliding layer keeps the
    # window's keys, in a DynamicCache and a StaticCache, and runs the window.
    capacity = calls[-1][1] if cache == "static" else None
    assert capacity is None or capacity >= len(PROMPT[0]) + NEW_TOKENS - 1
    expected_calls = []
    for step in range(NEW_TOKENS - 1):
        valid = len(PROMPT[0]) + step + 1
        full = (1, capacity or valid, [valid], (-1, -1))
        sliding = (1, WINDOW, [WINDOW], (WINDOW - 1, 0))
        expected_calls += [sliding, full] if family == "gpt_oss" else [full] * LAYERS
    assert calls == expected_calls


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_kvcache_decoding_at_alpha_one_gives_eagers_tokens(family, cache):
    got = _generate(family, "entmax_softmax_decoding", cache)
    expected = _generate(family, "eager", cache)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), **TOL_EAGER)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_left_padded_batch_decodes_as_each_sequence_alone(monkeypatch, caplog, family, cache):
    """Padding takes the masked path (left padding is not a prefix of the keys), and says so
    at debug level; alone, each sequence decodes through the kvcache op: the same tokens."""
    prompts = [[7, 3, 11], [5, 9, 3, 17, 2, 8]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts]).view(-1, 1)).long()
    calls = _count_kvcache_calls(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="entmax_fast.hf"):
        batched = _generate(family, "entmax", cache, ids, attention_mask=mask)
    assert "decoding step on the masked path: padding" in caplog.text
    assert [call for call in calls if call[3] == (-1, -1)] == []  # the full-attention layers: masked
    for row, prompt in enumerate(prompts):
        alone = _generate(family, "entmax", cache, torch.tensor([prompt]))
        assert torch.equal(alone.sequences[0], batched.sequences[row, width - len(prompt):])
        torch.testing.assert_close(torch.stack(alone.scores)[:, 0], torch.stack(batched.scores)[:, row],
                                   **TOLERANCES[family])
    assert len(calls) > 0


def test_decode_benchmark_dry_run(tmp_path):
    """bench/bench_hf_decode.py on a tiny model: a time per token for each method, the
    kvcache op's tokens equal to the masked path's, a row per cache."""
    from test_tools import load_script

    bench = load_script("bench/bench_hf_decode.py")
    rows = bench.main(["--hidden", "32", "--layers", "1", "--vocab", "61", "--prompt", "16", "--new-tokens", "3",
                       "--rounds", "1", "--out", str(tmp_path)])
    assert [(row["cache"], row["method"]) for row in rows] == [
        (cache, method) for cache in ("dynamic", "static") for method in ("kvcache op", "masked", "sdpa (softmax)")]
    assert all(row["ms/token"] > 0 for row in rows)
    assert [row["tokens = masked's"] for row in rows if row["method"] == "kvcache op"] == ["True", "True"]
    assert (tmp_path / "hf_decode.csv").exists()
