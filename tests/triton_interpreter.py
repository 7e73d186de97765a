"""Three parts of the Triton interpreter done with less Python, for the same values.

**Reductions by slices.** The interpreter's reduction with a combine function of the kernel's
own calls that function once per slice along the axis instead of once per element.

The interpreter of triton 3.9 reduces with a combine function it does not know (the NaN-keeping
row maximum of attention_fwd, `_max_nan`) element by element: a Python call of the function and
two scalar tensors per element, 4,096 calls for a 64 x 64 tile. On the interpreted attention
tests that loop took two thirds of the time (cProfile of
test_fp32_forward_and_backward[L257-E16-perhead-causal]: 25 of 37 s in the forward). A combine
function is elementwise, so calling it on whole slices, in the order the interpreter takes the
elements (index 0, 1, 2, ... along the axis), and rounding the running value to the input's
dtype after each call as the interpreter does, gives the interpreter's values.
tests/test_triton_interpreter.py compares the two on NaN, signed zeros and an order-sensitive
combine function.

**The language patched once per launch.** The interpreter swaps triton.language's builtins
for its own when a kernel launches, and again on every call of a `@triton.jit` helper inside
it: a scan of the language modules' members, 0.3 ms a call. The kernels call many small
helpers per tile, so that on test_dq_in_the_dkdv_kernel_varlen_and_dropout those scans took
26 of 63 s (cProfile). The launch's patch is in place until the launch ends, and a helper's
scan of the modules the launch patched finds nothing left to swap, so a helper whose language
modules the running launch patched skips it.

**No overflow check whose assertion is off.** Every integer add, subtract and multiply of
the interpreter recomputes itself in int64 and compares the result with the type's range
(`binary_op_sanitize_overflow_impl`, eight interpreted operations), then hands the comparison
to `device_assert`, which returns without looking at it unless the builder's `debug` option is
set (triton 3.9: never in the interpreter). A third of the interpreter's time on
test_few_capture_slots_stay_exact went there (cProfile: 14 of 44 s). The interpreter's
semantic object skips the computation when the assertion it feeds is off.

`install()` replaces each part only on the triton releases it was checked against
(`VERIFIED_TRITON`: the suite's interpreter tests passed there with it), and there only where
the interpreter has the shape this was written against. On any other triton it changes
nothing: the tests are then slower, never different.
"""
import functools
import inspect
import threading

import numpy as np


def _running_value(result, dtype, shape):
    """A combine function's result (a tensor or a constant) as an array of `shape` in `dtype`."""
    import triton.language as tl

    value = np.asarray(result.handle.data if isinstance(result, tl.core.tensor) else result, dtype=dtype)
    if value.size == int(np.prod(shape)):
        value = value.reshape(shape)
    return np.broadcast_to(value, shape).copy()


def _reduce_by_slices(self, input):
    """ReduceOps.generic_reduce with the combine function called on slices."""
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    data = [arg.handle.data for arg in input]
    shape = data[0].shape
    output_shape = shape[:axis] + shape[axis + 1:]
    running = [np.take(d, 0, axis=axis) for d in data]
    for index in range(1, shape[axis]):
        acc = tuple(self.to_tensor(r, arg.dtype) for r, arg in zip(running, input))
        item = tuple(self.to_tensor(np.take(d, index, axis=axis), arg.dtype) for d, arg in zip(data, input))
        result = self.combine_fn.fn(*acc, *item)
        result = result if isinstance(result, tuple) else (result, )
        running = [_running_value(r, d.dtype, output_shape) for r, d in zip(result, data)]
    ret = []
    for value, arg in zip(running, input):
        if self.keep_dims:
            if original_axis is not None:
                value = np.expand_dims(value, axis)
            else:
                value = value.reshape((1, ) * len(shape))
        elif original_axis is None:
            value = value.item()
        ret.append(self.to_tensor(value, arg.dtype))
    return ret


# `modules`: inside a launch, the language modules patched so far in it (empty until the
# launch's own patch); outside one, None.
_launch = threading.local()


@functools.lru_cache(maxsize=None)
def _language_modules(fn):
    """The triton.language modules `fn` sees, as the interpreter's `_patch_lang` finds them (a
    module's names are bound when it is imported)."""
    import triton.language as tl

    return frozenset(value for value in fn.__globals__.values()
                     if inspect.ismodule(value) and value in (tl, tl.core))


def _patch_lang_once(patch_lang, fn):
    """`_patch_lang`, skipped for a helper whose modules the running launch patched."""
    from triton.runtime import interpreter

    modules = _language_modules(fn)
    patched = getattr(_launch, "modules", None)
    if patched is None:
        return patch_lang(fn)
    if modules and modules <= patched:
        return interpreter._LangPatchScope()
    scope = patch_lang(fn)
    _launch.modules = patched | modules
    return scope


def _launch_call(call, self, *args, **kwargs):
    """GridExecutor.__call__, recording the modules its own `_patch_lang` patches."""
    outer = getattr(_launch, "modules", None)
    _launch.modules = frozenset()
    try:
        return call(self, *args, **kwargs)
    finally:
        _launch.modules = outer


def _sanitize_overflow_when_asserted(sanitize, self, lhs, rhs, binary_op):
    """`binary_op_sanitize_overflow_impl` where its `device_assert` would look at the result."""
    if self.builder.options.debug:
        return sanitize(lhs, rhs, binary_op)
    return None


VERIFIED_TRITON = frozenset({"3.8.0", "3.9.0"})


def install(triton_version=None):
    """Installs each part where the interpreter has what it replaces, on a triton in
    `VERIFIED_TRITON` (`triton_version`: the installed one when None); returns the names of
    those installed."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return ()
    if (triton_version or triton.__version__) not in VERIFIED_TRITON:
        return ()
    installed = []
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    if reduce_ops is not None and all(hasattr(reduce_ops, name) for name in
                                      ("generic_reduce", "unravel", "to_tensor", "apply_impl")):
        reduce_ops.element_by_element_reduce = reduce_ops.generic_reduce
        reduce_ops.generic_reduce = _reduce_by_slices
        installed.append("reduce_by_slices")
    executor = getattr(interpreter, "GridExecutor", None)
    if all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope")) and executor is not None:
        launch = executor.__call__
        interpreter._patch_lang = functools.partial(_patch_lang_once, interpreter._patch_lang)
        executor.__call__ = lambda self, *args, **kwargs: _launch_call(launch, self, *args, **kwargs)
        installed.append("patch_lang_once")
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if hasattr(semantic, "binary_op_sanitize_overflow_impl") and hasattr(semantic, "builder"):
        semantic.binary_op_sanitize_overflow_impl = functools.partial(
            _sanitize_overflow_when_asserted, semantic.binary_op_sanitize_overflow_impl, semantic)
        installed.append("sanitize_overflow_when_asserted")
    return tuple(installed)
