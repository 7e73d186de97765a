"""Loads the compiled extension ``entmax_fast._C`` if it was built, and says why if not."""
from __future__ import annotations

_STATUS = None


def status() -> tuple[bool, str]:
    """(loaded, reason). Importing ``_C`` registers the ``torch.ops.entmax_fast`` ops."""
    global _STATUS
    if _STATUS is None:
        try:
            from . import _C  # noqa: F401
        except ImportError as exc:
            _STATUS = (False, f"the C++ extension entmax_fast._C is not built ({exc}); "
                              "reinstall with a C++ compiler: pip install --no-build-isolation -e .")
        except OSError as exc:
            _STATUS = (False, f"the C++ extension entmax_fast._C failed to load ({exc})")
        else:
            import torch

            # The row-wise kernels' instruction set: "portable" (scalar std:: maths) is the
            # slower fallback on CPUs without AVX2+FMA, worth knowing when timing.
            isa = torch.ops.entmax_fast.cpu_kernel_isa()
            _STATUS = (True, f"entmax_fast._C loaded (CPU kernels: {isa})")
            # The Python side of the C++ ops (fake kernels, autograd) is registered here, at
            # load time: torch.library registration cannot happen inside a torch.compile trace.
            from . import cpp_ops, structured

            cpp_ops.is_available()
            structured._extension_status()
    return _STATUS
