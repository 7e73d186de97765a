"""The shape of the house: imports only point down the layers, there is no import loop, and
the kinds the kernels specialise on have one definition (entmax_fast/common.py) that the C++
header csrc/common/kinds.h mirrors. Read from the sources with ``ast``, nothing imported."""
import ast
import pathlib
import re

import pytest

from entmax_fast import common

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"entmax_fast": ROOT / "entmax_fast", "entmax_fast.triton_kernels": ROOT / "triton_kernels"}

# Lowest first. A module may import modules of its own layer or below, never above.
LAYERS = [
    ("shared", ["entmax_fast.common", "entmax_fast._validation", "entmax_fast._C"]),
    ("references and kernels", ["entmax_fast.reference", "entmax_fast.triton_kernels"]),
    ("backends", ["entmax_fast.backends"]),
    ("dispatch", ["entmax_fast.dispatch"]),
    ("public functions", ["entmax_fast.mappings", "entmax_fast.attention", "entmax_fast.structured",
                          "entmax_fast.losses", "entmax_fast.continuous"]),
    ("modules and integrations", ["entmax_fast.nn", "entmax_fast.multihead", "entmax_fast.hf"]),
    ("package and applications", ["entmax_fast", "entmax_fast.train"]),
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports, at any depth of its code (lazy imports
    inside functions count: they run as surely, only later)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if _is_package(module) else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                origin = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # "from x import y" imports the module x.y when there is one, else a name of x.
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                targets.add(submodule if submodule in MODULES or submodule == "entmax_fast._C" else origin)
    return {name for name in targets if name in MODULES or name == "entmax_fast._C"} - {module}


def _layer(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py's LAYERS"
    return best[0]


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_point_down_the_layers():
    upward = []
    for module in MODULES:
        for target in _imports(module):
            if _layer(target) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {target} "
                              f"({LAYERS[_layer(target)][0]})")
    assert not upward, "imports that run up a floor:\n" + "\n".join(sorted(upward))


def test_no_import_loop():
    graph = {module: _imports(module) & MODULES.keys() for module in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module):
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                loop = stack[stack.index(target):] + [target]
                pytest.fail("import loop: " + " -> ".join(loop))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_checker_sees_an_upward_import_and_a_loop(tmp_path, monkeypatch):
    """The two checks above fail on the faults they are for."""
    fake = {"entmax_fast.common": tmp_path / "common.py", "entmax_fast.dispatch": tmp_path / "dispatch.py"}
    fake["entmax_fast.common"].write_text("from .dispatch import select\n")
    fake["entmax_fast.dispatch"].write_text("def f():\n    from . import common\n")
    monkeypatch.setitem(globals(), "MODULES", fake)
    with pytest.raises(AssertionError, match="entmax_fast.common .* imports entmax_fast.dispatch"):
        test_imports_point_down_the_layers()
    with pytest.raises(pytest.fail.Exception, match="import loop"):
        test_no_import_loop()


def test_dispatch_imports_no_public_module():
    assert _imports("entmax_fast.dispatch") <= {"entmax_fast.common", "entmax_fast._validation"}


def _cpp_kinds() -> dict[str, int]:
    text = (ROOT / "csrc" / "common" / "kinds.h").read_text()
    enums = {}
    for enum, body in re.findall(r"enum class (\w+) : int \{([^}]*)\}", text):
        for name, value in re.findall(r"k(\w+) = (\d+)", body):
            enums[f"{enum}::{name}".lower()] = int(value)
    return enums


def test_cpp_kinds_mirror_common():
    prefixes = {"ALPHA": "alphakind", "MASK": "maskkind", "GRAD": "gradkind", "PROX": "prox"}
    python = {f"{prefixes[name.split('_')[0]]}::{name.split('_', 1)[1]}".lower(): value
              for name, value in vars(common).items()
              if name.split("_")[0] in prefixes and isinstance(value, int) and name.isupper()}
    assert python and python == _cpp_kinds()
