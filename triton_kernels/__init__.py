"""Triton kernels of entmax_fast, installed as `entmax_fast.triton_kernels`.

Importing this package does not import triton; each kernel module does, so the rest of
the library works where triton is missing.
"""
