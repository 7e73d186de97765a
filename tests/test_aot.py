"""Triton kernel configurations compile ahead of time for sm_80 and sm_90 within A100's
shared memory (triton_kernels/aot.py, docs/checking.md item 2); spills are printed as a
diagnostic, not failed (time on a GPU is the measure, docs/gpu.md).

One test per kernel module, so a module that fails or hangs does not hide the others.
The modules list 330 (row-wise) and 936 + 840 (attention) configurations, so CI compiles
a covering sample in which every option value (dtype, head dim, alpha kind, mask kind,
varlen, dropout, ...) occurs at least once; ENTMAX_FAST_AOT_SAMPLE=pairs covers every pair
of values, ENTMAX_FAST_AOT_FULL=1 compiles everything.
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
# CI compiles every option value once (the attention kernels take 20-120 s per compile
# here); ENTMAX_FAST_AOT_SAMPLE=pairs compiles every pair of values.
SAMPLE = os.environ.get("ENTMAX_FAST_AOT_SAMPLE", "values")


@pytest.mark.parametrize("module_name", aot.KERNEL_MODULES)
def test_module_compiles(module_name):
    """No compile error, shared memory within A100's; spills printed."""
    if not (ROOT / "triton_kernels" / f"{module_name}.py").exists():
        pytest.skip(f"triton_kernels/{module_name}.py does not exist yet")
    rows = aot.check(modules=(module_name,), sample=False if FULL else SAMPLE)
    print(aot.format_table(rows))
    print("\n".join(aot.spills(rows)))
    assert rows, f"{module_name}.aot_configs() listed no configuration"
    assert {row["arch"] for row in rows if not row["error"]} >= {"sm_80", "sm_90"}
    found = aot.problems(rows)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module_name", aot.KERNEL_MODULES)
def test_configuration_names_are_unique(module_name):
    """A name is a configuration's key (`check(names=...)`, bench/kernel_loops.py) and its
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


def test_programs_per_sm_from_registers_and_shared_memory():
    # 255 registers x 4 warps: two programs fit the 64K register file
    assert aot.programs_per_sm(90, 255, 4, 16384) == 2
    # shared memory limits first: 100 KB per program on sm_80's 164 KB
    assert aot.programs_per_sm(80, 32, 4, 100 * 1024) == 1


# The forward's loops over key tiles (the max pass's two, the threshold passes' two, the
# output pass's: 5 fused, 4 + 1 split) and each backward kernel's loop over the flagged
# tiles load their tiles unconditionally, so that Triton pipelines them. A loop that tests
# a tile's flag before loading it is not pipelined: until the tile lists, only the max
# pass was.
PIPELINED_AT_LEAST = {
    ("attention_fwd", "entmax_attn_fwd_bf16_e128_a2_m1_g1"): 5,
    ("attention_fwd", "entmax_attn_fwd_threshold_bf16_e64_a2_m0_g0"): 4,
    ("attention_fwd", "entmax_attn_fwd_threshold_bf16_e64_a2_m1_g0"): 4,
    ("attention_fwd", "entmax_attn_fwd_output_fp16_e128_a0_m0_g2"): 1,
    ("attention_bwd", "entmax_attn_bwd_dq_bf16_e64_a2_m0_da0"): 1,
    ("attention_bwd", "entmax_attn_bwd_dkdv_bf16_e64_a2_m0"): 1,
}


@pytest.mark.parametrize("module_name", ("attention_fwd", "attention_bwd"))
def test_tile_loops_are_pipelined(module_name):
    names = [name for module, name in PIPELINED_AT_LEAST if module == module_name]
    rows = aot.check(archs=(80, 90), modules=(module_name,), names=names)
    assert len(rows) == 2 * len(names) and not aot.problems(rows), rows
    for row in rows:
        pipelined, loops = (int(n) for n in row["PIPELINED"].split("/"))
        assert pipelined >= PIPELINED_AT_LEAST[(module_name, row["config"])], row


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


def test_kernel_loops_reads_loops_from_backward_branches():
    """bench/kernel_loops.py's parser: a loop is a backward branch, its body the
    instructions from the target to the branch; forward branches and short loops are not
    loops to report, and predicates do not change an opcode."""
    path = Path(__file__).resolve().parent.parent / "bench" / "kernel_loops.py"
    spec = importlib.util.spec_from_file_location("kernel_loops", path)
    kernel_loops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_loops)
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FADD R2, R2, R3 ;
        /*0020*/               @P0 FFMA R4, R2, R2, R4 ;
        /*0030*/              @!P1 FFMA R5, R2, R2, R5 ;
        /*0040*/               @P2 BRA 0x60 ;
        /*0050*/                   FMNMX R6, R6, R2, !PT ;
        /*0060*/               @P3 BRA 0x10 ;
        /*0070*/                   EXIT ;
    """
    loops = kernel_loops.sass_loops(sass, min_instructions=2)
    assert [(loop["start"], loop["end"], loop["instructions"]) for loop in loops] == [(0x10, 0x60, 6)]
    assert loops[0]["opcodes"]["FFMA"] == 2 and loops[0]["opcodes"]["BRA"] == 2
    assert loops[0]["skips"] == [(0x40, 1)], "the FMNMX the forward branch jumps over"
    assert kernel_loops.sass_loops(sass, min_instructions=7) == []
    # a backward branch that also tests a predicate (the general-alpha pass loop's form)
    predicated = sass.replace("@P3 BRA 0x10", "@P1 BRA P2, 0x10")
    assert [(loop["start"], loop["end"]) for loop in kernel_loops.sass_loops(predicated, 2)] == [(0x10, 0x60)]


def test_every_attention_variant_applies_to_the_kernel_source(tmp_path):
    """bench/bench_attention_variants.py edits attention_fwd.py's (and, for --backward,
    attention_bwd.py's) source by anchors: each must still be there exactly once, or the
    GPU call that times the variants fails."""
    path = Path(__file__).resolve().parent.parent / "bench" / "bench_attention_variants.py"
    spec = importlib.util.spec_from_file_location("bench_attention_variants", path)
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    for name in variants.VARIANTS:
        assert callable(variants.variant_kernel(name, str(tmp_path))), name
    assert set(variants.SLOTS) <= set(variants.VARIANTS)
    for name in variants.BACKWARD_VARIANTS:
        module = variants.variant_module(name, str(tmp_path), backward=True)
        assert callable(module.entmax_attn_bwd_dkdv_kernel), name
