"""AOT signatures of the @triton.jit kernels, written from the kernels' own parameter lists.

``triton.compile`` needs the type of every parameter. The kernel's parameter list already
names them and marks the constexprs, so a signature is that list plus the parameters that
are not i32: the pointers (a table per kernel family, in which ``TENSOR`` stands for the
dtype of the tensors a launch passes) and the fp32 scalars. A parameter added to a kernel
enters its signature without a second list to keep in step.
"""
import inspect

import torch

# The dtypes the launchers accept, by the key the tile tables and AOT configs use.
DTYPE_KEYS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
TENSOR = "TENSOR"


def pointer_type(dtype_key: str) -> str:
    return f"*{dtype_key}"


def _parameters(fn):
    """(name, is_constexpr) of a @triton.jit function's parameters, read from the Python
    function itself: the interpreter's functions (TRITON_INTERPRET=1) have no ``params``.
    An annotation is a ``tl.constexpr`` or, under ``from __future__ import annotations``,
    the string naming it."""
    return [(name, "constexpr" in str(param.annotation))
            for name, param in inspect.signature(fn.fn).parameters.items()]


def kernel_signature(fn, dtype_key: str, pointers: dict, floats=()) -> dict:
    """{parameter: type} of a @triton.jit kernel, in its parameter order: constexpr
    parameters as such, ``pointers`` (name -> type, ``TENSOR`` for the tensors' dtype
    ``dtype_key``), ``floats`` fp32, every other parameter (sizes, strides, flags) i32,
    which is what the JIT picks for values below 2**31."""
    signature = {}
    for name, is_constexpr in _parameters(fn):
        if is_constexpr:
            signature[name] = "constexpr"
        elif name in pointers:
            kind = pointers[name]
            signature[name] = pointer_type(dtype_key) if kind == TENSOR else kind
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return signature
