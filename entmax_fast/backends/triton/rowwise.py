"""Launchers of the row-wise α-entmax kernels (entmax_fast/triton_kernels/rowwise.py): the
Triton backend of the op ``entmax``.

Layout: 2-D input (R, n); the row stride is free, the last dimension must have stride 1 (a
tensor whose last stride is not 1 is copied once with ``.contiguous()``, documented, not
silent: see `entmax_forward`). Outputs are contiguous. The threshold and pass count behind
an output (`entmax_threshold`, `_forward`) are for tests and benchmarks.
"""
from __future__ import annotations

import functools
import types

import torch

from ... import common
from ...triton_kernels.rowwise import (DEFAULT_MAX_PASSES, DEFAULT_TOL, STAT_C_HI, STAT_C_LO,
                                       STAT_CAPTURED_AT, STAT_PASSES, STATS_COLUMNS, candidate_slots,
                                       entmax_rowwise_bwd_kernel, entmax_rowwise_fwd_kernel,
                                       plain_alpha, start_subset, tile_config)

__all__ = ["entmax_forward", "entmax_backward", "entmax_threshold"]


# (device, α, stream) -> _alpha_args of a python-float α. Filling a fresh (1,) tensor costs a
# kernel launch per call on a GPU; the kernels only read it, so one per value is shared.
# Only the general kind reads it (1, 1.5 and 2 are constexpr kinds): its tensor is filled on
# the stream of the call that creates it and shared only with calls on that stream, which
# run after the fill, so nothing waits on the host. Float α can take endless values (an
# annealed α), hence the bound.
_FLOAT_ALPHA_ARGS: dict[tuple, tuple[int, torch.Tensor, int]] = {}
_FLOAT_ALPHA_ARGS_MAX = 256


def _alpha_args(alpha, device):
    """(ALPHA_KIND, fp32 alpha tensor, stride) for the kernels. The public layer checked α."""
    if isinstance(alpha, torch.Tensor):
        return common.ALPHA_GENERAL, alpha.to(torch.float32).contiguous(), 1
    kind = common.alpha_kind(alpha)
    stream = None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            # filled by the graph, as the call's own: it holds α only once the graph replays
            return kind, torch.full((1,), float(alpha), dtype=torch.float32, device=device), 0
        if kind == common.ALPHA_GENERAL:
            stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, alpha, stream)
    args = _FLOAT_ALPHA_ARGS.get(key)
    if args is None:
        args = (kind, torch.full((1,), float(alpha), dtype=torch.float32, device=device), 0)
        if len(_FLOAT_ALPHA_ARGS) >= _FLOAT_ALPHA_ARGS_MAX:
            _FLOAT_ALPHA_ARGS.clear()
        _FLOAT_ALPHA_ARGS[key] = args
    return args


@functools.lru_cache(maxsize=None)
def _launch_config(n_cols: int, alpha_kind: int) -> tuple[int, int, types.MappingProxyType]:
    """(ROWS, num_warps, the kernels' tile constexprs) of `tile_config`, once per length and
    α kind: the table is fixed, and building it again each call is host time a small call's
    kernel does not have. Read-only, as every call shares it."""
    return _split_config(tile_config(n_cols, alpha_kind))


@functools.lru_cache(maxsize=None)
def _table_candidates(n_cols: int, alpha_kind: int) -> int:
    return candidate_slots(n_cols, tile_config(n_cols, alpha_kind), alpha_kind)


@functools.lru_cache(maxsize=None)
def _table_subset(n_cols: int, alpha_kind: int) -> int:
    return start_subset(tile_config(n_cols, alpha_kind), alpha_kind)


def _split_config(config: dict) -> tuple[int, int, types.MappingProxyType]:
    constexprs = dict(config)
    num_warps = constexprs.pop("num_warps")
    return constexprs["ROWS"], num_warps, types.MappingProxyType(constexprs)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    # Kernels index columns with unit stride; another last stride costs one copy.
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _forward(x: torch.Tensor, alpha, tol: float = DEFAULT_TOL, max_passes: int = DEFAULT_MAX_PASSES,
             config: dict | None = None, candidates: int | None = None, subset: int | None = None,
             all_plain: bool | None = None):
    """Returns (p, c, passes, captured_at): output; threshold in the c-form of
    triton_kernels/rowwise.py as (R, 2) fp32 pairs, c = c[:, 0] + c[:, 1]; passes per row
    (int32); the pass from whose support on a general-kind row's later evaluations ran
    over its captured candidates (int32, 0: none; `candidate_slots`). ``config`` overrides
    `tile_config` (benchmarks and tests of the chunked path), ``candidates`` the slots,
    ``subset`` the values the iteration's start is found from (`start_subset`; 0: c = 1),
    ``all_plain`` the compile of a launch whose rows are all plain (`plain_alpha`)."""
    p, stats = _launch_forward(x, alpha, tol, max_passes, config, candidates, subset, all_plain)
    counts = stats.view(torch.int32)
    return (p, stats[:, STAT_C_HI.value:STAT_C_LO.value + 1], counts[:, STAT_PASSES.value],
            counts[:, STAT_CAPTURED_AT.value])


def _launch_forward(x, alpha, tol=DEFAULT_TOL, max_passes=DEFAULT_MAX_PASSES, config=None, candidates=None,
                    subset=None, all_plain=None):
    """(p, the kernel's record per row: (R, STATS_COLUMNS) fp32) for `_forward`'s arguments."""
    x = _unit_stride(x)
    n_rows, n_cols = x.shape
    kind, alpha_t, alpha_stride = _alpha_args(alpha, x.device)
    if not (tol > 0):
        raise ValueError(f"tol must be > 0, got {tol}")
    if max_passes < 2:
        raise ValueError(f"max_passes must be >= 2 (max, one evaluation), got {max_passes}")
    p = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    # one buffer for the record: a small call's host time is a few µs per allocation
    stats = torch.empty((n_rows, STATS_COLUMNS.value), dtype=torch.float32, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return p, stats.zero_()
    rows_per_program, num_warps, tile = _split_config(config) if config else _launch_config(n_cols, kind)
    if candidates is None:
        candidates = (candidate_slots(n_cols, config, kind) if config
                      else _table_candidates(n_cols, kind))
    if subset is None:
        subset = start_subset(config, kind) if config else _table_subset(n_cols, kind)
    slots = (torch.empty((n_rows, candidates), dtype=torch.float32, device=x.device)
             if candidates else stats)
    if all_plain is None:
        all_plain = plain_alpha(alpha)
    # Plain integer arithmetic: triton.cdiv is a ConstexprFunction, microseconds per call on the host.
    entmax_rowwise_fwd_kernel[((n_rows + rows_per_program - 1) // rows_per_program,)](
        x, p, stats, alpha_t, slots, n_rows, n_cols, x.stride(0), p.stride(0),
        alpha_stride, float(tol), int(max_passes), ALPHA_KIND=kind, CANDIDATES=candidates,
        SUBSET=subset, ALL_PLAIN=bool(all_plain), num_warps=num_warps, num_stages=1, **tile)
    return p, stats


def entmax_forward(x: torch.Tensor, alpha) -> torch.Tensor:
    """α-entmax of every row of ``x``.

    x: (R, n) float32/float16/bfloat16; row stride free, last stride 1 expected (else one
    ``.contiguous()`` copy). alpha: python float > 0, or float tensor (R,) of values > 0
    (checked by the public layer, on the device without a host sync). Returns p (R, n) in x's dtype,
    computed in fp32. A row holding NaN or +inf gives NaN; −inf entries get weight 0.
    """
    return _launch_forward(x, alpha)[0]


def entmax_threshold(x: torch.Tensor, alpha, tol: float = DEFAULT_TOL,
                     max_passes: int = DEFAULT_MAX_PASSES):
    """(mu, passes): the reference's μ per row (fp32, (R,)) and passes over the row (int32).

    Passes count evaluations over the row before the output: 1 (max) + one per iteration
    (softmax: 1). For resident rows they are passes over registers, not memory reads.
    """
    _, c, passes, _ = _forward(x, alpha, tol, max_passes)
    n_rows = x.shape[0]
    if isinstance(alpha, torch.Tensor):
        t = alpha.to(torch.float32) - 1
    else:
        t = torch.full((n_rows,), float(alpha) - 1, dtype=torch.float32, device=x.device)
    c = c.double().sum(-1)  # the pair, in float64 so that 1 − c keeps the low part
    t = t.double()
    t_safe = torch.where(t == 0, torch.ones_like(t), t)
    mu = torch.where(t == 0, -torch.log(c), (1 - c) / t_safe)
    return mu.float(), passes


def entmax_backward(p: torch.Tensor, grad: torch.Tensor, alpha, need_alpha_grad: bool,
                    config: dict | None = None):
    """(dx, dalpha or None) of α-entmax from its output p (docs/maths.md, "Backward").

    p, grad: (R, n), float32/float16/bfloat16 (last stride 1 expected). dx has grad's dtype;
    dalpha is fp32 (R,). At α = 1 dalpha uses the exact limit of ∂p/∂α.
    """
    p, grad = _unit_stride(p), _unit_stride(grad)
    n_rows, n_cols = p.shape
    kind, alpha_t, alpha_stride = _alpha_args(alpha, p.device)
    dx = torch.empty((n_rows, n_cols), dtype=grad.dtype, device=p.device)
    dalpha = torch.zeros((n_rows,), dtype=torch.float32, device=p.device) if need_alpha_grad else None
    if n_rows == 0 or n_cols == 0:
        return dx, dalpha
    rows_per_program, num_warps, tile = _split_config(config) if config else _launch_config(n_cols, kind)
    entmax_rowwise_bwd_kernel[((n_rows + rows_per_program - 1) // rows_per_program,)](
        p, grad, dx, dalpha if need_alpha_grad else alpha_t, alpha_t,
        n_rows, n_cols, p.stride(0), grad.stride(0), dx.stride(0), alpha_stride,
        ALPHA_KIND=kind, NEED_DALPHA=bool(need_alpha_grad), num_warps=num_warps, num_stages=1, **tile)
    return dx, dalpha
