"""Every ```python block of README.md runs as written (each in a fresh namespace, on CPU),
so the README's code cannot rot. A block that imports a package that is not installed is
skipped, naming the package."""
import ast
import importlib.util
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list:
    """(first line number, code) of every ```python block."""
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in _FENCE.finditer(text)]


def _missing_top_level_imports(code: str) -> list:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


_BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_readme_has_python_blocks():
    assert len(_BLOCKS) >= 2, "README.md lost its python examples (or this test its way of finding them)"


def test_block_finder_sees_only_python_fences():
    text = "a\n```python\nx = 1\n```\n```bash\nexit 1\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (9, "y = 2\nz = 3\n")]


@pytest.mark.parametrize("line, code", _BLOCKS, ids=[f"README.md:{line}" for line, _ in _BLOCKS])
def test_readme_block_runs(line, code):
    missing = _missing_top_level_imports(code)
    if missing:
        pytest.skip(f"README.md:{line} needs {', '.join(missing)}, not installed here")
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": f"readme_block_{line}"})
