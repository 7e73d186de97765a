"""Every branch of the dispatch registry, forced or chosen, is exercised here."""
import math
import os
import subprocess
import sys
import threading
import types
import warnings

import pytest
import torch

import entmax_fast
from entmax_fast import dispatch
from entmax_fast.backends import triton as triton_backend


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
    assert dispatch.last_choice("entmax") == dispatch.Choice(
        "entmax", "reference", "reference: plain torch; forced by use_backend('reference')")


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    entmax_fast.sparsemax(torch.randn(2, 3))
    assert dispatch.last_choice("entmax").reason == "reference: plain torch; forced by ENTMAX_FAST_BACKEND=reference"
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


def _add_toy_op(monkeypatch, **refusals):
    """Op "toy" (forward: math.sqrt) in the backends named, each refusing with the given
    reason (None: accepts); a backend named with the refusal "broken" fails to load it."""
    real = dispatch._backend
    toy = types.ModuleType("toy_ops")
    toy.toy_forward, toy.toy_backward = math.sqrt, math.floor
    for name in refusals:
        monkeypatch.setitem(sys.modules, f"entmax_fast.backends.{name}.toy_ops", toy)

    def backend(name):
        module = real(name)
        if name not in refusals:
            return module
        refusal = refusals[name]
        return types.SimpleNamespace(
            OPS={**module.OPS, "toy": "no_such_module" if refusal == "broken" else "toy_ops"},
            available=module.available, runs_on=module.runs_on, describe=module.describe,
            supports=lambda op, request: (None if refusal == "broken" else refusal) if op == "toy"
            else module.supports(op, request))

    monkeypatch.setattr(dispatch, "_backend", backend)


def test_forced_backend_without_implementation_falls_back_with_reason(monkeypatch):
    _add_toy_op(monkeypatch, reference=None)
    with entmax_fast.use_backend("triton"):
        (forward, _), choice = dispatch.select("toy", _cpu_request())
    assert choice.backend == "reference" and "forced 'triton' has no toy implementation" in choice.reason
    assert forward(4.0) == 2.0


def test_unsupported_call_skips_to_next_backend(monkeypatch):
    _add_toy_op(monkeypatch, cpp="cpp refuses this dtype", reference=None)
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (True, "pretend built"))
    _, choice = dispatch.select("toy", _cpu_request())
    assert choice.backend == "reference" and "cpp refuses this dtype" in choice.reason


def test_broken_optional_backend_falls_back_with_reason(monkeypatch):
    _add_toy_op(monkeypatch, cpp="broken", reference=None)
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (True, "pretend built"))
    _, choice = dispatch.select("toy", _cpu_request())
    assert choice.backend == "reference" and "failed to load" in choice.reason


def test_cuda_requests_prefer_triton_then_warn_on_reference(monkeypatch):
    _add_toy_op(monkeypatch, triton=None, reference=None)
    request = dispatch.Request(torch.device("cuda"), torch.float16, {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dispatch._AVAILABILITY, "triton", (True, "pretend GPU"))
    assert dispatch.select("toy", request)[1].backend == "triton"
    monkeypatch.setitem(dispatch._AVAILABILITY, "triton", (False, "no triton in this test"))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    with pytest.warns(UserWarning, match="runs the plain-torch reference: .*no triton in this test"):
        assert dispatch.select("toy", request)[1].backend == "reference"


def test_no_backend_at_all_raises(monkeypatch):
    _add_toy_op(monkeypatch, cpp="no")
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (True, "pretend built"))
    with pytest.raises(dispatch.BackendUnavailableError, match="no backend can run toy"):
        dispatch.select("toy", _cpu_request())
    with pytest.raises(KeyError, match="no backend implements op 'nothing'"):
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


def test_reasons_say_what_runs_and_why_in_words(monkeypatch):
    if dispatch.availability("cpp")[0]:
        entmax_fast.entmax15(torch.randn(2, 3))
        isa = torch.ops.entmax_fast.cpu_kernel_isa()
        assert dispatch.last_choice("entmax").reason == \
            f"cpp: C++ extension, {isa} CPU kernels (first choice for CPU tensors)"
        entmax_fast.entmax_attention(*(torch.randn(1, 1, 3, 4) for _ in range(3)), dropout_p=0.5)
        assert dispatch.last_choice("attention").reason == \
            "reference: plain torch, because cpp: the C++ attention has no dropout"
    entmax_fast.normmax_bisect(torch.randn(2, 3))
    assert dispatch.last_choice("normmax").reason == "reference: plain torch, because cpp: no normmax implementation"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dispatch._AVAILABILITY, "triton", (True, "pretend GPU"))
    monkeypatch.setattr(triton_backend, "_capability", lambda device: (9, 0))
    monkeypatch.setitem(dispatch._LOADED, ("attention", "triton"), "a kernel")
    request = dispatch.Request(torch.device("cuda"), torch.float16, {"alpha": 1.5})
    assert dispatch.select("attention", request)[1].reason == \
        "triton: CUDA tensor, alpha = 1.5 in (1, 2] (first choice for CUDA tensors)"


def test_last_choice_is_per_thread():
    """Each thread sees its own last call, like the forcing; a thread that has not called
    an op sees None for it."""
    entmax_fast.entmax15(torch.randn(2, 3))
    mine = dispatch.last_choice("entmax")
    barrier = threading.Barrier(2)
    seen = {}

    def other_thread():
        seen["before"] = dispatch.last_choice("entmax")
        with entmax_fast.use_backend("reference"):
            entmax_fast.entmax15(torch.randn(2, 3))
        barrier.wait()
        barrier.wait()
        seen["after"] = dispatch.last_choice("entmax")

    thread = threading.Thread(target=other_thread)
    thread.start()
    barrier.wait()
    assert dispatch.last_choice("entmax") == mine
    assert entmax_fast.backend_info()["last_choice"]["entmax"]["reason"] == mine.reason
    entmax_fast.sparsemax(torch.randn(2, 3))
    barrier.wait()
    thread.join()
    assert seen["before"] is None
    assert seen["after"].backend == "reference" and "forced by use_backend('reference')" in seen["after"].reason


_CONCURRENT_FIRST_USE = """
import threading, warnings
import torch
import entmax_fast

warnings.simplefilter("error")
x = torch.randn(4, 16)
calls = [entmax_fast.entmax15, lambda x: entmax_fast.fusedmax(x, 0.1), entmax_fast.sparsemax,
         lambda x: entmax_fast.entmax_attention(x[None, None], x[None, None], x[None, None])]
barrier = threading.Barrier(8)
errors = []

def first_use(i):
    barrier.wait()
    try:
        calls[i % len(calls)](x)
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=first_use, args=(i,)) for i in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not errors, errors
"""


def test_concurrent_first_use_registers_kernels_once():
    """Eight threads that use the package for the first time at once: the ops' Python side
    is registered once (torch warns "Overriding a previously registered kernel" otherwise,
    an error here). A fresh interpreter, since registration happens once per process."""
    env = dict(os.environ, ENTMAX_FAST_BACKEND="")
    result = subprocess.run([sys.executable, "-c", _CONCURRENT_FIRST_USE], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Overriding a previously registered kernel" not in result.stderr


def test_backend_info_says_per_device_whether_each_backend_is_used(monkeypatch):
    info = entmax_fast.backend_info()["backends"]
    for name, entry in info.items():
        assert entry["cpu"].startswith(("yes: ", "no: ", "only when forced")), (name, entry["cpu"])
        assert entry["cuda"].startswith(("yes: ", "no: ", "only when forced")), (name, entry["cuda"])
    assert info["reference"]["cpu"].startswith("yes: ")
    if not torch.cuda.is_available():
        assert all(entry["cuda"] == "no: no CUDA device here" for entry in info.values())
        assert info["triton"]["cpu"].startswith(("no: ", "only when forced, in the Triton interpreter"))
    if dispatch.availability("cpp")[0]:
        assert info["cpp"]["cpu"].startswith("yes: first choice for entmax")
        assert "entmax," not in info["reference"]["cpu"]

    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (False, "not built in this test"))
    info = entmax_fast.backend_info()["backends"]
    assert info["cpp"]["cpu"] == "no: not built in this test"
    assert info["reference"]["cpu"].startswith("yes: first choice for entmax")


def test_triton_without_cuda_is_reported_as_interpreter_only_or_unusable():
    ok, reason = dispatch.availability("triton")
    if torch.cuda.is_available() or "not importable" in reason:
        pytest.skip("this test is about a machine with triton and without CUDA")
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert ok and "no CUDA device: interpreter only" in reason
    else:
        assert not ok and "no CUDA device" in reason


def _counting_select(monkeypatch):
    """Replaces dispatch._select by a counter of fresh choices (the memo's misses)."""
    fresh = []
    real = dispatch._select

    def counting(op, request):
        fresh.append(op)
        return real(op, request)

    monkeypatch.setattr(dispatch, "_select", counting)
    return fresh


def test_a_repeated_call_reuses_its_choice_and_reports_it(monkeypatch):
    """The memo answers a call like an earlier one, and last_choice / backend_info still
    report the latest call's choice, with its reason, after a different one in between."""
    fresh = _counting_select(monkeypatch)
    X = torch.randn(2, 3)
    entmax_fast.entmax15(X)
    default = dispatch.last_choice("entmax")
    with entmax_fast.use_backend("reference"):
        entmax_fast.entmax15(X)
    assert dispatch.last_choice("entmax").reason == "reference: plain torch; forced by use_backend('reference')"
    calls_so_far = len(fresh)
    entmax_fast.entmax15(X)
    assert len(fresh) == calls_so_far, "the same call as before chose afresh"
    assert dispatch.last_choice("entmax") == default
    assert entmax_fast.backend_info()["last_choice"]["entmax"] == {"backend": default.backend,
                                                                   "reason": default.reason}


def test_memoised_choice_follows_use_backend_and_the_env_var(monkeypatch):
    X = torch.randn(2, 3)
    entmax_fast.sparsemax(X)
    default = dispatch.last_choice("entmax")
    for _ in range(2):  # the second round runs on memoised choices
        with entmax_fast.use_backend("reference"):
            entmax_fast.sparsemax(X)
            assert dispatch.last_choice("entmax").reason.endswith("forced by use_backend('reference')")
        entmax_fast.sparsemax(X)
        assert dispatch.last_choice("entmax") == default
        monkeypatch.setenv(dispatch.ENV_VAR, "reference")
        entmax_fast.sparsemax(X)
        assert dispatch.last_choice("entmax").reason.endswith("forced by ENTMAX_FAST_BACKEND=reference")
        monkeypatch.setenv(dispatch.ENV_VAR, "cuda-magic")
        with pytest.raises(ValueError, match="ENTMAX_FAST_BACKEND must be one of"):
            entmax_fast.sparsemax(X)
        monkeypatch.delenv(dispatch.ENV_VAR)
        entmax_fast.sparsemax(X)
        assert dispatch.last_choice("entmax") == default


def test_memoised_choice_follows_availability(monkeypatch):
    X = torch.randn(2, 3)
    entmax_fast.entmax15(X)
    default = dispatch.last_choice("entmax")
    with monkeypatch.context() as patch:
        patch.setitem(dispatch._AVAILABILITY, "cpp", (False, "not built in this test"))
        entmax_fast.entmax15(X)
        choice = dispatch.last_choice("entmax")
        assert choice.backend == "reference" and "not built in this test" in choice.reason
        with entmax_fast.use_backend("cpp"):
            with pytest.raises(dispatch.BackendUnavailableError, match="not built in this test"):
                entmax_fast.entmax15(X)
    entmax_fast.entmax15(X)
    assert dispatch.last_choice("entmax") == default


def test_memoised_cuda_fallback_warns_from_the_callers_line_once(monkeypatch):
    """The once-per-op warning of a CUDA call on the reference: from the memo as from a fresh
    choice, pointing at select's caller."""
    _add_toy_op(monkeypatch, triton=None, reference=None)
    request = dispatch.Request(torch.device("cuda"), torch.float16, {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dispatch._AVAILABILITY, "triton", (False, "no triton in this test"))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    with pytest.warns(UserWarning, match="no triton in this test") as fresh:
        dispatch.select("toy", request)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.select("toy", request)[1].backend == "reference"
    monkeypatch.setattr(dispatch, "_WARNED", set())
    with pytest.warns(UserWarning, match="no triton in this test") as memoised:
        dispatch.select("toy", request)
    assert [w.filename for w in fresh] == [w.filename for w in memoised] == [__file__]


def test_memo_takes_the_implementation_from_the_loaded_table(monkeypatch):
    _add_toy_op(monkeypatch, reference=None)
    assert dispatch.select("toy", _cpu_request())[0][0](9.0) == 3.0
    monkeypatch.setitem(dispatch._LOADED, ("toy", "reference"), (abs, abs))
    assert dispatch.select("toy", _cpu_request())[0] == (abs, abs)
    monkeypatch.delitem(dispatch._LOADED, ("toy", "reference"))
    (forward, _), choice = dispatch.select("toy", _cpu_request())
    assert forward(9.0) == 3.0 and choice.backend == "reference"


def test_unhashable_options_are_chosen_afresh(monkeypatch):
    _add_toy_op(monkeypatch, reference=None)
    fresh = _counting_select(monkeypatch)
    request = dispatch.Request(torch.device("cpu"), torch.float32, {"sizes": [1, 2]})
    for _ in range(2):
        assert dispatch.select("toy", request)[1].backend == "reference"
    assert fresh == ["toy", "toy"]


def test_memo_stays_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "_SELECTIONS", {})
    monkeypatch.setattr(dispatch, "_SELECTIONS_MAX", 3)
    X = torch.randn(2, 3)
    for alpha in (1.1, 1.2, 1.3, 1.4, 1.6, 1.7):
        entmax_fast.entmax_bisect(X, alpha)
        assert len(dispatch._SELECTIONS) <= 3


@pytest.mark.parametrize("value", ["1", "0", "true", "TRUE", "false", "yes", "on", "off", "y", "no", "2", ""])
def test_one_reading_of_triton_interpret(monkeypatch, value):
    """The backend and the kernels read TRITON_INTERPRET through one function, which parses
    it as triton does: they never disagree on whether kernels run in the interpreter."""
    from entmax_fast.backends import triton as triton_backend
    from entmax_fast.triton_kernels import aot

    assert triton_backend.interpreting is aot.interpreting
    monkeypatch.setenv("TRITON_INTERPRET", value)
    knobs = pytest.importorskip("triton.knobs")
    assert aot.interpreting() == knobs.getenv_bool("TRITON_INTERPRET", False)
