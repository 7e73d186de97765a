"""The C++ backend: the operators of the compiled extension ``entmax_fast._C`` (csrc/).

CPU kernels for row-wise entmax, entmax attention (and its decoding form against a key/value
cache), fusedmax, oscarmax and the chain marginals (crf, sparsemap); CUDA kernels for
fusedmax, oscarmax, crf and sparsemap where the extension was built with CUDA. ``loader`` is the one place
that loads the extension; nothing is loaded until availability is first asked for.
"""
from __future__ import annotations

import torch

from .. import unimplemented_score_options

# The score options (backends.SCORE_OPTIONS) the kernels implement: all of them, in the CPU
# attention operator (csrc/cpu/entmax_attention.cpp), where a lower-right causal mask reaches
# it as the window's right bound 0, and in the decoding operator (csrc/cpu/entmax_kvcache.cpp),
# which is lower-right causal by definition.
SCORE_OPTIONS_IMPLEMENTED = frozenset({"window", "lower_right_causal", "softcap", "alibi_slopes", "sinks"})
OPS = {"entmax": "ops", "attention": "ops", "attention_kvcache": "ops", "attention_support": "ops", "fusedmax": "ops",
       "oscarmax": "ops", "crf": "ops", "sparsemap": "ops"}
_FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def available() -> tuple[bool, str]:
    from . import loader

    return loader.status()


def runs_on(device) -> str | None:
    if device.type not in ("cpu", "cuda"):
        return f"the extension has no {device.type} kernels"
    return None


def supports(op: str, request) -> str | None:
    from . import loader

    if op in ("fusedmax", "oscarmax"):
        if request.device.type not in loader.structured_devices():
            return f"entmax_fast._C has no structured kernel for device {request.device.type!r}"
        return None
    if op in ("crf", "sparsemap"):
        if request.device.type not in loader.chain_devices():
            return f"entmax_fast._C has no chain ({op}) kernel for device {request.device.type!r}"
        return None
    if request.dtype not in _FLOAT_TYPES:
        return f"unsupported dtype {request.dtype}"
    if request.device.type != "cpu":
        return "the C++ entmax ops are CPU-only"
    if not loader.has_entmax_ops():
        return "entmax_fast._C is loaded but has no CPU entmax ops (built without csrc/cpu/)"
    if op == "attention" and request.options.get("dropout_p", 0.0) > 0:
        return "the C++ attention has no dropout"
    if op == "attention" and request.options.get("mask_requires_grad"):
        return "the C++ attention gives no gradient to a float attn_mask"
    if op == "attention":
        return unimplemented_score_options(request, "the C++ attention", SCORE_OPTIONS_IMPLEMENTED)
    if op == "attention_kvcache":
        if not loader.has_kvcache_op():
            return ("entmax_fast._C has no decoding operator (built before csrc/cpu/entmax_kvcache.cpp existed); "
                    "rebuild it: pip install --no-build-isolation -e .")
        return unimplemented_score_options(request, "the C++ decoding attention", SCORE_OPTIONS_IMPLEMENTED)
    if op == "attention_support":
        if not loader.has_support_op():
            return ("entmax_fast._C has no attention support-size operator (built before it existed); "
                    "rebuild it: pip install --no-build-isolation -e .")
        return unimplemented_score_options(request, "the C++ attention", SCORE_OPTIONS_IMPLEMENTED)
    return None


def describe(op: str, request) -> str:
    if request.device.type == "cpu":
        from . import loader

        return f"cpp: C++ extension, {loader.cpu_kernel_set()} CPU kernels"
    return f"cpp: C++ extension, {request.device.type.upper()} kernels"
