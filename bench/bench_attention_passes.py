"""Dense passes over K per query block in the fused entmax attention forward, the tau error
that count leaves, and the fraction of (query block, key block) tiles the sparse passes skip.

The forward (triton_kernels/attention_fwd.py) makes a fixed number of dense passes: one for
the row max, NUM_PASSES candidate passes (NUM_CANDIDATES points each, Newton/secant bracket
update, Halley finish), then one sparse output pass. This script runs a CPU emulation of
exactly that iteration in float32 (`emulate_tau`), checks it against the kernel itself in the
Triton interpreter on a small case, and reports, per alpha:
- the tau error |tau - tau*| (float64 bisection) and |sum p - 1| after 1 and after 2
  candidate passes (2 and 3 dense passes), rows of n scores N(0, sigma^2);
- the fraction of tiles flagged (visited by the output pass and the backward) for
  i.i.d. scores and for scores with a recency bias (z_ij = sigma g_ij - |i - j| / 32), causal
  and not.

Usage: python bench/bench_attention_passes.py [--rows 256] [--csv out.csv]
"""
import argparse
import csv
import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from entmax_fast.triton_kernels import attention as tri  # noqa: E402
from entmax_fast.triton_kernels import attention_fwd as fwd  # noqa: E402
from tests.oracle import oracle_entmax  # noqa: E402


def _candidate_pass(u, lo, hi, fhi, fphi, has_fhi, inv_am1, num_cand):
    """float32 twin of attention_fwd._candidate_pass on rows u [R, n] (shifted, scaled)."""
    c = torch.arange(num_cand, dtype=torch.float32)
    step = (hi - lo) / num_cand
    t = lo[:, None] + c[None, :] * step[:, None]                       # [R, C]
    d = (u[:, None, :] - t[:, :, None]).clamp(min=0)                   # [R, C, n]
    pos = d > 0
    log_d = torch.log2(torch.where(pos, d, torch.ones_like(d)))
    p2 = torch.where(pos, torch.exp2((inv_am1 - 2.0) * log_d), torch.zeros_like(d))
    p1 = p2 * d
    p0 = p1 * d
    f = p0.sum(-1) - 1.0
    fp = -inv_am1 * p1.sum(-1)
    fpp = inv_am1 * (inv_am1 - 1.0) * p2.sum(-1)
    il = torch.where(f >= 0, c[None, :].expand_as(f), torch.zeros_like(f)).amax(-1).long()
    gather = lambda x, i: x.gather(1, i[:, None].clamp(max=num_cand - 1))[:, 0]  # noqa: E731
    left = lo + il.float() * step
    fl, fpl, fppl = gather(f, il), gather(fp, il), gather(fpp, il)
    has_r = il + 1 < num_cand
    right = torch.where(has_r, left + step, hi)
    fr = torch.where(has_r, gather(f, il + 1), fhi)
    fpr = torch.where(has_r, gather(fp, il + 1), fphi)
    has_fr = has_r | has_fhi
    minus_one = -torch.ones_like(fpl)
    newton_ok = fpl < 0
    newton = torch.where(newton_ok, left - fl / torch.where(newton_ok, fpl, minus_one), left)
    newton_r_ok = has_fr & (fpr < 0) & (fr <= 0)
    newton_r = torch.where(newton_r_ok, right - fr / torch.where(newton_r_ok, fpr, minus_one),
                           left)
    new_lo = torch.maximum(left, torch.minimum(torch.maximum(newton, newton_r), right))
    secant_ok = has_fr & (fl - fr > 0)
    secant = torch.where(secant_ok, left + fl * (right - left) /
                         torch.where(secant_ok, fl - fr, torch.ones_like(fl)), right)
    new_hi = torch.minimum(right, torch.maximum(secant, new_lo))
    new_has_fhi = has_fr & ~(secant_ok & (secant < right))
    den = 2.0 * fpl * fpl - fl * fppl
    halley_ok = newton_ok & (den > 0)
    halley = left - 2.0 * fl * fpl / torch.where(halley_ok, den, torch.ones_like(den))
    tau = torch.where(halley_ok & ~torch.isnan(halley),
                      torch.minimum(torch.maximum(halley, new_lo), new_hi), new_lo)
    return new_lo, new_hi, fr, fpr, new_has_fhi, tau


def emulate_tau(z, alpha, num_passes=2, num_cand=fwd.NUM_CANDIDATES, chunk=64):
    """tau (shifted coordinates u = (alpha-1)(z - max z)) and the lower bound lo at the start
    of the last pass (the tile-flag threshold), as the forward kernel computes them."""
    taus, los = [], []
    for rows in z.float().split(chunk):
        m = rows.amax(-1)
        n = torch.isfinite(rows).sum(-1).float()
        u = (alpha - 1.0) * (rows - m[:, None])
        inv_am1 = 1.0 / (alpha - 1.0)
        lo = torch.full_like(m, -1.0)
        hi = -torch.exp2((1.0 - alpha) * torch.log2(n.clamp(min=1)))
        fhi = torch.zeros_like(m)
        fphi = torch.zeros_like(m)
        has_fhi = torch.zeros_like(m, dtype=torch.bool)
        for _ in range(num_passes):
            flag_lo = lo
            lo, hi, fhi, fphi, has_fhi, tau = _candidate_pass(u, lo, hi, fhi, fphi, has_fhi,
                                                              inv_am1, num_cand)
        taus.append(tau)
        los.append(flag_lo)
    return torch.cat(taus), torch.cat(los)


def exact_tau(z, alpha):
    z = z.double()
    p = oracle_entmax(z, alpha)
    m = z.amax(-1, keepdim=True)
    # on the support p = (u - tau)^(1/(alpha-1)): tau from the largest entry
    u_top = torch.zeros_like(m[:, 0])
    return u_top - p.amax(-1) ** (alpha - 1.0)


def tau_table(rows, alphas, sizes, sigma2s):
    out = []
    for alpha in alphas:
        for n in sizes:
            for s2 in sigma2s:
                z = torch.randn(rows, n, dtype=torch.float64) * math.sqrt(s2)
                t_star = exact_tau(z, alpha)
                u64 = (alpha - 1.0) * (z - z.amax(-1, keepdim=True))
                for passes in (1, 2):
                    tau, _ = emulate_tau(z, alpha, num_passes=passes)
                    mass = (u64 - tau.double()[:, None]).clamp(min=0) ** (1.0 / (alpha - 1.0))
                    out.append({"alpha": alpha, "n": n, "sigma2": s2, "dense_passes": 1 + passes,
                                "tau_err": (tau.double() - t_star).abs().max().item(),
                                "sum_err": (mass.sum(-1) - 1).abs().max().item()})
    return out


def tile_table(length, alphas, sigma2, block_m, block_n):
    out = []
    i = torch.arange(length, dtype=torch.float64)
    recency = -(i[:, None] - i[None, :]).abs() / 32.0
    for pattern in ("iid", "recency"):
        for causal in (False, True):
            for alpha in alphas:
                z = torch.randn(length, length, dtype=torch.float64) * math.sqrt(sigma2)
                if pattern == "recency":
                    z = z + recency
                if causal:
                    z = z.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1),
                                      -math.inf)
                _, lo = emulate_tau(z, alpha)
                u = (alpha - 1.0) * (z.float() - z.float().amax(-1, keepdim=True))
                above = (u > lo[:, None]).float()
                tiles = torch.nn.functional.max_pool2d(above[None, None], (block_m, block_n),
                                                       ceil_mode=True)[0, 0]
                reachable = torch.ones_like(tiles, dtype=torch.bool)
                if causal:
                    reachable = (torch.arange(tiles.shape[1])[None, :] * block_n
                                 < (torch.arange(tiles.shape[0])[:, None] + 1) * block_m)
                visited = tiles[reachable].sum().item()
                nonzero = torch.nn.functional.max_pool2d(
                    (oracle_entmax(z, alpha) > 0).float()[None, None],
                    (block_m, block_n), ceil_mode=True)[0, 0].sum().item()
                out.append({"pattern": pattern, "causal": causal, "alpha": alpha,
                            "tiles_reachable": int(reachable.sum()),
                            "tiles_visited": int(visited), "tiles_nonzero_exact": int(nonzero),
                            "skipped_fraction": 1 - visited / reachable.sum().item()})
    return out


def check_against_kernel(alpha=1.25):
    """The emulation is the kernel's iteration: compare taus on one small case."""
    q = torch.randn(1, 1, 64, 32) * 2
    k = torch.randn(1, 1, 200, 32)
    v = torch.randn(1, 1, 200, 32)
    seed = torch.zeros(1, dtype=torch.int64)
    alpha_t = torch.full((1,), alpha)
    _, stats, _, _ = tri.attention_forward(q, k, v, None, alpha_t, fwd.ALPHA_GENERAL, seed, 0.0,
                                           False, 1 / math.sqrt(32), False)
    z = (q @ k.transpose(-1, -2))[0, 0] / math.sqrt(32)
    tau, _ = emulate_tau(z, alpha)
    return (stats[fwd.STAT_TAU, 0, 0] - tau).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--tile-length", type=int, default=1024)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"kernel vs emulation, max |tau difference|: {check_against_kernel():.2e}")
    alphas = (1.1, 1.25, 1.5, 1.75, 2.0)
    taus = tau_table(args.rows, alphas, (1024, 8192), (1.0, 6.0))
    print(f"\ntau error after the dense passes (fp32 emulation, {args.rows} rows each, worst row)")
    print(f"{'alpha':>6} {'n':>6} {'sigma2':>6} {'dense':>5} {'|tau-tau*|':>11} {'|sum p-1|':>10}")
    for r in taus:
        print(f"{r['alpha']:>6} {r['n']:>6} {r['sigma2']:>6} {r['dense_passes']:>5} "
              f"{r['tau_err']:>11.2e} {r['sum_err']:>10.2e}")
    block_m, block_n = fwd.block_sizes(64, "fp16")[:2]
    tiles = tile_table(args.tile_length, (1.25, 1.5, 2.0), 6.0, block_m, block_n)
    print(f"\ntiles visited by the sparse passes, L = {args.tile_length}, sigma^2 = 6, "
          f"{block_m}x{block_n} tiles (head dim <= 64)")
    print(f"{'pattern':>8} {'causal':>6} {'alpha':>6} {'reachable':>9} {'visited':>8} "
          f"{'exact nz':>8} {'skipped':>8}")
    for r in tiles:
        print(f"{r['pattern']:>8} {str(r['causal']):>6} {r['alpha']:>6} {r['tiles_reachable']:>9} "
              f"{r['tiles_visited']:>8} {r['tiles_nonzero_exact']:>8} "
              f"{r['skipped_fraction']:>8.1%}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in taus + tiles for k in r}))
            writer.writeheader()
            writer.writerows(taus + tiles)


if __name__ == "__main__":
    main()
