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


# flash-attn 2's public signatures (flash_attn_interface), written down: flash-attn is not a
# dependency. The README's migration table must say what each argument is here.
FLASH_ATTN_ARGUMENTS = {
    "flash_attn_func": ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                        "alibi_slopes", "deterministic", "return_attn_probs"),
    "flash_attn_varlen_func": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                               "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                               "deterministic", "return_attn_probs", "block_table"),
    "flash_attn_with_kvcache": ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                                "return_softmax_lse"),
}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def test_flash_attn_migration_table_names_every_argument():
    table = _section(README.read_text(encoding="utf-8"), "### Migrating from flash-attn")
    flash_column = "\n".join(line.split("|")[1] for line in table.splitlines() if line.startswith("| "))
    for function, arguments in FLASH_ATTN_ARGUMENTS.items():
        assert f"`{function}(" in flash_column, function
        missing = [name for name in arguments if not re.search(rf"[`(, ]{name}[`=,)]", flash_column)]
        assert not missing, f"the flash-attn column of README's migration table lacks {function}'s {missing}"
    assert "`causal=True`" in flash_column and "window_size=(-1, 0)" in table


# The sentence each docstring with a top-left ``is_causal`` carries for a user porting
# flash-attn code (whitespace aside).
FLASH_CAUSAL_SENTENCE = ("Unlike flash-attn's ``causal=True`` (bottom-right since flash-attn 2.1), ``is_causal`` is "
                         "aligned top-left when Lq ≠ Lk, as in SDPA")


@pytest.mark.parametrize("name", ["entmax_attention", "entmax_attention_varlen", "attention_weights", "support_size",
                                  "fusedmax_attention", "oscarmax_attention"])
def test_docstrings_say_how_is_causal_differs_from_flash_attn(name):
    import entmax_fast

    docstring = " ".join(getattr(entmax_fast, name).__doc__.split())
    assert FLASH_CAUSAL_SENTENCE in docstring
