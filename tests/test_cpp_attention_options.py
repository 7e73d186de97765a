"""The C++ CPU attention's score options (window_size, lower-right causal masks, softcap, ALiBi,
sinks; docs/attention.md, "Score options"), run by the operator itself: forward and gradients
of q, k, v, the sinks and a per-head α against the float64 oracle at lengths that cross the
operator's query tile (64) in both directions (Lq < Lk, Lq > Lk), with GQA and masks; fp16
and bf16 against the float32 reference; queries a window leaves without keys; a window's
memory and time grow with the window, not with Lq × Lk; the operators under opcheck,
torch.compile and inference mode. Skipped, with the reason, when the extension is not built."""
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import entmax_fast
from entmax_fast import dispatch
from entmax_fast._validation import ScoreOptions
from entmax_fast.backends.cpp import loader
from entmax_fast.backends.cpp import ops as cpp_ops
from entmax_fast.reference.attention import attention_backward as reference_backward
from entmax_fast.reference.attention import attention_forward as reference_forward
from oracle import as_float64, attention_leaves, oracle_attention, oracle_entmax

_AVAILABLE, _REASON = dispatch.availability("cpp")
_AVAILABLE = _AVAILABLE and loader.has_entmax_ops()
pytestmark = [pytest.mark.skipif(not _AVAILABLE, reason=f"C++ CPU ops unavailable: {_REASON}"),
              # torch warns that SDPA gives NaN rows where a lower-right causal mask leaves a
              # query no key; here such rows are zeros, as fully masked rows are.
              pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

B, H, HKV, E, EV = 2, 4, 2, 8, 6
# One α per head, as tests/test_attention_options.py: none of them 1 (the oracle's α = 1 rows
# are torch.softmax, which has no derivative in α), none above 2 (where s = p^(2−α) grows as p
# shrinks, and float64 gradients of both the reference and this backend differ from the
# oracle's by ~1e-10); 1.25 and 1.75 take the general solver, 1.5 and 2 the closed forms.
ALPHA_HEADS = (1.25, 1.5, 1.75, 2.0)
# Against the float64 oracle, as tests/test_attention_options.py: a few float64 ulps; in
# float32 an allowance on top of the float32 reference's own error (_assert_within_reference_error),
# larger for dα, which sums a term per row, each the weights' rounding times up to 1/(α − 1)².
TOL = {torch.float64: {"atol": 1e-12, "rtol": 1e-12}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}
ALPHA_TOL = {torch.float64: TOL[torch.float64], torch.float32: {"atol": 1e-4, "rtol": 1e-3}}
# fp16/bf16 (float32 inside) against the float32 reference on the same rounded inputs, relative
# to the largest reference entry: tests/test_cpp_ops.py's allowances for the forward (DTYPES)
# and the backward (test_attention_backward_low_precision_vs_reference_float32).
LOW_PRECISION = [pytest.param(torch.float16, 2e-3, 4e-3, id="f16"),
                 pytest.param(torch.bfloat16, 1.6e-2, 3e-2, id="bf16")]
# Lengths on both sides of the 64-query tile, neither a multiple of it, Lq < Lk and Lq > Lk.
LENGTHS = [pytest.param(70, 133, id="Lq<Lk"), pytest.param(133, 70, id="Lq>Lk")]


def _option_case(name, lq, lk, dtype, generator):
    """Keyword arguments of entmax_attention (and of the oracle) for option case ``name``."""
    slopes_heads = torch.rand(H, generator=generator) * 0.2
    slopes_batch = torch.rand(B, H, generator=generator) * 0.2
    sinks = torch.randn(H, generator=generator, dtype=dtype).requires_grad_()
    cases = {
        "left": {"window_size": (5, -1)},
        "right": {"window_size": (-1, 3)},
        "both": {"window_size": (7, 4)},
        "lower_right_window": {"window_size": (-1, 0)},
        "lower_right_bias": {"attn_mask": causal_lower_right(lq, lk)},
        "wider_than_sequence": {"window_size": (500, 500)},
        "softcap": {"softcap": 1.5},
        "alibi_heads": {"alibi_slopes": slopes_heads},
        "alibi_batch_heads": {"alibi_slopes": slopes_batch},
        "sinks": {"sinks": sinks},
        "all": {"window_size": (9, 2), "softcap": 2.0, "alibi_slopes": slopes_batch, "sinks": sinks},
    }
    return cases[name]


OPTION_CASES = ["left", "right", "both", "lower_right_window", "lower_right_bias", "wider_than_sequence", "softcap",
                "alibi_heads", "alibi_batch_heads", "sinks", "all"]


def _inputs(lq, lk, dtype, generator):
    """q scaled up so that scores reach the softcap and rows are sparse."""
    q = (torch.randn(B, H, lq, E, generator=generator, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    k = torch.randn(B, HKV, lk, E, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(B, HKV, lk, EV, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def cpp_attention(q, k, v, **kwargs):
    """The public entmax_attention on the C++ backend, which must run the call itself."""
    return _attention_on("cpp", q, k, v, **kwargs)


def _attention_on(backend, q, k, v, **kwargs):
    with dispatch.use_backend(backend):
        out = entmax_fast.entmax_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)
    assert dispatch.last_choice("attention").backend == backend
    return out


def _assert_within_reference_error(name, got, reference, oracle, atol):
    """|got − oracle| ≤ 2 |reference − oracle| + atol·max(1, |oracle|), largest entries
    (FlashAttention's rule, as tests/test_cpp_ops.py): in float32 the reference's own error,
    which grows with the rows a gradient sums, sets the bound."""
    err = (got.double() - oracle).abs().max().item()
    reference_err = (reference.double() - oracle).abs().max().item()
    bound = 2 * reference_err + atol * max(1.0, oracle.abs().max().item())
    assert err <= bound, f"{name}: error {err:.3g} vs reference error {reference_err:.3g} (bound {bound:.3g})"


def _check_against_oracle(q, k, v, alpha, options, dtype, **masks):
    """The C++ call's output and gradients of every leaf against the oracle's in float64:
    within a few ulps in float64, within the float32 reference's own error in float32."""
    leaves = attention_leaves(q, k, v, alpha, options)
    grad_out = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=dtype)
    results = {}
    for backend in ("cpp", "reference") if dtype == torch.float32 else ("cpp",):
        out = _attention_on(backend, q, k, v, alpha=alpha, **options, **masks)
        assert out.dtype == dtype
        results[backend] = (out, *torch.autograd.grad(out, leaves, grad_out))

    leaves64 = as_float64(leaves)
    q64, k64, v64 = leaves64[:3]
    alpha64 = leaves64[3] if isinstance(alpha, torch.Tensor) else alpha
    options64 = dict(options)
    if options.get("sinks") is not None:
        options64["sinks"] = leaves64[-1]
    expected = oracle_attention(q64, k64, v64, alpha=alpha64, **options64, **masks)
    expected_all = (expected, *torch.autograd.grad(expected, leaves64, grad_out.double()))
    names = ["out", "dq", "dk", "dv"] + (["dalpha"] if isinstance(alpha, torch.Tensor) else []) + \
            (["dsinks"] if options.get("sinks") is not None else [])
    for index, (name, want) in enumerate(zip(names, expected_all)):
        tol = (ALPHA_TOL if name == "dalpha" else TOL)[dtype]
        got = results["cpp"][index]
        if dtype == torch.float32:
            _assert_within_reference_error(name, got, results["reference"][index], want, tol["atol"])
        else:
            torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{name}: {m}")
    return results["cpp"][0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("lq,lk", LENGTHS)
def test_each_option_matches_the_oracle(dtype, case, lq, lk):
    generator = torch.Generator().manual_seed(lq * 7 + len(case))
    q, k, v = _inputs(lq, lk, dtype, generator)
    options = _option_case(case, lq, lk, dtype, generator)
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype, requires_grad=True)
    _check_against_oracle(q, k, v, alpha, options, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("mask", ["bool", "float", "is_causal"])
@pytest.mark.parametrize("lq,lk", LENGTHS)
def test_all_options_with_masks_match_the_oracle(dtype, mask, lq, lk):
    """Every option with a bool mask (one query with every key masked), a float mask or SDPA's
    top-left causal mask."""
    generator = torch.Generator().manual_seed(lq + 3)
    q, k, v = _inputs(lq, lk, dtype, generator)
    options = _option_case("all", lq, lk, dtype, generator)
    masks = {}
    if mask == "bool":
        masks["attn_mask"] = torch.rand(B, 1, lq, lk, generator=generator) > 0.3
        masks["attn_mask"][:, :, 0] = False
    elif mask == "float":
        masks["attn_mask"] = torch.randn(lq, lk, generator=generator, dtype=dtype)
    else:
        masks["is_causal"] = True
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype, requires_grad=True)
    out = _check_against_oracle(q, k, v, alpha, options, dtype, **masks)
    if mask == "bool":
        # Every real key masked: the sink takes the row, and its value is zero.
        assert (out[:, :, 0] == 0).all()


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_float_alpha_with_every_option(alpha):
    """α = 1 (softmax with sinks), 1.5 and 2 (sparsemax) as a float, without gradient."""
    generator = torch.Generator().manual_seed(int(alpha * 10))
    q, k, v = _inputs(70, 133, torch.float64, generator)
    options = _option_case("all", 70, 133, torch.float64, generator)
    _check_against_oracle(q, k, v, alpha, options, torch.float64)


def test_gqa_heads_share_key_gradients_with_options():
    """Four query heads per key/value head accumulate into the same dK and dV."""
    generator = torch.Generator().manual_seed(5)
    q = (torch.randn(1, 8, 90, E, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    k = torch.randn(1, 2, 80, E, generator=generator, dtype=torch.float64).requires_grad_()
    v = torch.randn(1, 2, 80, EV, generator=generator, dtype=torch.float64).requires_grad_()
    options = {"window_size": (20, 5), "softcap": 1.0, "alibi_slopes": torch.rand(8, generator=generator) * 0.1,
               "sinks": torch.randn(8, generator=generator, dtype=torch.float64).requires_grad_()}
    _check_against_oracle(q, k, v, 1.5, options, torch.float64)


@pytest.mark.parametrize("sinks", [False, True], ids=["no_sink", "sink"])
def test_queries_without_keys_give_zero_rows_and_gradients(sinks):
    """Lq > Lk with the window (2, 0): the first Lq − Lk queries sit before every key (whole
    tiles of them, then part of one) and give zero rows and zero dq, with or without a sink."""
    lq, lk = 150, 40
    generator = torch.Generator().manual_seed(11)
    q, k, v = _inputs(lq, lk, torch.float64, generator)
    options = {"window_size": (2, 0)}
    if sinks:
        options["sinks"] = torch.randn(H, generator=generator, dtype=torch.float64).requires_grad_()
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float64, requires_grad=True)
    out = _check_against_oracle(q, k, v, alpha, options, torch.float64)
    without_keys = lq - lk
    assert (out[:, :, :without_keys] == 0).all() and (out[:, :, without_keys:] != 0).any()
    (dq,) = torch.autograd.grad(cpp_attention(q, k, v, alpha=1.5, **options).sum(), (q,))
    assert (dq[:, :, :without_keys] == 0).all()


def test_sink_gradient_is_the_sinks_jacobian_term():
    """dsinks[h] = −Σ_rows s_sink δ (docs/attention.md), written out in float64 from the
    oracle's α-entmax of each windowed row with the sink appended: s = p^(2−α) on the support,
    g = dO·v for the keys and 0 for the sink, δ = Σ s g / Σ s."""
    lq, lk, window = 70, 75, 6
    generator = torch.Generator().manual_seed(2)
    q, k, v = (t.detach() for t in _inputs(lq, lk, torch.float64, generator))
    sinks = torch.randn(H, generator=generator, dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float64)
    out = cpp_attention(q, k, v, alpha=alpha, sinks=sinks, window_size=(window, window))
    grad_out = torch.randn(out.shape, dtype=torch.float64)
    (dsinks,) = torch.autograd.grad(out, (sinks,), grad_out)

    k_heads, v_heads = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    scores = q @ k_heads.transpose(-1, -2) * E ** -0.5
    position = torch.arange(lq).view(-1, 1) + lk - lq
    key = torch.arange(lk).view(1, -1)
    scores = scores.masked_fill((key < position - window) | (key > position + window), float("-inf"))
    sink_column = sinks.detach().view(1, H, 1, 1).expand(B, H, lq, 1)
    row = oracle_entmax(torch.cat([scores, sink_column], dim=-1), alpha.view(1, H, 1, 1))
    g = torch.cat([grad_out @ v_heads.transpose(-1, -2), torch.zeros(B, H, lq, 1, dtype=torch.float64)], dim=-1)
    s = torch.where(row > 0, row.clamp(min=1e-300).pow((2 - alpha).view(1, H, 1, 1)), torch.zeros_like(row))
    delta = (s * g).sum(-1, keepdim=True) / s.sum(-1, keepdim=True)
    expected = -(s[..., -1:] * delta).sum(dim=(0, 2, 3))
    assert (row[..., -1] > 0).any()
    torch.testing.assert_close(dsinks, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype,forward_atol,backward_atol", LOW_PRECISION)
@pytest.mark.parametrize("lq,lk", LENGTHS)
def test_low_precision_matches_the_float32_reference(dtype, forward_atol, backward_atol, lq, lk):
    """fp16/bf16 are computed in float32 inside: output and gradients (q, k, v, sinks) match
    the float32 reference on the same rounded inputs up to the dtype's rounding."""
    generator = torch.Generator().manual_seed(lq)
    q, k, v = (t.detach() for t in _inputs(lq, lk, dtype, generator))
    slopes = torch.rand(B, H, generator=generator) * 0.2
    sinks = torch.randn(H, generator=generator)
    mask = torch.rand(B, 1, lq, lk, generator=generator) > 0.2
    options = {"window_size": (9, 2), "softcap": 2.0, "alibi_slopes": slopes}
    grad_out = torch.randn(B, H, lq, EV, generator=generator).to(dtype)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = cpp_attention(*leaves[:3], attn_mask=mask, alpha=1.5, sinks=leaves[3], **options)
    grads = torch.autograd.grad(out, leaves, grad_out)

    q32, k32, v32 = (t.float() for t in (q, k, v))
    kwargs = {"scale": E ** -0.5, "is_causal": False, "dropout_p": 0.0, "enable_gqa": True, "sinks": sinks, **options}
    expected, saved = reference_forward(q32, k32, v32, mask, 1.5, need_grad=1, **kwargs)
    dq, dk, dv, _, _, dsinks = reference_backward(grad_out.float(), q32, k32, v32, mask, 1.5, expected, saved,
                                                  need_sinks_grad=True, **kwargs)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=forward_atol * max(1.0, expected.abs().max().item()),
                               rtol=0)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, (dq, dk, dv, dsinks)):
        assert got.dtype == (torch.float32 if name == "dsinks" else dtype), name
        torch.testing.assert_close(got.float(), want, atol=backward_atol * max(1.0, want.abs().max().item()), rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


# Run in a fresh interpreter, which reads its peak resident memory (VmHWM) after resetting it
# to the current one (writing 5 to /proc/self/clear_refs, Linux): the growth of the peak over a
# call is what the call had allocated and touched at its busiest.
_PEAK_MEMORY_SCRIPT = textwrap.dedent("""
    import torch
    import entmax_fast
    from entmax_fast import dispatch

    L, E, HEADS = 4096, 16, 2

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")

    def peak_bytes():
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024  # kB

    try:
        reset_peak()
    except OSError:
        print("unsupported")
        raise SystemExit
    q, k, v = (torch.randn(1, HEADS, L, E, requires_grad=True) for _ in range(3))
    sinks = torch.randn(HEADS, requires_grad=True)
    options = dict(window_size=(64, 0), softcap=5.0, alibi_slopes=torch.rand(HEADS) * 0.1, sinks=sinks)
    with dispatch.use_backend("cpp"):
        # A short call first: loads the extension and sets up the thread pool and allocator.
        entmax_fast.entmax_attention(*(t[..., :256, :] for t in (q, k, v)), **options).sum().backward()
        reset_peak()
        before = peak_bytes()
        entmax_fast.entmax_attention(q, k, v, **options).sum().backward()
        window_growth = peak_bytes() - before
        assert dispatch.last_choice("attention").backend == "cpp"
    # The measure's own check: one touched L x L float32 block shows in the peak.
    reset_peak()
    before = peak_bytes()
    dense = torch.ones(L, L)
    control_growth = peak_bytes() - before
    print(window_growth, control_growth)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak memory from Linux's /proc")
def test_window_never_allocates_lq_by_lk():
    """Forward and backward at Lq = Lk = 4096 with the window (64, 0): the process's peak
    memory grows by far less than one 4096 × 4096 float32 score block (64 MiB), which the same
    measure does see when such a block is allocated."""
    result = subprocess.run([sys.executable, "-c", _PEAK_MEMORY_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "unsupported":
        pytest.skip("/proc/self/clear_refs cannot be written here: the peak memory cannot be reset")
    window_growth, control_growth = map(int, result.stdout.split())
    block = 4096 * 4096 * 4
    assert control_growth > block * 9 // 10, (window_growth, control_growth)
    assert window_growth < block // 8, (window_growth, control_growth)


def test_operators_pass_opcheck_with_options():
    """The operators' schema, fake kernels (torch.compile) and aliasing with every option set."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 70, 8, generator=generator)
    k, v = torch.randn(2, 2, 75, 8, generator=generator), torch.randn(2, 2, 75, 5, generator=generator)
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25], dtype=torch.float64)
    slopes, sinks = torch.rand(2, 4, generator=generator), torch.randn(4, generator=generator)
    options = ([5, 2], 1.5, slopes, sinks)
    forward_args = (q, k, v, None, alpha, 0.3, False, *options)
    torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_fwd, forward_args)
    _, stats, *_ = torch.ops.entmax_fast.entmax_attention_fwd(*forward_args)
    for need_sinks_grad in (True, False):
        torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_bwd,
                              (torch.randn(2, 4, 70, 5, generator=generator), q, k, v, None, stats, alpha, 0.3, False,
                               True, *options, need_sinks_grad))


def test_torch_compile_fullgraph_runs_the_options_on_the_operator():
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(66, 70, torch.float64, torch.Generator()))
    sinks = torch.randn(H, requires_grad=True)
    slopes = torch.rand(H) * 0.2
    bias = causal_lower_right(66, 70)

    def model(q, k, v, sinks, bias):
        with dispatch.use_backend("cpp"):
            return entmax_fast.entmax_attention(q, k, v, bias, enable_gqa=True, window_size=(8, -1), softcap=2.0,
                                                alibi_slopes=slopes, sinks=sinks).square().sum()

    assert_compiled_like_eager(model, (q, k, v, sinks), bias)


def assert_compiled_like_eager(model, inputs, *constants):
    """model(*inputs, *constants) compiled (fullgraph, aot_eager) runs on the C++ operator and
    gives the eager call's value and gradients in inputs."""
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(*inputs, *constants)
    assert dispatch.last_choice("attention").backend == "cpp"
    got_grads = torch.autograd.grad(got, inputs)
    expected = model(*inputs, *constants)
    expected_grads = torch.autograd.grad(expected, inputs)
    torch.testing.assert_close(got, expected)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_options_under_no_grad_and_inference_mode_match_the_ordinary_call(context):
    generator = torch.Generator().manual_seed(4)
    q, k, v = (t.detach() for t in _inputs(70, 133, torch.float32, generator))
    options = _option_case("all", 70, 133, torch.float32, generator)
    options["sinks"] = options["sinks"].detach()
    expected = cpp_attention(q, k, v, **options)
    with context():
        got = cpp_attention(q, k, v, **options)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_backend_runs_every_option_without_refusing():
    """The backend lists every score option as implemented, and its functions take them."""
    from entmax_fast.backends import SCORE_OPTIONS
    from entmax_fast.backends import cpp

    assert cpp.SCORE_OPTIONS_IMPLEMENTED == frozenset(SCORE_OPTIONS)
    request = dispatch.Request(torch.device("cpu"), torch.float32,
                               {"alpha": 1.5, **{option: True for option in SCORE_OPTIONS}})
    assert cpp.supports("attention", request) is None
    q = torch.randn(1, 2, 3, 4)
    out, _ = cpp_ops.attention_forward(q, q, q, None, 1.5, scale=0.5, is_causal=False, dropout_p=0.0,
                                       enable_gqa=False, need_grad=0,
                                       score_options=ScoreOptions((1, 0), 1.0, torch.rand(2), torch.zeros(2)))
    assert out.isfinite().all()
