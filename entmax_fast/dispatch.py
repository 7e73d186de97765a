"""One registry that picks, per call, the backend of every op, and remembers why.

Backends:
- ``reference``: plain torch (``entmax_fast.reference``); always available.
- ``triton``: Triton kernels (``entmax_fast.triton_kernels``); default for CUDA tensors.
  On CPU tensors only when forced, which runs the Triton interpreter
  (``TRITON_INTERPRET=1`` must be set before triton is first imported).
- ``cpp``: the compiled extension ``entmax_fast._C``; default for CPU tensors when built.

Forcing: the environment variable ``ENTMAX_FAST_BACKEND`` or the context manager
:func:`use_backend`. A forced backend that implements the op but cannot run this call
raises (a forced choice is never silently ignored); a forced backend that has no
implementation of the op at all leaves that op to the default order, and the recorded
reason says so.

:func:`last_choice` and ``entmax_fast.backend_info()`` tell which backend each op used
last and why; a CUDA call that does not get a fast backend also warns once.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

BACKENDS = ("reference", "triton", "cpp")
ENV_VAR = "ENTMAX_FAST_BACKEND"


@dataclass(frozen=True)
class Request:
    """What a backend needs to know to accept or refuse a call."""

    device: torch.device
    dtype: torch.dtype
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Choice:
    op: str
    backend: str
    reason: str


@dataclass
class _Impl:
    module: str
    attrs: tuple
    # Returns None when the call is supported, else the reason it is not.
    supports: Callable[[Request], Optional[str]]


class BackendUnavailableError(RuntimeError):
    pass


_REGISTRY: dict[str, dict[str, _Impl]] = {}
_LAST: dict[str, Choice] = {}
_LOADED: dict[tuple[str, str], Any] = {}
_WARNED: set = set()
_LOCAL = threading.local()
_AVAILABILITY: dict[str, tuple[bool, str]] = {}


def register(op: str, backend: str, module: str, attrs, supports=None) -> None:
    """Declare that ``module`` implements ``op`` for ``backend`` with the names ``attrs``
    (imported lazily, on first use)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(attrs, str):
        attrs = (attrs,)
    _REGISTRY.setdefault(op, {})[backend] = _Impl(module, tuple(attrs), supports or (lambda request: None))
    _LOADED.pop((op, backend), None)


def _triton_availability() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} with CUDA device {torch.cuda.get_device_name()}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, f"triton {triton.__version__} in interpreter mode (TRITON_INTERPRET=1), CPU tensors only"
    return True, (f"triton {triton.__version__} importable but no CUDA device; CPU tensors need "
                  "TRITON_INTERPRET=1 set before triton is imported")


def _cpp_availability() -> tuple[bool, str]:
    from . import _ext

    return _ext.status()


def availability(backend: str) -> tuple[bool, str]:
    """(available, reason) for a backend on this machine; cached."""
    if backend not in _AVAILABILITY:
        if backend == "reference":
            _AVAILABILITY[backend] = (True, "plain torch, always available")
        elif backend == "triton":
            _AVAILABILITY[backend] = _triton_availability()
        elif backend == "cpp":
            _AVAILABILITY[backend] = _cpp_availability()
        else:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return _AVAILABILITY[backend]


def _runs_on(backend: str, request: Request) -> Optional[str]:
    """None if ``backend`` can run on the request's device, else why not."""
    ok, why = availability(backend)
    if not ok:
        return why
    if backend == "triton":
        if request.device.type == "cuda":
            return None if torch.cuda.is_available() else "no CUDA device"
        if request.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return f"triton cannot run {request.device.type} tensors here ({why})"
    if backend == "cpp" and request.device.type not in ("cpu", "cuda"):
        return f"the extension has no {request.device.type} kernels"
    return None


def forced_backend() -> Optional[str]:
    forced = getattr(_LOCAL, "forced", None)
    if forced is None:
        forced = os.environ.get(ENV_VAR) or None
        if forced is not None and forced not in BACKENDS:
            raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {forced!r}")
    return forced


@contextlib.contextmanager
def use_backend(backend: Optional[str]):
    """Force ``backend`` for every op called inside the block (None: default choice)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    previous = getattr(_LOCAL, "forced", None)
    _LOCAL.forced = backend
    try:
        yield
    finally:
        _LOCAL.forced = previous


def _default_order(device: torch.device):
    return ("triton", "cpp", "reference") if device.type == "cuda" else ("cpp", "reference")


def _load(op: str, backend: str):
    if (op, backend) not in _LOADED:
        impl = _REGISTRY[op][backend]
        module = importlib.import_module(impl.module, package=__package__)
        objs = tuple(getattr(module, name) for name in impl.attrs)
        _LOADED[(op, backend)] = objs if len(objs) > 1 else objs[0]
    return _LOADED[(op, backend)]


def select(op: str, request: Request) -> tuple[Any, Choice]:
    """Pick the implementation of ``op`` for ``request``; returns (implementation, choice).

    Under ``torch.compile`` the choice is made once, when the graph is traced, and kept as
    a constant of the compiled code (a backend forced later does not re-trace it).
    """
    if torch.compiler.is_compiling():
        options = tuple(sorted(request.options.items()))
        backend = _backend_name_while_tracing(op, request.device.type, request.dtype, options)
        return _LOADED[(op, backend)], _LAST[op]
    return _select(op, request)


@torch.compiler.assume_constant_result
def _backend_name_while_tracing(op: str, device_type: str, dtype: torch.dtype, options: tuple) -> str:
    return _select(op, Request(torch.device(device_type), dtype, dict(options)))[1].backend


def _select(op: str, request: Request) -> tuple[Any, Choice]:
    impls = _REGISTRY.get(op)
    if not impls:
        raise KeyError(f"no backend registered for op {op!r}")
    forced = forced_backend()
    refusals = []
    if forced is not None:
        if forced in impls:
            why_not = _runs_on(forced, request) or impls[forced].supports(request)
            if why_not is not None:
                raise BackendUnavailableError(
                    f"backend {forced!r} was forced for {op} but cannot run this call: {why_not}")
            try:
                implementation = _load(op, forced)
            except Exception as exc:  # noqa: BLE001
                raise BackendUnavailableError(
                    f"backend {forced!r} was forced for {op} but failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            choice = Choice(op, forced, "forced")
            _LAST[op] = choice
            return implementation, choice
        refusals.append(f"forced {forced!r} has no {op} implementation")
    for backend in _default_order(request.device):
        if backend not in impls:
            refusals.append(f"{backend}: no {op} implementation")
            continue
        why_not = _runs_on(backend, request) or impls[backend].supports(request)
        if why_not is None:
            reason = "default order" if not refusals else "; ".join(refusals)
            try:
                implementation = _load(op, backend)
            except Exception as exc:  # noqa: BLE001 - a broken optional backend must not break the op
                refusals.append(f"{backend}: failed to load ({type(exc).__name__}: {exc})")
                continue
            choice = Choice(op, backend, reason)
            _LAST[op] = choice
            if request.device.type == "cuda" and backend == "reference" and op not in _WARNED:
                _WARNED.add(op)
                warnings.warn(f"entmax_fast: {op} on CUDA runs the plain-torch reference: {reason}",
                              stacklevel=3)
            return implementation, choice
        refusals.append(f"{backend}: {why_not}")
    raise BackendUnavailableError(f"no backend can run {op}: " + "; ".join(refusals))


def last_choice(op: str) -> Optional[Choice]:
    """The backend the last call of ``op`` used, and why (None before the first call)."""
    return _LAST.get(op)


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {op: tuple(impls) for op, impls in _REGISTRY.items()}


# ---------------------------------------------------------------------------------------
# The table: every (op, backend) pair of the package, in one place.
# ---------------------------------------------------------------------------------------

def _triton_rowwise_supports(request: Request) -> Optional[str]:
    if request.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"triton row-wise kernels take float32/float16/bfloat16, got {request.dtype}"
    return None


def _cpp_supports_float_types(request: Request) -> Optional[str]:
    if request.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return f"unsupported dtype {request.dtype}"
    if request.device.type != "cpu":
        return "the C++ entmax ops are CPU-only"
    return None


def _cpp_structured_supports(request: Request) -> Optional[str]:
    from .structured import cpp_structured_supports

    return cpp_structured_supports(request)


def _triton_attention_supports(request: Request) -> Optional[str]:
    if request.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the fused kernels take float32/float16/bfloat16, got {request.dtype}"
    alpha = request.options.get("alpha")
    if isinstance(alpha, float) and not 1.0 < alpha <= 2.0:
        return f"the fused kernels need 1 < alpha <= 2, got {alpha}"
    if request.options.get("head_dim", 0) > 256:
        return f"head dims above 256 are not supported by the fused kernels, got {request.options['head_dim']}"
    return None


def _cpp_attention_supports(request: Request) -> Optional[str]:
    why_not = _cpp_supports_float_types(request)
    if why_not is None and request.options.get("dropout_p", 0.0) > 0:
        return "the C++ attention has no dropout"
    if why_not is None and request.options.get("mask_requires_grad"):
        return "the C++ attention gives no gradient to a float attn_mask"
    return why_not


register("entmax", "reference", ".reference.mappings", ("entmax_rowwise_forward", "entmax_rowwise_backward"))
register("entmax", "triton", ".triton_kernels.rowwise", ("entmax_rowwise_forward", "entmax_rowwise_backward"),
         _triton_rowwise_supports)
register("entmax", "cpp", ".cpp_ops", ("entmax_rowwise_forward", "entmax_rowwise_backward"),
         _cpp_supports_float_types)
register("normmax", "reference", ".reference.normmax_budget", ("normmax_forward", "normmax_backward"))
register("budget", "reference", ".reference.normmax_budget", ("budget_forward", "budget_backward"))
register("fusedmax", "reference", ".reference.structured", "fusedmax")
register("fusedmax", "cpp", ".structured", "fusedmax_cpp", lambda request: _cpp_structured_supports(request))
register("oscarmax", "reference", ".reference.structured", "oscarmax")
register("oscarmax", "cpp", ".structured", "oscarmax_cpp", lambda request: _cpp_structured_supports(request))
register("attention", "reference", ".reference.attention", "entmax_attention")
register("attention", "triton", ".triton_kernels.attention", "entmax_attention_triton",
         _triton_attention_supports)
register("attention", "cpp", ".cpp_ops", "entmax_attention_cpp", _cpp_attention_supports)
register("attention_varlen", "reference", ".reference.attention", "entmax_attention_varlen")
register("attention_varlen", "triton", ".triton_kernels.attention", "entmax_attention_varlen",
         _triton_attention_supports)
