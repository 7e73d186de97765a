"""Instructions per loop iteration of compiled Triton kernels, read from their SASS: a
proxy for time where no GPU is at hand (the threshold passes are bound by the instructions
each score costs, not by memory).

Compiles configurations of the AOT tables (`aot_configs()` of triton_kernels/attention_fwd.py,
attention_bwd.py, rowwise.py) for one architecture, without a GPU, disassembles them with the
cuobjdump of the triton wheel and prints every loop (a backward branch) of at least
--min-instructions instructions: its length, the instructions per element of a tile
(length x threads / (BLOCK_M x BLOCK_N) scores for attention, / (ROWS x BLOCK) entries for
the row-wise kernels) and the most frequent opcodes.
`--variants` also compiles the forward variants of tools/attention_variants.py, so that an
edit's effect is read in one run:

    python tools/kernel_loops.py entmax_attn_fwd_threshold_bf16_e64_a2_m0_g0 \\
        --variants kernel predicated_moments

Counts are static: a run-time branch inside a loop counts whether a launch takes it or
not. Each loop's conditional forward branches are listed with the instructions they jump
over, so that the path a launch takes can be read off (general alpha's dK/dV loop holds a
near-one log that heads with alpha >= 1.25 never run: about 1300 instructions, 40 per
score; the other attention launches compile it apart). Compiling needs real
`@triton.jit` functions: run it without TRITON_INTERPRET.
Instruction counts are not time (latency, occupancy and the tensor cores overlap
differently); a GPU decides.

Public functions: `sass_loops(sass, min_instructions)` (the parser, tests/test_tools.py),
`disassemble`, `configurations`, `report` and `main(argv)`.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
# "BRA 0x10" or, for a branch that also tests a uniform predicate, "BRA P2, 0x10"
_BACKWARD = re.compile(r"BRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")
_CONDITIONAL = re.compile(r"^@!?U?P\w+\s+BRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")


def sass_loops(sass: str, min_instructions: int) -> list[dict]:
    """Loops of a disassembly: (start, end, instructions, opcode counts, skips), innermost
    and outer ones alike, in address order of their backward branch. ``skips`` are the
    conditional forward branches inside a loop, (address, instructions jumped over): a
    uniform branch (general alpha's log near alpha = 1, a kind of row) puts code in the
    loop that a launch may never run, and the instructions a launch takes are the loop's
    less the blocks it jumps over."""
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    index = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (address, text) in enumerate(code):
        branch = _BACKWARD.search(text)
        if not branch or int(branch.group(1), 16) > address:
            continue
        body = [t for _, t in code[index[int(branch.group(1), 16)]:i + 1]]
        if len(body) < min_instructions:
            continue
        opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                      for t in body)
        start = int(branch.group(1), 16)
        skips = []
        for at, inner in code[index[start]:i]:
            forward = _CONDITIONAL.match(inner)
            if forward and at < int(forward.group(1), 16) <= address:
                skips.append((at, index[int(forward.group(1), 16)] - index[at] - 1))
        loops.append({"start": start, "end": address, "instructions": len(body),
                      "opcodes": opcodes, "skips": skips})
    return loops


def disassemble(cubin: bytes) -> str:
    from entmax_fast.triton_kernels import aot

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([aot._cuobjdump(), "-sass", path], capture_output=True,
                              text=True, check=True).stdout


def configurations(names):
    from entmax_fast.triton_kernels import aot

    found = {}
    for module_name in aot.KERNEL_MODULES:
        module = aot._import_kernel_module(module_name)
        for cfg in module.aot_configs() if module else []:
            if cfg["name"] in names:
                found[cfg["name"]] = cfg
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"kernel_loops: no AOT configuration named {missing}")
    return [found[name] for name in names]


def report(cfg, arch, min_instructions, label):
    from entmax_fast.triton_kernels import aot

    compiled = aot.compile_config(cfg, arch)
    usage = aot._resource_usage(compiled.asm["cubin"], compiled.metadata.name)
    threads = 32 * cfg["num_warps"]
    constexprs = cfg["constexprs"]
    tile = (constexprs.get("BLOCK_M", 0) * constexprs.get("BLOCK_N", 0)
            or constexprs.get("ROWS", 0) * constexprs.get("BLOCK", 0))
    print(f"{label} sm_{arch}: {usage['REG']} registers, {usage['STACK']} bytes of stack, "
          f"{cfg['num_warps']} warps")
    for loop in sass_loops(disassemble(compiled.asm["cubin"]), min_instructions):
        per_score = f", {loop['instructions'] * threads / tile:.1f} per element" if tile else ""
        top = " ".join(f"{op}:{n}" for op, n in loop["opcodes"].most_common(10))
        print(f"  loop {loop['start']:#07x}-{loop['end']:#07x}: {loop['instructions']} "
              f"instructions{per_score}  [{top}]")
        if loop["skips"]:
            print("    conditional branches jumping over " + ", ".join(
                f"{n} at {at:#07x}" for at, n in loop["skips"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", help="AOT configuration names")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--min-instructions", type=int, default=100)
    parser.add_argument("--variants", nargs="+", default=None,
                        help="forward variants of tools/attention_variants.py (fwd configs)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_loops: unset TRITON_INTERPRET (it compiles the kernels)")
    cfgs = configurations(args.configs)
    if not args.variants:
        for cfg in cfgs:
            report(cfg, args.arch, args.min_instructions, cfg["name"])
        return 0
    from tools import attention_variants as variants

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            kernel = variants.variant_kernel(name, tmp)
            for cfg in cfgs:
                report(dict(cfg, fn=kernel), args.arch, args.min_instructions,
                       f"{cfg['name']} [{name}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
