"""Plain-torch reference of fusedmax and oscarmax (docs/maths.md, "fusedmax and oscarmax"); the
tests' ground truth.

    fusedmax(z; lam)  = sparsemax(prox_TV(z; lam)),
        prox_TV(z; lam) = argmin_y ½‖y − z‖² + lam Σ_i |y_{i+1} − y_i|
    oscarmax(z; beta) = sparsemax(prox_OWL(z; w)),  w_i = beta (n − i), i = 1..n,
        prox_OWL(z; w) = argmin_y ½‖y − z‖² + Σ_i w_i |y|_[i]   (|y|_[1] ≥ |y|_[2] ≥ ...)

The prox of each row is computed exactly in float64 by a Python loop (Condat's direct
algorithm for TV; sort + pool-adjacent-violators for OWL), which also returns the groups of
the solution. The differentiable output is then rebuilt from the input with the groups held
fixed (a group's value is the group mean of z, or of |z| with signs for OWL, plus a constant),
so autograd yields the exact Jacobian without a hand-written backward — a route independent
of the C++ operators' explicit formula.

Masking: along the mapped dimension a position is valid when its score is not −inf and (with
``lengths``) its index is < the row's length. Only valid positions enter the prox (they are
sliced out in order, so the TV chain joins the valid neighbours across a masked position) and
the projection; masked positions get weight 0. A row without valid positions gives zeros.
A row with NaN or +inf at a valid position gives NaN weights and a NaN gradient
(torch.softmax's rule).

Large scores: each row is scaled by a power of two 2^−e (exact) so that its valid entries
have |z| < 1 (for TV also shifted by their max: prox_TV commutes with shifts), the prox runs
with reg 2^−e (the prox is positively homogeneous) and is mapped back, and the projection
sees y − max y (sparsemax is shift invariant). Any finite scores
give finite weights; unshifted, scores of ~1e18 gave all-zero weights (1 + y rounds to y).
"""
from __future__ import annotations

import math
import numbers

import torch

from ..common import compute_dtype
from .attention import CHUNK_ELEMENTS, expand_heads, masked_scores

__all__ = [
    "fusedmax",
    "oscarmax",
    "tv1d_prox",
    "oscar_prox",
    "fusedmax_attention",
    "oscarmax_attention",
    "structured_attention",
    "check_mapping_args",
    "CHUNK_ELEMENTS",
]

# ---------------------------------------------------------------------------------------
# Argument checks (shared with the public module).

def check_mapping_args(name: str, X, reg, reg_name: str, dim: int, lengths, check_values: bool = True) -> None:
    """Raise a ValueError/TypeError (IndexError for ``dim``) naming the bad argument, with
    expected vs got."""
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"{name}: X must be a torch.Tensor, got {type(X).__name__}")
    if not X.is_floating_point():
        raise TypeError(f"{name}: X must have a floating dtype, got {X.dtype}")
    if X.dim() == 0:
        raise ValueError(f"{name}: X must have at least 1 dimension, got a 0-d tensor")
    # The row-wise mappings' types (and torch.softmax's): TypeError, IndexError.
    if not isinstance(dim, int):
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__}")
    if not -X.dim() <= dim < X.dim():
        raise IndexError(f"{name}: dim must be in [{-X.dim()}, {X.dim() - 1}] for X of shape {tuple(X.shape)}, got {dim}")
    if isinstance(reg, bool) or not isinstance(reg, numbers.Real):
        raise TypeError(f"{name}: {reg_name} must be a Python float >= 0, got {type(reg).__name__}")
    if not math.isfinite(float(reg)) or float(reg) < 0:
        raise ValueError(f"{name}: {reg_name} must be finite and >= 0, got {reg}")
    if lengths is not None:
        expected = tuple(s for i, s in enumerate(X.shape) if i != dim % X.dim())
        if not isinstance(lengths, torch.Tensor):
            raise TypeError(f"{name}: lengths must be an integer tensor of shape {expected}, got {type(lengths).__name__}")
        if tuple(lengths.shape) != expected:
            raise ValueError(f"{name}: lengths must have shape {expected} (X's shape without dim {dim}), "
                             f"got {tuple(lengths.shape)}")
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise TypeError(f"{name}: lengths must have an integer dtype, got {lengths.dtype}")
        if lengths.device != X.device:
            raise ValueError(f"{name}: lengths must be on X's device ({X.device}), got {lengths.device}")
        if check_values and lengths.numel() > 0:
            lo, hi = int(lengths.min()), int(lengths.max())
            if lo < 0 or hi > X.shape[dim]:
                raise ValueError(f"{name}: lengths must lie in [0, {X.shape[dim]}] (the size of dim {dim}), "
                                 f"got values in [{lo}, {hi}]")


# ---------------------------------------------------------------------------------------
# Exact per-row prox on Python floats; each returns (values, group ids).

def _tv1d_prox_list(x: list, lam: float):
    """Condat (2013)'s direct algorithm. Group ids number the constant segments."""
    width = len(x)
    if width <= 1 or lam == 0:
        return list(x), list(range(width))
    out = [0.0] * width
    group = [0] * width
    segment = 0
    k = k0 = kplus = kminus = 0
    umin, umax = lam, -lam
    vmin, vmax = x[0] - lam, x[0] + lam
    while True:
        while k == width - 1:
            if umin < 0.0:
                for i in range(k0, kminus + 1):
                    out[i], group[i] = vmin, segment
                segment += 1
                k0 = k = kminus = kminus + 1
                vmin = x[k0]
                umin = lam
                umax = vmin + umin - vmax
            elif umax > 0.0:
                for i in range(k0, kplus + 1):
                    out[i], group[i] = vmax, segment
                segment += 1
                k0 = k = kplus = kplus + 1
                vmax = x[k0]
                umax = -lam
                umin = vmax + umax - vmin
            else:
                vmin += umin / (k - k0 + 1)
                for i in range(k0, k + 1):
                    out[i], group[i] = vmin, segment
                return out, group
        umin += x[k + 1] - vmin
        if umin < -lam:
            for i in range(k0, kminus + 1):
                out[i], group[i] = vmin, segment
            segment += 1
            k0 = k = kplus = kminus = kminus + 1
            vmin = x[k0]
            vmax = vmin + 2 * lam
            umin, umax = lam, -lam
            continue
        umax += x[k + 1] - vmax
        if umax > lam:
            for i in range(k0, kplus + 1):
                out[i], group[i] = vmax, segment
            segment += 1
            k0 = k = kplus = kminus = kplus + 1
            vmax = x[k0]
            vmin = vmax - 2 * lam
            umin, umax = lam, -lam
            continue
        k += 1
        if umin >= lam:
            kminus = k
            vmin += (umin - lam) / (kminus - k0 + 1)
            umin = lam
        if umax <= -lam:
            kplus = k
            vmax += (umax + lam) / (kplus - k0 + 1)
            umax = -lam


def _oscar_prox_list(x: list, beta: float):
    """Sort |x| decreasingly, subtract w, PAV (non-increasing), clip at 0, restore order and
    signs. Group ids number the PAV blocks; entries whose output is 0 get group −1."""
    m = len(x)
    if beta == 0:
        return list(x), list(range(m))
    order = sorted(range(m), key=lambda i: -abs(x[i]))
    sums, lens = [], []
    for r, i in enumerate(order):
        sums.append(abs(x[i]) - beta * (m - 1 - r))
        lens.append(1)
        # Equal means are pooled too, so distinct groups have distinct values.
        while len(sums) > 1 and sums[-2] / lens[-2] <= sums[-1] / lens[-1]:
            last_sum, last_len = sums.pop(), lens.pop()
            sums[-1] += last_sum
            lens[-1] += last_len
    out = [0.0] * m
    group = [-1] * m
    r = 0
    for b, (s, length) in enumerate(zip(sums, lens)):
        t = max(s / length, 0.0)
        for i in order[r:r + length]:
            sign = (x[i] > 0) - (x[i] < 0)
            out[i] = sign * t
            group[i] = b if t > 0 and sign != 0 else -1
        r += length
    return out, group


# ---------------------------------------------------------------------------------------
# Row-wise driver.

def _valid_positions(Z: torch.Tensor, lengths) -> torch.Tensor:
    valid = Z != float("-inf")
    if lengths is not None:
        index = torch.arange(Z.shape[-1], device=Z.device)
        valid = valid & (index < lengths.to(Z.device).unsqueeze(-1))
    return valid


def _prox_rows(Z64: torch.Tensor, valid: torch.Tensor, reg: list, kind: str):
    """Exact prox of every row of the (rows, n) float64 tensor Z64 over its valid entries,
    row r with regularisation reg[r].

    Returns y (rows, n; 0 at masked positions) and global group ids (rows, n; −1 where the
    entry belongs to no group: masked, or OWL output 0)."""
    rows, n = Z64.shape
    prox = _tv1d_prox_list if kind == "tv" else _oscar_prox_list
    z_rows = Z64.detach().cpu().tolist()
    valid_rows = valid.cpu().tolist()
    y = [[0.0] * n for _ in range(rows)]
    group = [[-1] * n for _ in range(rows)]
    next_group = 0
    for r in range(rows):
        positions = [j for j in range(n) if valid_rows[r][j]]
        values, ids = prox([z_rows[r][j] for j in positions], reg[r])
        for j, value, gid in zip(positions, values, ids):
            y[r][j] = value
            group[r][j] = next_group + gid if gid >= 0 else -1
        next_group += len(positions)
    y_t = torch.tensor(y, dtype=torch.float64, device=Z64.device).reshape(rows, n)
    g_t = torch.tensor(group, dtype=torch.int64, device=Z64.device).reshape(rows, n)
    return y_t, g_t


def _group_mean(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each entry's group (0 where group is −1); differentiable."""
    in_group = group >= 0
    index = torch.where(in_group, group, 0).reshape(-1)
    weights = in_group.reshape(-1).to(values.dtype)
    size = int(index.max()) + 1 if index.numel() else 1
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, values.reshape(-1) * weights)
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, index, weights)
    mean = sums[index] / counts[index].clamp_min(1)
    return torch.where(in_group.reshape(-1), mean, torch.zeros_like(mean)).reshape(values.shape)


def _differentiable_prox(Z64: torch.Tensor, valid: torch.Tensor, reg: list, kind: str) -> torch.Tensor:
    """The prox of each row as an affine function of Z64 with the groups held fixed: its
    values are the exact prox, its autograd Jacobian is J_prox (docs/maths.md, "fusedmax and
    oscarmax")."""
    y_exact, group = _prox_rows(Z64, valid, reg, kind)
    z = torch.where(valid, Z64, torch.zeros_like(Z64))
    if kind == "tv":
        mean = _group_mean(z, group)
        return mean + (y_exact - mean.detach())
    magnitude = _group_mean(z.abs(), group)
    sign = torch.sign(y_exact)
    return sign * magnitude + (y_exact - sign * magnitude.detach())


def _masked_sparsemax(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sparsemax over the valid entries of each row; support found without grad, tau with."""
    with torch.no_grad():
        scores = torch.where(valid, y, torch.full_like(y, float("-inf")))
        ordered, _ = torch.sort(scores, dim=-1, descending=True)
        finite = ordered > float("-inf")
        cumulative = torch.where(finite, ordered, torch.zeros_like(ordered)).cumsum(-1)
        rank = torch.arange(1, y.shape[-1] + 1, device=y.device, dtype=y.dtype)
        in_support = finite & (1 + rank * ordered > cumulative)
        k = in_support.sum(-1, keepdim=True).clamp_min(1)
        tau_detached = (cumulative.gather(-1, k - 1) - 1) / k
        support = valid & (y > tau_detached)
    count = support.sum(-1, keepdim=True).clamp_min(1).to(y.dtype)
    tau = (torch.where(support, y, torch.zeros_like(y)).sum(-1, keepdim=True) - 1) / count
    return torch.where(support, y - tau, torch.zeros_like(y))


class NanRows(torch.autograd.Function):
    """NaN in the rows marked ``poisoned`` and 0 elsewhere, with a NaN gradient in those rows
    only; added to a mapping's output, it gives softmax's NaN rows without touching the
    values or gradients of the other rows."""

    @staticmethod
    def forward(ctx, Z, poisoned):
        ctx.save_for_backward(poisoned)
        return torch.where(poisoned, float("nan"), 0.0).to(Z.dtype).expand(Z.shape).clone()

    @staticmethod
    def backward(ctx, grad):
        (poisoned,) = ctx.saved_tensors
        return torch.where(poisoned, float("nan"), 0.0).to(grad.dtype).expand(grad.shape).clone(), None


def _row_exponent(Z64: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """e per row (rows, 1) with max |z| 2^−e in [0.5, 1) over the valid entries (0 for an
    all-zero or empty row)."""
    max_abs = torch.where(valid, Z64.abs(), torch.zeros_like(Z64)).amax(-1, keepdim=True)
    _, exponent = torch.frexp(max_abs)
    return exponent.to(torch.int64)


def _times_pow2(values: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """values · 2^exponent, exact; in two factors, since 2^±1074 alone is not a float64."""
    half = torch.div(exponent, 2, rounding_mode="floor")
    return values * torch.pow(2.0, half.to(values.dtype)) * torch.pow(2.0, (exponent - half).to(values.dtype))


def _valid_max(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Row max (rows, 1) over the valid entries, 0 for a row without any; no gradient (the
    shifts it serves cancel out)."""
    masked = torch.where(valid, values, torch.full_like(values, float("-inf"))).amax(-1, keepdim=True)
    return torch.where(torch.isinf(masked), torch.zeros_like(masked), masked).detach()


def _structured_map(name: str, X: torch.Tensor, reg, reg_name: str, dim: int, lengths, kind: str, project: bool):
    check_mapping_args(name, X, reg, reg_name, dim, lengths)
    Z = X.movedim(dim, -1)
    shape = Z.shape
    n = shape[-1]
    Z64 = Z.to(torch.float64).reshape(-1, n)
    valid = _valid_positions(Z64, None if lengths is None else lengths.reshape(-1))
    poisoned = (valid & (torch.isnan(Z64) | torch.isposinf(Z64))).any(-1, keepdim=True)
    valid_and_finite = valid & ~poisoned
    Z64_finite = torch.where(valid_and_finite, Z64, torch.zeros_like(Z64))
    exponent = _row_exponent(Z64_finite, valid_and_finite)
    scaled = _times_pow2(Z64_finite, -exponent)
    count = valid_and_finite.sum(-1).tolist()
    # Capped where a larger value no longer changes the prox (csrc/common/structured_algos.h).
    reg_rows = [min(math.ldexp(float(reg), -e), 4.0 * (m + 1) if kind == "tv" else 4.0)
                for e, m in zip(exponent.reshape(-1).tolist(), count)]
    shift = _valid_max(scaled, valid_and_finite) if kind == "tv" else torch.zeros_like(scaled[:, :1])
    y_work = _differentiable_prox(scaled - shift, valid_and_finite, reg_rows, kind)
    if project:
        y_max = _valid_max(y_work, valid_and_finite)
        out = _masked_sparsemax(_times_pow2(y_work - y_max, exponent), valid_and_finite)
    else:
        out = torch.where(valid, _times_pow2(y_work + shift, exponent), torch.full_like(y_work, float("-inf")))
    out = out + NanRows.apply(Z64, poisoned)
    return out.reshape(shape).to(X.dtype).movedim(-1, dim)


def fusedmax(X: torch.Tensor, lam: float = 1.0, dim: int = -1, lengths=None) -> torch.Tensor:
    """Reference fusedmax along ``dim``: sparsemax(prox_TV(X; lam)); differentiable in X."""
    return _structured_map("fusedmax", X, lam, "lam", dim, lengths, "tv", project=True)


def oscarmax(X: torch.Tensor, beta: float = 1.0, dim: int = -1, lengths=None) -> torch.Tensor:
    """Reference oscarmax along ``dim``: sparsemax(prox_OWL(X; w)), w_i = beta (n − i)."""
    return _structured_map("oscarmax", X, beta, "beta", dim, lengths, "owl", project=True)


def tv1d_prox(X: torch.Tensor, lam: float, dim: int = -1, lengths=None) -> torch.Tensor:
    """Reference prox_TV of the valid entries along ``dim`` (−inf at masked positions)."""
    return _structured_map("tv1d_prox", X, lam, "lam", dim, lengths, "tv", project=False)


def oscar_prox(X: torch.Tensor, beta: float, dim: int = -1, lengths=None) -> torch.Tensor:
    """Reference prox_OWL with OSCAR weights w_i = beta (n − i), n = number of valid entries."""
    return _structured_map("oscar_prox", X, beta, "beta", dim, lengths, "owl", project=False)


# ---------------------------------------------------------------------------------------
# Attention.

def structured_attention(mapping, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False, chunk_elements: int = CHUNK_ELEMENTS):
    """Scaled-dot-product attention with ``mapping`` (a row-wise map along the last dim) in
    place of softmax. Scores are materialised one query chunk at a time (at most
    ``chunk_elements`` entries per chunk); autograd keeps every chunk's weights for the
    backward, so training memory is O(B·H·Lq·Lk).

    query (..., H, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev) -> (..., H, Lq, Ev).
    ``attn_mask``: bool (True = attend) or float (added to the scores), broadcastable to
    (..., H, Lq, Lk). ``is_causal``: top-left aligned, query i sees keys j <= i; together
    with ``attn_mask`` a key is attended when both allow it. ``enable_gqa``: key/value heads
    are repeated to match the query heads. ``scale``: default 1/sqrt(E) (1 for E = 0, whose
    scores are all 0). Half-precision inputs are computed in float32.
    """
    for arg_name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            raise ValueError(f"attention: {arg_name} must be a tensor with at least 2 dimensions (..., L, E), "
                             f"got {getattr(tensor, 'shape', type(tensor).__name__)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"attention: query and key must have the same last dimension, got {query.shape[-1]} "
                         f"and {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"attention: key and value must have the same length (dim -2), got {key.shape[-2]} "
                         f"and {value.shape[-2]}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p}")
    if enable_gqa and query.dim() >= 3:
        heads = query.shape[-3]
        for kv in (key, value):
            if kv.dim() >= 3 and kv.shape[-3] != heads and (kv.shape[-3] == 0 or heads % kv.shape[-3] != 0):
                raise ValueError(f"attention: query heads ({heads}) must be divisible by key/value heads "
                                 f"({kv.shape[-3]}) for grouped-query attention")
        key, value = (expand_heads(kv, heads) if kv.dim() >= 3 else kv for kv in (key, value))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] > 0 else 1.0
    compute = compute_dtype(query.dtype)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    mask = attn_mask
    if mask is not None and mask.dim() < 2:
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    lq, lk = q.shape[-2], k.shape[-2]
    batch_heads = max(1, q.numel() // max(1, q.shape[-1] * lq))
    rows_per_chunk = max(1, chunk_elements // max(1, batch_heads * lk))
    outputs = []
    for start in range(0, lq, rows_per_chunk):
        stop = min(start + rows_per_chunk, lq)
        scores = masked_scores(q[..., start:stop, :], k, scale, mask, start, stop, is_causal, query_length=lq)
        weights = mapping(scores)
        if dropout_p > 0:
            weights = torch.nn.functional.dropout(weights, dropout_p)
        outputs.append(weights @ v)
    if not outputs:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)).to(query.dtype)
    return torch.cat(outputs, dim=-2).to(query.dtype)


def fusedmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, *, lam: float = 1.0):
    """Reference fusedmax attention (see :func:`structured_attention`)."""
    return structured_attention(lambda s: fusedmax(s, lam, dim=-1), query, key, value, attn_mask, dropout_p,
                                is_causal, scale, enable_gqa)


def oscarmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, *, beta: float = 1.0):
    """Reference oscarmax attention (see :func:`structured_attention`)."""
    return structured_attention(lambda s: oscarmax(s, beta, dim=-1), query, key, value, attn_mask, dropout_p,
                                is_causal, scale, enable_gqa)
