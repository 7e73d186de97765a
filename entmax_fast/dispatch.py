"""One registry that picks, per call, the backend of every op, and remembers why.

Backends (packages under ``entmax_fast/backends``, one contract, written down in
``entmax_fast/backends/__init__.py``):
- ``reference``: plain torch (``entmax_fast.reference``); always available.
- ``triton``: Triton kernels (``entmax_fast.triton_kernels``); default for CUDA tensors.
  On CPU tensors only when forced, which runs the Triton interpreter
  (``TRITON_INTERPRET=1`` must be set before triton is first imported).
- ``cpp``: the compiled extension ``entmax_fast._C``; default for CPU tensors when built.

An op's implementation is the pair ``(<op>_forward, <op>_backward)`` of the backend
module its ``OPS`` table names; the public layer wraps the pair in its autograd.Function.
This module imports no public module: the arrows point down, to the backends.

Forcing: the environment variable ``ENTMAX_FAST_BACKEND`` or the context manager
:func:`use_backend`. A forced backend that implements the op but cannot run this call
raises (a forced choice is never silently ignored); a forced backend that has no
implementation of the op at all leaves that op to the default order, and the recorded
reason says so.

:func:`last_choice` and ``entmax_fast.backend_info()`` tell which backend each op used
last in the calling thread and why; a CUDA call that does not get a fast backend also warns
once.

Choices are memoised: a small op's whole GPU kernel can take less time than a fresh choice
(backend questions, reasons in words), so a call like an earlier one reuses its choice; the
memo's key holds every input a choice reads (`_selection_key`).

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
from typing import Any, Optional

import torch

BACKENDS = ("reference", "triton", "cpp")
ENV_VAR = "ENTMAX_FAST_BACKEND"
# Read by the triton backend's runs_on on every choice; see backends/triton/__init__.py.
_TRITON_INTERPRET_VAR = "TRITON_INTERPRET"


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


class BackendUnavailableError(RuntimeError):
    pass


_BACKEND_MODULES = {"reference": ".backends.reference", "triton": ".backends.triton", "cpp": ".backends.cpp"}
_BACKEND_PACKAGES: dict[str, Any] = {}
_LOADED: dict[tuple[str, str], Any] = {}
_WARNED: set = set()
# Per thread: the forced backend and the last choice of every op (another thread's calls
# must not change what this thread is told).
_LOCAL = threading.local()
_AVAILABILITY: dict[str, tuple[bool, str]] = {}
# Loading a backend may register torch.library kernels, once per process; two threads
# doing it at the same time would register twice.
_LOAD_LOCK = threading.RLock()
# _selection_key -> (backend, Choice). Float options (entmax_bisect's α) can take endless
# values, so the memo is emptied when it grows past _SELECTIONS_MAX.
_SELECTIONS: dict[tuple, tuple[str, Choice]] = {}
_SELECTIONS_MAX = 1024


def _backend(name: str):
    """The backend's package: light to import (no triton, no extension). Kept here because
    every call of every op asks for it, several times."""
    package = _BACKEND_PACKAGES.get(name)
    if package is None:
        package = _BACKEND_PACKAGES[name] = importlib.import_module(_BACKEND_MODULES[name], package=__package__)
    return package


def _implementations(op: str) -> tuple[str, ...]:
    return tuple(name for name in BACKENDS if op in _backend(name).OPS)


def availability(backend: str) -> tuple[bool, str]:
    """(available, reason) for a backend on this machine; cached."""
    if backend not in _AVAILABILITY:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        with _LOAD_LOCK:
            if backend not in _AVAILABILITY:
                _AVAILABILITY[backend] = _backend(backend).available()
    return _AVAILABILITY[backend]


def _runs_on(backend: str, request: Request) -> Optional[str]:
    """None if ``backend`` can run tensors on the request's device here, else why not."""
    why_not = _backend(backend).runs_on(request.device)
    if why_not is not None:
        return why_not
    ok, why = availability(backend)
    return None if ok else why


def _refusal(backend: str, op: str, request: Request) -> Optional[str]:
    return _runs_on(backend, request) or _backend(backend).supports(op, request)


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
    default choice).

    Examples:
        >>> import torch, entmax_fast
        >>> with entmax_fast.use_backend("reference"):
        ...     p = entmax_fast.entmax15(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        >>> entmax_fast.backend_info()["last_choice"]["entmax"]["backend"]
        'reference'
    """
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
                package = _BACKEND_MODULES[backend]
                module = importlib.import_module(f"{package}.{_backend(backend).OPS[op]}", package=__package__)
                # A forward-only op (attention_kvcache) has no backward.
                _LOADED[(op, backend)] = (getattr(module, f"{op}_forward"), getattr(module, f"{op}_backward", None))
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
    """Pick the implementation of ``op`` for ``request``; returns ((forward, backward), choice).

    Under ``torch.compile`` the choice is made once, when the graph is traced, and kept as
    a constant of the compiled code (a backend forced later does not re-trace it).
    """
    if torch.compiler.is_compiling():
        options = tuple(sorted(request.options.items()))
        backend, reason = _choice_while_tracing(op, request.device.type, request.dtype, options)
        return _LOADED[(op, backend)], Choice(op, backend, reason)
    try:
        memo = _SELECTIONS.get(_selection_key(op, request))
    except TypeError:  # an unhashable option: choose afresh, as without the memo
        return _select(op, request)
    if memo is None:
        implementation, choice = _select(op, request)
        # Keyed after choosing: the first choice fills _AVAILABILITY, which the key holds.
        if len(_SELECTIONS) >= _SELECTIONS_MAX:
            _SELECTIONS.clear()
        _SELECTIONS[_selection_key(op, request)] = (choice.backend, choice)
        return implementation, choice
    backend, choice = memo
    # Read afresh: _LOADED is the one record of what a backend's module gave (tests replace
    # its entries, and a removed one is loaded again by choosing afresh).
    implementation = _LOADED.get((op, backend))
    if implementation is None:
        return _select(op, request)
    _last_choices()[op] = choice
    if request.device.type == "cuda" and backend == "reference" and op not in _WARNED:
        _warn_reference_on_cuda(op, choice.reason, stacklevel=3)
    return implementation, choice


def _selection_key(op: str, request: Request) -> tuple:
    """Everything `_select` reads that can differ between two calls: the call (op, device,
    dtype, options), the forcing (this thread's `use_backend`, the environment variable),
    what the backends answer (availability; the triton backend's runs_on reads
    TRITON_INTERPRET and torch.cuda.is_available, which is fixed in a process but replaced by
    tests) and the registry functions tests replace (`_backend`, `_default_order`)."""
    environ = os.environ
    return (op, request.device, request.dtype, tuple(request.options.items()), getattr(_LOCAL, "forced", None),
            environ.get(ENV_VAR), environ.get(_TRITON_INTERPRET_VAR), torch.cuda.is_available,
            tuple(_AVAILABILITY.items()), _backend, _default_order)


def _warn_reference_on_cuda(op: str, reason: str, stacklevel: int) -> None:
    _WARNED.add(op)
    warnings.warn(f"entmax_fast: {op} on CUDA runs the plain-torch reference: {reason}", stacklevel=stacklevel)


@_mark_constant_for_compile
def _choice_while_tracing(op: str, device_type: str, dtype: torch.dtype, options: tuple) -> tuple[str, str]:
    choice = _select(op, Request(torch.device(device_type), dtype, dict(options)))[1]
    return choice.backend, choice.reason


def _select(op: str, request: Request) -> tuple[Any, Choice]:
    impls = _implementations(op)
    if not impls:
        raise KeyError(f"no backend implements op {op!r}")
    forced, forced_by = _forcing()
    refusals = []
    if forced is not None:
        if forced in impls:
            why_not = _refusal(forced, op, request)
            if why_not is not None:
                raise BackendUnavailableError(
                    f"backend {forced!r} was forced for {op} but cannot run this call: {why_not}")
            try:
                implementation = _load(op, forced)
            except Exception as exc:  # noqa: BLE001
                raise BackendUnavailableError(
                    f"backend {forced!r} was forced for {op} but failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            choice = Choice(op, forced, f"{_backend(forced).describe(op, request)}; forced by {forced_by}")
            _last_choices()[op] = choice
            return implementation, choice
        refusals.append(f"forced {forced!r} has no {op} implementation ({forced_by})")
    for backend in _default_order(request.device):
        if backend not in impls:
            refusals.append(f"{backend}: no {op} implementation")
            continue
        why_not = _refusal(backend, op, request)
        if why_not is None:
            try:
                implementation = _load(op, backend)
            except Exception as exc:  # noqa: BLE001 - a broken optional backend must not break the op
                refusals.append(f"{backend}: failed to load ({type(exc).__name__}: {exc})")
                continue
            reason = _backend(backend).describe(op, request)
            if refusals:
                reason += ", because " + "; ".join(refusals)
            else:
                reason += f" (first choice for {request.device.type.upper()} tensors)"
            choice = Choice(op, backend, reason)
            _last_choices()[op] = choice
            if request.device.type == "cuda" and backend == "reference" and op not in _WARNED:
                _warn_reference_on_cuda(op, reason, stacklevel=4)
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
    for op in registered_ops():
        for candidate in _default_order(request.device):
            if op in _backend(candidate).OPS and _refusal(candidate, op, request) is None:
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
    """Every op and the backends that implement it."""
    ops = dict.fromkeys(op for name in BACKENDS for op in _backend(name).OPS)
    return {op: _implementations(op) for op in ops}
