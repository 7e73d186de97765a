"""The kernel-development tools of tools/ (tools/README.md), through the public functions
their docstrings list and their main(argv): what each one parses, edits or emulates must
still match the kernels it is about. The tests that run kernels run them where the Triton
tests do (tests/devices.py: compiled on CUDA, else in the Triton interpreter).

`load_script` is the one place the tests import a script of bench/ or tools/ (neither is an
installed package); tests/test_hf.py and tests/test_triton_attention.py use it for their
benchmarks.
"""
import ast
import functools
import importlib.util
import pathlib

import pytest
import torch

from entmax_fast.reference.attention import entmax_attention as reference_attention
from entmax_fast.triton_kernels import attention_common
from devices import on_test_device, triton_attention
from oracle import oracle_attention, oracle_entmax

ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.cache
def load_script(path: str):
    """The script at ``path``, relative to the repository ("tools/tune_attention.py",
    "bench/bench_hf_training.py"), imported once from its file. Tests use only the public
    names its docstring lists, or its main(argv)."""
    file = ROOT / path
    spec = importlib.util.spec_from_file_location(f"{file.parent.name}.{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def on_device():
    """Every tensor the test makes lives on DEVICE (CUDA when there is one)."""
    with on_test_device():
        yield


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _err(got, expected):
    """The largest error relative to the expected tensor's magnitude (at least 1)."""
    expected = expected.to(torch.float64)
    scale = expected.abs().max().clamp(min=1.0)
    return ((got.to(torch.float64) - expected).abs().max() / scale).item()


def _check_attention(q, k, v, grad_out, alpha, **kwargs):
    """The Triton backend's forward and gradients against the reference run in float64;
    returns the forward's output."""
    out, grads = _grads(lambda *t: triton_attention(*t, alpha=alpha, **kwargs), [q, k, v],
                        grad_out)
    ref_out, ref_grads = _grads(lambda *t: reference_attention(*t, alpha=alpha, **kwargs),
                                [t.double() for t in (q, k, v)], grad_out)
    assert _err(out, ref_out) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name
    return out


# --- every tool's imports of bench/ and tools/ ----------------------------------------------

def _imports_of_the_folders(path):
    """(line, module, names) of each import of a bench/ or tools/ module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("bench", "tools"):
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names
                      if alias.name.split(".")[0] in ("bench", "tools")]
    return found


def test_every_import_of_a_bench_or_tools_module_resolves():
    """The tools and benchmarks import each other's helpers as bench.X / tools.X (their
    folders are not installed packages): each such import names a file that is there and,
    for "from M import N", a module or a top-level name of M. Many of them sit inside
    functions that run only on a GPU, where nothing else would notice a broken one."""
    checked = 0
    for path in sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "tools").glob("*.py")):
        for line, module, names in _imports_of_the_folders(path):
            file = ROOT / pathlib.Path(*module.split(".")).with_suffix(".py")
            folder = ROOT / pathlib.Path(*module.split("."))
            where = f"{path.relative_to(ROOT)}:{line}"
            if folder.is_dir():
                for name in names:
                    assert (folder / f"{name}.py").exists(), f"{where}: no {module}/{name}.py"
                continue
            assert file.exists(), f"{where}: no {file.relative_to(ROOT)}"
            tree = ast.parse(file.read_text())
            defined = {node.name for node in tree.body
                       if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            defined |= {target.id for node in tree.body if isinstance(node, ast.Assign)
                        for target in node.targets if isinstance(target, ast.Name)}
            for name in names:
                assert name in defined, f"{where}: {module} has no {name}"
            checked += 1
    assert checked >= 8


# --- tools/kernel_loops.py --------------------------------------------------------------------

def test_kernel_loops_reads_loops_from_backward_branches():
    """tools/kernel_loops.py's parser: a loop is a backward branch, its body the
    instructions from the target to the branch; forward branches and short loops are not
    loops to report, and predicates do not change an opcode."""
    kernel_loops = load_script("tools/kernel_loops.py")
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


def test_kernel_loops_names_the_variants_it_compiles(capsys):
    """--variants takes the forward variants of tools/attention_variants.py (--help says
    so), and a configuration that no AOT table lists is refused by name."""
    kernel_loops = load_script("tools/kernel_loops.py")
    with pytest.raises(SystemExit) as exit_info:
        kernel_loops.main(["--help"])
    assert exit_info.value.code == 0
    assert "tools/attention_variants.py" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no AOT configuration named .*no_such_kernel"):
        kernel_loops.configurations(["no_such_kernel"])


# --- tools/attention_variants.py --------------------------------------------------------------

def test_every_attention_variant_applies_to_the_kernel_source(tmp_path):
    """tools/attention_variants.py edits attention_fwd.py's (and, for --backward,
    attention_bwd.py's) source by anchors: each must still be there exactly once, or the
    GPU run that times the variants fails."""
    variants = load_script("tools/attention_variants.py")
    for name in variants.VARIANTS:
        assert callable(variants.variant_kernel(name, str(tmp_path))), name
    assert set(variants.SLOTS) <= set(variants.VARIANTS)
    for name in variants.BACKWARD_VARIANTS:
        module = variants.variant_module(name, str(tmp_path), backward=True)
        assert callable(module.entmax_attn_bwd_dkdv_kernel), name


def test_forward_variants_still_edit_the_kernel(tmp_path):
    """tools/attention_variants.py times edited copies of the forward kernel; each edit's
    anchor must still be in the kernel, or the variant would time nothing new."""
    variants = load_script("tools/attention_variants.py")
    from entmax_fast.triton_kernels import attention_fwd

    for name, edits in variants.VARIANTS.items():
        kernel = variants.variant_kernel(name, str(tmp_path))
        assert type(kernel) is type(attention_fwd.entmax_attn_fwd_kernel), name
        assert (kernel is attention_fwd.entmax_attn_fwd_kernel) == (not edits), name


@pytest.mark.usefixtures("on_device")
def test_blocks_first_variant_computes_what_the_kernels_do(tmp_path, monkeypatch):
    """attention_variants.py's "blocks_first" (the grid with the blocks along its first
    dimension, the heads along its second) must differ only in launch order: with its
    kernels and its grid, a causal GQA call (B 2, H 4, Hkv 2, Lq 70, Lk 90, E 16: as many
    heads as blocks on neither grid) still matches float64, forward and backward."""
    variants = load_script("tools/attention_variants.py")
    from entmax_fast.triton_kernels import attention_bwd, attention_fwd

    assert set(variants.GRIDS) <= set(variants.VARIANTS) & set(variants.BACKWARD_VARIANTS)
    backward = variants.variant_module("blocks_first", str(tmp_path), backward=True)
    monkeypatch.setattr(attention_fwd, "entmax_attn_fwd_kernel",
                        variants.variant_kernel("blocks_first", str(tmp_path)))
    for name in ("entmax_attn_bwd_dq_kernel", "entmax_attn_bwd_dkdv_kernel"):
        monkeypatch.setattr(attention_bwd, name, getattr(backward, name))
    monkeypatch.setattr(attention_common, "launch_grid", variants.GRIDS["blocks_first"])
    q = torch.randn(2, 4, 70, 16) * 1.5
    k, v = torch.randn(2, 2, 90, 16), torch.randn(2, 2, 90, 16)
    _check_attention(q, k, v, torch.randn(2, 4, 70, 16), alpha=2.0, is_causal=True,
                     enable_gqa=True)


# --- tools/common.py --------------------------------------------------------------------------

def test_tool_edits_are_undone_even_when_the_timing_fails():
    """tools/common.py's replaced, through which the variants and tune scripts swap kernels
    and table functions for a timing: a value of None keeps the attribute, and every
    attribute is restored after the block, also after an exception (a later timing would
    otherwise run the edited kernel)."""
    replaced = load_script("tools/common.py").replaced
    launch_grid, candidate_slots = attention_common.launch_grid, attention_common.candidate_slots
    with pytest.raises(RuntimeError, match="timing failed"):
        with replaced((attention_common, "launch_grid", "edited"),
                      (attention_common, "candidate_slots", None)):
            assert attention_common.launch_grid == "edited"
            assert attention_common.candidate_slots is candidate_slots
            raise RuntimeError("timing failed")
    assert attention_common.launch_grid is launch_grid
    assert attention_common.candidate_slots is candidate_slots


# --- tools/tune_attention.py ------------------------------------------------------------------

def test_tune_replaces_the_chunks_it_names_alone():
    """tune_attention.py --chunks KERNEL=WIDTH times that kernel's products in chunks of
    WIDTH (never wider than the head dim) and leaves every other kernel's chunk as the
    table has it; "table" leaves the table as it is."""
    tune = load_script("tools/tune_attention.py")
    table = attention_common.chunk_width
    assert tune.parse_chunks("table") == {} and tune.chunk_width_over(table, {}) is table
    chunk_width = tune.chunk_width_over(table, tune.parse_chunks("dq=64,dkdv=256"))
    assert [chunk_width("dq", e, "bf16", 90) for e in (32, 128, 256)] == [32, 64, 64]
    assert [chunk_width("dkdv", e, "fp32", None) for e in (64, 256)] == [64, 256]
    for e, dtype_key, arch in ((256, "fp32", None), (256, "fp32", 90), (128, "bf16", 90)):
        assert chunk_width("fwd", e, dtype_key, arch) == table("fwd", e, dtype_key, arch)
    with pytest.raises(SystemExit, match="--chunks takes NAME=VALUE with NAME one of fwd, dq"):
        tune.parse_chunks("dkv=64")
    with pytest.raises(SystemExit, match="--caps takes NAME=VALUE"):
        tune.parse_caps("dq=many")


def test_tune_compiles_each_candidate_as_it_is_timed():
    """tools/tune_attention.py --jobs compiles every candidate in a process of its own,
    which runs the script with that candidate's arguments: they must give back exactly
    that candidate (an option left out would compile another configuration)."""
    tune, bench_common = load_script("tools/tune_attention.py"), load_script("bench/common.py")
    args = tune.parse_args([
        "--head-dims", "64", "128", "--causal", "--alpha", "1.25", "--alpha-tensor",
        "--tiles", "64x64", "128x32", "--fwd-launch", "4x3", "8x2", "--bwd-launch", "4x2",
        "--phases", "fused", "split", "--threshold-caps", "0", "128", "--dq", "kernel",
        "atomic", "--mask", "bool", "--caps", "table", "output=128,dq=128,dkdv=168",
        "--chunks", "table", "dq=64,dkdv=32"])
    table = tune.candidate_table(args)
    assert [len(listed) for listed in table.values()] == [96, 96]
    length = bench_common.compile_length(args.length)
    for head_dim, listed in table.items():
        for candidate in listed:
            alone = tune.parse_args(tune.candidate_argv(args, head_dim, candidate, length))
            assert tune.candidate_table(alone) == {head_dim: [candidate]}
            assert (alone.length, alone.causal, alone.alpha, alone.alpha_tensor, alone.mask,
                    alone.dtype, alone.forward_only) == (2048, True, 1.25, True, "bool",
                                                         "bf16", False)
    # what Triton specialises an integer on (1, divisible by 16), for the lengths and the
    # tile counts: the same at the compile length as at the timed one, or the compiles
    # would fill the cache with other kernels
    def keys(length):
        return [(n == 1, n % 16 == 0) for n in [length] + [length // b for b in (16, 32, 64, 128)]]

    for length in (1000, 1024, 2048, 4096, 8192, 16384, 32768):
        assert keys(bench_common.compile_length(length)) == keys(length), length


# --- tools/attention_passes.py ----------------------------------------------------------------

def test_alpha_15_root_with_a_score_just_below_it_is_certified():
    """alpha 1.5: a score of the support at t sits just below the closed-form root, so the
    exact certificate (no score between t and the root) fails by a hair while the root is
    tau to 1e-12; `_update_threshold` takes it (docs/attention.md, "Certificates"): its
    float32 twin in tools/attention_passes.py, run in float64 against the oracle, while a
    score far below the root is still refused."""
    passes = load_script("tools/attention_passes.py")
    with torch.device("cpu"):
        # a few scores near the top and the rest out of reach: no other score near tau
        u = torch.full((8, 200), -3.0, dtype=torch.float64)
        u[:, :4] = -torch.rand(8, 4, dtype=torch.float64) * 0.2
        u[:, 0] = 0.0
        u[:, 1] = -3.0   # the planted score's place
        tau = passes.exact_tau(u, 1.5)
        rows = u.shape[0]
        no = torch.zeros(rows, dtype=torch.bool)
        for below, certified in ((1e-9, True), (3e-2, False)):
            near = u.clone()
            near[:, 1] = tau - below   # weight 0 at tau: tau stays the oracle's
            t = tau - 0.05
            sums = passes.sums_at(near, t, 1.5)
            assert bool((sums[3] < near[:, 1] - t + 1e-12).all())   # it is in the support at t
            lo, hi, got, done = passes.update_threshold(
                t, sums, torch.full((rows,), -1.0, dtype=torch.float64),
                torch.zeros(rows, dtype=torch.float64),
                torch.full((rows,), -1.0, dtype=torch.float64), no, no, 1.5)[:4]
            assert bool(done.all()) == certified, below
            if certified:
                assert float((got - tau).abs().max()) <= 1e-6


@pytest.mark.usefixtures("on_device")
@pytest.mark.parametrize("alpha", [1.5, 1.25])
def test_trial_points_inside_the_bracket_stay_exact(alpha, monkeypatch):
    """Long rows of random scores: blocks need three or more threshold passes, and the
    passes after the second evaluate rows inside the bracket rather than at its lower end
    (`_trial_point`: alpha 1.5 near its closed-form upper bound, general alpha at its
    model's root), points that may lie right of tau. The float32 emulation of the passes
    (tools/attention_passes.py) confirms that these scores take that path; the kernel's
    forward and gradients must match float64."""
    lq, lk, e = 64, 1024, 16
    q = torch.randn(1, 1, lq, e) * 2.0
    k, v = torch.randn(1, 1, lk, e), torch.randn(1, 1, lk, e)
    passes = load_script("tools/attention_passes.py")
    y = (alpha - 1.0) * (q[0, 0] @ k[0, 0].T).cpu() * 0.25
    u = y - y.amax(-1, keepdim=True)
    moved = []
    trial_point = passes.trial_point

    def recording_trial_point(lo, hi, done, *rest):
        t = trial_point(lo, hi, done, *rest)
        moved.append(bool((t != lo).any()))
        return t

    monkeypatch.setattr(passes, "trial_point", recording_trial_point)
    with torch.device("cpu"):  # the emulation runs on the CPU whatever DEVICE is
        assert passes.emulate_block(u, alpha)[1] >= 3 and any(moved)

    out = _check_attention(q, k, v, torch.randn(1, 1, lq, e), alpha)
    assert _err(out, oracle_attention(q, k, v, alpha=alpha)) <= 1e-5


# --- tools/model_launch_order.py --------------------------------------------------------------

def test_launch_order_model_prints_every_case(capsys):
    """tools/model_launch_order.py: every case's line, and the heads-first order (the
    kernels') never ends later than the blocks-first one in the model."""
    model = load_script("tools/model_launch_order.py")
    assert model.main([]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split(" | ")[0] for line in lines] == [case[0] for case in model.CASES]
    for line in lines:
        assert not line.split(" | ")[-1].startswith("-"), line
    assert model.makespan([3.0, 1.0, 1.0, 1.0], 2) == 3.0


def test_threshold_candidates_lane_bound_is_between_the_support_and_y_above_minus_one(capsys):
    """tools/threshold_candidates.py: per α and length, the share of the row above the lane
    maxima's bound holds the support and is at most the share above y > -1; its thresholds
    match the float64 oracle's."""
    tool = load_script("tools/threshold_candidates.py")
    tool.main(["--lengths", "40", "300", "--rows", "4"])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 4
    for line in lines:
        lanes, above_minus_one, support = (float(cell.strip().rstrip("%")) for cell in line.split("|")[2:])
        assert support <= lanes <= above_minus_one, line
    z = torch.randn(3, 50, dtype=torch.float64)
    for alpha, factor in ((1.5, 0.5), (2.0, 1.0)):
        p = oracle_entmax(z, alpha)
        for row, p_row in zip(z, p):
            t = tool.threshold(factor * (row - row.max()), alpha)
            exponent = 2 if alpha == 1.5 else 1
            expected = torch.clamp(factor * (row - row.max()) - t, min=0) ** exponent
            torch.testing.assert_close(expected, p_row)
