"""Plain-torch reference of the chain-structured attention weights (docs/maths.md, "Chain
marginals: CRF and SparseMAP"); the tests' ground truth, exact in float64.

One row of m keys (the valid ones, in key order) carries binary selection variables
z ∈ {0,1}^m with the log-potential

    θ(z) = Σ_j s_j z_j + Σ_{j≥1} T[z_{j−1}, z_j]        (T: 2×2, [previous, current])

- CRF marginals: μ_j = P(z_j = 1) under p(z) ∝ exp θ(z). Computed by forward–backward in
  log space (torch.logsumexp over the two states); autograd through the recursion gives the
  exact gradient in the scores and in T.
- SparseMAP: the unary marginals of argmax_{μ ∈ M} s·μ + Σ T·(pair marginals) − ½ Σ_j μ_j²
  over the chain's marginal polytope M, written over distributions ξ on configurations:
  max θ_Aᵀξ − ½‖M_A ξ‖² on the simplex. Solved by a primal active-set method whose oracle is
  Viterbi (argmax_z θ(z) − z·μ, a MAP with unaries s − μ); the returned μ = M_A ξ_A is
  rebuilt from the input with the final active set A held fixed, ξ_A the solution of the
  equality-constrained KKT system, so autograd yields the closed-form backward (a route
  independent of the C++ operators, which use the chain's reduction to a TV prox). Rows with
  w = T00 + T11 − T01 − T10 = 0 separate by key (μ = clip(c, 0, 1)) and have a kink in w; their
  gradient in w is the one-sided derivative of least magnitude (docs/maths.md).

Masking: a score of −inf removes its key from the chain (the valid neighbours on either
side are linked); it gets weight 0. A row holding NaN or +inf at a valid position gets NaN
weights and a NaN gradient (torch.softmax's rule). A row without valid keys gets zeros.
"""
from __future__ import annotations

import math

import torch

from .structured import NanRows, structured_attention

__all__ = ["crf_marginals", "sparsemap_marginals", "crf_attention", "sparsemap_attention", "viterbi",
           "sparsemap_active_set", "sparsemap_rates_at_zero", "rows_and_transitions"]


# ---------------------------------------------------------------------------------------
# Rows and transitions.

def rows_and_transitions(scores: torch.Tensor, transitions: torch.Tensor, dim: int):
    """(rows (R, n), transitions (R, 2, 2), the moved shape): scores with ``dim`` last,
    flattened to rows, and the transitions broadcast to one 2×2 matrix per row (the
    expansion is differentiable: its gradient sums back to ``transitions``' shape)."""
    moved = scores.movedim(dim, -1)
    batch = moved.shape[:-1]
    count = math.prod(batch)
    per_row = transitions.expand(*batch, 2, 2).reshape(count, 2, 2)
    return moved.reshape(count, moved.shape[-1]), per_row, moved.shape


def _from_rows(out: torch.Tensor, moved_shape, dim: int, dtype) -> torch.Tensor:
    return out.reshape(moved_shape).to(dtype).movedim(-1, dim)


# ---------------------------------------------------------------------------------------
# CRF: forward–backward in log space.

def _crf_rows(s: torch.Tensor, T: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Marginals (R, n) of rows s (R, n) in float64 with transitions T (R, 2, 2); masked
    positions are skipped by the recursion and get 0."""
    rows, n = s.shape
    zero_col = torch.zeros(rows, 1, dtype=s.dtype, device=s.device)
    unary = torch.cat([zero_col.expand(rows, n).unsqueeze(-1), s.unsqueeze(-1)], dim=-1)  # (R, n, 2)
    unary = torch.where(valid.unsqueeze(-1), unary, torch.zeros_like(unary))
    # Forward: alpha[j](b) = log Σ over the prefix's configurations ending in state b.
    alphas = []
    alpha = None
    started = torch.zeros(rows, 1, dtype=torch.bool, device=s.device)
    for j in range(n):
        v = valid[:, j:j + 1]
        if alpha is None:
            stepped = unary[:, j]
            alpha = torch.where(v, stepped, torch.zeros_like(stepped))
        else:
            through = torch.logsumexp(alpha.unsqueeze(-1) + T, dim=1) + unary[:, j]
            stepped = torch.where(started, through, unary[:, j])
            alpha = torch.where(v, stepped, alpha)
        started = started | v
        # Renormalised at every step: the messages then hold differences of log-potentials
        # only, so that scores of 1e37 do not swamp an O(1) marginal.
        alpha = alpha - torch.logsumexp(alpha, dim=-1, keepdim=True)
        alphas.append(alpha)
    # Backward: beta[j](a) = log Σ over the suffix after j given state a at j.
    betas = [None] * n
    beta = torch.zeros(rows, 2, dtype=s.dtype, device=s.device)
    for j in range(n - 1, -1, -1):
        betas[j] = beta
        v = valid[:, j:j + 1]
        through = torch.logsumexp(T + (unary[:, j] + beta).unsqueeze(1), dim=2)
        beta = torch.where(v, through, beta)
        beta = beta - torch.logsumexp(beta, dim=-1, keepdim=True)
    out = []
    for j in range(n):
        both = alphas[j] + betas[j]
        log_mu = both[:, 1:2] - torch.logsumexp(both, dim=-1, keepdim=True)
        out.append(torch.where(valid[:, j:j + 1], torch.exp(log_mu), torch.zeros_like(log_mu)))
    return torch.cat(out, dim=-1) if out else s.new_zeros(rows, 0)


# ---------------------------------------------------------------------------------------
# SparseMAP: active set with a Viterbi oracle.

def viterbi(unary: list, T: list) -> tuple[list, float]:
    """argmax_z Σ_j unary_j z_j + Σ_j T[z_{j−1}][z_j] over z ∈ {0,1}^m, and its value
    (ties to the smaller state)."""
    m = len(unary)
    if m == 0:
        return [], 0.0
    best = [0.0, unary[0]]
    offset = 0.0
    back = []
    for j in range(1, m):
        step, pointers = [], []
        for b in (0, 1):
            from0, from1 = best[0] + T[0][b], best[1] + T[1][b]
            a = 1 if from1 > from0 else 0
            step.append(max(from0, from1) + (unary[j] if b else 0.0))
            pointers.append(a)
        # Measured from the leading state, so that an O(1) score is not lost beside a sum of
        # huge ones (3e37 + 1 == 3e37); the offset is added back to the value.
        top = max(step)
        offset += top
        best = [step[0] - top, step[1] - top]
        back.append(pointers)
    state = 1 if best[1] > best[0] else 0
    value = best[state] + offset
    z = [state]
    for pointers in reversed(back):
        state = pointers[state]
        z.append(state)
    return z[::-1], value


def _score_difference(z: list, base: list, s: list, T: list) -> float:
    """θ(z) − θ(base), summed over the positions where they differ only (exact for any
    scores, where θ(z) − θ(base) would cancel two sums of huge terms)."""
    unary = sum(si * (zi - bi) for si, zi, bi in zip(s, z, base) if zi != bi)
    pairs = sum(T[a][b] for a, b in zip(z, z[1:])) - sum(T[a][b] for a, b in zip(base, base[1:]))
    return unary + pairs


def _pair_counts(z: list) -> list:
    counts = [0.0] * 4
    for a, b in zip(z, z[1:]):
        counts[2 * a + b] += 1.0
    return counts


def _kkt_solve(M: torch.Tensor, rhs: torch.Tensor, total: float) -> torch.Tensor:
    """Solve [[MᵀM, 1], [1ᵀ, 0]] [ξ; τ] = [rhs; total] (differentiable in M and rhs)."""
    k = M.shape[1]
    ones = torch.ones(k, 1, dtype=M.dtype, device=M.device)
    top = torch.cat([M.T @ M, ones], dim=1)
    bottom = torch.cat([ones.T, torch.zeros(1, 1, dtype=M.dtype, device=M.device)], dim=1)
    system = torch.cat([top, bottom], dim=0)
    right = torch.cat([rhs, torch.full((1,), total, dtype=M.dtype, device=M.device)])
    return torch.linalg.solve(system, right)


def sparsemap_active_set(s: list, T: list, max_iterations: int | None = None) -> list:
    """The active configurations (lists of 0/1) of SparseMAP on one row's valid scores ``s``
    with transitions ``T`` (nested lists), at the optimum: a primal active-set method
    (Nocedal & Wright, Alg. 16.3) on the simplex over configurations, the oracle Viterbi.

    Each iteration solves the KKT system of the active set; a solution with a negative
    weight takes the longest feasible step towards it and drops the configuration that
    reaches 0; a feasible one asks the oracle for the configuration of largest reduced
    score θ(z) − z·μ, optimal once it does not exceed the multiplier τ. A new configuration
    whose unary vector lies in the affine hull of the active ones would make the system
    singular: the weights then move along the null direction (μ unchanged, the objective up
    by a positive multiple of the reduced-score excess) until one reaches 0, which leaves.
    """
    m = len(s)
    if m == 0:
        return [[]]
    limit = max_iterations or 50 * (m + 2)
    z0, _ = viterbi(s, T)
    active = [z0]
    weights = torch.ones(1, dtype=torch.float64)
    # θ is measured from the first active configuration's θ (the constant leaves ξ alone):
    # at the optimum the active θ differ by (z − z')·μ, at most m, whatever the scores.
    tol = 1e-11 * (m + 1) * max(1.0, max(abs(v) for row in T for v in row))
    for _ in range(limit):
        base = active[0]
        M = torch.tensor(active, dtype=torch.float64).T  # (m, k)
        theta = torch.tensor([_score_difference(z, base, s, T) for z in active], dtype=torch.float64)
        solution = _kkt_solve(M, theta, 1.0)
        target, tau = solution[:-1], float(solution[-1])
        if bool((target >= 0).all()):
            weights = target
            mu = (M @ weights).tolist()
            z, _ = viterbi([si - mi for si, mi in zip(s, mu)], T)
            excess = _score_difference(z, base, s, T) - sum(mi for mi, zi in zip(mu, z) if zi) - tau
            if excess <= tol or z in active:
                return active
            new = torch.tensor(z, dtype=torch.float64)
            # Affine dependence: [M; 1ᵀ] c = [z; 1] solvable exactly.
            lhs = torch.cat([M, torch.ones(1, M.shape[1], dtype=torch.float64)])
            coefficients = torch.linalg.lstsq(lhs, torch.cat([new, torch.ones(1, dtype=torch.float64)])).solution
            residual = float((lhs @ coefficients - torch.cat([new, torch.ones(1, dtype=torch.float64)])).abs().max())
            if residual < 1e-9:
                # Direction d = e_new − c: weights of the old ones move by −t c, the new by t.
                shrinking = coefficients > 1e-12
                ratios = torch.where(shrinking, weights / coefficients.clamp_min(1e-300),
                                     torch.full_like(weights, math.inf))
                step = float(ratios.min())
                leaving = int(ratios.argmin())
                weights = torch.cat([weights - step * coefficients, torch.tensor([step], dtype=torch.float64)])
                keep = [i for i in range(len(active) + 1) if i != leaving]
                active = [active[i] for i in keep if i < len(active)] + [z]
                weights = weights[keep]
                continue
            active.append(z)
            weights = torch.cat([weights, torch.zeros(1, dtype=torch.float64)])
            continue
        # Step towards the solution until the first weight reaches 0.
        decreasing = target < weights
        ratios = torch.where(decreasing, weights / (weights - target).clamp_min(1e-300),
                             torch.full_like(weights, math.inf))
        step = min(1.0, float(ratios.min()))
        weights = weights + step * (target - weights)
        leaving = int(ratios.argmin())
        keep = [i for i in range(len(active)) if i != leaving and float(weights[i]) > 0]
        active = [active[i] for i in keep]
        weights = weights[keep]
    raise RuntimeError(f"sparsemap: the active-set method did not converge in {limit} iterations")


def sparsemap_rates_at_zero(s: list, T: list, flip: bool) -> list:
    """dμ_j/dλ at λ = 0+ of one row's valid scores ``s`` when w = T00 + T11 − T01 − T10 is 0,
    on the side w > 0 (``flip`` False: ν = μ, λ = w/2) or w < 0 (``flip`` True: ν_j = 1 − μ_j
    at odd j, λ = −w/2); docs/maths.md, "Chain marginals". At λ = 0 the prox is the
    identity, so the groups the prox starts from are the runs of exactly equal c′ (equal
    inputs fuse at once), each moving by −(left − right)/size; the clip passes a group's
    rate inside (0, 1), or at 0 moving up, or at 1 moving down."""
    t00, t01, t10, t11 = T[0][0], T[0][1], T[1][0], T[1][1]
    into = (t01 - t00 + t11 - t10) / 2
    outof = (t10 - t00 + t11 - t01) / 2
    m = len(s)
    c = [s[j] + (into if j > 0 else 0.0) + (outof if j + 1 < m else 0.0) for j in range(m)]
    values = [1.0 - v if flip and j % 2 else v for j, v in enumerate(c)]
    rates = [0.0] * m
    start, left = 0, 0.0
    while start < m:
        end = start
        while end + 1 < m and values[end + 1] == values[start]:
            end += 1
        right = 0.0 if end + 1 == m else (1.0 if values[end + 1] > values[start] else -1.0)
        rate = -(left - right) / (end - start + 1)
        value = values[start]
        if 0.0 < value < 1.0 or (value == 0.0 and rate > 0) or (value == 1.0 and rate < 0):
            for j in range(start, end + 1):
                rates[j] = -rate if flip and j % 2 else rate
        start, left = end + 1, right
    return rates


class _KinkAtZeroW(torch.autograd.Function):
    """Adds 0 to a row's marginals; its gradient in w (taken at w = 0) is the element of
    least magnitude between the one-sided derivatives D+ = ½ g·(dμ/dλ)+ and
    D− = −½ g·(dμ/dλ)−: 0 where they straddle 0, their common value where the loss is
    smooth in w. The backward is plain torch ops in g, so it is differentiable again."""

    @staticmethod
    def forward(ctx, w, above, below):
        ctx.save_for_backward(above, below)
        return torch.zeros_like(above)

    @staticmethod
    def backward(ctx, grad):
        above, below = ctx.saved_tensors
        right_side = (grad * above).sum() / 2
        left_side = -(grad * below).sum() / 2
        low, high = torch.minimum(left_side, right_side), torch.maximum(left_side, right_side)
        dw = torch.where(low > 0, low, torch.where(high < 0, high, torch.zeros_like(low)))
        return dw, None, None


_W_DIRECTION = ((1.0, -1.0), (-1.0, 1.0))  # ∂w/∂T


def _sparsemap_rows(s: torch.Tensor, T: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """SparseMAP marginals (R, n) of float64 rows, differentiable in s and T through the
    KKT system of each row's final active set; rows with w = 0 by _sparsemap_row_at_zero_w."""
    rows, n = s.shape
    s_list, T_list, valid_list = s.detach().cpu().tolist(), T.detach().cpu().tolist(), valid.cpu().tolist()
    out_rows = []
    for r in range(rows):
        positions = [j for j in range(n) if valid_list[r][j]]
        if not positions:
            out_rows.append(s.new_zeros(n))
            continue
        index = torch.tensor(positions, device=s.device)
        t = T_list[r]
        if t[0][0] + t[1][1] - t[0][1] - t[1][0] == 0.0:  # w, in the C++ rows' order of operations
            mu = _sparsemap_row_at_zero_w(s[r, index], T[r], [s_list[r][j] for j in positions], t)
            out_rows.append(s.new_zeros(n).index_put((index,), mu))
            continue
        active = sparsemap_active_set([s_list[r][j] for j in positions], t)
        M = torch.tensor(active, dtype=s.dtype, device=s.device).T  # (m, k)
        counts = torch.tensor([_pair_counts(z) for z in active], dtype=s.dtype, device=s.device)  # (k, 4)
        # Measured from the first configuration's θ, as in sparsemap_active_set: the same ξ,
        # without cancelling huge scores where the configurations agree.
        differs = M - M[:, :1]
        theta = differs.T @ s[r, index] + (counts - counts[:1]) @ T[r].reshape(4)
        weights = _kkt_solve(M, theta, 1.0)[:-1]
        out_rows.append(s.new_zeros(n).index_put((index,), M @ weights))
    return torch.stack(out_rows) if out_rows else s.new_zeros(0, n)


def _sparsemap_row_at_zero_w(s: torch.Tensor, T: torch.Tensor, s_list: list, t: list) -> torch.Tensor:
    """SparseMAP of one row's valid scores where w = 0. The pair term of an edge is then
    linear in the unary marginals (w multiplies its only other part, the pair marginal
    μ_{j−1,j}(1, 1)), so the problem separates by key: μ = clip(c, 0, 1), c = s plus the
    edges' linear terms. Its gradient in s and in the edge terms is that of the clip (passing
    strictly inside (0, 1), as the C++ rows do); in w the loss has a kink, and its gradient
    is _KinkAtZeroW's rule. (At w = 0 the active set is degenerate: the KKT route's
    derivatives depend on which of the equivalent active sets it ends with.)"""
    m = s.shape[0]
    into = (T[0, 1] - T[0, 0] + T[1, 1] - T[1, 0]) / 2
    outof = (T[1, 0] - T[0, 0] + T[1, 1] - T[0, 1]) / 2
    has_previous = (torch.arange(m, device=s.device) > 0).to(s.dtype)
    has_next = (torch.arange(m, device=s.device) < m - 1).to(s.dtype)
    c = s + has_previous * into + has_next * outof
    mu = torch.where((c > 0) & (c < 1), c, c.detach().clamp(0, 1))
    direction = torch.tensor(_W_DIRECTION, dtype=s.dtype, device=s.device)
    w = (T * direction).sum()
    above, below = (torch.tensor(sparsemap_rates_at_zero(s_list, t, flip), dtype=s.dtype, device=s.device)
                    for flip in (False, True))
    return mu + _KinkAtZeroW.apply(w, above, below)


# ---------------------------------------------------------------------------------------
# Row-wise driver.

def _chain_map(rows_fn, scores: torch.Tensor, transitions: torch.Tensor, dim: int) -> torch.Tensor:
    rows, T, moved_shape = rows_and_transitions(scores, transitions, dim)
    s = rows.to(torch.float64)
    T = T.to(torch.float64)
    valid = s != float("-inf")
    poisoned = (valid & (torch.isnan(s) | torch.isposinf(s))).any(-1, keepdim=True)
    valid_and_finite = valid & ~poisoned
    s_finite = torch.where(valid_and_finite, s, torch.zeros_like(s))
    out = rows_fn(s_finite, T, valid_and_finite) + NanRows.apply(s, poisoned)
    return _from_rows(out, moved_shape, dim, scores.dtype)


def crf_marginals(scores: torch.Tensor, transitions: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reference CRF marginals P(z_j = 1) along ``dim`` (transitions broadcastable to the
    rows' batch shape + (2, 2)); differentiable in both."""
    return _chain_map(_crf_rows, scores, transitions, dim)


def sparsemap_marginals(scores: torch.Tensor, transitions: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reference SparseMAP unary marginals along ``dim``; differentiable in both."""
    return _chain_map(_sparsemap_rows, scores, transitions, dim)


# ---------------------------------------------------------------------------------------
# Attention.

def _per_head(transitions: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(2, 2) as is, (H, 2, 2) as (H, 1, 2, 2): broadcast against the scores' (..., H, Lq)."""
    return transitions if transitions.dim() == 2 else transitions.unsqueeze(-3)


def crf_attention(query, key, value, transitions, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Reference CRF attention: weights = CRF marginals over each query row's attendable keys."""
    per_head = _per_head(transitions, query)
    return structured_attention(lambda scores: crf_marginals(scores, per_head, dim=-1), query, key, value,
                                attn_mask, 0.0, is_causal, scale, enable_gqa)


def sparsemap_attention(query, key, value, transitions, attn_mask=None, is_causal=False, scale=None,
                        enable_gqa=False):
    """Reference SparseMAP attention: weights = SparseMAP marginals over each row's keys."""
    per_head = _per_head(transitions, query)
    return structured_attention(lambda scores: sparsemap_marginals(scores, per_head, dim=-1), query, key, value,
                                attn_mask, 0.0, is_causal, scale, enable_gqa)
