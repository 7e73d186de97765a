"""Start-up cost: `import entmax_fast` against `import torch`, each in fresh interpreters.

The two imports alternate (so a busy machine slows both alike); the medians and their
ratio are printed. The target is a ratio of at most 1.3: entmax_fast imports neither
triton nor torch._dynamo until an op or torch.compile needs them.

    python bench/bench_import.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

TARGET_RATIO = 1.3


def _import_seconds(module: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="fresh interpreters per import (default 7)")
    args = parser.parse_args()
    # The first run of each warms the file cache; it is not counted.
    _import_seconds("torch")
    _import_seconds("entmax_fast")
    times = {"torch": [], "entmax_fast": []}
    for _ in range(args.repeats):
        for module in times:
            times[module].append(_import_seconds(module))
    torch_s = statistics.median(times["torch"])
    ours_s = statistics.median(times["entmax_fast"])
    ratio = ours_s / torch_s
    print(f"## Import time (fresh interpreters, median of {args.repeats}, alternating)")
    print(f"import torch        {torch_s:6.2f} s")
    print(f"import entmax_fast  {ours_s:6.2f} s   ratio {ratio:.2f} "
          f"({'within' if ratio <= TARGET_RATIO else 'ABOVE'} the {TARGET_RATIO}x target)")


if __name__ == "__main__":
    main()
