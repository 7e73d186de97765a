"""The documentation site (mkdocs.yml, `bash scripts/docs.sh`) stays true to the code.

- Every public name (``entmax_fast.__all__`` and the ``__all__`` of the public
  subpackages) has a reference entry in the built site, with its signature as the code has
  it (parameter names and kinds) and its docstring rendered; names added later are covered
  without editing this file.
- Every ``>>>`` example in a public docstring runs and prints what it shows (doctest).
- Every ```python block of the guides runs as written.

The site is the one `bash scripts/docs.sh` built (ENTMAX_FAST_DOCS_SITE names it) or, without
that, one built here into a temporary folder (skipped when mkdocs is not installed: the
script installs it).
"""
import ast
import doctest
import html
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import entmax_fast
from test_readme import _missing_top_level_imports, python_blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md")) + [ROOT / "docs" / "index.md"]


def _subpackages() -> tuple:
    """The public subpackages the reference covers, as the site's generator lists them."""
    tree = ast.parse((ROOT / "scripts" / "docs_reference.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == ["SUBPACKAGES"]:
            return ast.literal_eval(node.value)
    raise AssertionError("scripts/docs_reference.py lost its SUBPACKAGES")


def public_names() -> list:
    """(public path the reference documents it under, object) for every public name, once:
    a subpackage's name that the package also exports is documented under the package."""
    names, seen = [], set()
    scopes = [("entmax_fast", entmax_fast)] + [(f"entmax_fast.{sub}", importlib.import_module(f"entmax_fast.{sub}"))
                                                for sub in _subpackages()]
    for prefix, module in scopes:
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen and (callable(obj) or inspect.ismodule(obj)):
                continue
            seen.add(id(obj))
            names.append((f"{prefix}.{name}", obj))
    return names


PUBLIC = public_names()


# --------------------------------------------------------------------------------------
# The built site.

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    if os.environ.get("ENTMAX_FAST_DOCS_SITE"):
        return pathlib.Path(os.environ["ENTMAX_FAST_DOCS_SITE"]).resolve()
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (bash scripts/docs.sh installs the pinned doc tools and runs this)")
    out = tmp_path_factory.mktemp("site")
    # Not --quiet: it drops the warnings below the error level, which --strict then never counts.
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, f"mkdocs build failed:\n{build.stdout}\n{build.stderr}"
    return out


@pytest.fixture(scope="module")
def reference(site) -> dict:
    """{anchor id: html of its entry up to the next entry} over the API reference pages."""
    entries = {}
    for page in sorted((site / "api").glob("*.html")):
        text = page.read_text(encoding="utf-8")
        starts = [match for match in re.finditer(r'<h(\d) id="([^"]+)" class="doc doc-heading"', text)]
        for match, following in zip(starts, starts[1:] + [None]):
            entries[match.group(2)] = text[match.start():following.start() if following else len(text)]
    assert entries, f"no reference entries under {site / 'api'}"
    return entries


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _words(text: str) -> list:
    return re.findall(r"\w+", text)


def rendered_parameters(signature_text: str) -> list:
    """(name, kind) of the parameters of a rendered signature ``name(a, b=1, *, c) -> T``."""
    arguments = ast.parse(f"def {signature_text.strip()}:\n    pass").body[0].args
    kinds = inspect.Parameter
    out = [(a.arg, kinds.POSITIONAL_ONLY) for a in arguments.posonlyargs]
    out += [(a.arg, kinds.POSITIONAL_OR_KEYWORD) for a in arguments.args]
    out += [(arguments.vararg.arg, kinds.VAR_POSITIONAL)] if arguments.vararg else []
    out += [(a.arg, kinds.KEYWORD_ONLY) for a in arguments.kwonlyargs]
    out += [(arguments.kwarg.arg, kinds.VAR_KEYWORD)] if arguments.kwarg else []
    return out


def test_rendered_parameters_reads_every_kind():
    assert rendered_parameters("f(a, /, b=1, *args, c, d=(1, 2), **kw) -> dict[str, int]") == [
        ("a", inspect.Parameter.POSITIONAL_ONLY), ("b", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("args", inspect.Parameter.VAR_POSITIONAL), ("c", inspect.Parameter.KEYWORD_ONLY),
        ("d", inspect.Parameter.KEYWORD_ONLY), ("kw", inspect.Parameter.VAR_KEYWORD)]


def test_public_names_cover_the_subpackages():
    paths = [path for path, _ in PUBLIC]
    assert "entmax_fast.entmax_attention" in paths and "entmax_fast.distributed.shard" in paths
    assert "entmax_fast.hf.register" in paths and "entmax_fast.continuous.continuous_density" in paths
    # Exported by the package and its subpackage, documented once, under the package.
    assert "entmax_fast.continuous_softmax" in paths and "entmax_fast.continuous.continuous_softmax" not in paths


# The site is built once per process that needs it: one pytest-xdist worker runs these.
@pytest.mark.xdist_group("docs_site")
@pytest.mark.parametrize("path, obj", PUBLIC, ids=[path for path, _ in PUBLIC])
def test_public_name_has_reference_entry(reference, path, obj):
    assert path in reference, (f"{path} has no entry in the API reference (scripts/docs_reference.py generates "
                               f"one for every name in an __all__ it reads)")
    entry = reference[path]
    if not callable(obj):
        assert re.search(r"doc-attribute|doc-symbol-attribute", entry), f"{path}: not rendered as an attribute"
        return
    signature = re.search(r'<div class="doc-signature highlight">(.*?)</div>', entry, re.DOTALL)
    assert signature, f"{path}: its reference entry shows no signature"
    expected = [(name, parameter.kind) for name, parameter in inspect.signature(obj).parameters.items()]
    assert rendered_parameters(_text(signature.group(1))) == expected, f"{path}: rendered signature differs"
    doc = inspect.cleandoc(vars(obj).get("__doc__") or "") if inspect.isclass(obj) else inspect.getdoc(obj)
    assert doc, f"{path} has no docstring of its own"
    summary = re.sub(r":\w+:", "", doc.split("\n\n")[0])
    contents = _text(entry[signature.end():])
    missing = [word for word in _words(summary) if word not in contents]
    assert not missing, f"{path}: the docstring's first paragraph did not render (missing {missing[:8]})"


# --------------------------------------------------------------------------------------
# Examples in the docstrings.

def _doctests() -> list:
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    tests = []
    for path, obj in PUBLIC:
        if callable(obj):
            tests += [(path, test) for test in finder.find(obj, path, globs={}) if test.examples]
    return tests


DOCTESTS = _doctests()


def test_examples_are_found():
    assert any(path == "entmax_fast.entmax_attention" for path, _ in DOCTESTS), \
        "entmax_attention's Examples are no longer found"


@pytest.mark.parametrize("path, test", DOCTESTS, ids=[test.name for _, test in DOCTESTS])
def test_docstring_examples_run(path, test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    output = []
    runner.run(test, out=output.append)
    assert runner.failures == 0, "".join(output)


# --------------------------------------------------------------------------------------
# The guides' code.

GUIDE_BLOCKS = [(page, line, code) for page in GUIDES
                for line, code in python_blocks(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("page, line, code", GUIDE_BLOCKS,
                         ids=[f"{page.relative_to(ROOT)}:{line}" for page, line, _ in GUIDE_BLOCKS])
def test_guide_block_runs(page, line, code):
    missing = _missing_top_level_imports(code)
    if missing:
        pytest.skip(f"{page.name}:{line} needs {', '.join(missing)}, not installed here")
    exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), {"__name__": f"guide_block_{line}"})
