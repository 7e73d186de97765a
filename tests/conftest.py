"""Test setup shared by every test file.

- Without a CUDA device, TRITON_INTERPRET=1 before anything imports triton, so the Triton
  tests run the kernels in the Triton interpreter on CPU tensors; with one, they run the
  compiled kernels on CUDA tensors (tests/devices.py).
- Under the interpreter, three of its slow paths take shortcuts with the same values
  (tests/triton_interpreter.py): reductions with a kernel's own combine function run per
  slice, helpers called inside a launch do not patch triton.language again, and the overflow
  recomputation whose assertion is off is skipped.
- `torch.empty`/`torch.empty_like` return NaN-filled float tensors, so an output a kernel
  or launcher forgets to write fails loudly instead of passing on lucky zeros.
- Under pytest-xdist each worker takes its share of the cores for torch's threads, so that
  the workers' thread pools do not oversubscribe the machine.
- With ENTMAX_FAST_TEST_INSTALLED=1 (scripts/check_wheel.sh) the run stops at once unless
  `entmax_fast` was imported from outside the source tree, i.e. from the installed package.
- Tests marked with an `xdist_group` (the ahead-of-time compiles, the context-parallel
  groups) are collected first: the longest units of work start first when pytest-xdist
  spreads the suite over the cores.
"""
import os
import pathlib

import pytest
import torch  # importing torch does not import triton

if os.environ.get("ENTMAX_FAST_TEST_INSTALLED") == "1":
    import entmax_fast

    _tree = pathlib.Path(__file__).resolve().parent.parent
    if pathlib.Path(entmax_fast.__file__).resolve().is_relative_to(_tree):
        raise pytest.UsageError(f"ENTMAX_FAST_TEST_INSTALLED=1, but entmax_fast was imported from the source tree "
                                f"({entmax_fast.__file__}), not from the installed package")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter

    triton_interpreter.install()

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

_empty = torch.empty
_empty_like = torch.empty_like


def _nan_filled(tensor):
    if tensor.is_floating_point() and tensor.device.type == "cpu" and tensor.numel() > 0:
        tensor.fill_(float("nan"))
    return tensor


def _empty_nan(*args, **kwargs):
    return _nan_filled(_empty(*args, **kwargs))


def _empty_like_nan(*args, **kwargs):
    return _nan_filled(_empty_like(*args, **kwargs))


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _empty_nan)
    monkeypatch.setattr(torch, "empty_like", _empty_like_nan)
    yield


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    # pytest-xdist defines the marker; declared here too for runs without it.
    config.addinivalue_line("markers", "xdist_group(name): tests that run in one pytest-xdist worker")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
