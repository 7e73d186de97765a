"""Every branch of the dispatch registry, forced or chosen, is exercised here."""
import pytest
import torch

import entmax_fast
from entmax_fast import dispatch


def _cpu_request():
    return dispatch.Request(torch.device("cpu"), torch.float32, {"alpha": 1.5})


def test_default_on_cpu_is_cpp_when_built_else_reference():
    entmax_fast.entmax15(torch.randn(2, 3))
    choice = dispatch.last_choice("entmax")
    cpp_ok, cpp_reason = dispatch.availability("cpp")
    if cpp_ok:
        assert choice.backend == "cpp"
    else:
        assert choice.backend == "reference"
        assert cpp_reason in choice.reason


def test_backend_info_reports_every_backend_and_last_choice():
    entmax_fast.entmax_attention(*(torch.randn(1, 1, 3, 4) for _ in range(3)))
    info = entmax_fast.backend_info()
    assert set(info["backends"]) == {"reference", "triton", "cpp"}
    assert all(isinstance(b["reason"], str) and b["reason"] for b in info["backends"].values())
    assert info["last_choice"]["attention"]["backend"] in ("reference", "cpp")


def test_context_manager_forces_reference():
    with entmax_fast.use_backend("reference"):
        entmax_fast.entmax15(torch.randn(2, 3))
    assert dispatch.last_choice("entmax") == dispatch.Choice("entmax", "reference", "forced")


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    entmax_fast.sparsemax(torch.randn(2, 3))
    assert dispatch.last_choice("entmax").reason == "forced"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda-magic")
    with pytest.raises(ValueError, match="ENTMAX_FAST_BACKEND must be one of"):
        entmax_fast.sparsemax(torch.randn(2, 3))


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        with entmax_fast.use_backend("cuda"):
            pass


def test_forced_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (False, "not built in this test"))
    with entmax_fast.use_backend("cpp"):
        with pytest.raises(dispatch.BackendUnavailableError, match="not built in this test"):
            entmax_fast.entmax15(torch.randn(2, 3))


def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with entmax_fast.use_backend("triton"):
        with pytest.raises(dispatch.BackendUnavailableError, match="triton cannot run cpu tensors"):
            entmax_fast.entmax15(torch.randn(2, 3))


def test_forced_backend_without_implementation_falls_back_with_reason(monkeypatch):
    monkeypatch.setitem(dispatch._REGISTRY, "toy", {"reference": dispatch._Impl("math", ("sqrt",), lambda r: None)})
    with entmax_fast.use_backend("triton"):
        implementation, choice = dispatch.select("toy", _cpu_request())
    assert choice.backend == "reference" and "forced 'triton' has no toy implementation" in choice.reason
    assert implementation(4.0) == 2.0


def test_unsupported_call_skips_to_next_backend(monkeypatch):
    impls = {"cpp": dispatch._Impl("math", ("floor",), lambda r: "cpp refuses this dtype"),
             "reference": dispatch._Impl("math", ("sqrt",), lambda r: None)}
    monkeypatch.setitem(dispatch._REGISTRY, "toy", impls)
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (True, "pretend built"))
    _, choice = dispatch.select("toy", _cpu_request())
    assert choice.backend == "reference" and "cpp refuses this dtype" in choice.reason


def test_broken_optional_backend_falls_back_with_reason(monkeypatch):
    impls = {"cpp": dispatch._Impl("entmax_fast.no_such_module", ("f",), lambda r: None),
             "reference": dispatch._Impl("math", ("sqrt",), lambda r: None)}
    monkeypatch.setitem(dispatch._REGISTRY, "toy", impls)
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (True, "pretend built"))
    _, choice = dispatch.select("toy", _cpu_request())
    assert choice.backend == "reference" and "failed to load" in choice.reason


def test_cuda_requests_prefer_triton_then_warn_on_reference(monkeypatch):
    impls = {"triton": dispatch._Impl("math", ("floor",), lambda r: None),
             "reference": dispatch._Impl("math", ("sqrt",), lambda r: None)}
    monkeypatch.setitem(dispatch._REGISTRY, "toy", impls)
    request = dispatch.Request(torch.device("cuda"), torch.float16, {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dispatch._AVAILABILITY, "triton", (True, "pretend GPU"))
    assert dispatch.select("toy", request)[1].backend == "triton"
    monkeypatch.setitem(dispatch._AVAILABILITY, "triton", (False, "no triton in this test"))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    with pytest.warns(UserWarning, match="runs the plain-torch reference: .*no triton in this test"):
        assert dispatch.select("toy", request)[1].backend == "reference"


def test_no_backend_at_all_raises(monkeypatch):
    monkeypatch.setitem(dispatch._REGISTRY, "toy", {"cpp": dispatch._Impl("math", ("sqrt",), lambda r: "no")})
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (True, "pretend built"))
    with pytest.raises(dispatch.BackendUnavailableError, match="no backend can run toy"):
        dispatch.select("toy", _cpu_request())
    with pytest.raises(KeyError, match="no backend registered"):
        dispatch.select("nothing", _cpu_request())


@pytest.mark.parametrize("backend", [None, "reference"], ids=["default", "reference"])
def test_torch_compile_fullgraph_traces_mappings_and_attention(backend):
    X = torch.randn(3, 7, requires_grad=True)
    alpha = torch.full((3, 1), 1.5, requires_grad=True)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    alpha_heads = torch.tensor([1.5, 2.0], requires_grad=True)
    with entmax_fast.use_backend(backend):
        def model(X, alpha, q, alpha_heads):
            return (entmax_fast.entmax15(X) * X).sum() + (entmax_fast.entmax_bisect(X, alpha) * X).sum() + \
                entmax_fast.entmax_attention(q, q, q, alpha=alpha_heads).square().sum()

        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        inputs = (X, alpha, q, alpha_heads)
        expected = model(*inputs)
        expected_grads = torch.autograd.grad(expected, inputs)
        got = compiled(*inputs)
        got_grads = torch.autograd.grad(got, inputs)
    torch.testing.assert_close(got, expected)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e)
