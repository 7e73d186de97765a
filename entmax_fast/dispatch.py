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
last in the calling thread and why; a CUDA call that does not get a fast backend also warns
once.

Importing this module imports neither triton nor ``torch._dynamo`` (together seconds of
start-up): triton is imported when a backend's availability is first asked for, dynamo only
by ``torch.compile`` itself.
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
_LOADED: dict[tuple[str, str], Any] = {}
_WARNED: set = set()
# Per thread: the forced backend and the last choice of every op (another thread's calls
# must not change what this thread is told).
_LOCAL = threading.local()
_AVAILABILITY: dict[str, tuple[bool, str]] = {}
# Loading a backend registers torch.library kernels once per process; two threads doing it
# at the same time register twice ("Overriding a previously registered kernel").
_LOAD_LOCK = threading.RLock()


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
        return True, (f"triton {triton.__version__}, no CUDA device: interpreter only "
                      "(TRITON_INTERPRET=1; CPU tensors, when forced; slow, for testing)")
    return False, (f"triton {triton.__version__} is importable, but there is no CUDA device, and the "
                   "interpreter needs TRITON_INTERPRET=1 set before triton is imported")


def _cpp_availability() -> tuple[bool, str]:
    from . import _ext

    return _ext.status()


def availability(backend: str) -> tuple[bool, str]:
    """(available, reason) for a backend on this machine; cached."""
    if backend not in _AVAILABILITY:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        with _LOAD_LOCK:
            if backend not in _AVAILABILITY:
                if backend == "reference":
                    _AVAILABILITY[backend] = (True, "plain torch, always available")
                elif backend == "triton":
                    _AVAILABILITY[backend] = _triton_availability()
                else:
                    _AVAILABILITY[backend] = _cpp_availability()
    return _AVAILABILITY[backend]


def _runs_on(backend: str, request: Request) -> Optional[str]:
    """None if ``backend`` can run on the request's device, else why not."""
    if backend == "triton" and request.device.type != "cuda" and not (
            request.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return (f"triton cannot run {request.device.type} tensors here (only CUDA tensors, or CPU "
                "tensors in the interpreter: TRITON_INTERPRET=1 set before triton is imported)")
    ok, why = availability(backend)
    if not ok:
        return why
    if backend == "triton" and request.device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if backend == "cpp" and request.device.type not in ("cpu", "cuda"):
        return f"the extension has no {request.device.type} kernels"
    return None


def forced_backend() -> Optional[str]:
    return _forcing()[0]


def _forcing() -> tuple[Optional[str], str]:
    """(forced backend or None, how it was forced)."""
    forced = getattr(_LOCAL, "forced", None)
    if forced is not None:
        return forced, f"use_backend({forced!r})"
    forced = os.environ.get(ENV_VAR) or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {forced!r}")
    return forced, f"{ENV_VAR}={forced}"


@contextlib.contextmanager
def use_backend(backend: Optional[str]):
    """Force ``backend`` for every op called inside the block, in this thread (None:
    default choice)."""
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
        with _LOAD_LOCK:
            if (op, backend) not in _LOADED:
                impl = _REGISTRY[op][backend]
                module = importlib.import_module(impl.module, package=__package__)
                objs = tuple(getattr(module, name) for name in impl.attrs)
                _LOADED[(op, backend)] = objs if len(objs) > 1 else objs[0]
    return _LOADED[(op, backend)]


def _last_choices() -> dict[str, Choice]:
    last = getattr(_LOCAL, "last", None)
    if last is None:
        last = _LOCAL.last = {}
    return last


def _mark_constant_for_compile(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (about
    2.5 s) at import time: that decorator only sets this attribute, which dynamo reads when
    it traces a call (tests/test_import.py checks the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


def select(op: str, request: Request) -> tuple[Any, Choice]:
    """Pick the implementation of ``op`` for ``request``; returns (implementation, choice).

    Under ``torch.compile`` the choice is made once, when the graph is traced, and kept as
    a constant of the compiled code (a backend forced later does not re-trace it).
    """
    if torch.compiler.is_compiling():
        options = tuple(sorted(request.options.items()))
        backend, reason = _choice_while_tracing(op, request.device.type, request.dtype, options)
        return _LOADED[(op, backend)], Choice(op, backend, reason)
    return _select(op, request)


@_mark_constant_for_compile
def _choice_while_tracing(op: str, device_type: str, dtype: torch.dtype, options: tuple) -> tuple[str, str]:
    choice = _select(op, Request(torch.device(device_type), dtype, dict(options)))[1]
    return choice.backend, choice.reason


def _describe(backend: str, request: Request, op: str) -> str:
    """What runs the call, in a user's words: "cpp: C++ extension, avx2-fma kernels"."""
    if backend == "cpp":
        if request.device.type == "cpu":
            from . import _ext

            return f"cpp: C++ extension, {_ext.cpu_kernel_set()} CPU kernels"
        return f"cpp: C++ extension, {request.device.type.upper()} kernels"
    if backend == "triton":
        where = "CUDA tensor" if request.device.type == "cuda" else "CPU tensor in the Triton interpreter"
        # The fused attention kernels take only 1 < alpha <= 2; the row-wise ones any alpha.
        alpha = request.options.get("alpha") if op.startswith("attention") else None
        if isinstance(alpha, float):
            where += f", alpha = {alpha:g} in (1, 2]"
        elif alpha is not None:
            where += ", alpha per head"
        return f"triton: {where}"
    return "reference: plain torch"


def _select(op: str, request: Request) -> tuple[Any, Choice]:
    impls = _REGISTRY.get(op)
    if not impls:
        raise KeyError(f"no backend registered for op {op!r}")
    forced, forced_by = _forcing()
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
            choice = Choice(op, forced, f"{_describe(forced, request, op)}; forced by {forced_by}")
            _last_choices()[op] = choice
            return implementation, choice
        refusals.append(f"forced {forced!r} has no {op} implementation ({forced_by})")
    for backend in _default_order(request.device):
        if backend not in impls:
            refusals.append(f"{backend}: no {op} implementation")
            continue
        why_not = _runs_on(backend, request) or impls[backend].supports(request)
        if why_not is None:
            try:
                implementation = _load(op, backend)
            except Exception as exc:  # noqa: BLE001 - a broken optional backend must not break the op
                refusals.append(f"{backend}: failed to load ({type(exc).__name__}: {exc})")
                continue
            reason = _describe(backend, request, op)
            if refusals:
                reason += ", because " + "; ".join(refusals)
            else:
                reason += f" (first choice for {request.device.type.upper()} tensors)"
            choice = Choice(op, backend, reason)
            _last_choices()[op] = choice
            if request.device.type == "cuda" and backend == "reference" and op not in _WARNED:
                _WARNED.add(op)
                warnings.warn(f"entmax_fast: {op} on CUDA runs the plain-torch reference: {reason}",
                              stacklevel=3)
            return implementation, choice
        refusals.append(f"{backend}: {why_not}")
    raise BackendUnavailableError(f"no backend can run {op}: " + "; ".join(refusals))


def last_choice(op: str) -> Optional[Choice]:
    """The backend the last call of ``op`` in this thread used, and why (None before this
    thread's first call)."""
    return _last_choices().get(op)


def device_usage(backend: str, device_type: str) -> str:
    """Whether ``backend`` will be used for float32 tensors on ``device_type`` here, in words:
    "no: ...", "yes: first choice for ...", or "only when forced ..."."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return "no: no CUDA device here"
    request = Request(torch.device(device_type), torch.float32, {})
    why_not = _runs_on(backend, request)
    if why_not is not None:
        return f"no: {why_not}"
    first_for = []
    for op, impls in _REGISTRY.items():
        for candidate in _default_order(request.device):
            if candidate in impls and _runs_on(candidate, request) is None and impls[candidate].supports(request) is None:
                if candidate == backend:
                    first_for.append(op)
                break
    if backend == "reference":
        fallback = "the fallback for calls the other backends refuse (dropout, for example)"
        return f"yes: first choice for {', '.join(first_for)}; {fallback}" if first_for else f"yes: {fallback}"
    if first_for:
        return f"yes: first choice for {', '.join(first_for)}"
    if backend == "triton":
        return "only when forced, in the Triton interpreter (slow: for testing kernels)"
    return "only when forced"


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
