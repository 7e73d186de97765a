"""Triton kernel configurations compile ahead of time for sm_80 and sm_90 without spills
and within A100's shared memory (triton_kernels/aot.py, docs/checking.md item 2).

One test per kernel module, so a module that fails or hangs does not hide the others. The
row-wise module is compiled whole (132 configs). The attention modules list 360 + 720
configs (2160 compiles for both archs, about 30 minutes here with the two modules in
parallel; all without spills when last run), so CI compiles their pairwise covering sample
(every pair of options — dtype × head dim, head dim × dropout, ... — at least once);
ENTMAX_FAST_AOT_FULL=1 compiles everything.
"""
import importlib
import importlib.util
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def _load_aot():
    try:
        return importlib.import_module("entmax_fast.triton_kernels.aot")
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location("entmax_fast_aot_under_test", ROOT / "triton_kernels" / "aot.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


aot = _load_aot()


FULL = os.environ.get("ENTMAX_FAST_AOT_FULL") == "1"


@pytest.mark.parametrize("module_name", aot.KERNEL_MODULES)
def test_module_compiles_without_spills(module_name):
    """No compile error, no spill (local memory or stack frame), shared memory within
    A100's."""
    if not (ROOT / "triton_kernels" / f"{module_name}.py").exists():
        pytest.skip(f"triton_kernels/{module_name}.py does not exist yet")
    rows = aot.check(modules=(module_name,), sample=module_name != "rowwise" and not FULL)
    print(aot.format_table(rows))
    assert rows, f"{module_name}.aot_configs() listed no configuration"
    assert {row["arch"] for row in rows if not row["error"]} >= {"sm_80", "sm_90"}
    found = aot.problems(rows)
    assert not found, "\n".join(found)


def test_problems_flags_spills_errors_and_shared_memory():
    base = {"module": "m", "kernel": "k", "config": "c", "arch": "sm_80", "error": None,
            "REG": 32, "SHARED": 0, "LOCAL": 0, "STACK": 0}
    assert aot.problems([base]) == []
    assert "spills" in aot.problems([dict(base, LOCAL=8)])[0]
    assert "spills" in aot.problems([dict(base, STACK=16)])[0]
    assert "shared memory" in aot.problems([dict(base, SHARED=aot.SHARED_LIMIT_BYTES + 1)])[0]
    assert "compile error" in aot.problems([dict(base, error="CompilationError: x")])[0]


def test_covering_sample_keeps_every_pair_of_options():
    def config(name):
        return {"name": name, "fn": test_covering_sample_keeps_every_pair_of_options}

    names = [f"k_{d}_{e}_{v}" for d in ("fp32", "fp16") for e in ("e64", "e128") for v in ("plain", "dropout")]
    sample = aot.covering_sample([config(n) for n in names])
    pairs = {(a, b) for n in names for a in n.split("_") for b in n.split("_")}
    covered = {(a, b) for c in sample for a in c["name"].split("_") for b in c["name"].split("_")}
    assert covered == pairs and len(sample) < len(names)
