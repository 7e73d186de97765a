"""Shared helpers of the tools/ scripts. The measuring helpers they share with the user
benchmarks (timing, compile runs, tables) are bench/common.py's."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def replaced(*edits):
    """For the block: each (module, name, value) of ``edits`` set, a value of None leaving
    the attribute as it is; every attribute restored after, also when the block raises.
    tools/attention_variants.py and tools/tune_attention.py time edited kernels and tables
    this way, in the process that imports the real ones."""
    saved = [(module, name, getattr(module, name)) for module, name, value in edits
             if value is not None]
    for module, name, value in edits:
        if value is not None:
            setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
