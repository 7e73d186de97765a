"""Verification table: every op on every backend usable here vs the float64 oracle.

    python bench/verify.py

Forward: max |out − oracle| on float32 inputs (the oracle sees the same float32 values, in
float64). Gradient: max |grad − oracle grad|, the oracle gradient from central finite
differences of the float64 oracle. On a machine without a GPU the Triton backend runs in
the Triton interpreter (small shapes). Exits non-zero when an error exceeds its bound.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from common import machine, print_table  # noqa: E402
from oracle import oracle_attention, oracle_budget, oracle_entmax, oracle_normmax, oracle_rows  # noqa: E402

import entmax_fast  # noqa: E402
from entmax_fast import dispatch  # noqa: E402

FORWARD_BOUND = 1e-5
GRAD_BOUND = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fd_grad(f64, X, g, h=1e-6):
    """Central-difference vector–Jacobian product gᵀ ∂f/∂X of a float64 function."""
    X = X.to(torch.float64)
    grad = torch.zeros_like(X)
    flat, gflat = X.view(-1), grad.view(-1)
    for i in range(flat.numel()):
        old = flat[i].item()
        flat[i] = old + h
        plus = (f64(X) * g).sum()
        flat[i] = old - h
        minus = (f64(X) * g).sum()
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * h)
    return grad


def _usable(backend, op):
    if backend not in dispatch.registered_ops().get(op, ()):
        return False
    return dispatch._runs_on(backend, dispatch.Request(torch.device(DEVICE), torch.float32, {})) is None


def verify_mappings():
    rows = []
    X = torch.randn(5, 37, dtype=torch.float64) * 2
    X[1, ::4] = float("-inf")
    X32 = X.float().to(DEVICE)
    g = torch.randn(5, 37, dtype=torch.float64)
    row_alpha = torch.tensor([1.1, 1.5, 2.0, 2.5, 1.0], dtype=torch.float64).view(5, 1)
    cases = [
        ("sparsemax", lambda x: entmax_fast.sparsemax(x), 2.0),
        ("entmax15", lambda x: entmax_fast.entmax15(x), 1.5),
        ("entmax_bisect(1.25)", lambda x: entmax_fast.entmax_bisect(x, 1.25), 1.25),
        ("entmax_bisect(3)", lambda x: entmax_fast.entmax_bisect(x, 3.0), 3.0),
        ("entmax_bisect(per-row alpha)", lambda x: entmax_fast.entmax_bisect(x, row_alpha.float().to(x.device)),
         row_alpha),
    ]
    finite = torch.isfinite(X)
    for name, fn, alpha in cases:
        expected = oracle_entmax(X32.double().cpu(), alpha)
        oracle_grad = _fd_grad(lambda x: oracle_entmax(torch.where(finite, x, X), alpha), X32.double().cpu(), g)
        for backend in dispatch.BACKENDS:
            if not _usable(backend, "entmax"):
                continue
            x = X32.clone().requires_grad_()
            with entmax_fast.use_backend(backend):
                out = fn(x)
                out.backward(g.float().to(DEVICE))
            fwd_err = (out.double().cpu() - expected).abs().max().item()
            grad_err = (x.grad.double().cpu() - oracle_grad).abs()[finite].max().item()
            rows.append({"op": name, "backend": backend, "fwd_err": fwd_err, "grad_err": grad_err,
                         "ok": fwd_err <= FORWARD_BOUND and grad_err <= GRAD_BOUND})
    return rows


def verify_other_mappings():
    """normmax / budget (reference backend) and fusedmax / oscarmax (every backend)."""
    rows = []
    X = torch.randn(3, 12, dtype=torch.float64) * 2
    g = torch.randn(3, 12, dtype=torch.float64)
    cases = [
        ("normmax_bisect(1.5)", "normmax", lambda x: entmax_fast.normmax_bisect(x, 1.5),
         lambda x: oracle_normmax(x, 1.5)),
        ("budget_bisect(2)", "budget", lambda x: entmax_fast.budget_bisect(x, 2.0), lambda x: oracle_budget(x, 2.0)),
        ("fusedmax(0.1)", "fusedmax", lambda x: entmax_fast.fusedmax(x, 0.1),
         lambda x: oracle_rows(x, 0.1, "fused")[0]),
        ("oscarmax(0.01)", "oscarmax", lambda x: entmax_fast.oscarmax(x, 0.01),
         lambda x: oracle_rows(x, 0.01, "oscar")[0]),
    ]
    X32 = X.float()
    for name, op, fn, oracle in cases:
        expected = oracle(X32.double())
        oracle_grad = _fd_grad(oracle, X32.double(), g)
        for backend in dispatch.BACKENDS:
            if not _usable(backend, op):
                continue
            x = X32.clone().requires_grad_()
            with entmax_fast.use_backend(backend):
                out = fn(x)
                out.backward(g.float())
            fwd_err = (out.double() - expected).abs().max().item()
            grad_err = (x.grad.double() - oracle_grad).abs().max().item()
            rows.append({"op": name, "backend": backend, "fwd_err": fwd_err, "grad_err": grad_err,
                         "ok": fwd_err <= FORWARD_BOUND and grad_err <= GRAD_BOUND})
    return rows


def verify_attention():
    rows = []
    b, h, lq, lk, e = 1, 2, 9, 13, 8
    q, k, v = (torch.randn(b, h, n, e, dtype=torch.float64) for n in (lq, lk, lk))
    mask = torch.rand(lq, lk) > 0.2
    g = torch.randn(b, h, lq, e, dtype=torch.float64)
    cases = [("entmax15 attention", {"alpha": 1.5}), ("sparsemax attention", {"alpha": 2.0}),
             ("entmax attention per-head alpha, causal",
              {"alpha": torch.tensor([1.25, 1.75], dtype=torch.float64), "is_causal": True}),
             ("entmax15 attention, bool mask", {"alpha": 1.5, "attn_mask": mask})]
    for name, kwargs in cases:
        q32, k32, v32 = (t.float() for t in (q, k, v))
        expected = oracle_attention(q32, k32, v32, **kwargs)
        oracle_grad = _fd_grad(lambda x: oracle_attention(x, k32, v32, **kwargs), q32.double(), g)
        for backend in dispatch.BACKENDS:
            if not _usable(backend, "attention"):
                continue
            kw = dict(kwargs)
            if isinstance(kw["alpha"], torch.Tensor):
                kw["alpha"] = kw["alpha"].float().to(DEVICE)
            if "attn_mask" in kw:
                kw["attn_mask"] = kw["attn_mask"].to(DEVICE)
            qq = q32.clone().to(DEVICE).requires_grad_()
            with entmax_fast.use_backend(backend):
                out = entmax_fast.entmax_attention(qq, k32.to(DEVICE), v32.to(DEVICE), **kw)
                out.backward(g.float().to(DEVICE))
            fwd_err = (out.double().cpu() - expected).abs().max().item()
            grad_err = (qq.grad.double().cpu() - oracle_grad).abs().max().item()
            rows.append({"op": name, "backend": backend, "fwd_err": fwd_err, "grad_err": grad_err,
                         "ok": fwd_err <= FORWARD_BOUND and grad_err <= GRAD_BOUND})
    return rows


def _pivot(rows: list) -> list:
    """One line per op, one column per backend: "forward error / gradient error"."""
    table = {}
    for r in rows:
        line = table.setdefault(r["op"], {"op": r["op"], **{backend: "-" for backend in dispatch.BACKENDS}})
        line[r["backend"]] = f"{r['fwd_err']:.1e} / {r['grad_err']:.1e}" + ("" if r["ok"] else " FAIL")
    return list(table.values())


def main():
    torch.manual_seed(0)
    print(f"# machine: {machine()}")
    for name, info in entmax_fast.backend_info()["backends"].items():
        print(f"# backend {name}: {'available' if info['available'] else 'unavailable'} — {info['reason']}")
    # The interpreter evaluates masked-off lanes too; numpy's warnings about them are noise.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    rows = verify_mappings() + verify_other_mappings() + verify_attention()
    print_table(_pivot(rows), "max |error| vs the float64 oracle, forward / gradient (float32 inputs; "
                f"bounds {FORWARD_BOUND:g} / {GRAD_BOUND:g}; '-': backend has no such op here)")
    failed = [r for r in rows if not r["ok"]]
    if failed:
        print(f"VERIFY FAILED: {len(failed)} of {len(rows)} checks above their bounds")
        sys.exit(1)
    print(f"all {len(rows)} checks (op x backend) within the bounds")


if __name__ == "__main__":
    main()
