"""Triton kernel configurations compile ahead of time for sm_80 and sm_90 within A100's
shared memory (triton_kernels/aot.py, docs/checking.md item 2); spills are printed as a
diagnostic, not failed (time on a GPU is the measure of speed).

The modules list hundreds (row-wise, decoding) and tens of thousands (attention) of configurations, so the suite
compiles a covering sample in which every option value (dtype, head dim, alpha kind, mask
kind, varlen, dropout, ...) occurs at least once per kernel, options slow to compile spread
over cheap configurations (aot.compile_cost), around the configurations whose loops must be
pipelined: once per run, in parallel processes, one test per kernel module reading
its rows, so that a module that fails does not hide the others.
ENTMAX_FAST_AOT_SAMPLE=pairs covers every pair of values, ENTMAX_FAST_AOT_FULL=1 compiles
everything, ENTMAX_FAST_AOT_JOBS sets the processes (default: one per core).
"""
import importlib
import importlib.util
import json
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
# CI compiles every option value once (the attention kernels take 20-120 s per compile
# here); ENTMAX_FAST_AOT_SAMPLE=pairs compiles every pair of values.
SAMPLE = os.environ.get("ENTMAX_FAST_AOT_SAMPLE", "values")
# Compiles run in this many processes (ptxas is single-threaded).
JOBS = int(os.environ.get("ENTMAX_FAST_AOT_JOBS", "0")) or os.cpu_count() or 1

# The forward's loops over key tiles (the max pass's two, the threshold passes' two, the
# output pass's: 5 fused, 4 + 1 split) and each backward kernel's loop over the flagged
# tiles load their tiles unconditionally, so that Triton pipelines them. A loop that tests
# a tile's flag before loading it is not pipelined.
PIPELINED_AT_LEAST = {
    ("attention_fwd", "entmax_attn_fwd_bf16_e128_a2_m1_g1"): 5,
    ("attention_fwd", "entmax_attn_fwd_threshold_bf16_e64_a2_m0_g0"): 4,
    ("attention_fwd", "entmax_attn_fwd_threshold_bf16_e64_a2_m1_g0"): 4,
    ("attention_fwd", "entmax_attn_fwd_output_fp16_e128_a0_m0_g2"): 1,
    ("attention_bwd", "entmax_attn_bwd_dq_bf16_e64_a2_m0_da0"): 1,
    ("attention_bwd", "entmax_attn_bwd_dkdv_bf16_e64_a2_m0"): 1,
}

# The tests that read the compiled sample run in one pytest-xdist worker (scripts/test.sh
# distributes by group), so that the sample is compiled once per run, in JOBS processes.
COMPILES = pytest.mark.xdist_group("aot_compile")


def _present_modules():
    return tuple(m for m in aot.KERNEL_MODULES if (ROOT / "triton_kernels" / f"{m}.py").exists())


@pytest.fixture(scope="session")
def compiled_rows(tmp_path_factory):
    """Every kernel module's sample (or, with ENTMAX_FAST_AOT_FULL=1, every configuration)
    and the configurations PIPELINED_AT_LEAST names, compiled once for sm_80 and sm_90.
    Under pytest-xdist the rows are kept in the run's shared temporary folder, so that a
    worker that did not compile them reads them instead of compiling again."""
    def compile_rows():
        return aot.check(modules=_present_modules(), sample=False if FULL else SAMPLE,
                         include=tuple(name for _, name in PIPELINED_AT_LEAST), jobs=JOBS)

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compile_rows()
    import filelock

    cache = tmp_path_factory.getbasetemp().parent / f"aot_rows_{SAMPLE}_{int(FULL)}.json"
    with filelock.FileLock(f"{cache}.lock"):
        if cache.is_file():
            return json.loads(cache.read_text())
        rows = compile_rows()
        cache.write_text(json.dumps(rows))
        return rows


@COMPILES
@pytest.mark.parametrize("module_name", aot.KERNEL_MODULES)
def test_module_compiles(module_name, compiled_rows):
    """No compile error, shared memory within A100's; spills printed."""
    if not (ROOT / "triton_kernels" / f"{module_name}.py").exists():
        pytest.skip(f"triton_kernels/{module_name}.py does not exist yet")
    rows = [row for row in compiled_rows if row["module"] == module_name]
    print(aot.format_table(rows))
    print("\n".join(aot.spills(rows)))
    assert rows, f"{module_name}.aot_configs() listed no configuration"
    assert {row["arch"] for row in rows if not row["error"]} >= {"sm_80", "sm_90"}
    found = aot.problems(rows)
    assert not found, "\n".join(found)


@COMPILES
@pytest.mark.parametrize("module_name", ("attention_fwd", "attention_bwd"))
def test_tile_loops_are_pipelined(module_name, compiled_rows):
    names = [name for module, name in PIPELINED_AT_LEAST if module == module_name]
    rows = [row for row in compiled_rows if row["module"] == module_name and row["config"] in names]
    assert len(rows) == 2 * len(names) and not aot.problems(rows), rows
    for row in rows:
        pipelined, loops = (int(n) for n in row["PIPELINED"].split("/"))
        assert pipelined >= PIPELINED_AT_LEAST[(module_name, row["config"])], row


@pytest.mark.parametrize("module_name", aot.KERNEL_MODULES)
def test_configuration_names_are_unique(module_name):
    """A name is a configuration's key (`check(names=...)`, tools/kernel_loops.py) and its
    tokens are what the covering sample covers: two configurations may not share one."""
    if not (ROOT / "triton_kernels" / f"{module_name}.py").exists():
        pytest.skip(f"triton_kernels/{module_name}.py does not exist yet")
    names = [cfg["name"] for cfg in aot._import_kernel_module(module_name).aot_configs()]
    assert len(names) == len(set(names))


def test_problems_flags_errors_and_shared_memory_and_spills_apart():
    base = {"module": "m", "kernel": "k", "config": "c", "arch": "sm_80", "error": None,
            "REG": 32, "SHARED": 0, "LOCAL": 0, "STACK": 0}
    assert aot.problems([base]) == [] and aot.spills([base]) == []
    assert aot.problems([dict(base, LOCAL=8)]) == []
    assert "spills" in aot.spills([dict(base, LOCAL=8)])[0]
    assert "spills" in aot.spills([dict(base, STACK=16)])[0]
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


def test_covering_sample_is_taken_around_included_configurations():
    def config(name):
        return {"name": name, "fn": test_covering_sample_is_taken_around_included_configurations}

    names = [f"k_{d}_{e}" for d in ("fp32", "fp16", "bf16") for e in ("e64", "e128")]
    configs = [config(n) for n in names]
    included = [cfg for cfg in configs if cfg["name"] in ("k_fp16_e64", "k_bf16_e128")]
    sample = aot.covering_sample(configs, pairs=False, covered=included)
    tokens = {t for n in names for t in n.split("_")}
    together = {t for c in sample + included for t in c["name"].split("_")}
    assert together == tokens and not {c["name"] for c in sample} & {c["name"] for c in included}
    assert len(sample) == 1, "fp32 is the one value the included configurations miss"


def test_covering_sample_spreads_what_is_slow_to_compile():
    def config(name):
        return {"name": name, "fn": test_covering_sample_spreads_what_is_slow_to_compile}

    names = [f"k_{d}_{e}" for d in ("fp32", "fp16") for e in ("e256", "e64")]
    slow = lambda name: 10 if {"fp32", "e256"} <= set(name.split("_")) else 1  # noqa: E731
    sample = aot.covering_sample([config(n) for n in names], pairs=False, cost=slow)
    assert sorted(c["name"] for c in sample) == ["k_fp16_e256", "k_fp32_e64"]
    assert [c["name"] for c in aot.covering_sample([config(n) for n in names], pairs=False,
                                                   cost=lambda name: 1)] == ["k_fp32_e256", "k_fp16_e64"]
    assert aot.compile_cost("entmax_attn_fwd_fp32_e256_a0_m0_g0") == 8
    assert aot.compile_cost("entmax_attn_fwd_fp16_e64_a2_m0_g0") == 1


def test_programs_per_sm_from_registers_and_shared_memory():
    # 255 registers x 4 warps: two programs fit the 64K register file
    assert aot.programs_per_sm(90, 255, 4, 16384) == 2
    # shared memory limits first: 100 KB per program on sm_80's 164 KB
    assert aot.programs_per_sm(80, 32, 4, 100 * 1024) == 1


def test_pipelined_loops_counts_the_loops_that_issue_async_copies():
    ttgir = """
    scf.for %i = %c0 to %n step %c1 {
      %a = ttg.async_copy_global_to_local %p, %s
      scf.for %j = %c0 to %m step %c1 {
        %b = tt.load %q
      }
    }
    scf.for %k = %c0 to %n step %c1 {
      scf.if %c {
        %c = ttg.async_copy_global_to_local %p, %s
      }
    }
    """
    assert aot.pipelined_loops(ttgir) == (2, 3)
