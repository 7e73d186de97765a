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
            _STATUS = (True, "entmax_fast._C loaded")
            # The Python side of the C++ ops (fake kernels, autograd) is registered here, at
            # load time: torch.library registration cannot happen inside a torch.compile trace.
            from . import cpp_ops, structured

            cpp_ops.is_available()
            structured._extension_status()
    return _STATUS
