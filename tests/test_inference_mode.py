"""Every public op that computes, under ``torch.inference_mode()`` and ``torch.no_grad()``,
on every backend that serves it: it runs, and gives what the ordinary (autograd) call gives.

Serving code runs under inference mode, where every tensor an op allocates is an inference
tensor: one that no code outside inference mode may update in place, and that autograd
refuses to save. So each case is called under the context twice, with ordinary inputs and
with inputs that are themselves inference tensors, and then once as in training (inputs
that require grad, a backward): a cache filled under inference mode must not break that
later call. Modules are created outside the contexts, as a served model's are.

``CASES`` is the table: one row per public op (or op and argument form), with the dispatch
ops it runs (none for the continuous attention, which is plain torch). A case runs with
each backend that implements one of its ops forced: reference and cpp on CPU tensors;
Triton on CUDA tensors when there is a GPU, else in the Triton interpreter, where a call
costs a fraction of a second (row-wise) to seconds (attention), so there only the cases
marked ``interpreter`` run: the row-wise launcher with a closed-form α (sparsemax), a float
α read from a tensor (entmax_bisect), a tensor α (the EntmaxBisect module) and under a loss
(α = 1.5); the attention launcher with a float α, a mask and a causal mask; and with a
per-head α tensor, packed (varlen). The layers above the dispatch are the same on every
backend and run every case on reference and cpp.

At the end, CUDA-graph capture: the fused attention forward and row-wise mappings captured
and replayed under inference mode equal eager calls (skipped without a CUDA device).
"""
import contextlib
import dataclasses
from typing import Callable

import pytest
import torch

import entmax_fast
from entmax_fast import continuous, dispatch
from devices import DEVICE, ON_GPU

# The interpreter evaluates both sides of tl.where with numpy, which warns about the side
# it discards.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CONTEXTS = [pytest.param(torch.no_grad, id="no_grad"), pytest.param(torch.inference_mode, id="inference_mode")]


@dataclasses.dataclass(frozen=True)
class Call:
    """``fn(*inputs)``; the first ``n_grad`` inputs require grad in the ordinary call (0: the op
    differentiates nothing)."""

    fn: Callable
    inputs: tuple
    n_grad: int


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ops: tuple  # the dispatch ops the call runs
    build: Callable  # device -> Call, made outside any context
    interpreter: bool = False  # also in the Triton interpreter


def _scores(device, rows=3, n=6):
    return torch.randn(rows, n, device=device) * 2


def _targets(device):
    return torch.tensor([0, 2, 5], device=device)


def _qkv(device, heads=2, kv_heads=2, length=3, head_dim=4):
    # B·H = 2: the C++ attention splits work per (batch, head), so two threads share it
    return (torch.randn(1, heads, length, head_dim, device=device),
            torch.randn(1, kv_heads, length, head_dim, device=device),
            torch.randn(1, kv_heads, length, head_dim, device=device))


def _mha(device, attention, need_weights):
    module = entmax_fast.MultiheadEntmaxAttention(8, 2, batch_first=True, attention=attention, device=device)
    padding = torch.tensor([[False, False, True], [False, False, False]], device=device)

    def call(query, key, value, key_padding_mask):
        return module(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights)

    return Call(call, (*(torch.randn(2, 3, 8, device=device) for _ in range(3)), padding), 3)


def _module(module, *inputs, n_grad=1):
    return Call(module, inputs, n_grad)


def _encoder_layer(device):
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, device=device).eval()
    entmax_fast.replace_attention(layer, attention="entmax15")
    return Call(layer, (torch.randn(2, 3, 8, device=device),), 1)


def _varlen(device):
    cu_seqlens = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    # one head: every head and sequence is a program of its own, seconds in the interpreter
    q, k, v = (torch.randn(3, 1, 4, device=device) for _ in range(3))
    alpha = torch.tensor([1.25], device=device)

    def call(q, k, v, alpha, cu_seqlens):
        return entmax_fast.entmax_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 2, 2, is_causal=True, alpha=alpha)

    return Call(call, (q, k, v, alpha, cu_seqlens), 4)


def _gaussian_parameters(device):
    basis = continuous.GaussianBasis1d.grid(4).to(device)
    mu = torch.tensor([0.2, 0.5, 0.9], device=device)
    sigma_sq = torch.tensor([0.01, 0.05, 0.2], device=device)
    return mu, sigma_sq, basis.centers, basis.variances


def _gaussian_parameters_2d(device):
    mu = torch.tensor([[0.3, 0.6], [0.5, 0.5]], device=device)
    sigma = torch.tensor([[[0.05, 0.01], [0.01, 0.04]], [[0.1, 0.0], [0.0, 0.2]]], device=device)
    centers = torch.tensor([[0.0, 0.0], [0.5, 0.5], [1.0, 0.2]], device=device)
    return mu, sigma, centers, torch.full((3,), 0.1, device=device)


def _continuous_attention(device, mask, **options):
    module = continuous.ContinuousAttention(4, 4, **options).to(device)
    inputs = (torch.randn(2, 4, device=device), torch.randn(2, 5, 4, device=device),
              torch.randn(2, 5, 4, device=device))
    if mask:
        present = torch.tensor([[True, True, True, False, False], [True] * 5], device=device)
        return Call(lambda q, k, v, m: module(q, k, v, mask=m), (*inputs, present), 3)
    return Call(module, inputs, 3)


def _basis_fit(device):
    basis = continuous.GaussianBasis1d.grid(4).to(device)
    present = torch.tensor([[True, True, True, False, False], [True] * 5], device=device)
    # the cached fit of each present length, then the one of the full length
    return Call(lambda expected, mask: (basis.fit_weights(expected, 5, mask), basis.fit_weights(expected, 5)),
                (torch.rand(2, basis.num_basis, device=device), present), 1)


CASES = [
    # row-wise mappings and their modules
    Case("sparsemax", ("entmax",), lambda d: Call(lambda x: entmax_fast.sparsemax(x, dim=0), (_scores(d),), 1),
         interpreter=True),
    Case("entmax15", ("entmax",), lambda d: Call(entmax_fast.entmax15, (_scores(d),), 1)),
    Case("entmax_bisect", ("entmax",), lambda d: Call(lambda x: entmax_fast.entmax_bisect(x, 1.3), (_scores(d),), 1),
         interpreter=True),
    Case("entmax_bisect/alpha_tensor", ("entmax",),
         lambda d: Call(entmax_fast.entmax_bisect, (_scores(d), torch.tensor([[1.2], [1.5], [2.5]], device=d)), 2)),
    Case("sparsemax_bisect", ("entmax",), lambda d: Call(entmax_fast.sparsemax_bisect, (_scores(d),), 1)),
    Case("normmax_bisect", ("normmax",), lambda d: Call(lambda x: entmax_fast.normmax_bisect(x, 1.7), (_scores(d),), 1)),
    Case("budget_bisect", ("budget",), lambda d: Call(entmax_fast.budget_bisect, (_scores(d),), 1)),
    Case("Sparsemax", ("entmax",), lambda d: _module(entmax_fast.Sparsemax(dim=-1), _scores(d))),
    Case("Entmax15", ("entmax",), lambda d: _module(entmax_fast.Entmax15(), _scores(d))),
    Case("EntmaxBisect", ("entmax",),
         lambda d: _module(entmax_fast.EntmaxBisect(torch.nn.Parameter(torch.full((3, 1), 1.4, device=d))),
                           _scores(d)),
         interpreter=True),
    Case("SparsemaxBisect", ("entmax",), lambda d: _module(entmax_fast.SparsemaxBisect(), _scores(d))),
    Case("NormmaxBisect", ("normmax",), lambda d: _module(entmax_fast.NormmaxBisect(alpha=1.5), _scores(d))),
    Case("BudgetBisect", ("budget",), lambda d: _module(entmax_fast.BudgetBisect(budget=3), _scores(d))),
    # losses and their modules
    Case("sparsemax_loss", ("entmax",), lambda d: Call(entmax_fast.sparsemax_loss, (_scores(d), _targets(d)), 1)),
    Case("entmax15_loss", ("entmax",), lambda d: Call(entmax_fast.entmax15_loss, (_scores(d), _targets(d)), 1),
         interpreter=True),
    Case("sparsemax_bisect_loss", ("entmax",),
         lambda d: Call(entmax_fast.sparsemax_bisect_loss, (_scores(d), _targets(d)), 1)),
    Case("entmax_bisect_loss", ("entmax",),
         lambda d: Call(entmax_fast.entmax_bisect_loss,
                        (_scores(d), _targets(d), torch.full((3, 1), 1.3, device=d)), 1)),
    Case("normmax_bisect_loss", ("normmax",),
         lambda d: Call(entmax_fast.normmax_bisect_loss, (_scores(d), _targets(d)), 1)),
    Case("SparsemaxLoss", ("entmax",), lambda d: _module(entmax_fast.SparsemaxLoss(), _scores(d), _targets(d))),
    Case("Entmax15Loss", ("entmax",),
         lambda d: _module(entmax_fast.Entmax15Loss(reduction="sum"), _scores(d),
                           torch.tensor([0, -100, 5], device=d))),
    Case("SparsemaxBisectLoss", ("entmax",),
         lambda d: _module(entmax_fast.SparsemaxBisectLoss(reduction="none"), _scores(d), _targets(d))),
    Case("EntmaxBisectLoss", ("entmax",),
         lambda d: _module(entmax_fast.EntmaxBisectLoss(alpha=1.3), _scores(d), _targets(d))),
    Case("NormmaxBisectLoss", ("normmax",),
         lambda d: _module(entmax_fast.NormmaxBisectLoss(), _scores(d), _targets(d))),
    # attention
    Case("entmax_attention", ("attention",),
         lambda d: Call(lambda q, k, v, m: entmax_fast.entmax_attention(q, k, v, attn_mask=m, is_causal=True),
                        (*_qkv(d), torch.tensor([[True, False, True]] * 3, device=d)), 3),
         interpreter=True),
    Case("entmax_attention/alpha_per_head_gqa", ("attention",),
         lambda d: Call(lambda q, k, v, alpha, m: entmax_fast.entmax_attention(q, k, v, attn_mask=m, enable_gqa=True,
                                                                               alpha=alpha),
                        (*_qkv(d, kv_heads=1), torch.tensor([1.25, 1.75], device=d),
                         torch.randn(1, 1, 3, 3, device=d)), 4)),
    Case("sparsemax_attention", ("attention",), lambda d: Call(entmax_fast.sparsemax_attention, _qkv(d), 3)),
    Case("entmax_attention_varlen", ("attention_varlen",), _varlen, interpreter=True),
    Case("attention_weights", ("entmax",),
         lambda d: Call(lambda q, k: entmax_fast.attention_weights(q, k, is_causal=True), _qkv(d)[:2], 2)),
    Case("support_size", ("entmax",),
         lambda d: Call(lambda q, k: entmax_fast.support_size(q, k, alpha=2.0), _qkv(d)[:2], 0)),
    # Reading a cache that holds the new tokens: a write into an inference tensor outside
    # inference mode is refused by torch (tests/test_kvcache.py writes under inference_mode).
    Case("entmax_attention_with_kvcache", ("attention_kvcache",),
         lambda d: Call(lambda q, k_cache, v_cache, seqlens: entmax_fast.entmax_attention_with_kvcache(
             q, k_cache, v_cache, cache_seqlens=seqlens), (*_qkv(d, length=3), torch.tensor([3], dtype=torch.int32,
                                                                                          device=d)), 0)),
    Case("MultiheadEntmaxAttention", ("attention",), lambda d: _mha(d, "entmax15", need_weights=False)),
    Case("MultiheadEntmaxAttention/learned", ("attention",), lambda d: _mha(d, "learned", need_weights=False)),
    Case("MultiheadEntmaxAttention/learned_weights", ("entmax",), lambda d: _mha(d, "learned", need_weights=True)),
    Case("MultiheadEntmaxAttention/fusedmax", ("fusedmax",), lambda d: _mha(d, "fusedmax", need_weights=False)),
    Case("replace_attention/encoder_layer", ("attention",), _encoder_layer),
    # structured
    Case("fusedmax", ("fusedmax",), lambda d: Call(lambda x: entmax_fast.fusedmax(x, 0.5), (_scores(d),), 1)),
    Case("oscarmax", ("oscarmax",),
         lambda d: Call(lambda x, lengths: entmax_fast.oscarmax(x, 0.3, lengths=lengths),
                        (_scores(d), torch.tensor([6, 4, 2], device=d)), 1)),
    Case("Fusedmax", ("fusedmax",), lambda d: _module(entmax_fast.Fusedmax(lam=0.5, dim=0), _scores(d))),
    Case("Oscarmax", ("oscarmax",), lambda d: _module(entmax_fast.Oscarmax(beta=0.3), _scores(d))),
    Case("fusedmax_attention", ("fusedmax",),
         lambda d: Call(lambda q, k, v: entmax_fast.fusedmax_attention(q, k, v, is_causal=True, lam=0.5), _qkv(d), 3)),
    Case("oscarmax_attention", ("oscarmax",),
         lambda d: Call(lambda q, k, v, m: entmax_fast.oscarmax_attention(q, k, v, attn_mask=m, beta=0.3),
                        (*_qkv(d), torch.tensor([[True, True, False]] * 3, device=d)), 3)),
    # structured over the chain of keys; the transitions are learned, so they take gradients
    Case("crf_marginals", ("crf",),
         lambda d: Call(entmax_fast.crf_marginals, (_scores(d), torch.tensor([[0.5, -0.5], [-0.5, 1.0]], device=d)), 2)),
    Case("sparsemap_marginals", ("sparsemap",),
         lambda d: Call(entmax_fast.sparsemap_marginals,
                        (_scores(d), torch.tensor([[0.5, -0.5], [-0.5, 1.0]], device=d)), 2)),
    Case("crf_attention", ("crf",),
         lambda d: Call(lambda q, k, v, t: entmax_fast.crf_attention(q, k, v, t, is_causal=True),
                        (*_qkv(d), torch.randn(2, 2, 2, device=d)), 4)),
    Case("sparsemap_attention", ("sparsemap",),
         lambda d: Call(lambda q, k, v, t, m: entmax_fast.sparsemap_attention(q, k, v, t, attn_mask=m),
                        (*_qkv(d), torch.randn(2, 2, 2, device=d), torch.tensor([[True, True, False]] * 3, device=d)),
                        4)),
    Case("MultiheadEntmaxAttention/crf", ("crf",), lambda d: _mha(d, "crf", need_weights=True)),
    # continuous attention (plain torch, no backend)
    Case("continuous_softmax", (), lambda d: Call(continuous.continuous_softmax, _gaussian_parameters(d), 2)),
    Case("continuous_sparsemax", (), lambda d: Call(continuous.continuous_sparsemax, _gaussian_parameters(d), 2)),
    Case("continuous_entmax15", (), lambda d: Call(continuous.continuous_entmax15, _gaussian_parameters(d), 2)),
    Case("continuous_softmax_2d", (), lambda d: Call(continuous.continuous_softmax_2d, _gaussian_parameters_2d(d), 2)),
    Case("continuous_sparsemax_2d", (),
         lambda d: Call(lambda *a: continuous.continuous_sparsemax_2d(*a, num_angles=16), _gaussian_parameters_2d(d),
                        2)),
    Case("continuous_density", (),
         lambda d: Call(lambda *a: continuous.continuous_density("entmax15", *a), _gaussian_parameters(d), 2)),
    Case("continuous_sparsemax_2d_error_bound", (),
         lambda d: Call(lambda sigma, variances: continuous.continuous_sparsemax_2d_error_bound(sigma, variances, 16),
                        _gaussian_parameters_2d(d)[1::2], 0)),
    Case("sequence_positions", (),
         lambda d: Call(lambda mask: continuous.sequence_positions(5, mask),
                        (torch.tensor([[True, False, True, True, False]], device=d),), 0)),
    Case("GaussianBasis1d", (), lambda d: _module(continuous.GaussianBasis1d.grid(4).to(d), torch.rand(5, device=d))),
    Case("GaussianBasis1d/fit_weights", (), _basis_fit),
    Case("ContinuousAttention", (), lambda d: _continuous_attention(d, mask=False)),
    Case("ContinuousAttention/masked_entmax15_sum", (),
         lambda d: _continuous_attention(d, mask=True, density="entmax15", combine="sum")),
]


def _backends(case):
    """The backends that implement one of the case's ops ([None]: no backend, plain torch)."""
    if not case.ops:
        return [None]
    implemented = dispatch.registered_ops()
    backends = [name for name in dispatch.BACKENDS if any(name in implemented[op] for op in case.ops)]
    if "triton" in backends and not (ON_GPU or case.interpreter):
        backends.remove("triton")
    return backends


PARAMS = [pytest.param(case, backend, id=f"{case.name}-{backend or 'torch'}")
          for case in CASES for backend in _backends(case)]


@pytest.fixture(autouse=True)
def two_threads_at_least():
    """The C++ attention gives its tasks to the intra-op pool only with two threads or more,
    which pytest-xdist's share of this machine's cores (conftest.py) may not leave."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)


def _device(backend):
    return DEVICE if backend == "triton" else torch.device("cpu")


def _forcing(backend):
    if backend is None:
        return contextlib.nullcontext()
    ok, why = dispatch.availability(backend)
    if not ok:
        pytest.skip(f"backend {backend} is not available here: {why}")
    return entmax_fast.use_backend(backend)


def _outputs(result):
    """The tensors of a call's result (MultiheadEntmaxAttention returns (out, weights or None))."""
    results = result if isinstance(result, tuple) else (result,)
    return [tensor for tensor in results if tensor is not None]


def test_every_public_computing_op_has_a_case():
    # alibi_slopes builds a constant from a head count: no tensor goes in.
    public = set(entmax_fast.__all__) - {"backend_info", "use_backend", "alibi_slopes"} | set(continuous.__all__)
    assert {case.name.split("/")[0] for case in CASES} == public


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("case, backend", PARAMS)
def test_op_under_context_matches_the_ordinary_call(case, backend, context):
    device = _device(backend)
    call = case.build(device)
    with torch.inference_mode():
        inference_inputs = tuple(tensor.clone() for tensor in call.inputs)
    with _forcing(backend):
        with context():
            got = _outputs(call.fn(*call.inputs))
            got_from_inference_inputs = _outputs(call.fn(*inference_inputs))
        # After the calls above, whatever they cached: the ordinary call still records and
        # differentiates.
        leaves = [tensor.detach().requires_grad_() if i < call.n_grad else tensor
                  for i, tensor in enumerate(call.inputs)]
        expected = _outputs(call.fn(*leaves))
        if call.n_grad:
            sum(out.sum() for out in expected).backward()
    assert all(leaf.grad is not None for leaf in leaves[:call.n_grad])
    expected = [out.detach() for out in expected]
    for outputs in (got, got_from_inference_inputs):
        assert not any(out.requires_grad for out in outputs)
        if context is torch.inference_mode:
            assert all(out.is_inference() for out in outputs)
        torch.testing.assert_close(outputs, expected)


# --------------------------------------------------------------------------------------
# CUDA graphs: capture, then replay on new input values, against eager calls
# --------------------------------------------------------------------------------------

GRAPH_CASES = {
    "entmax_attention": lambda q, k, v, x, alpha: entmax_fast.entmax_attention(q, k, v, is_causal=True),
    "entmax_attention_alpha_per_head": lambda q, k, v, x, alpha: entmax_fast.entmax_attention(q, k, v, alpha=alpha),
    "sparsemax": lambda q, k, v, x, alpha: entmax_fast.sparsemax(x),
    "entmax15": lambda q, k, v, x, alpha: entmax_fast.entmax15(x),
    # a float α without a closed form: the kernels read it from a tensor the graph fills
    "entmax_bisect": lambda q, k, v, x, alpha: entmax_fast.entmax_bisect(x, 1.25),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_cuda_graph_replay_matches_eager(name):
    fn = GRAPH_CASES[name]
    device = torch.device("cuda")
    varying = [torch.randn(2, 4, 128, 64, device=device) for _ in range(3)] + [torch.randn(64, 300, device=device)]
    # made before the capture: copying a host list to the device is not allowed while capturing
    alpha = torch.tensor([1.2, 1.5, 1.8, 2.0], device=device)
    with torch.inference_mode():
        # Kernels are compiled (and every cache filled) before the capture, on a side stream,
        # as torch.cuda.graphs asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*varying, alpha)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn(*varying, alpha)
    for _ in range(2):
        for tensor in varying:
            tensor.copy_(torch.randn_like(tensor))
        graph.replay()
        with torch.inference_mode():
            eager = fn(*varying, alpha)
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager)
