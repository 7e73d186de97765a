"""The Triton backend: launchers and torch.library custom ops over the kernels of
``entmax_fast.triton_kernels``, for CUDA tensors (and CPU tensors in the Triton interpreter).

Light, as the backend contract asks (entmax_fast/backends/__init__.py): importing this
package imports neither triton nor a kernel; `available` imports triton on its first call,
and the submodules named in OPS (which import the kernels) are loaded by dispatch when an
op is first run here.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ...triton_kernels.aot import interpreting
# Imports torch only: the dtypes the kernels take, not the kernels.
from ...triton_kernels.signature import DTYPE_KEYS
from .. import unimplemented_score_options

# The score options (backends.SCORE_OPTIONS) the kernels implement.
SCORE_OPTIONS_IMPLEMENTED = frozenset({"window", "lower_right_causal", "softcap", "alibi_slopes",
                                       "sinks"})
# The decoding kernels (triton_kernels/kvcache_decode.py) implement every score option.
KVCACHE_SCORE_OPTIONS_IMPLEMENTED = frozenset({"window", "lower_right_causal", "softcap", "alibi_slopes", "sinks"})
OPS = {"entmax": "rowwise", "attention": "attention", "attention_varlen": "attention",
       "attention_kvcache": "kvcache", "attention_support": "attention"}

def available() -> tuple[bool, str]:
    """(available, reason): triton importable, and a CUDA device or the interpreter."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} with CUDA device {torch.cuda.get_device_name()}"
    if interpreting():
        return True, (f"triton {triton.__version__}, no CUDA device: interpreter only "
                      "(TRITON_INTERPRET=1; CPU tensors, when forced; slow, for testing)")
    return False, (f"triton {triton.__version__} is importable, but there is no CUDA device, and the "
                   "interpreter needs TRITON_INTERPRET=1 set before triton is imported")


def runs_on(device: torch.device) -> Optional[str]:
    """None if the kernels can run tensors on ``device`` here, else why not (whether triton is
    available at all is ``available``'s to say)."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return (f"triton cannot run {device.type} tensors here (only CUDA tensors, or CPU "
                "tensors in the interpreter: TRITON_INTERPRET=1 set before triton is imported)")
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    return None


# The fused attention kernels use tensor-core bf16 and tf32 products and packed fp32 -> fp16
# conversions (`triton_kernels.support.positive_f16`): compute capability 8.0 (Ampere) on.
ATTENTION_MIN_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=None)
def _capability_at(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    # The index is resolved before the cache: the current device may change between calls.
    return _capability_at(torch.cuda.current_device() if device.index is None else device.index)


def _capability_refusal(device: torch.device, what: str) -> Optional[str]:
    """None where ``what`` (kernels with tensor-core products) can run on ``device``."""
    if device.type == "cuda":
        capability = _capability(device)
        if capability < ATTENTION_MIN_CAPABILITY:
            return (f"{what} need a GPU of compute capability "
                    f"{'.'.join(map(str, ATTENTION_MIN_CAPABILITY))} or newer, got "
                    f"{'.'.join(map(str, capability))}")
    return None


def supports(op: str, request) -> Optional[str]:
    """None if the kernels can run this call of ``op``, else why not."""
    if op == "entmax":
        if request.dtype not in DTYPE_KEYS:
            return f"triton row-wise kernels take float32/float16/bfloat16, got {request.dtype}"
        return None
    # attention_support runs the attention forward: the same calls are refused
    if op in ("attention", "attention_varlen", "attention_support"):
        if request.dtype not in DTYPE_KEYS:
            return f"the fused kernels take float32/float16/bfloat16, got {request.dtype}"
        if request.options.get("head_dim", 0) > 256:
            return f"head dims above 256 are not supported by the fused kernels, got {request.options['head_dim']}"
        if request.options.get("mask_requires_grad"):
            return "the Triton kernels do not differentiate a float attn_mask"
        unimplemented = unimplemented_score_options(request, "the fused attention", SCORE_OPTIONS_IMPLEMENTED)
        if unimplemented is not None:
            return unimplemented
        return _capability_refusal(request.device, "the fused attention kernels")
    if op == "attention_kvcache":
        if request.dtype not in DTYPE_KEYS:
            return f"the decoding kernels take float32/float16/bfloat16, got {request.dtype}"
        if request.options.get("head_dim", 0) > 256:
            return f"head dims above 256 are not supported by the decoding kernels, got {request.options['head_dim']}"
        unimplemented = unimplemented_score_options(request, "the Triton decoding attention",
                                                    KVCACHE_SCORE_OPTIONS_IMPLEMENTED)
        if unimplemented is not None:
            return unimplemented
        return _capability_refusal(request.device, "the decoding kernels")
    return f"the Triton backend has no {op}"


def describe(op: str, request) -> str:
    """What runs the call, in a user's words."""
    where = "CUDA tensor" if request.device.type == "cuda" else "CPU tensor in the Triton interpreter"
    # The fused attention kernels run alpha 1.5 and 2 in closed form, any other alpha (>= 1)
    # per head: softmax at 1, a bracketing threshold search above 2.
    alpha = request.options.get("alpha") if op.startswith("attention") else None
    if isinstance(alpha, float):
        where += f", alpha = {alpha:g}" + (" in (1, 2]" if 1.0 < alpha <= 2.0 else " (per-head kernels)")
    elif alpha is not None:
        where += ", alpha per head"
    return f"triton: {where}"
