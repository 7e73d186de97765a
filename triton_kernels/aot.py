"""Ahead-of-time compile check of every Triton kernel configuration (KERNELS.md §2).

Each kernel module listed in KERNEL_MODULES exposes ``aot_configs() -> list[dict]`` with
keys name, fn, signature, constexprs, num_warps, num_stages: every configuration its
launcher can choose. This module compiles each of them for every arch in ARCHS without a
GPU, reads the cubin's resource usage with the ``cuobjdump`` shipped in the triton wheel,
and flags compile errors, register spills (LOCAL or STACK > 0) and shared memory above
SHARED_LIMIT_BYTES (A100's 163 KB, the smallest of the targets).

    python -m entmax_fast.triton_kernels.aot      # or: python triton_kernels/aot.py

prints the table and exits 1 on any problem. `check()` is the library form used by
tests/test_aot.py. Compiling needs real `@triton.jit` functions, which triton does not
create under TRITON_INTERPRET=1, so `check()` runs the compile in a subprocess with that
variable removed when it is set (as it is under the test suite's conftest).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL_MODULES = ("rowwise", "attention_fwd", "attention_bwd")
ARCHS = (80, 90)
SHARED_LIMIT_BYTES = 163 * 1024
_FIELDS = ("REG", "SHARED", "LOCAL", "STACK")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off")


def _import_kernel_module(name: str):
    """The module `name` of this folder, or None when the folder has no such file."""
    if not (Path(__file__).with_name(f"{name}.py")).exists():
        return None
    if __package__:
        return importlib.import_module(f".{name}", __package__)
    # Run as a plain script: import the folder as the package `triton_kernels`, ours first.
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"triton_kernels.{name}")


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


def compile_all(archs=ARCHS, modules=KERNEL_MODULES) -> list[dict]:
    """Compiles every config in this process; one row per (module, config, arch)."""
    if _interpreting():
        raise RuntimeError("compile_all cannot run with TRITON_INTERPRET set; use check()")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for module_name in modules:
        module = _import_kernel_module(module_name)
        if module is None:
            continue
        for cfg in module.aot_configs():
            for arch in archs:
                row = {"module": module_name, "kernel": cfg["fn"].__name__, "config": cfg["name"],
                       "arch": f"sm_{arch}", "error": None}
                try:
                    src = ASTSource(fn=cfg["fn"], signature=cfg["signature"], constexprs=cfg["constexprs"])
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                              options={"num_warps": cfg["num_warps"],
                                                       "num_stages": cfg["num_stages"]})
                    usage = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
                    # Triton's shared memory is dynamic: the cubin's SHARED omits it.
                    usage["SHARED"] = max(usage["SHARED"], int(compiled.metadata.shared))
                    row.update(usage)
                except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
                    row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                rows.append(row)
    return rows


def problems(rows: list[dict]) -> list[str]:
    """One line per compile error, spill, or shared memory over SHARED_LIMIT_BYTES."""
    found = []
    for row in rows:
        where = f"{row['module']}:{row['config']}@{row['arch']}"
        if row["error"]:
            found.append(f"{where}: compile error {row['error']}")
            continue
        if row["LOCAL"] > 0 or row["STACK"] > 0:
            found.append(f"{where}: spills (LOCAL={row['LOCAL']}, STACK={row['STACK']})")
        if row["SHARED"] > SHARED_LIMIT_BYTES:
            found.append(f"{where}: shared memory {row['SHARED']} B > {SHARED_LIMIT_BYTES} B")
    return found


def check(archs=ARCHS, modules=KERNEL_MODULES) -> list[dict]:
    """compile_all, in a subprocess without TRITON_INTERPRET when that is set."""
    if not _interpreting():
        return compile_all(archs, modules)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json",
           "--archs", ",".join(str(a) for a in archs), "--modules", ",".join(modules)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"AOT subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    header = ("module", "config", "arch") + _FIELDS + ("error",)
    lines = [[row["module"], row["config"], row["arch"]]
             + [str(row.get(field, "-")) for field in _FIELDS] + [row["error"] or ""] for row in rows]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*line) for line in lines])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    parser.add_argument("--archs", default=",".join(str(a) for a in ARCHS))
    parser.add_argument("--modules", default=",".join(KERNEL_MODULES))
    args = parser.parse_args(argv)
    archs = tuple(int(a) for a in args.archs.split(","))
    modules = tuple(m for m in args.modules.split(",") if m)
    if args.json:
        print(json.dumps(compile_all(archs, modules)))
        return 0
    rows = check(archs, modules)
    print(format_table(rows))
    found = problems(rows)
    for line in found:
        print(line, file=sys.stderr)
    print(f"{len(rows)} compiles, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
