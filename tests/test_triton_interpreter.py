"""tests/triton_interpreter.py, installed by conftest.py: the reduction by slices gives the
values of the interpreter's own element-by-element reduction (NaN rows, signed zeros, a combine
function whose result depends on the order of the elements, two outputs, every axis and
keep_dims); a helper runs on the launch's patched language, which is restored after it; integer
overflow is caught exactly when the interpreter's assertions are on."""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("tests/triton_interpreter.py replaces parts of the Triton interpreter only",
                allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import triton_interpreter  # noqa: E402
from entmax_fast.triton_kernels.attention_fwd import _max_nan  # noqa: E402

if triton.__version__ not in triton_interpreter.VERIFIED_TRITON:
    pytest.skip(f"tests/triton_interpreter.py leaves triton {triton.__version__}'s interpreter as it is (checked on "
                f"{', '.join(sorted(triton_interpreter.VERIFIED_TRITON))})", allow_module_level=True)


@triton.jit
def _halve_then_add(b_acc, b_item):
    """Not associative: the result depends on the order in which the elements come."""
    return b_acc * 0.5 + b_item


@triton.jit
def _max_and_count(b_acc, b_count, b_item, b_item_count):
    """Two outputs, one of them integer."""
    return tl.maximum(b_acc, b_item), b_count + b_item_count


@triton.jit
def _reduce_kernel(p_x, p_out_rows, p_out_cols, p_out_all, p_out_kept, p_count,
                   COMBINE: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    o_m = tl.arange(0, M)
    o_n = tl.arange(0, N)
    b_x = tl.load(p_x + o_m[:, None] * N + o_n[None, :])
    if COMBINE == 0:
        tl.store(p_out_rows + o_m, tl.reduce(b_x, 1, _max_nan))
        tl.store(p_out_cols + o_n, tl.reduce(b_x, 0, _max_nan))
        tl.store(p_out_all, tl.reduce(b_x, None, _max_nan))
        b_kept = tl.reduce(b_x, 1, _max_nan, keep_dims=True)
    else:
        tl.store(p_out_rows + o_m, tl.reduce(b_x, 1, _halve_then_add))
        tl.store(p_out_cols + o_n, tl.reduce(b_x, 0, _halve_then_add))
        tl.store(p_out_all, tl.reduce(b_x, None, _halve_then_add))
        b_kept = tl.reduce(b_x, 1, _halve_then_add, keep_dims=True)
    tl.store(p_out_kept + o_m[:, None], b_kept)
    b_count = (b_x > 0).to(tl.int32)
    b_max, b_positive = tl.reduce((b_x, b_count), 1, _max_and_count)
    tl.store(p_out_all + 1 + o_m, b_max)
    tl.store(p_count + o_m, b_positive)


def _run(x, combine):
    m, n = x.shape
    outs = [torch.zeros(m), torch.zeros(n), torch.zeros(1 + m), torch.zeros(m), torch.zeros(m, dtype=torch.int32)]
    _reduce_kernel[(1,)](x, *outs, COMBINE=combine, M=m, N=n)
    return outs


@pytest.fixture
def element_by_element(monkeypatch):
    def use():
        monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce",
                            interpreter.ReduceOps.element_by_element_reduce)
    return use


def test_conftest_installed_every_part():
    assert interpreter.ReduceOps.generic_reduce is triton_interpreter._reduce_by_slices
    assert interpreter._patch_lang.func is triton_interpreter._patch_lang_once
    assert (interpreter.interpreter_semantic.binary_op_sanitize_overflow_impl.func
            is triton_interpreter._sanitize_overflow_when_asserted)


@triton.jit
def _helper_that_uses_the_language(b_x):
    return tl.sum(tl.where(b_x > 0, b_x, 0.0), 0) + tl.max(b_x, 0) + tl.math.exp2(tl.min(b_x, 0))


@triton.jit
def _helper_kernel(p_x, p_out, N: tl.constexpr):
    b_x = tl.load(p_x + tl.arange(0, N))
    tl.store(p_out, _helper_that_uses_the_language(b_x))


def test_helpers_run_on_the_launchs_patched_language_and_it_is_restored_after():
    """A helper skips the patch (the launch's is in place), and the launch's end restores the
    language as before it."""
    import triton.language as tl_module

    before = {name: getattr(tl_module, name) for name in ("sum", "max", "where", "load")}
    x = torch.tensor([3.0, -1.0, 2.0, -4.0])
    out = torch.zeros(1)
    _helper_kernel[(1,)](x, out, N=4)
    torch.testing.assert_close(out, torch.tensor([5.0 + 3.0 + 2.0 ** -4.0]))
    assert {name: getattr(tl_module, name) for name in before} == before
    assert getattr(triton_interpreter._launch, "modules", None) is None


@pytest.mark.parametrize("combine", [0, 1], ids=["max_nan", "order-sensitive"])
@pytest.mark.parametrize("m,n", [(4, 8), (16, 2), (1, 16)])
def test_reduction_by_slices_gives_the_element_by_element_values(element_by_element, combine, m, n):
    x = torch.randn(m, n) * 100
    x[-1, 0] = -0.0
    x[-1, 1:] = torch.where(torch.arange(n - 1) % 2 == 0, -0.0, 0.0)
    x[0, n // 2] = float("nan")
    by_slices = _run(x, combine)
    element_by_element()
    expected = _run(x, combine)
    for got, want in zip(by_slices, expected):
        torch.testing.assert_close(got, want, atol=0.0, rtol=1e-6, equal_nan=True)
    assert torch.isnan(by_slices[0][0]) and torch.isnan(by_slices[2][0])


@triton.jit
def _double_kernel(p_x, p_out, N: tl.constexpr):
    o_n = tl.arange(0, N)
    b_x = tl.load(p_x + o_n)
    tl.store(p_out + o_n, b_x + b_x)


@pytest.mark.parametrize("debug", [False, True], ids=["assertions-off", "assertions-on"])
def test_int_overflow_is_checked_exactly_when_the_assertion_is_on(monkeypatch, debug):
    import dataclasses

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=debug))
    fine = torch.tensor([1, -7, 2 ** 29, 5], dtype=torch.int32)
    out = torch.zeros_like(fine)
    _double_kernel[(1,)](fine, out, N=4)
    assert out.tolist() == [2, -14, 2 ** 30, 10]
    overflowing = torch.tensor([1, 2 ** 30 + 1, 3, 4], dtype=torch.int32)
    if debug:
        with pytest.raises(Exception, match="overflow detected"):
            _double_kernel[(1,)](overflowing, out, N=4)
    else:
        _double_kernel[(1,)](overflowing, out, N=4)
        assert out[1].item() == -2 ** 31 + 2
