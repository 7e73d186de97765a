"""Passes over K per query block in the fused entmax attention forward, the threshold error
they leave, the work per score, and the fraction of key tiles the later passes skip.

The forward (triton_kernels/attention_fwd.py, docs/attention.md) makes one pass for the row
maximum, then threshold passes until every row of the block is exact or converged, then one
output pass over the flagged tiles. Where alpha's kind captures, the first threshold pass
captures every score above a lower bound it raises as it goes (compactions), and the
passes after it run over those scores alone, on chip, unless a row did not fit its slots.
This script emulates that iteration in float32 on the CPU (`emulate_block`, the update of
`_update_threshold` written with torch ops), checks its thresholds against the kernel's own
in the Triton interpreter on a small case, and prints per alpha and row length:
- the threshold passes a block of BLOCK_M rows needs (mean and max over blocks; a block
  stops when its slowest row is done), for i.i.d. N(0, sigma^2) scores and for scores with a
  recency bias (z_ij = sigma g_ij - |i - j| / 32, causal);
- the largest |tau - tau*| (float64 sort-based tau*);
- the fraction of blocks that capture (the general kind only where its rows are likely to
  fit, `capture_fits`), the first pass's compactions per block, and the fraction of blocks
  that took the passes over the tiles after it;
- a model of the forward's per-score work in units of one fp32 CUDA-core operation:
  the q.k product counts QK_COST per pass (one bf16 QK^T entry at E = 64 costs about as
  much as 5 fp32 operations on H100/H200), each threshold evaluation OPS_PER_EVAL, the
  output pass OUTPUT_OPS + QK_COST + PV_COST on the tiles it visits, the capturing first
  pass RUNNING_OPS + QK_COST per tile visit and COMPACT_UNITS per compaction; a softmax
  forward (FlashAttention) is about SOFTMAX_UNITS. The model counts operations, it does
  not time them: docs/performance.md has the measured figures.
- the fraction of (query block, key block) tiles visited by the first threshold pass (those
  the max pass flags) and by the passes after it.

Run as a script, it sets TRITON_INTERPRET=1 (the kernel check runs in the interpreter);
imported, it leaves the environment to the importer.

    python tools/attention_passes.py [--blocks 16] [--lengths 1024 4096] [--csv out.csv]

Public functions (tests/test_tools.py calls them): `emulate_block`, `exact_tau`, `scores`,
`sums_at` (the moments of shifted rows at a trial point), `update_threshold` (the float32
twin of `_update_threshold`), `trial_point` (of `_trial_point`; `emulate_block` calls it
through this module's name), `capture_slots`, `capture_fits`, `check_against_kernel`,
`table` and `main(argv)`.
"""
import argparse
import csv
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from entmax_fast import common  # noqa: E402
from entmax_fast.backends.triton import attention as tri  # noqa: E402
from entmax_fast.triton_kernels import attention_common  # noqa: E402
from tests.oracle import oracle_entmax  # noqa: E402

QK_COST = 5.0          # one bf16 q.k entry at E = 64, in fp32-operation units
PV_COST = 5.0          # one p.v entry
OPS_PER_EVAL = {2.0: 6.0, 1.5: 8.0, "general": 14.0}   # d, the sums, the certificate
MAX_PASS_OPS = 3.0     # scale, running row max, running column max (`_subset_bound`)
OUTPUT_OPS = 6.0       # d, p, sums, s
CAPTURE_OPS = 12.0     # the capture of the scores above lo in the passes over the tiles
                       # (sm_90 SASS: +15-24 instructions per score against 12-19 for a
                       # later pass)
# the first threshold pass, which captures above a rising lower bound (sm_90 SASS, bf16,
# E 64: 15.2, 15.5 and 19.4 instructions per score at alpha 2, 1.5 and general, the
# product's share included; 19.3, 19.7 and 24.4 with the counts from a sum of the
# comparisons instead of the rank: attention_variants.py's capture_cast_sum)
RUNNING_OPS = {2.0: 11.0, 1.5: 12.0, "general": 15.0}
COMPACT_UNITS = 2800.0 * 128   # one compaction of 128 slots: ~2800 instructions per thread
SOFTMAX_UNITS = QK_COST + PV_COST + 7.0
BLOCK_M, BLOCK_N = 64, 64


def _moments(d, alpha):
    pos = d > 0
    if alpha == 2.0:
        a, b = d.sum(-1), pos.float().sum(-1)
        c = b
    elif alpha == 1.5:
        a, b, c = (d * d).sum(-1), d.sum(-1), pos.float().sum(-1)
    else:
        e = 1.0 / (alpha - 1.0)
        pw = torch.where(pos, d.clamp(min=1e-30) ** (e - 1.0), torch.zeros_like(d))
        a, b = (pw * d).sum(-1), pw.sum(-1)
        c = b
    dmin = torch.where(pos, d, torch.full_like(d, float("inf"))).amin(-1)
    return a, b, c, dmin


def update_threshold(t, sums, lo, hi, tau, done, tight, alpha):
    """float32 twin of attention_fwd._update_threshold; returns (lo, hi, tau, done, tight)."""
    a, b, c, dmin = sums
    f = a - 1.0
    left = f >= 0
    bs = torch.where(b > 0, b, torch.ones_like(b))
    if alpha == 2.0:
        step = f / bs
        root = t + step
        exact = left & (step <= dmin)
        new_lo, new_hi = root, torch.where(left, hi, t)
    elif alpha == 1.5:
        disc = b * b - c * f
        real = disc >= 0
        root = t + (b - disc.clamp(min=0).sqrt()) / torch.where(c > 0, c, torch.ones_like(c))
        step = f / (2.0 * bs)
        gap = (root - t - dmin).clamp(min=0)
        exact = left & real & (c * gap * gap <= 2.0 * attention_common.TAU_STEP_TOL * (b - c * (root - t)))
        new_lo = torch.where(left, t + step, torch.maximum(root, t + step))
        new_hi = torch.where(left, torch.where(real, root, hi), t)
    else:
        step = f * (alpha - 1.0) / bs
        root = t + step
        exact = left & (step <= attention_common.TAU_STEP_TOL)
        new_lo, new_hi = root, torch.where(left, hi, t)
    small = left & (step <= attention_common.TAU_STEP_TOL)
    root = torch.where(exact, root, t + step)
    exact = exact | small
    hi_next = torch.minimum(hi, new_hi)
    lo_next = torch.minimum(torch.maximum(lo, new_lo), hi_next)
    narrow = (hi_next - lo_next) <= attention_common.TAU_STEP_TOL
    root = torch.where(exact, root, lo_next)
    exact = exact | narrow
    new = exact & ~done
    tau = torch.where(new, root, tau)
    lo_next = torch.where(new, root, torch.where(done, lo, lo_next))
    hi_out = torch.where(done, hi, hi_next)
    if alpha == 1.5:
        tight = (left & real & (hi_next < hi)) | (tight & (hi_out == hi))
    else:
        tight = torch.zeros_like(left)
    return lo_next, hi_out, tau, done | exact, tight


def _model_root(t, sums, alpha):
    """float32 twin of attention_fwd._model_root."""
    a, b = sums[0], sums[1]
    if alpha in (1.5, 2.0):
        return t
    fit = (b > 0) & (a > 0)
    a_safe = torch.where(fit, a, torch.ones_like(a))
    shrink = 1.0 - torch.exp2(-(alpha - 1.0) * torch.log2(a_safe))
    return torch.where(fit, t + a_safe / torch.where(fit, b, torch.ones_like(b)) * shrink, t)


def trial_point(lo, hi, done, tight, guess, alpha):
    """float32 twin of attention_fwd._trial_point."""
    if alpha not in (1.5, 2.0):
        return torch.where(done, lo, torch.minimum(torch.maximum(guess, lo), hi))
    return torch.where(tight & ~done, torch.maximum(lo, hi - 0.3 * (hi - lo)), lo)


def _pass(t, sums, lo, hi, tau, done, tight, alpha):
    """The update from a threshold pass's sums at t, and the pass's `_model_root`."""
    return (*update_threshold(t, sums, lo, hi, tau, done, tight, alpha),
            _model_root(t, sums, alpha))


def sums_at(u, t, alpha):
    """`_moments` of the shifted rows u at every row's trial point t."""
    return _moments((u - t[:, None]).clamp(min=0), alpha)


def capture_slots(alpha):
    """The forward's capture slots at alpha: its kind's, none near alpha = 1 (the kernel's
    NEAR_ONE compile, alpha < 1.25)."""
    kind = common.alpha_kind(alpha)
    if kind == common.ALPHA_GENERAL and 1.0 / (alpha - 1.0) > attention_common.NEAR_ONE_INV_AM1.value:
        return 0
    return attention_common.candidate_slots(kind)


def capture_fits(u_sub, lo, done, alpha):
    """attention_fwd._capture_fits for the general kind (the others always capture): no open
    row has more than CAPTURE_MAX_COLUMN_SHARE of its column maxima u_sub above lo."""
    if common.alpha_kind(alpha) != common.ALPHA_GENERAL:
        return True
    above = torch.where(done, 0, (u_sub > lo[:, None]).sum(-1))
    return int(above.max()) <= u_sub.shape[1] * attention_common.CAPTURE_MAX_COLUMN_SHARE


def _compact_bound(u, stored, alpha, lo, hi, done):
    """float32 twin of attention_fwd._compact's bound: COMPACT_STEPS evaluations over the
    stored scores alone (a subset of the row: its threshold bounds tau from below)."""
    u_sub = torch.where(stored, u, torch.full_like(u, -float("inf")))
    return _subset_bound(u_sub, alpha, lo, hi, done, attention_common.COMPACT_STEPS.value)


def _subset_bound(u_sub, alpha, lo, hi, done, steps):
    """The lower bound of tau that `steps` evaluations over a subset of each row find
    (attention_fwd._subset_bound, and _compact's)."""
    lo_s, hi_s, tau_s, done_s = lo, hi, lo, done
    tight_s, guess = torch.zeros_like(done), lo
    for _ in range(steps):
        t = trial_point(lo_s, hi_s, done_s, tight_s, guess, alpha)
        lo_s, hi_s, tau_s, done_s, tight_s, guess = _pass(t, sums_at(u_sub, t, alpha), lo_s,
                                                          hi_s, tau_s, done_s, tight_s, alpha)
    return torch.where(done, lo, torch.maximum(lo, lo_s))


def _running_capture(u, alpha, tile_max, lo, hi, done, slots):
    """float32 twin of attention_fwd._running_capture_pass over the tiles the max pass
    flagged (the last one, which crosses the causal diagonal, first): each tile's scores
    above lo go to the row's next slots (past `slots` they are counted, not stored), and
    between segments of COMPACT_SEGMENT tiles a row holding more than COMPACT_FILL of its
    slots, or a segment that overflowed, raises lo (`_compact_bound`). Returns (lo,
    stored [R, n], counts [R], compactions, tile visits)."""
    rows, n = u.shape
    stored = torch.zeros_like(u, dtype=torch.bool)
    count = torch.zeros(rows, dtype=torch.long)
    flagged = (tile_max > -1.0).any(0)
    tiles = [i for i in range(tile_max.shape[1]) if bool(flagged[i])]
    segment = attention_common.COMPACT_SEGMENT_C.value
    budget = attention_common.COMPACT_MIN_C.value + \
        max(0, len(tiles) - 1) // attention_common.COMPACT_TILES_C.value
    compactions, visits = 0, 0

    def capture(tile):
        nonlocal count
        cols = slice(tile * BLOCK_N, min(n, (tile + 1) * BLOCK_N))
        new = u[:, cols] > lo[:, None]
        slot = count[:, None] + new.long().cumsum(-1) - 1
        stored[:, cols] |= new & (slot < slots)
        count = count + new.sum(-1)

    if tiles and tiles[-1] == tile_max.shape[1] - 1:
        capture(tiles.pop())
        visits += 1
    start = 0
    while start < len(tiles):
        before = stored.clone()
        for tile in tiles[start:start + segment]:
            capture(tile)
            visits += 1
        most = int(torch.where(done, 0, count).max())
        if most > slots:
            if compactions == budget:
                break
            lo = _compact_bound(u, stored, alpha, lo, hi, done)
            stored = before & (u > lo[:, None])
            count = stored.sum(-1)
            compactions += 1
            continue
        start += segment
        if most > slots * attention_common.COMPACT_FILL and compactions < budget:
            lo = _compact_bound(u, stored, alpha, lo, hi, done)
            stored &= u > lo[:, None]
            count = stored.sum(-1)
            compactions += 1
    return lo, stored, count, compactions, visits


def emulate_block(u, alpha):
    """Threshold passes of one block of rows u [R, n] (shifted: max 0, -inf masked).
    Returns (tau [R], passes, tiles the first threshold pass visits / tiles, tiles visited
    per later pass over the tiles / tiles, passes that ran over captured scores,
    compactions of the first pass, its tile visits / flagged tiles, whether the block
    took the passes over the tiles, whether it captured). The max pass flags the tiles
    with a score within the bracket's width of its row's maximum (the kernel compares with
    the running maximum, nearest tiles first; here the final one), and the lower bound lo
    starts from the threshold of each column's largest score (`_subset_bound`). Where
    alpha's kind captures (`attention_common.candidate_slots`; the general kind where
    `capture_fits`), the first threshold pass captures above a rising lower bound
    (`_running_capture`) and, when every open row fits its slots, the passes run over
    those alone. Otherwise (or after a capture that did not fit) the passes over
    the tiles: two points, then one that rewrites the flags at the lower bound lo and
    captures above it (the passes after it over those scores when they fit), then one
    point per pass over the tiles it flagged."""
    rows = u.shape[0]
    lo = torch.full((rows,), -1.0)
    hi = torch.zeros(rows)
    tau = lo.clone()
    done = torch.zeros(rows, dtype=torch.bool)
    tight = torch.zeros(rows, dtype=torch.bool)
    guess = lo
    n_tiles = -(-u.shape[1] // BLOCK_N)
    padded = torch.nn.functional.pad(u, (0, n_tiles * BLOCK_N - u.shape[1]), value=-float("inf"))
    tile_max = padded.reshape(rows, n_tiles, BLOCK_N).amax(-1)  # [R, tiles]
    # the max pass's column maxima: a subset of each row whose threshold bounds tau below
    u_sub = padded.reshape(rows, n_tiles, BLOCK_N).amax(1)
    lo = _subset_bound(u_sub, alpha, lo, hi, done, attention_common.SUBSET_STEPS_C.value)
    tau = lo.clone()
    guess = lo
    first_visited = float((tile_max > -1.0).any(0).float().mean())
    flagged = tile_max > -1.0
    slots = capture_slots(alpha) if capture_fits(u_sub, lo, done, alpha) else 0
    passes, captured, compactions, running_visits, fell_back = 0, 0, 0, 0.0, True
    if slots > 0:
        lo, stored, count, compactions, visits = _running_capture(u, alpha, tile_max, lo, hi,
                                                                  done, slots)
        running_visits = visits / max(1, int(flagged.any(0).sum()))
        passes = 1
        flagged = tile_max > lo[:, None]
        if int(torch.where(done, 0, count).max()) <= slots:
            fell_back = False
            u_c = torch.where(stored, u, torch.full_like(u, -float("inf")))
            while not bool(done.all()) and passes < attention_common.MAX_TAU_PASSES:
                t = trial_point(lo, hi, done, tight, guess, alpha)
                lo, hi, tau, done, tight, guess = _pass(t, sums_at(u_c, t, alpha), lo, hi,
                                                        tau, done, tight, alpha)
                passes += 1
                captured += 1
    visited = []
    if fell_back:
        mid = 0.5 * (lo + hi)
        first = lo
        s0, s1 = sums_at(u, first, alpha), sums_at(u, mid, alpha)
        lo, hi, tau, done, tight, guess_lo = _pass(first, s0, lo, hi, tau, done, tight, alpha)
        lo, hi, tau, done, tight, guess_mid = _pass(mid, s1, lo, hi, tau, done, tight, alpha)
        guess = torch.where(s1[0] >= 1.0, guess_mid, guess_lo)
        first_two_point = passes
        passes += 1
        fits = False
        while not bool(done.all()) and passes < attention_common.MAX_TAU_PASSES:
            if fits:
                captured += 1
            else:
                visited.append(float(flagged.any(0).float().mean()))
            reflag = passes == first_two_point + 1
            if reflag:
                # the pass that rewrites the flags does so at lo, a lower bound; alpha 2
                # and 1.5 evaluate there too, general alpha at its trial point
                flagged = tile_max > lo[:, None]
                open_count = torch.where(done, 0, (u > lo[:, None]).sum(-1))
                fits = slots > 0 and int(open_count.max()) <= slots
            closed_form_reflag = reflag and alpha in (1.5, 2.0)
            t = lo if closed_form_reflag else trial_point(lo, hi, done, tight, guess, alpha)
            lo, hi, tau, done, tight, guess = _pass(t, sums_at(u, t, alpha), lo, hi, tau,
                                                    done, tight, alpha)
            passes += 1
    tau = torch.where(done, tau, lo)
    return (tau, passes, first_visited, (sum(visited) / len(visited) if visited else 0.0),
            captured, compactions, running_visits, fell_back, slots > 0)


def exact_tau(u, alpha):
    """Sort-free float64 tau of shifted rows, from the oracle's weights."""
    p = oracle_entmax(u.double() / (alpha - 1.0), alpha)
    # p = (u - tau)^e on the support: tau = u_max - p_max^(alpha-1) (u_max = 0)
    return -(p.amax(-1) ** (alpha - 1.0))


def scores(kind, n, sigma, start):
    z = sigma * torch.randn(BLOCK_M, n)
    if kind == "local":
        i = torch.arange(start, start + BLOCK_M)[:, None]
        j = torch.arange(n)[None, :]
        z = z - (i - j).abs() / 32.0
        z = z.masked_fill(j > i, float("-inf"))
    return z


def block_units(n, alpha, first, visit, passes, captured, compactions, running_visits,
                fell_back, capturing):
    """Modelled work per score of one block's forward (units of one fp32 operation);
    `capturing`: the block captured (`emulate_block`)."""
    key = alpha if alpha in OPS_PER_EVAL else "general"
    eval_ops = OPS_PER_EVAL[key]
    units = (QK_COST + MAX_PASS_OPS) + (QK_COST + PV_COST + OUTPUT_OPS)
    if capturing:
        units += first * running_visits * (QK_COST + RUNNING_OPS[key]) \
            + compactions * COMPACT_UNITS / (BLOCK_M * n)
    if fell_back:
        # the passes over captured scores cost next to nothing per score of the row
        later = max(0.0, passes - (2 if capturing else 1) - captured)
        capture = CAPTURE_OPS * visit if capturing else 0.0
        units += first * (QK_COST + 2 * eval_ops) + later * visit * (QK_COST + eval_ops) \
            + capture
    return units


def table(alphas, lengths, blocks, sigma):
    rows = []
    for alpha in alphas:
        for n in lengths:
            for kind in ("random", "local"):
                passes, errors, firsts, visits, captures = [], [], [], [], []
                compactions, fallbacks, units, capturing = [], [], [], []
                for _ in range(blocks):
                    z = scores(kind, n, sigma, n - BLOCK_M)
                    y = (alpha - 1.0) * z
                    u = (y - y.amax(-1, keepdim=True)).float()
                    tau, p, first, visit, captured, compacted, running, fell_back, capture_ran = \
                        emulate_block(u, alpha)
                    capturing.append(capture_ran)
                    passes.append(p)
                    captures.append(captured)
                    firsts.append(first)
                    visits.append(visit)
                    compactions.append(compacted)
                    fallbacks.append(fell_back)
                    units.append(block_units(n, alpha, first, visit, p, captured, compacted,
                                             running, fell_back, capture_ran))
                    errors.append(float((tau.double() - exact_tau(u, alpha)).abs().max()))
                mean = lambda values: sum(values) / len(values)  # noqa: E731
                rows.append({"alpha": alpha, "n": n, "scores": kind,
                             "passes_mean": mean(passes),
                             "captured_passes_mean": mean(captures),
                             "passes_max": max(passes), "tau_err_max": max(errors),
                             "compactions_mean": mean(compactions),
                             "capturing": mean([float(c) for c in capturing]),
                             "fell_back": mean([float(f) for f in fallbacks]),
                             "first_pass_tiles_visited": mean(firsts),
                             "later_tiles_visited": mean(visits),
                             "units_per_score": mean(units),
                             "x_softmax_fwd_model": mean(units) / SOFTMAX_UNITS})
    return rows


def check_against_kernel(alpha=1.5):
    """The emulation's tau equals the kernel's (interpreter) on a small causal case."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
    _, (stats, _, _, _) = tri.attention_forward(q, k, v, None, alpha, scale=0.25, is_causal=True,
                                                dropout_p=0.0, enable_gqa=False,
                                                need_grad=common.GRAD_NONE)
    z = (q[0, 0] @ k[0, 0].T) * 0.25
    z = z.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    y = (alpha - 1.0) * z
    u = y - y.amax(-1, keepdim=True)
    tau = emulate_block(u, alpha)[0]
    # the kernel stores tau in z units
    return float((tau - (alpha - 1.0) * stats[attention_common.STAT_TAU, 0, 0]).abs().max())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks of 64 rows per cell")
    parser.add_argument("--sigma", type=float, default=1.0, help="score standard deviation")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.5, 2.0, 1.25])
    parser.add_argument("--compact-fill", type=float, default=attention_common.COMPACT_FILL,
                        help="emulate compactions at this fill of the slots (the kernel's: "
                             "attention_common.COMPACT_FILL)")
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    attention_common.COMPACT_FILL = args.compact_fill
    torch.manual_seed(0)
    print(f"emulation vs kernel (interpreter), max |tau difference|: {check_against_kernel():.2e}")
    rows = table(args.alphas, args.lengths, args.blocks, args.sigma)
    print("alpha | n | scores | passes mean | of which over captured scores | max | "
          "max tau err | blocks capturing | compactions | blocks over the tiles | "
          "pass-1 tiles visited | "
          "later tiles visited | units/score (model) | x softmax fwd (model)")
    for r in rows:
        print(f"{r['alpha']:5g} | {r['n']:5d} | {r['scores']:6s} | {r['passes_mean']:5.2f} | "
              f"{r['captured_passes_mean']:5.2f} | "
              f"{r['passes_max']:3d} | {r['tau_err_max']:.1e} | {r['capturing']:.2f} | "
              f"{r['compactions_mean']:4.1f} | "
              f"{r['fell_back']:.2f} | "
              f"{r['first_pass_tiles_visited']:.2f} | {r['later_tiles_visited']:.2f} | "
              f"{r['units_per_score']:6.1f} | {r['x_softmax_fwd_model']:.1f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
