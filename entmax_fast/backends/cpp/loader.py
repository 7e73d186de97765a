"""Loads the compiled extension, building it on first use where none was built with the
package; says why if neither works; registers the fake (meta) kernels of its operators, so
that torch.compile can trace them.

Where the operators come from, first that works: ``entmax_fast._C`` built with the package
(``setup.py build_ext --inplace`` or an install that could see torch), else the library
``build`` compiles once per torch version into the user's cache. A missing extension is never
silent: the reason is what ``backend_info()`` reports for the ``cpp`` backend, and the first
op that asks warns once with it and the command that fixes it.

Registration happens here, at load time, because torch.library registration cannot
happen inside a torch.compile trace. The operators get no autograd: the public layer's
autograd.Function calls their forward and backward (entmax_fast/backends/__init__.py).
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import threading
import warnings

import torch

from ...common import compute_dtype
from . import build

_ENTMAX_OPS = ("entmax_rowwise_fwd", "entmax_rowwise_bwd", "entmax_attention_fwd", "entmax_attention_bwd")
_KVCACHE_OP = "entmax_attention_kvcache_fwd"
_SUPPORT_OP = "entmax_attention_support"
_STRUCTURED_OPS = ("fusedmax_forward", "fusedmax_backward", "oscarmax_forward", "oscarmax_backward")
_CHAIN_OPS = ("crf_forward", "crf_backward", "sparsemap_forward", "sparsemap_backward")
# Frames in these folders are skipped when the warning looks for the user's call.
_INTERNAL_DIRS = (str(pathlib.Path(__file__).resolve().parents[2]), str(pathlib.Path(torch.__file__).resolve().parent))

# Held while loading: two threads registering fake kernels at once would register twice
# (torch warns "Overriding a previously registered kernel").
_LOCK = threading.Lock()
# (loaded, reason), filled once. Plain module state, so that torch.compile reads it as a
# constant instead of tracing the loading.
_STATUS: tuple[bool, str] | None = None
# Device types with a kernel, per group of operators (read once: every call asks).
_OPS_DEVICES: dict = {}


def status() -> tuple[bool, str]:
    """(loaded, reason). The first call loads or builds the extension; if that fails, it warns."""
    global _STATUS
    if _STATUS is None:
        with _LOCK:
            if _STATUS is None:
                _STATUS = _load()
                if not _STATUS[0]:
                    warnings.warn(f"entmax_fast: CPU ops run on the plain-torch reference (tens of times slower "
                                  f"than the C++ backend): {_STATUS[1]}", stacklevel=_caller_stacklevel())
    return _STATUS


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside the package and torch (an op's
    autograd.Function.apply), so that the warning points at the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _load() -> tuple[bool, str]:
    origin, why_not_packaged = _import_packaged()
    cuda_absent = None
    if origin is None:
        try:
            library, cuda_absent = build.obtain()
        except build.BuildError as exc:
            return False, f"the C++ extension is unavailable: {why_not_packaged}, and {exc}"
        except OSError as exc:
            return False, (f"the C++ extension is unavailable: {why_not_packaged}, and the one built on first use "
                           f"failed to load ({exc}); rebuild it: {build.BUILD_COMMAND}")
        origin = f"built on first use, as {why_not_packaged}: {library}"
    _register_fakes()
    # The row-wise kernels' instruction set: "portable" (scalar std:: maths) is the slower
    # fallback on CPUs without AVX2+FMA, and "avx2-fma" slower than "avx512" for α outside
    # {1, 1.5, 2}: worth knowing when timing.
    kernels = f"CPU kernels: {cpu_kernel_set()}" if _has("cpu_kernel_isa") else "no CPU entmax kernels"
    return True, f"entmax_fast._C loaded ({origin}; {kernels}; {_cuda_operators(cuda_absent)})"


def _import_packaged() -> tuple[str | None, str]:
    """(where the extension built with the package was loaded from, "") or (None, why not)."""
    if importlib.util.find_spec(f"{__package__.split('.')[0]}._C") is None:
        # pip's default build isolation hides torch from setup.py, which then builds none.
        return None, "none was built with the package"
    try:
        from ... import _C  # importing it registers the torch.ops.entmax_fast operators
    except (ImportError, OSError) as exc:
        return None, f"entmax_fast._C, built with the package, does not load with torch {torch.__version__} ({exc})"
    return f"built by setup.py: {_C.__file__}", ""


def _cuda_operators(cuda_absent: str | None) -> str:
    """The CUDA fusedmax/oscarmax operators, present or why not."""
    if _has("fusedmax_forward") and torch._C._dispatch_has_kernel_for_dispatch_key("entmax_fast::fusedmax_forward",
                                                                                   "CUDA"):
        return "CUDA operators: fusedmax, oscarmax, crf, sparsemap"
    if cuda_absent is None:
        cuda_absent = build.cuda_toolkit()[1] or "the extension was built without nvcc"
    return f"no CUDA operators: {cuda_absent}"


def _has(name: str) -> bool:
    return hasattr(torch.ops.entmax_fast, name)


def has_entmax_ops() -> bool:
    return status()[0] and all(_has(name) for name in _ENTMAX_OPS)


def has_kvcache_op() -> bool:
    """Whether the extension has the decoding operator (an extension built from an older
    checkout has the other entmax ops without it)."""
    return has_entmax_ops() and _has(_KVCACHE_OP)


def has_support_op() -> bool:
    """Whether the extension has the attention support-size operator (an extension built
    from an older checkout has the other entmax ops without it)."""
    return has_entmax_ops() and _has(_SUPPORT_OP)


def _devices_with(ops: tuple) -> frozenset:
    """Device types with a kernel for every op of ``ops`` ("cpu", and "cuda" where built;
    none in an extension built before they existed), read once per group."""
    if ops not in _OPS_DEVICES:
        if status()[0] and all(_has(name) for name in ops):
            _OPS_DEVICES[ops] = frozenset(
                device for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
                if torch._C._dispatch_has_kernel_for_dispatch_key(f"entmax_fast::{ops[0]}", key))
        else:
            _OPS_DEVICES[ops] = frozenset()
    return _OPS_DEVICES[ops]


def structured_devices() -> frozenset:
    """Device types with a fusedmax/oscarmax kernel ("cpu", and "cuda" where built)."""
    return _devices_with(_STRUCTURED_OPS)


def chain_devices() -> frozenset:
    """Device types with the crf/sparsemap operators ("cpu", and "cuda" where built)."""
    return _devices_with(_CHAIN_OPS)


def cpu_kernel_set() -> str:
    """The C++ CPU kernels in use: "avx512" (the General kind's passes on CPUs with AVX-512,
    the other kernels then run their AVX2 version), "avx2-fma", or "portable" (CPUs without
    AVX2+FMA); a lower set can be forced with ``torch.ops.entmax_fast.cpu_kernel_isa("avx2-fma")``
    or ``("portable")``, and ``("auto")`` restores the best."""
    return torch.ops.entmax_fast.cpu_kernel_isa()


def _register_fakes() -> None:
    def rowwise_fwd(x, alpha):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def rowwise_bwd(p, grad, alpha, need_alpha_grad):
        dalpha = p.new_empty((p.shape[0],), dtype=alpha.dtype) if need_alpha_grad else p.new_empty((0,))
        return torch.empty_like(p, memory_format=torch.contiguous_format), dalpha

    def attention_fwd(query, key, value, attn_mask, alpha, scale, is_causal, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, sinks=None, support_capacity=0):
        batch, heads, lq, _ = query.shape
        return (query.new_empty((batch, heads, lq, value.shape[-1])),
                query.new_empty((batch, heads, lq, 2), dtype=torch.float64),
                query.new_empty((batch, heads, lq, support_capacity), dtype=torch.int16),
                query.new_empty((batch, heads, lq, support_capacity), dtype=compute_dtype(query.dtype)),
                query.new_empty((batch, heads, lq if support_capacity > 0 else 0), dtype=torch.int32))

    def attention_bwd(grad_out, query, key, value, attn_mask, stats, alpha, scale, is_causal, need_alpha_grad,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, need_sinks_grad=False,
                      support_columns=None, support_scores=None, support_ends=None):
        return (torch.empty_like(query, memory_format=torch.contiguous_format),
                torch.empty_like(key, memory_format=torch.contiguous_format),
                torch.empty_like(value, memory_format=torch.contiguous_format),
                query.new_empty((query.shape[1] if need_alpha_grad else 0,), dtype=torch.float64),
                query.new_empty((query.shape[1] if need_sinks_grad and sinks is not None else 0,),
                                dtype=torch.float64))

    def attention_kvcache_fwd(query, k_cache, v_cache, seqlens_k, block_table, alpha, scale, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, sinks=None):
        batch, heads, lq, _ = query.shape
        return query.new_empty((batch, heads, lq, v_cache.shape[-1]))

    def attention_support(query, key, attn_mask, stats, alpha, scale, is_causal, window_size=(-1, -1), softcap=0.0,
                          alibi_slopes=None, sinks=None):
        return query.new_empty(query.shape[:3], dtype=torch.int64)

    def structured_fwd(x, reg, lengths=None):
        return torch.empty_like(x), torch.empty_like(x)

    def structured_bwd(grad, p, y, reg):
        return torch.empty_like(p)

    def chain_fwd(x, transitions):
        return torch.empty_like(x), x.new_empty(tuple(x.shape), dtype=torch.float64)

    def crf_fwd(x, transitions):
        return torch.empty_like(x), x.new_empty((0,))

    def chain_bwd(grad, x, transitions, mu, saved):
        return torch.empty_like(x), torch.empty_like(transitions)

    fakes = {"entmax_rowwise_fwd": rowwise_fwd, "entmax_rowwise_bwd": rowwise_bwd,
             "entmax_attention_fwd": attention_fwd, "entmax_attention_bwd": attention_bwd,
             _KVCACHE_OP: attention_kvcache_fwd, _SUPPORT_OP: attention_support,
             "fusedmax_forward": structured_fwd, "oscarmax_forward": structured_fwd,
             "fusedmax_backward": structured_bwd, "oscarmax_backward": structured_bwd,
             "crf_forward": crf_fwd, "sparsemap_forward": chain_fwd, "crf_backward": chain_bwd,
             "sparsemap_backward": chain_bwd}
    for name, fake in fakes.items():
        if _has(name):
            torch.library.register_fake(f"entmax_fast::{name}")(fake)
