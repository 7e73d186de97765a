"""Ahead-of-time compile check of every Triton kernel configuration (docs/checking.md item 2).

Each kernel module listed in KERNEL_MODULES exposes ``aot_configs() -> list[dict]`` with
keys name, fn, signature, constexprs, num_warps, num_stages (and optionally options: further
compile options such as maxnreg, as the launcher passes them; arch_constexprs: {arch:
constexprs} that replace some of constexprs for sm_<arch>, as the launcher chooses them on
that architecture): every configuration its launcher can choose. This module compiles each
of them for every arch in ARCHS without a GPU, reads the cubin's resource usage with the
``cuobjdump`` shipped in the triton wheel, and fails on compile errors and shared memory
above SHARED_LIMIT_BYTES (A100's 163 KB, the smallest of the targets). Register spills
(LOCAL or STACK > 0), warps, programs per SM and the loops Triton software-pipelined are
reported beside them as diagnostics: time on a GPU is the measure of speed. Kernels
compile with the specialisation an aligned launch gets (`runtime_attrs`), so that the
table describes the kernels that run.

    python -m entmax_fast.triton_kernels.aot      # or: python triton_kernels/aot.py

prints the table and exits 1 on any problem (``--jobs N`` compiles in N processes).
`check()` is the library form used by tests/test_aot.py and tools/. Compiling needs real
`@triton.jit` functions, which triton does not create under TRITON_INTERPRET=1 (set by the
test suite's conftest), so `check()` compiles in a subprocess with that variable removed,
under a time limit.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNEL_MODULES = ("rowwise", "attention_fwd", "attention_bwd", "kvcache_decode", "attention_support")
ARCHS = (80, 90)
SHARED_LIMIT_BYTES = 163 * 1024
MODULE_TIMEOUT_S = 3600.0
_FIELDS = ("REG", "SHARED", "LOCAL", "STACK")


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks triton to run kernels in its interpreter, parsed as
    triton parses it (``triton.knobs.getenv_bool``: 1, true, yes, on, y in any case), without
    importing triton. The one definition: the backend and the kernels import it."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def _import_kernel_module(name: str):
    """The module `name` of this folder, or None when the folder has no such file."""
    if not (Path(__file__).with_name(f"{name}.py")).exists():
        return None
    if __package__:
        return importlib.import_module(f".{name}", __package__)
    return importlib.import_module(f"{_bind_this_folder()}.{name}")


def _bind_this_folder() -> str:
    """Run as a plain script (as `check` runs it): import this folder under the name the
    kernels' relative imports need (`entmax_fast.triton_kernels`; kinds.py reads
    `entmax_fast.common`), ours first, whether or where the package is installed."""
    package = "entmax_fast.triton_kernels"
    if package not in sys.modules:
        folder = Path(__file__).resolve().parent
        if str(folder.parent) not in sys.path:
            sys.path.insert(0, str(folder.parent))
        importlib.import_module("entmax_fast")
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)])
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
    return package


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _resource_usage(cubin: bytes, kernel_name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    # One "Function <name>:" header per kernel, the counters on the next line.
    match = re.search(rf"Function {re.escape(kernel_name)}:\s*\n(.*)", out)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource line for {kernel_name}:\n{out}")
    usage = dict(re.findall(r"(\w+):(\d+)", match.group(1)))
    return {field: int(usage.get(field, 0)) for field in _FIELDS}


# Options that make a configuration slow to compile: fp32 operands, general-alpha root
# finding (a0) and wide heads unroll longer loops for ptxas. Compile times of the fused
# forward for sm_90 (triton 3.9, one x86 core each, at 559d955): fp32_e16_a3 12 s,
# fp16_e256_a2 17 s, fp32_e16_a0 29 s, bf16_e256_a0 30 s, fp32_e256_a0 49 s, fp32_e32_a0_m2
# 52 s: each such option about doubles the time.
SLOW_TO_COMPILE = frozenset({"fp32", "a0", "e128", "e256"})


def compile_cost(name: str) -> int:
    """The relative compile time of the configuration `name`: 2 ** (its options in
    SLOW_TO_COMPILE). The covering sample weighs what a configuration adds by it."""
    return 2 ** len(SLOW_TO_COMPILE.intersection(name.split("_")))


def covering_sample(configs: list[dict], pairs: bool = True, covered=(), cost=compile_cost) -> list[dict]:
    """A subset of ``configs`` in which every pair of option values that occurs together
    in some config still occurs together (pairwise coverage), or, without ``pairs``, in
    which every option value occurs at least once.

    Config names are ``<kernel>_<option>_<option>...`` (e.g. ``entmax_attn_fwd_fp16_e128_a0_m1_dropout``);
    per kernel function, configs are taken greedily by how many not yet covered token pairs
    (dtype × head dim, head dim × variant, ...) they add per unit of ``cost(name)`` (the
    weighted set-cover greedy: slow options are spread over cheap configurations instead
    of stacked in one). Used where the full cross product is too slow to compile on every
    CI run; interactions of three options may be missed. What the configs in ``covered``
    hold counts as covered already (they are not returned).
    """
    def tokens_covered(cfg):
        tokens = sorted(set(cfg["name"].split("_")))
        return ({(a, b) for i, a in enumerate(tokens) for b in tokens[i:]} if pairs
                else {(a, a) for a in tokens})

    chosen = []
    by_kernel: dict[str, list[dict]] = {}
    for cfg in configs:
        by_kernel.setdefault(cfg["fn"].__name__, []).append(cfg)
    for kernel, group in by_kernel.items():
        covers = [tokens_covered(cfg) for cfg in group]
        costs = [cost(cfg["name"]) for cfg in group]
        uncovered = set().union(*covers).difference(
            *(tokens_covered(cfg) for cfg in covered if cfg["fn"].__name__ == kernel))
        while uncovered:
            best = max(range(len(group)), key=lambda i: (len(covers[i] & uncovered) / costs[i], -i))
            chosen.append(group[best])
            uncovered -= covers[best]
    return chosen


# Integer parameters that bound a tensor's contiguous dimension: at run time the JIT marks
# them divisible by 16 for the usual sizes (head dims 64, 80, 96, 128; rows of 1024).
_CONTIGUOUS_EXTENTS = ("head_e", "head_ev", "n_cols")


def runtime_attrs(signature: dict) -> dict:
    """The specialisation the JIT gives a launch on aligned tensors of the usual sizes, as
    `triton.compile` attributes: pointers, strides and contiguous extents divisible by 16.
    Without it a load masked along its contiguous dimension is neither vectorised nor made
    asynchronous, and the compiled kernel (registers, pipelining) is not the one that runs."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
            if kind.startswith("*") or name.startswith("stride_") or name in _CONTIGUOUS_EXTENTS}


def arch_constexprs(cfg: dict, arch: int) -> dict:
    """The constexprs of one entry of an `aot_configs()` list compiled for sm_<arch>."""
    return dict(cfg["constexprs"], **cfg.get("arch_constexprs", {}).get(arch, {}))


def compile_config(cfg: dict, arch: int):
    """`triton.compile` of one entry of an `aot_configs()` list for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=cfg["fn"], signature=cfg["signature"],
                    constexprs=arch_constexprs(cfg, arch), attrs=runtime_attrs(cfg["signature"]))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                                   **cfg.get("options", {})})


def pipelined_loops(ttgir: str) -> tuple[int, int]:
    """(loops whose body issues asynchronous copies, loops) of a compiled kernel's TTGIR.

    A software-pipelined loop copies later iterations' tiles global -> shared while this
    one computes; a loop that loads under an `if` is not pipelined and waits for each load.
    """
    loops, pipelined, open_loops, depth = 0, 0, [], 0
    for line in ttgir.splitlines():
        code = re.sub(r'"[^"]*"', "", line.split(" loc(")[0])
        if "scf.for " in code:
            loops += 1
            open_loops.append([depth, False])
        if "async_copy_global_to_local" in code and open_loops:
            open_loops[-1][1] = True
        depth += code.count("{") - code.count("}")
        while open_loops and depth <= open_loops[-1][0]:
            pipelined += open_loops.pop()[1]
    return pipelined, loops


def select_configs(module_name: str, sample=False, names=None, include=()) -> list[dict]:
    """The entries of `module_name`'s `aot_configs()` to compile: all of them, or with
    ``sample`` ("pairs" or "values") that ``covering_sample``, or with ``names`` those so
    named; with ``include``, the configurations so named are added, and the covering sample
    is taken around them (they count as covering what they hold), so that a check that
    needs particular configurations compiles nothing twice."""
    module = _import_kernel_module(module_name)
    if module is None:
        return []
    configs = module.aot_configs()
    if names:
        return [cfg for cfg in configs if cfg["name"] in names]
    if not sample:
        return configs
    included = [cfg for cfg in configs if cfg["name"] in include]
    chosen = covering_sample(configs, pairs=_sample_mode(sample) == "pairs", covered=included)
    return included + [cfg for cfg in chosen if cfg["name"] not in include]


def _row_key(module_name: str, cfg: dict, arch: int) -> dict:
    """What names a row of the report: one configuration compiled for sm_<arch>."""
    return {"module": module_name, "kernel": cfg["fn"].__name__, "config": cfg["name"],
            "arch": f"sm_{arch}"}


def compile_row(module_name: str, cfg: dict, arch: int) -> dict:
    """Compiles one configuration for sm_<arch>: its row of the report (resources, programs
    per SM, pipelined loops, or the error)."""
    row = dict(_row_key(module_name, cfg, arch), error=None, WARPS=cfg["num_warps"])
    started = time.perf_counter()
    try:
        compiled = compile_config(cfg, arch)
        usage = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
        # Triton's shared memory is dynamic: the cubin's SHARED omits it.
        usage["SHARED"] = max(usage["SHARED"], int(compiled.metadata.shared))
        row.update(usage)
        row["PROGS/SM"] = programs_per_sm(arch, usage["REG"], cfg["num_warps"], usage["SHARED"])
        row["PIPELINED"] = "{}/{}".format(*pipelined_loops(compiled.asm["ttgir"]))
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    # Compile time (a cache hit when Triton's cache holds the kernel): what a sample costs.
    row["SECONDS"] = round(time.perf_counter() - started, 1)
    return row


@functools.lru_cache(maxsize=None)
def _configs_by_name(module_name: str) -> dict:
    """A kernel module's `aot_configs()` by name, listed once per worker process."""
    return {cfg["name"]: cfg for cfg in _import_kernel_module(module_name).aot_configs()}


def _compile_task(module_name: str, config_name: str, arch: int) -> dict:
    """One compile in a worker process of `compile_all`: the configuration by name.
    Announces the compile on stdout first, so that a check cut by its time limit can name
    what was compiling."""
    cfg = _configs_by_name(module_name)[config_name]
    _emit(dict(_row_key(module_name, cfg, arch), compiling=True))
    return compile_row(module_name, cfg, arch)


def _emit(row: dict) -> None:
    """One JSON line on stdout in one write: the workers and their parent share the pipe,
    and a write of under PIPE_BUF bytes is not interleaved with another's."""
    os.write(sys.stdout.fileno(), (json.dumps(row) + "\n").encode())


def compile_all(archs=ARCHS, modules=KERNEL_MODULES, on_event=None, sample=False,
                names=None, include=(), jobs: int = 1) -> list[dict]:
    """Compiles every config (or, with ``sample`` "pairs" or "values", that
    ``covering_sample``; with ``names``, the configs so named; ``include``: see
    `select_configs`) in this process, or in ``jobs`` worker processes; one row per
    (module, config, arch), in the order of the configs.

    `on_event(row)` is called before each compile (row with "compiling": True; in this
    process only, a worker announces its own on stdout) and after.
    """
    if interpreting():
        raise RuntimeError("compile_all cannot run with TRITON_INTERPRET set; use check()")
    tasks = [(module_name, cfg, arch) for module_name in modules
             for cfg in select_configs(module_name, sample, names, include) for arch in archs]
    if jobs <= 1:
        rows = []
        for module_name, cfg, arch in tasks:
            if on_event:
                on_event(dict(_row_key(module_name, cfg, arch), compiling=True))
            rows.append(compile_row(module_name, cfg, arch))
            if on_event:
                on_event(rows[-1])
        return rows
    import concurrent.futures
    import multiprocessing

    # Workers are spawned, not forked: each imports triton and the kernels afresh, as the
    # one-process path does, whatever this process has imported.
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_bind_worker) as pool:
        futures = [pool.submit(_compile_task, module_name, cfg["name"], arch)
                   for module_name, cfg, arch in tasks]
        if on_event:
            for future in concurrent.futures.as_completed(futures):
                on_event(future.result())
        return [future.result() for future in futures]


def _bind_worker() -> None:
    """A spawned worker imports this file as a plain module: bind the kernels' package as
    the parent did."""
    if not __package__:
        _bind_this_folder()


# Per SM on sm_80 / sm_90: 64K 32-bit registers, shared memory, resident programs (CTAs).
_SM_REGISTERS = 65536
_SM_SHARED = {80: 164 * 1024, 90: 228 * 1024}
_SM_PROGRAMS = 32


def programs_per_sm(arch: int, registers: int, num_warps: int, shared: int) -> int:
    """Programs of one kernel resident on an SM at once, from its registers and shared
    memory (occupancy = programs x warps / 64). A diagnostic: time on a GPU is the measure."""
    by_registers = _SM_REGISTERS // max(1, registers * 32 * num_warps)
    by_shared = _SM_SHARED.get(arch, _SM_SHARED[80]) // max(1, shared)
    return min(_SM_PROGRAMS, by_registers, by_shared)


def problems(rows: list[dict]) -> list[str]:
    """One line per compile error or shared memory over SHARED_LIMIT_BYTES: a configuration
    the launcher can choose that would not run."""
    found = []
    for row in rows:
        where = f"{row['module']}:{row['config']}@{row['arch']}"
        if row["error"]:
            found.append(f"{where}: compile error {row['error']}")
            continue
        if row["SHARED"] > SHARED_LIMIT_BYTES:
            found.append(f"{where}: shared memory {row['SHARED']} B > {SHARED_LIMIT_BYTES} B")
    return found


def spills(rows: list[dict]) -> list[str]:
    """One line per configuration that spills registers (LOCAL or STACK > 0). Reported, not
    failed: spills, registers and occupancy are proxies for speed, and a tile table chosen
    to avoid spills can be slower than one that spills a little; a GPU timing decides."""
    return [f"{row['module']}:{row['config']}@{row['arch']}: spills (LOCAL={row['LOCAL']}, "
            f"STACK={row['STACK']})" for row in rows
            if not row["error"] and (row["LOCAL"] > 0 or row["STACK"] > 0)]


def _sample_mode(sample) -> str:
    return sample if sample in ("pairs", "values") else "pairs"


def check(archs=ARCHS, modules=KERNEL_MODULES, timeout_s: float = MODULE_TIMEOUT_S, sample=False,
          names=None, include=(), jobs: int = 1) -> list[dict]:
    """compile_all in a subprocess (without TRITON_INTERPRET), in ``jobs`` worker processes
    there, under a time limit.

    A run past `timeout_s` (ptxas stuck on one config, say) keeps the rows it finished and
    gets one error row for each config that was still compiling.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--jsonl", "--jobs", str(jobs),
           "--archs", ",".join(str(a) for a in archs), "--modules", ",".join(modules)]
    cmd += ["--sample", _sample_mode(sample)] if sample else []
    cmd += ["--names", ",".join(names)] if names else []
    cmd += ["--include", ",".join(include)] if include else []
    # Its own process group, so that a run cut by the limit takes its workers with it.
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
        failed = process.returncode != 0
        reason = f"subprocess exit {process.returncode}: {err.strip()[-500:]}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        failed, reason = True, f"timeout after {timeout_s:.0f} s"
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rows = [r for r in events if not r.get("compiling")]
    if failed:
        key = lambda r: (r["module"], r["config"], r["arch"])  # noqa: E731
        finished = {key(r) for r in rows}
        unfinished = [r for r in events if r.get("compiling") and key(r) not in finished]
        for row in unfinished or [{"module": ",".join(modules), "config": "?", "arch": "?", "kernel": "?"}]:
            rows.append({"module": row["module"], "kernel": row["kernel"], "config": row["config"],
                         "arch": row["arch"], "error": reason})
    return rows


def format_table(rows: list[dict]) -> str:
    columns = _FIELDS + ("WARPS", "PROGS/SM", "PIPELINED", "SECONDS")
    header = ("module", "config", "arch") + columns + ("error",)
    lines = [[row["module"], row["config"], row["arch"]]
             + [str(row.get(field, "-")) for field in columns] + [row["error"] or ""]
             for row in rows]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*line) for line in lines])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", action="store_true",
                        help="compile in this process, print one JSON line per event (used by check)")
    parser.add_argument("--archs", default=",".join(str(a) for a in ARCHS))
    parser.add_argument("--modules", default=",".join(KERNEL_MODULES))
    parser.add_argument("--names", default="",
                        help="only the configurations of these names (comma-separated)")
    parser.add_argument("--include", default="",
                        help="with --sample, these configurations too (comma-separated); the "
                             "sample is taken around them")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--sample", nargs="?", const="pairs", choices=("pairs", "values"),
                        help="only a covering sample of each module's configs: every pair of "
                             "option values (default) or every value once")
    args = parser.parse_args(argv)
    archs = tuple(int(a) for a in args.archs.split(","))
    modules = tuple(m for m in args.modules.split(",") if m)
    names = tuple(n for n in args.names.split(",") if n)
    include = tuple(n for n in args.include.split(",") if n)
    if args.jsonl:
        compile_all(archs, modules, on_event=_emit,
                    sample=args.sample, names=names, include=include, jobs=args.jobs)
        return 0
    rows = check(archs, modules, sample=args.sample, names=names, include=include, jobs=args.jobs)
    print(format_table(rows))
    found = problems(rows)
    for line in found:
        print(line, file=sys.stderr)
    print(f"{len(rows)} compiles, {len(found)} problems, {len(spills(rows))} spilling "
          f"(a diagnostic)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
