"""The backends: one module per backend, each exposing the same contract.

    reference   plain torch (entmax_fast.reference): always available, every op
    triton      launchers and torch.library custom ops over the kernels in
                entmax_fast.triton_kernels (CUDA tensors; CPU tensors in the interpreter)
    cpp         the one loader of the compiled extension entmax_fast._C and wrappers of
                its operators (csrc/): CPU kernels, and CUDA kernels where built with CUDA

Contract. A backend is a package here whose ``__init__`` is light (it imports neither
triton nor the extension nor any kernel) and defines

    OPS: dict[str, str]      op name -> the submodule (relative to the backend package)
                             that defines the op's forward and backward
    available() -> (bool, reason)             asked once (dispatch keeps the answer); may
                                              import triton or load the extension
    runs_on(device) -> None, or why it cannot run tensors on that torch.device here
                             (availability aside)
    supports(op, request) -> None, or why it cannot run that call (request: device,
                             dtype and the op's options, see dispatch.Request)
    describe(op, request) -> what runs the call, in a user's words

and, in the submodule OPS names, a forward and a backward for each op. They compute; they hold no autograd.
The public layer (mappings.py, structured.py, attention.py) validates the arguments once
and holds the one torch.autograd.Function of each op, which calls the dispatched pair:

    entmax      entmax_forward(x, alpha) -> p
                entmax_backward(p, grad, alpha, need_alpha_grad) -> (dx, dalpha | None)
                x: (R, n) rows with unit stride; alpha: float, or a (R,) tensor in x's
                compute dtype (common.compute_dtype)
    normmax     normmax_forward(x, alpha) -> p;  normmax_backward(p, grad, alpha) -> dx
    budget      budget_forward(x, budget) -> p;  budget_backward(p, grad, budget) -> dx
                x: (R, n) rows with unit stride; alpha, budget: float, or a (R,) tensor in
                x's compute dtype (one value per row)
    fusedmax    fusedmax_forward(x, reg, lengths) -> (p, saved)
    oscarmax    fusedmax_backward(grad, x, lengths, p, saved, reg) -> dx  (oscarmax_* alike)
                x: (R, n) contiguous in its compute dtype; lengths: (R,) integer or None;
                saved: one tensor the backward needs (the C++ operators: the prox output)
    attention   attention_forward(query, key, value, attn_mask, alpha, *, scale,
                                  is_causal, dropout_p, enable_gqa, need_grad)
                    -> (out, saved)
                attention_backward(grad_out, query, key, value, attn_mask, alpha, out,
                                   saved, *, scale, is_causal, dropout_p, enable_gqa,
                                   need_mask_grad, need_alpha_grad)
                    -> (dq, dk, dv, dmask | None, dalpha | None)
                query (B, H, Lq, E), key (B, Hkv, Lk, E), value (B, Hkv, Lk, Ev), none
                empty, E >= 1; attn_mask None, bool or additive, 4-D, broadcastable to
                (B, H, Lq, Lk); alpha: float or (H,) tensor; scale: float; need_grad:
                common.GRAD_*; saved: a tuple of tensors (what the backward needs; the
                dropout seed among them)
    attention_varlen
                attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, alpha, *, scale,
                                         is_causal, dropout_p, need_grad) -> (out, saved)
                attention_varlen_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, alpha, out, saved,
                                          *, scale, is_causal, dropout_p,
                                          need_alpha_grad) -> (dq, dk, dv, dalpha | None)

Outputs and gradients come back in the inputs' dtypes (dalpha in alpha's dtype for a
tensor alpha). Backends trust their arguments: checks live in the public layer, once.
"""
