"""Triton kernels of entmax_fast, installed as `entmax_fast.triton_kernels`.

What is compiled, and what the AOT check (aot.py) needs to compile it: the @triton.jit
kernels (rowwise.py; attention_fwd.py, attention_bwd.py and what both share,
attention_common.py; the support reductions both families use, support.py), the kinds
they specialise on (kinds.py), their tile tables and their AOT signatures (signature.py).
The host code that launches them is the Triton backend, `entmax_fast.backends.triton`.

Importing this package does not import triton; each kernel module does, so the rest of
the library works where triton is missing.
"""
