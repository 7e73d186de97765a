"""Loads the compiled extension ``entmax_fast._C`` if it was built, and says why if not."""
from __future__ import annotations

import threading

_STATUS = None
# Held while loading: loading registers the ops' Python side (fake kernels, autograd) with
# torch.library, which two threads must not do at once (torch warns "Overriding a
# previously registered kernel"). Re-entrant: the registration asks for status() again.
_LOCK = threading.RLock()
_READY = False


def status() -> tuple[bool, str]:
    """(loaded, reason). Importing ``_C`` registers the ``torch.ops.entmax_fast`` ops."""
    global _STATUS, _READY
    if _READY:
        return _STATUS
    with _LOCK:
        if _STATUS is None:
            _STATUS = _load()
            _READY = True
    return _STATUS


def _load() -> tuple[bool, str]:
    global _STATUS
    try:
        from . import _C  # noqa: F401
    except ImportError as exc:
        return False, (f"the C++ extension entmax_fast._C is not built ({exc}); "
                       "reinstall with a C++ compiler: pip install --no-build-isolation -e .")
    except OSError as exc:
        return False, f"the C++ extension entmax_fast._C failed to load ({exc})"
    # The row-wise kernels' instruction set: "portable" (scalar std:: maths) is the slower
    # fallback on CPUs without AVX2+FMA, worth knowing when timing.
    _STATUS = (True, f"entmax_fast._C loaded (CPU kernels: {cpu_kernel_set()})")
    # The Python side of the C++ ops (fake kernels, autograd) is registered here, at load
    # time: torch.library registration cannot happen inside a torch.compile trace.
    from . import cpp_ops, structured

    cpp_ops.is_available()
    structured._extension_status()
    return _STATUS


def cpu_kernel_set() -> str:
    """The C++ CPU kernels in use: "avx2-fma", or "portable" (CPUs without AVX2+FMA, or
    forced with ``torch.ops.entmax_fast.cpu_kernel_isa("portable")``)."""
    import torch

    return torch.ops.entmax_fast.cpu_kernel_isa()
