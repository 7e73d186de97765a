"""MkDocs hook: the API reference pages, generated at build time from the public names, and
README sections included in pages.

The names are read from the source (griffe, as mkdocstrings reads it; nothing is imported):
``entmax_fast.__all__`` and the ``__all__`` of the public subpackages below. A name is
documented once, under its public path, on the page of the module that defines it, so a
name added to an ``__all__`` gets a reference entry without editing the docs; a module with
no page below gets a page of its own, named after it. tests/test_docs.py checks that every
public name has an entry with its signature in the built site.

A page line ``<!-- include README.md: Heading -->`` is replaced by the README's section under
that heading (up to the next heading), so that the site says what the README says without a
second copy; links into docs/ are made relative to the page, links to other files of the
repository (outside the site) keep their text. A heading the README no longer has fails the
build.
"""
from __future__ import annotations

import os
import posixpath
import re

import griffe
from mkdocs.structure.files import File

PACKAGE = "entmax_fast"
SUBPACKAGES = ("continuous", "distributed", "hf")
NAV_TITLE = "API reference"

# (page, title, lead, defining modules), in the nav's order. A module maps to the first page
# that lists it.
PAGES = (
    ("mappings", "Row-wise mappings",
     "The α-entmax mappings of the `entmax` package, as functions and `nn` modules.",
     ("mappings", "nn")),
    ("losses", "Losses", "Fenchel–Young losses of the mappings, as functions and `nn` modules.", ("losses",)),
    ("attention", "Attention",
     "Scaled-dot-product entmax attention (SDPA's arguments, (B, H, L, E) layout), its packed "
     "variable-length form, and reading its weights.",
     ("attention", "inspection")),
    ("kvcache", "Decoding with a KV cache", "Attention of new tokens against a key/value cache.", ("kvcache",)),
    ("multihead", "Multi-head attention module",
     "A drop-in for `torch.nn.MultiheadAttention` and the function that swaps it into a model.",
     ("multihead",)),
    ("structured", "Structured attention", "fusedmax and oscarmax: sparse mappings that group neighbours.",
     ("structured",)),
    ("continuous", "Continuous attention", "Attention densities over a continuous domain (`entmax_fast.continuous`).",
     ("continuous",)),
    ("distributed", "Context parallelism", "One long sequence sharded over a `torch.distributed` group "
     "(`entmax_fast.distributed`).", ("distributed",)),
    ("hf", "Hugging Face", "`attn_implementation=\"entmax\"` for `transformers` models (`entmax_fast.hf`).", ("hf",)),
    ("backends", "Backends", "Which backend runs each op, and forcing one.", ("", "dispatch")),
)


def _defining_module(obj) -> str:
    """The module under the package that defines ``obj`` ("" for the package itself), its
    first component: ``entmax_fast.continuous.one_d.x`` → "continuous"."""
    path = obj.target_path if obj.is_alias else obj.path
    parts = path.split(".")[1:-1]
    return parts[0] if parts else ""


def public_entries(package) -> dict:
    """{module: [public path, ...]} for every public name, each once, in ``__all__`` order."""
    entries, seen = {}, set()
    scopes = [(PACKAGE, package)] + [(f"{PACKAGE}.{name}", package[name]) for name in SUBPACKAGES]
    for prefix, module in scopes:
        for name in module.exports or ():
            obj = module[name]
            target = obj.target_path if obj.is_alias else obj.path
            if target in seen:
                continue
            seen.add(target)
            entries.setdefault(_defining_module(obj), []).append(f"{prefix}.{name}")
    return entries


def reference_pages(package) -> list:
    """[(file name, title, markdown)] of the reference pages."""
    entries = public_entries(package)
    pages, placed = [], set()
    known = list(PAGES) + [(module, f"{PACKAGE}.{module}", "", (module,))
                           for module in entries if not any(module in modules for *_, modules in PAGES)]
    for page, title, lead, modules in known:
        paths = [path for module in modules if module not in placed for path in entries.get(module, [])]
        placed.update(modules)
        if not paths:
            continue
        # A public subpackage's own docstring is its overview: it heads its page.
        overview = [f"::: {PACKAGE}.{module}\n    options:\n      members: false\n      show_root_heading: false\n"
                    for module in modules if module in SUBPACKAGES]
        body = [f"# {title}", "", lead, ""] + overview + [f"::: {path}\n" for path in paths]
        pages.append((f"api/{page}.md", title, "\n".join(body)))
    return pages


def documented_paths(package) -> dict:
    """{name a docstring may use: public path it is documented under}: each public path,
    its short name where that is unique, and its path through its subpackage."""
    paths, short = {}, {}
    for module_paths in public_entries(package).values():
        for path in module_paths:
            paths[path] = path
            name = path.rsplit(".", 1)[1]
            short.setdefault(name, []).append(path)
            for sub in SUBPACKAGES:
                if name in (package[sub].exports or ()):
                    paths.setdefault(f"{PACKAGE}.{sub}.{name}", path)
    paths.update({name: where[0] for name, where in short.items() if len(where) == 1 and name not in paths})
    return paths


_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj):`~?([\w.]+)`")
# A page of the site named in a docstring (docs/maths.md), made a link from the reference pages
# (api/), which sit one folder below docs/.
_DOCS_PAGE = re.compile(r"(?<![\w/`])docs/([\w.-]+\.md)")
# reST's "text::" before an indented literal block; Markdown shows the block as code already.
_LITERAL_MARKER = re.compile(r"(\S)::$|\s+::$", re.MULTILINE)


class SphinxRoles(griffe.Extension):
    """Griffe extension: the docstrings' Sphinx roles (``:func:`name```) become a link to the
    name's reference entry where it has one, else the name as code; a docs/ page it names
    becomes a link to that page; reST's ``::`` before a literal block a colon. So markup
    written for readers of the source does not show as text on the site."""

    def on_package(self, *, pkg, **kwargs):
        if pkg.name != PACKAGE:
            return
        paths = documented_paths(pkg)

        def replace(match):
            name = match.group(1)
            return f"[`{name}`][{paths[name]}]" if name in paths else f"`{name}`"

        pending = [pkg]
        while pending:
            obj = pending.pop()
            if obj.docstring is not None:
                text = _DOCS_PAGE.sub(r"[docs/\1](../\1)", _ROLE.sub(replace, obj.docstring.value))
                obj.docstring.value = _LITERAL_MARKER.sub(lambda match: f"{match.group(1)}:" if match.group(1) else "", text)
            pending.extend(member for member in obj.members.values() if not member.is_alias)


_pages: list = []


def on_config(config):
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    package = griffe.load(PACKAGE, search_paths=[root], resolve_aliases=False)
    _pages[:] = reference_pages(package)
    for index, item in enumerate(config["nav"]):
        if isinstance(item, dict) and NAV_TITLE in item:
            overview = item[NAV_TITLE]
            config["nav"][index] = {NAV_TITLE: [overview] + [{title: path} for path, title, _ in _pages]}
            return config
    raise ValueError(f"mkdocs.yml's nav has no {NAV_TITLE!r} entry for the generated reference pages")


def on_files(files, config):
    for path, _, markdown in _pages:
        files.append(File.generated(config, path, content=markdown))
    return files


_INCLUDE = re.compile(r"^<!-- include README\.md: (.+?) -->$", re.MULTILINE)
_HEADING = re.compile(r"^(#+) (.+)$")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def readme_section(readme: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading (of any level), outside code blocks."""
    lines, section, fenced = readme.splitlines(), None, False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else _HEADING.match(line)
        if section is None:
            if match and match.group(2).strip() == heading:
                section = []
            continue
        if match:
            break
        section.append(line)
    if section is None:
        raise ValueError(f"README.md has no heading {heading!r} for a page to include")
    return "\n".join(section).strip("\n")


def relink(markdown: str, page_uri: str) -> str:
    """README links made right for a page at ``page_uri`` under docs/."""
    def replace(match):
        text, target = match.groups()
        if re.match(r"[a-z]+://|#", target):
            return match.group(0)
        if target.startswith("docs/"):
            return f"[{text}]({posixpath.relpath(target[len('docs/'):], posixpath.dirname(page_uri) or '.')})"
        return text
    return _LINK.sub(replace, markdown)


def on_page_markdown(markdown, page, config, files):
    if not _INCLUDE.search(markdown):
        return markdown
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as readme_file:
        readme = readme_file.read()
    return _INCLUDE.sub(lambda match: relink(readme_section(readme, match.group(1)), page.file.src_uri), markdown)
