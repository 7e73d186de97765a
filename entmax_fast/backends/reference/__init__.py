"""The reference backend: the plain-torch implementations of ``entmax_fast.reference``,
exact and always available; the fallback for every call the fast backends refuse."""
from __future__ import annotations

OPS = {op: "ops" for op in ("entmax", "normmax", "budget", "fusedmax", "oscarmax", "attention", "attention_varlen",
                                   "attention_kvcache", "attention_support", "crf", "sparsemap")}


def available() -> tuple[bool, str]:
    return True, "plain torch, always available"


def runs_on(device) -> str | None:
    return None


def supports(op: str, request) -> str | None:
    return None


def describe(op: str, request) -> str:
    return "reference: plain torch"
