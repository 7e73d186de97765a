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
    ("public functions", ["entmax_fast.mappings", "entmax_fast.attention", "entmax_fast.kvcache", "entmax_fast.inspection",
                          "entmax_fast.distributed", "entmax_fast.length_scale",
                          "entmax_fast.structured", "entmax_fast.chain", "entmax_fast.losses", "entmax_fast.continuous"]),
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


def _looked_up_module(node) -> str | None:
    """The module named by a string constant in ``sys.modules.get("x")``,
    ``sys.modules["x"]`` or ``importlib.import_module("x")``: imports by name, which the
    import statements do not show."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        name = node.slice
    elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.modules.get", "importlib.import_module") \
            and node.args:
        name = node.args[0]
    else:
        return None
    return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None


def _imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports, at any depth of its code (lazy imports
    inside functions count: they run as surely, only later), by statement or looked up by
    name (:func:`_looked_up_module`)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if _is_package(module) else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        looked_up = _looked_up_module(node)
        if looked_up is not None:
            targets.add(looked_up)
        elif isinstance(node, ast.Import):
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


# Arrows up that are not dependencies of the package: run as a plain script, aot.py imports
# the package so that the kernels' relative imports resolve (imported as part of the package,
# it does not).
SCRIPT_BOOTSTRAPS = {("entmax_fast.triton_kernels.aot", "entmax_fast")}


def test_imports_point_down_the_layers():
    upward = []
    for module in MODULES:
        for target in _imports(module):
            if _layer(target) > _layer(module) and (module, target) not in SCRIPT_BOOTSTRAPS:
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


def _origin(module: str, node: ast.ImportFrom) -> str:
    package = module if _is_package(module) else module.rpartition(".")[0]
    if not node.level:
        return node.module or ""
    base = package.split(".")
    return ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))


def _private_imports(module: str, source: str) -> list[str]:
    """``from M import _name`` in ``source`` (of ``module``) where ``_name`` is private to M:
    a module's underscored names are its own. Allowed: the names of a private module (its
    own name underscored, e.g. ``_validation``: the package's internals shared on purpose)
    and of the importer's own package (``from . import _x`` in a submodule)."""
    package = module if _is_package(module) else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        origin = _origin(module, node)
        if origin.rpartition(".")[2].startswith("_") or origin == package:
            continue
        found += [f"{module} imports {origin}.{alias.name}" for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__")
                  and f"{origin}.{alias.name}" not in MODULES and f"{origin}.{alias.name}" != "entmax_fast._C"]
    return found


# Private imports that remain, each to become a public name at its layer: the kernels' file
# is changed in parallel with this check (the Triton α >= 1 work), so the rename waits for it.
PRIVATE_IMPORTS_LEFT = {"entmax_fast.triton_kernels.attention_support imports "
                        "entmax_fast.triton_kernels.attention_bwd._row_weights"}


def test_no_module_imports_another_modules_private_name():
    found = {entry for module in MODULES for entry in _private_imports(module, MODULES[module].read_text())}
    assert not found - PRIVATE_IMPORTS_LEFT, "private names imported from another module:\n" + "\n".join(
        sorted(found - PRIVATE_IMPORTS_LEFT))
    assert PRIVATE_IMPORTS_LEFT <= found, f"resolved, take them off PRIVATE_IMPORTS_LEFT: {PRIVATE_IMPORTS_LEFT - found}"


def test_the_checkers_see_lookups_by_name_and_private_imports():
    """The lookup by name counts as an import; a private name of another module is found,
    the allowed forms are not."""
    def looked_up(source):
        return {_looked_up_module(node) for node in ast.walk(ast.parse(source))} - {None}

    assert looked_up("m = sys.modules.get('entmax_fast.distributed')\n") == {"entmax_fast.distributed"}
    assert looked_up("sys.modules['entmax_fast.hf'].f()\nimportlib.import_module('entmax_fast.nn')\n") == \
        {"entmax_fast.hf", "entmax_fast.nn"}
    assert _private_imports("entmax_fast.hf", "from .multihead import _active, ok\n") == \
        ["entmax_fast.hf imports entmax_fast.multihead._active"]
    assert _private_imports("entmax_fast.kvcache", "from .attention import _per_head as per_head\n")
    assert not _private_imports("entmax_fast.kvcache", "from ._validation import _assert_values\n"
                                                      "from .reference import attention as _attention\n")
    assert not _private_imports("entmax_fast.backends.triton.attention", "from . import _capability\n")


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


# bench/ (the user benchmarks) and tools/ (the kernel-development tools): scripts, not
# packages. bench/ stands without tools/; the tests reach either only through public names.
SCRIPT_DIRS = {"bench": ROOT / "bench", "tools": ROOT / "tools"}


def _scripts(folder: str) -> list[pathlib.Path]:
    return sorted(SCRIPT_DIRS[folder].glob("*.py"))


def _imports_of_tools(source: str) -> list[str]:
    """The imports in ``source`` of a tools/ module: as tools.X, or by the bare name of one
    of its files (a script that put tools/ on sys.path)."""
    stems = {path.stem for path in _scripts("tools")}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names
                  if name.split(".")[0] == "tools"
                  or (name in stems and name != "common" and not (SCRIPT_DIRS["bench"] / f"{name}.py").exists())]
    return found


def test_bench_never_imports_tools():
    """A user's benchmark runs without the kernel-development tools (bench/gpu_check.sh may
    still run them as steps)."""
    found = [f"{path.relative_to(ROOT)} {where}" for path in _scripts("bench")
             for where in _imports_of_tools(path.read_text())]
    assert not found, "bench/ imports tools/:\n" + "\n".join(found)


def _private_names() -> set[str]:
    """The top-level names starting with _ that the bench/ and tools/ scripts define."""
    names = set()
    for folder in SCRIPT_DIRS:
        for path in _scripts(folder):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _private_uses(source: str, private: set[str]) -> list[str]:
    """Where ``source`` uses a private name of a bench/ or tools/ script: imported from one
    (bench.X, tools.X), or read, set or patched on a name the file binds by assignment (a
    script loaded from its file) or on a call naming a bench/ or tools/ path. Names a file
    binds by importing a package module (entmax_fast's) are not scripts."""
    tree = ast.parse(source)
    assigned = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                assigned |= {name.id for name in ast.walk(target) if isinstance(name, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                origin = (module or alias.name).split(".")[0]
                if origin in SCRIPT_DIRS:
                    assigned.add((alias.asname or alias.name).split(".")[0])

    def is_script(value) -> bool:
        if isinstance(value, ast.Name):
            return value.id in assigned
        return isinstance(value, ast.Call) and any(
            isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            and arg.value.split("/")[0] in SCRIPT_DIRS for arg in value.args)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in SCRIPT_DIRS:
            found += [f"line {node.lineno}: from {node.module} import {alias.name}"
                      for alias in node.names if alias.name in private]
        elif isinstance(node, ast.Attribute) and node.attr in private and is_script(node.value):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and is_script(node.args[0])
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in private
              and (getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr", "delattr")
                   or getattr(node.func, "attr", None) in ("setattr", "delattr"))):
            found.append(f"line {node.lineno}: {node.args[1].value!r}")
    return found


def test_tests_use_no_private_name_of_bench_or_tools():
    """A test reaches a benchmark or a tool through the public functions its docstring lists
    or its main(argv), so that the scripts' internals can change without the tests."""
    private = _private_names()
    found = [f"{path.relative_to(ROOT)} {where}" for path in sorted((ROOT / "tests").glob("*.py"))
             for where in _private_uses(path.read_text(), private)]
    assert not found, "tests using private names of bench/ or tools/ scripts:\n" + "\n".join(found)


def test_the_checkers_see_a_tools_import_and_a_private_use():
    """The two checks above fail on the faults they are for, and pass the allowed forms."""
    assert _imports_of_tools("from tools.common import replaced\n")
    assert _imports_of_tools("def f():\n    import tune_attention\n")
    assert not _imports_of_tools("from bench.common import precompile\nfrom common import machine\n")
    private = {"_chunks", "_methods"}
    assert _private_uses("tune = load_script('tools/tune_attention.py')\ntune._chunks('table')\n",
                         private)
    assert _private_uses("load_script('bench/bench_rowwise_gpu.py')._methods(1, 'cpu')\n", private)
    assert _private_uses("def t(monkeypatch):\n    bench = load('x')\n"
                         "    monkeypatch.setattr(bench, '_methods', None)\n", private)
    assert _private_uses("from tools.tune_attention import _chunks\n", private)
    assert not _private_uses("from entmax_fast.backends.triton import rowwise\n"
                             "rowwise._methods(1)\ntune = load('t')\ntune.parse_chunks('x')\n",
                             private)
