"""Shared measuring helpers of the bench/ scripts (tools/ uses them too): timing, peak memory,
compile runs, tables, machine info."""
from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import time

import torch


def time_call(fn, repeats: int = 5, warmup: int = 1, min_time: float = 0.0) -> float:
    """Median wall time of ``fn()`` in seconds (CUDA-synchronised when a GPU is used)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    start_all = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start_all < min_time:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def kernel_times(step, repeats: int = 3) -> dict:
    """{kernel name: mean ms per call} of ``step()``'s GPU kernels over ``repeats`` profiled
    calls (torch.profiler): the device's time, without the host's."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = event.cuda_time_total
        if device_us > 0:
            times[event.key] = device_us / 1000 / repeats
    return times


def compile_length(length: int) -> int:
    """A length at which a GPU script's compile run builds the kernels it times at `length`,
    in less time. Triton specialises an integer argument on whether it is 1 or divisible by
    16: the sequence lengths, the strides they enter and the tile counts L / BLOCK (BLOCK 16
    to 128). At 2048 every one of them has the divisibility it has at any multiple of 2048
    (L / 128 = 16), so 2048 serves 4096 and longer; another length compiles as itself."""
    return 2048 if length % 2048 == 0 else length


def run_processes(commands: list[list[str]], jobs: int) -> int:
    """Runs every command, at most ``jobs`` at a time, their output discarded; returns how
    many failed. The GPU scripts compile their kernels this way (one process per
    configuration fills Triton's cache) before timing them alone."""
    started = []
    for command in commands:
        while sum(process.poll() is None for process in started) >= jobs:
            started[[process.poll() is None for process in started].index(True)].wait()
        started.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
    return sum(process.wait() != 0 for process in started)


def precompile(commands: list[list[str]], jobs: int, label: str) -> int:
    """`run_processes` for a GPU script's compile runs, then one line saying how many
    processes took how long and how many failed (a failed one leaves its kernels to be
    compiled where they are timed). Returns the count of failures.

    Triton compiles a kernel when it is first launched, in the launching process, one after
    the other: the quick attention grid's kernels took about 270 s compiled so (the forward's
    threshold launch 12-31 s each, the others 1-5 s; triton 3.6, sm_90, an empty cache, a
    2-core host; commit 8f7af03), and a GPU script that meets its kernels cold spends its
    time limit compiling. The printed time is what the compiles cost."""
    started = time.perf_counter()
    failed = run_processes(commands, jobs)
    print(f"{label}: {len(commands)} compile processes, {jobs} at a time, took "
          f"{time.perf_counter() - started:.0f} s" + (f"; {failed} failed, timing anyway"
                                                     if failed else ""), flush=True)
    return failed


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


_LIBC = None


def _libc():
    """glibc, set to serve (and return to the OS) every allocation >= 64 KiB by mmap, so that
    memory freed by one measurement does not hide the next one's peak; None elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        except OSError:
            _LIBC = False
    return _LIBC or None


def measure_peak_rss(fn) -> int | None:
    """Bytes by which the process's resident set peaked above its size before ``fn()``
    (Linux; None elsewhere). The kernel's peak counter (VmHWM) is reset to the current
    resident set first (/proc/self/clear_refs), so earlier peaks do not hide this one."""
    if platform.system() != "Linux" or not os.path.exists("/proc/self/clear_refs"):
        return None
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_bytes("VmRSS")
    fn()
    return max(0, _status_bytes("VmHWM") - before)


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return (f"{device}; {platform.processor() or platform.machine()}; torch {torch.__version__}; "
            f"threads {torch.get_num_threads()}; python {platform.python_version()}")


def print_table(rows: list[dict], title: str = "") -> None:
    if title:
        print(f"\n## {title}")
    if not rows:
        print("(no rows)")
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))


def _fmt(value) -> str:
    if isinstance(value, float):
        # Three significant digits, but never an exponent for large values (1.1e+03 ms).
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def write_csv(rows: list[dict], path: str) -> None:
    import csv

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
