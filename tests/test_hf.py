"""Hugging Face integration: tiny randomly initialised Llama (causal, GQA) and BERT
(bidirectional) models built from configs with attn_implementation="entmax"/"sparsemax",
checked against the same models running a dense float64 oracle attention registered in
this file; padding, generation with a KV cache, gradients, per-module α."""
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason="transformers >= 5 is not installed (pip install transformers)")

import entmax_fast.hf  # noqa: E402  (registers "entmax" and "sparsemax")
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from oracle import oracle_attention, oracle_entmax  # noqa: E402

# float64 models: our op vs the float64 oracle through the whole network.
TOL64 = {"atol": 1e-9, "rtol": 1e-7}


def _oracle_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, alpha=1.5, **kwargs):
    """Dense oracle: scores → oracle_entmax → weights @ V, with HF's (SDPA-style) masks."""
    if key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scaling = 1 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    scores = (query.double() @ key.double().transpose(-1, -2)) * scaling
    lq, lk = scores.shape[-2:]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and lq > 1:
        attention_mask = torch.ones(lq, lk, dtype=torch.bool).tril()
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, -math.inf)
        else:
            scores = scores + attention_mask.double()
    module_alpha = getattr(module, "entmax_alpha", None)
    if module_alpha is not None:
        alpha = module_alpha.detach().double().view(1, -1, 1, 1) if isinstance(module_alpha, torch.Tensor) \
            else module_alpha
    weights = oracle_entmax(scores, alpha)
    return (weights @ value.double()).to(query.dtype).transpose(1, 2).contiguous(), None


def _register_oracle(name, alpha):
    AttentionInterface.register(name, lambda *args, **kwargs: _oracle_attention_forward(*args, alpha=alpha, **kwargs))
    AttentionMaskInterface.register(name, sdpa_mask)


_register_oracle("oracle_entmax15", 1.5)
_register_oracle("oracle_sparsemax", 2.0)
_register_oracle("oracle_alpha1.3", 1.3)
entmax_fast.hf.register("entmax_1.3", alpha=1.3)
entmax_fast.hf.register("entmax_softmax", alpha=1.0)

IMPLEMENTATIONS = [pytest.param("entmax", "oracle_entmax15", id="entmax"),
                   pytest.param("sparsemax", "oracle_sparsemax", id="sparsemax"),
                   pytest.param("entmax_1.3", "oracle_alpha1.3", id="alpha1.3")]


def _llama(attn_implementation):
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def _bert(attn_implementation):
    config = transformers.BertConfig(vocab_size=53, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=64,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertModel(config).to(torch.float64)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def _batch(vocab):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (2, 11), generator=generator)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return ids, mask


def test_from_config_uses_the_registered_implementation():
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sparsemax")
    assert model.config._attn_implementation == "sparsemax"
    calls = []
    original = AttentionInterface._global_mapping["sparsemax"]

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    AttentionInterface.register("sparsemax", counting)
    try:
        model(torch.tensor([[1, 2, 3]]))
    finally:
        AttentionInterface.register("sparsemax", original)
    assert len(calls) == 1


@pytest.mark.parametrize("ours,oracle", IMPLEMENTATIONS)
def test_llama_logits_match_the_dense_oracle(ours, oracle):
    ids, mask = _batch(61)
    with torch.no_grad():
        got = _llama(ours)(input_ids=ids, attention_mask=mask).logits
        expected = _llama(oracle)(input_ids=ids, attention_mask=mask).logits
        sdpa = _llama("sdpa")(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], **TOL64)
    assert (got[keep] - sdpa[keep]).abs().max() > 1e-4  # really not softmax


def test_alpha_one_equals_sdpa():
    ids, mask = _batch(61)
    with torch.no_grad():
        got = _llama("entmax_softmax")(input_ids=ids, attention_mask=mask).logits
        expected = _llama("sdpa")(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], **TOL64)


@pytest.mark.parametrize("ours,oracle", IMPLEMENTATIONS[:2])
def test_bert_bidirectional_with_padding(ours, oracle):
    ids, mask = _batch(53)
    with torch.no_grad():
        got = _bert(ours)(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = _bert(oracle)(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, expected, **TOL64)


def test_generate_with_kv_cache_matches_oracle():
    ids = torch.tensor([[5, 9, 3, 17, 2]])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = _llama("entmax").generate(ids, **kwargs)
        expected = _llama("oracle_entmax15").generate(ids, **kwargs)
        # Every step's logits, not only the argmax: the cached decoding path attends all keys.
        logits = _llama("entmax")(got[:, :-1]).logits
        expected_logits = _llama("oracle_entmax15")(got[:, :-1]).logits
    assert torch.equal(got, expected)
    torch.testing.assert_close(logits, expected_logits, **TOL64)


def test_config_alpha_module_alpha_and_gradients():
    ids, mask = _batch(61)
    model = _llama("entmax")
    model.config.entmax_alpha = 1.3
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        expected = _llama("oracle_alpha1.3")(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], **TOL64)

    model = _llama("sparsemax").train()
    oracle = _llama("oracle_sparsemax")
    per_head = torch.tensor([1.2, 1.5, 1.8, 2.0], dtype=torch.float64)
    for layer, oracle_layer in zip(model.model.layers, oracle.model.layers):
        layer.self_attn.entmax_alpha = torch.nn.Parameter(per_head.clone())
        oracle_layer.self_attn.entmax_alpha = per_head
    logits = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        expected = oracle(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[keep], expected[keep], **TOL64)
    logits[keep].square().mean().backward()
    alpha_grad = model.model.layers[0].self_attn.entmax_alpha.grad
    assert alpha_grad is not None and torch.isfinite(alpha_grad).all() and alpha_grad.abs().max() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_register_errors():
    with pytest.raises(ValueError, match="alpha must be a finite float >= 1"):
        entmax_fast.hf.register("bad", alpha=0.5)
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        entmax_fast.hf.register("", alpha=1.5)
    with pytest.raises(TypeError, match="decode_with_kvcache must be a bool"):
        entmax_fast.hf.register("bad", alpha=1.5, decode_with_kvcache=1)


def test_training_benchmark_dry_run(tmp_path):
    """bench/bench_hf_training.py (the GPU check's end-to-end step) on its tiny CPU model:
    every implementation trains through its own attention (entmax_fast's for the two it
    registers), with finite losses, into the table the GPU check hands back."""
    from test_tools import load_script

    bench = load_script("bench/bench_hf_training.py")
    assert bench.main(["--tiny", "--device", "cpu", "--steps", "2", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "hf_training.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in table if line.startswith("| ") and not line.startswith("| implementation")}
    assert set(rows) == {"sdpa", "entmax", "sparsemax"}
    assert rows["sdpa"][1] == "1.00" and rows["sdpa"][4] == "torch SDPA"
    for name in ("entmax", "sparsemax"):
        assert math.isfinite(float(rows[name][1])) and math.isfinite(float(rows[name][3]))
        assert rows[name][4] in ("cpp", "reference", "triton")


def test_training_benchmark_compile_runs_launch_the_full_models_attention():
    """bench_hf_training.py --jobs compiles each entmax_fast implementation's kernels in a
    process of its own, on a one-layer model with a small vocabulary: every argument the
    attention launches depend on (heads, key/value heads, head dim through the hidden size,
    batch, length, dtype, device) must be the full model's, or the timed run compiles
    again; transformers' own implementations compile nothing."""
    from test_tools import load_script

    bench = load_script("bench/bench_hf_training.py")
    args = bench.parse_args(["--jobs", "3", "--implementations", "sdpa", "entmax", "sparsemax",
                             "eager", "--length", "1024", "--kv-heads", "8"])
    runs = [bench.parse_args(command[2:]) for command in bench.compile_commands(args)]
    assert [run.implementations for run in runs] == [["entmax"], ["sparsemax"]]
    for run in runs:
        for name in ("device", "dtype", "batch", "length", "hidden", "heads", "kv_heads"):
            assert getattr(run, name) == getattr(args, name), name
        assert (run.layers, run.steps, run.warmup, run.jobs, run.out) == (1, 1, 1, 0, None)


# Models whose attention has options of its own, float32 at α = 1 against transformers'
# "eager" (softmax, float32): the same maths, a different summation order.
TOL32 = {"atol": 1e-4, "rtol": 0}
SLIDING_WINDOW = 4
FAMILIES = ["gemma2", "mistral", "gpt_oss"]


def _with_options(family, attn_implementation):
    """A tiny float32 model: Gemma 2 (softcap, sliding and full layers), Mistral (every layer
    sliding), GPT-OSS (sinks, sliding and full layers); windows of 4 keys on 11 tokens."""
    sizes = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0,
                 sliding_window=SLIDING_WINDOW)
    torch.manual_seed(0)
    if family == "gemma2":
        config = transformers.Gemma2Config(**sizes, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                           query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])
        model = transformers.Gemma2ForCausalLM(config)
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**sizes))
    else:
        config = transformers.GptOssConfig(**sizes, num_local_experts=2, num_experts_per_tok=1,
                                           layer_types=["sliding_attention", "full_attention"])
        model = transformers.GptOssForCausalLM(config)
    # Scores large enough for the softcap to bend them and the window to matter; sinks that
    # take a share of the weight comparable to a key's.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            if family == "gpt_oss":
                layer.self_attn.sinks.normal_(1.0, 1.0)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def _record_calls(monkeypatch):
    """What each layer passes to entmax_attention, or to entmax_attention_with_kvcache for a
    decoding step: (mask given, window_size, softcap, sinks given)."""
    calls = []

    def recording(original):
        def record(query, key, value, **kwargs):
            calls.append((kwargs.get("attn_mask") is not None, kwargs["window_size"], kwargs["softcap"],
                          kwargs["sinks"] is not None))
            return original(query, key, value, **kwargs)
        return record

    for name in ("entmax_attention", "entmax_attention_with_kvcache"):
        monkeypatch.setattr(entmax_fast.hf, name, recording(getattr(entmax_fast.hf, name)))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_alpha_one_equals_eager_with_softcap_sliding_window_and_sinks(monkeypatch, family, padded):
    """Every option the model passes is honoured: the logits are eager's. A sliding layer
    without padding runs the window (no mask built), with padding transformers' mask."""
    ids, mask = _batch(61)
    if not padded:
        mask = torch.ones_like(mask)
    calls = _record_calls(monkeypatch)
    with torch.no_grad():
        got = _with_options(family, "entmax_softmax")(input_ids=ids, attention_mask=mask).logits
        expected = _with_options(family, "eager")(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], **TOL32)
    softcap = 2.0 if family == "gemma2" else 0.0
    sinks = family == "gpt_oss"
    sliding = (padded, (-1, -1) if padded else (SLIDING_WINDOW - 1, 0), softcap, sinks)
    full = (True if padded else False, (-1, -1), softcap, sinks)
    assert calls == ([sliding, sliding] if family == "mistral" else [sliding, full])


def test_gpt_oss_sinks_get_eager_gradients():
    """s_aux reaches the attention as learnable sinks: their gradients are eager's."""
    ids, mask = _batch(61)
    grads = {}
    for implementation in ("entmax_softmax", "eager"):
        model = _with_options("gpt_oss", implementation).train()
        model(input_ids=ids, attention_mask=mask).logits[mask.bool()].square().mean().backward()
        grads[implementation] = torch.stack([layer.self_attn.sinks.grad for layer in model.model.layers])
    scale = grads["eager"].abs().max()
    assert scale > 0
    # relative to the gradients' size (a mean over every logit makes them small)
    torch.testing.assert_close(grads["entmax_softmax"], grads["eager"], atol=1e-4 * float(scale), rtol=1e-4)


@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])
def test_generate_with_sliding_window_cache_matches_eager(monkeypatch, family):
    """Greedy decoding past the window through transformers' cache: each step's query sits at
    the last cached key, and the sliding layers run the window without a mask."""
    ids = torch.tensor([[5, 9, 3, 17, 2, 8]])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    calls = _record_calls(monkeypatch)
    with torch.no_grad():
        got = _with_options(family, "entmax_softmax").generate(ids, **kwargs)
        expected = _with_options(family, "eager").generate(ids, **kwargs)
    # Mistral: both layers slide; GPT-OSS: the first of each step's two.
    sliding_calls = calls if family == "mistral" else calls[::2]
    assert len(sliding_calls) == 5 * (2 if family == "mistral" else 1)
    assert {call[:2] for call in sliding_calls} == {(False, (SLIDING_WINDOW - 1, 0))}
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), **TOL32)


def test_attention_mask_leaves_out_only_the_plain_causal_window():
    """entmax_attention_mask: None for an unpadded causal sliding window whose last query is
    at the last key; a mask, equal to sdpa_mask's, for padding, other offsets, chunked
    attention, and for every mask without a window."""
    from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

    window = sliding_window_causal_mask_function(3)
    plain = dict(batch_size=2, q_length=4, kv_length=6, q_offset=5, kv_offset=3, mask_function=window, local_size=3)
    assert entmax_fast.hf.entmax_attention_mask(**plain) is None
    assert entmax_fast.hf.entmax_attention_mask(**plain, attention_mask=torch.ones(2, 9, dtype=torch.bool)) is None
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, 4] = False
    others = [dict(plain, attention_mask=padding), dict(plain, q_offset=4),
              dict(plain, mask_function=chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))),
              dict(plain, allow_is_causal_skip=False)]
    for arguments in others:
        built = entmax_fast.hf.entmax_attention_mask(**arguments)
        expected = sdpa_mask(**dict(arguments, allow_is_causal_skip=False))
        assert built is not None and torch.equal(built, expected), arguments
    causal = dict(batch_size=1, q_length=5, kv_length=5)
    assert entmax_fast.hf.entmax_attention_mask(**causal) is None and sdpa_mask(**causal) is None
    cached = dict(causal, q_offset=2, kv_length=7)
    assert torch.equal(entmax_fast.hf.entmax_attention_mask(**cached), sdpa_mask(**cached))


def _comparable_rows(layers, mask):
    """Each layer's weights where "eager" gives a number: the queries that are not padding in
    the first layer, and from the second layer on the unpadded sequence only ("eager" turns a
    padded query's row into NaN, and the NaN then reaches every row of that sequence through
    its keys; here a padded query's row is zeros)."""
    keep = mask.bool()[:, None, :, None]
    unpadded = mask.bool().all(dim=1)
    return [layers[0].masked_select(keep)] + [layer[unpadded] for layer in layers[1:]]


@pytest.mark.parametrize("model_of", [_llama, _bert], ids=["llama", "bert"])
def test_output_attentions_at_alpha_one_are_eagers_weights(model_of):
    ids, mask = _batch(61 if model_of is _llama else 53)
    with torch.no_grad():
        expected = model_of("eager")(input_ids=ids, attention_mask=mask, output_attentions=True)
        got = model_of("entmax_softmax")(input_ids=ids, attention_mask=mask, output_attentions=True)
        plain = model_of("entmax_softmax")(input_ids=ids, attention_mask=mask)
    assert len(got.attentions) == 2 and got.attentions[0].shape == (2, 4, 11, 11)
    for ours, theirs in zip(_comparable_rows(got.attentions, mask), _comparable_rows(expected.attentions, mask)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # Asking for the weights leaves the model's output as the fused path computes it.
    hidden = "logits" if model_of is _llama else "last_hidden_state"
    keep = mask.bool()
    torch.testing.assert_close(getattr(got, hidden)[keep], getattr(plain, hidden)[keep], atol=1e-10, rtol=1e-10)


def test_output_attentions_are_the_oracles_sparse_weights_with_gqa_and_sinks():
    """α = 1.5 on GPT-OSS (GQA, sinks, a sliding layer): every returned row is the oracle's
    (its real keys' weights, summing to less than one where the sink is in the support), with
    exact zeros."""
    ids, mask = _batch(61)
    mask = torch.ones_like(mask)
    model = _with_options("gpt_oss", "entmax")
    captured = []
    original = entmax_fast.hf.attention_weights

    def capturing(query, key, **kwargs):
        captured.append((query.detach(), key.detach(), kwargs))
        return original(query, key, **kwargs)

    entmax_fast.hf.attention_weights = capturing
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        entmax_fast.hf.attention_weights = original
    assert len(captured) == 2
    for weights, (query, key, kwargs) in zip(out.attentions, captured):
        kwargs = {name: value for name, value in kwargs.items() if name != "enable_gqa"}
        value = torch.eye(key.shape[2], dtype=torch.float64).expand(key.shape[0], key.shape[1], -1, -1)
        expected = oracle_attention(query, key, value, **kwargs)
        torch.testing.assert_close(weights.double(), expected, atol=1e-5, rtol=0)
        totals = weights.sum(-1)
        assert (weights == 0).any() and (totals < 1 - 1e-3).any() and (totals <= 1 + 1e-6).all()
