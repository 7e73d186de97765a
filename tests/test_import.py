"""`import entmax_fast` stays about as cheap as `import torch`: triton and torch._dynamo
(together seconds of start-up) are imported only when first needed. The speed itself is
measured by bench/bench_import.py; these tests check the behaviour behind it."""
import subprocess
import sys

import torch

from entmax_fast import dispatch

_HEAVY_MODULES = ("triton", "torch._dynamo")


def _modules_loaded_after(code: str) -> set:
    script = code + "\nimport sys\nprint('\\n'.join(sys.modules))\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(result.stdout.split())


def test_import_loads_neither_triton_nor_dynamo():
    loaded = _modules_loaded_after("import entmax_fast")
    assert "entmax_fast.dispatch" in loaded
    heavy = sorted(name for name in loaded if name.split(".")[0] == "triton" or name.startswith("torch._dynamo"))
    assert heavy == [], f"import entmax_fast imported {heavy[:10]}"


def test_eager_cpu_ops_load_neither_triton_nor_dynamo():
    loaded = _modules_loaded_after(
        "import torch, entmax_fast\n"
        "x = torch.randn(3, 5, requires_grad=True)\n"
        "entmax_fast.entmax15(x).sum().backward()\n"
        "entmax_fast.entmax_attention(*(torch.randn(1, 2, 4, 8) for _ in range(3)))\n")
    assert not {name for name in loaded if name == "triton" or name == "torch._dynamo"}


def test_constant_marker_matches_torch_compiler():
    """dispatch marks its tracing-time choice constant for dynamo without importing it; the
    mark must be the one torch.compiler.assume_constant_result sets."""
    def probe():
        return 0

    marked = torch.compiler.assume_constant_result(probe)
    extra = set(vars(marked)) - {"__wrapped__"}
    assert extra == {"_dynamo_marked_constant"} and marked._dynamo_marked_constant is True
    assert dispatch._choice_while_tracing._dynamo_marked_constant is True
