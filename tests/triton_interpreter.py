"""The Triton interpreter's reduction with a combine function of the kernel's own, one call of
that function per slice along the axis instead of one per element.

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

`install()` replaces the method when the interpreter has the shape this was written against,
and leaves it alone otherwise (the tests are then slower, not different).
"""
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
    running = [np.take(d, 0, axis=axis).astype(d.dtype) for d in data]
    for index in range(1, shape[axis]):
        acc = tuple(self.to_tensor(r, arg.dtype) for r, arg in zip(running, input))
        item = tuple(self.to_tensor(np.take(d, index, axis=axis), arg.dtype) for d, arg in zip(data, input))
        result = self.combine_fn.fn(*acc, *item)
        result = result if isinstance(result, tuple) else (result, )
        running = [_running_value(r, d.dtype, output_shape) for r, d in zip(result, data)]
    ret = []
    for value, arg in zip(running, input):
        value = np.asarray(value, dtype=arg.handle.data.dtype)
        if self.keep_dims:
            if original_axis is not None:
                value = np.expand_dims(value, axis)
            else:
                value = value.reshape((1, ) * len(shape))
        elif original_axis is None:
            value = value.item()
        ret.append(self.to_tensor(value, arg.dtype))
    return ret


def install():
    """Use `_reduce_by_slices` as the interpreter's generic reduction; returns whether it did."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    needed = ("generic_reduce", "unravel", "to_tensor", "apply_impl")
    if reduce_ops is None or not all(hasattr(reduce_ops, name) for name in needed):
        return False
    reduce_ops.element_by_element_reduce = reduce_ops.generic_reduce
    reduce_ops.generic_reduce = _reduce_by_slices
    return True
