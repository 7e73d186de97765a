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

and, in the submodule OPS names, a forward and a backward for each op (a forward only for
attention_kvcache and attention_support). They compute; they hold no autograd.
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
    crf         crf_forward(x, transitions) -> (mu, saved)
    sparsemap   crf_backward(grad, x, transitions, mu, saved) -> (dx, dtransitions)
                (sparsemap_* alike) x: (R, n) contiguous in its compute dtype, −inf marks
                a position removed from the chain; transitions: (R, 2, 2) contiguous, x's
                dtype, one matrix per row; saved: one tensor (the C++ SparseMAP: its
                float64 TV-prox output)
    attention   attention_forward(query, key, value, attn_mask, alpha, *, scale,
                                  is_causal, dropout_p, enable_gqa, need_grad,
                                  score_options) -> (out, saved)
                attention_backward(grad_out, query, key, value, attn_mask, alpha, out,
                                   saved, *, scale, is_causal, dropout_p, enable_gqa,
                                   need_mask_grad, need_alpha_grad, score_options,
                                   need_sinks_grad)
                    -> (dq, dk, dv, dmask | None, dalpha | None, dsinks | None)
                query (B, H, Lq, E), key (B, Hkv, Lk, E), value (B, Hkv, Lk, Ev), none
                empty, E >= 1; attn_mask None, bool or additive, 4-D, broadcastable to
                (B, H, Lq, Lk); alpha: float or (H,) tensor; scale: float; need_grad:
                common.GRAD_*; saved: a tuple of tensors (what the backward needs; the
                dropout seed among them); score_options: a _validation.ScoreOptions
                (docs/attention.md, "Score options"; the public layer checked it):
                the window as its ``window_bounds`` (a lower-right causal mask is the
                right bound 0), softcap, alibi_slopes (no gradient) and sinks (with a
                gradient); custom ops take it flat (``ScoreOptions.flat``)
    attention_varlen
                attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, alpha, *, scale,
                                         is_causal, dropout_p, need_grad,
                                         score_options) -> (out, saved)
                attention_varlen_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, alpha, out, saved,
                                          *, scale, is_causal, dropout_p,
                                          need_alpha_grad, score_options,
                                          need_sinks_grad)
                    -> (dq, dk, dv, dalpha | None, dsinks | None)
                alibi_slopes (B, H) hold a row per sequence
    attention_kvcache  (forward only: decoding, no autograd)
                attention_kvcache_forward(query, k_cache, v_cache, seqlens_k, block_table,
                                          alpha, *, scale, score_options) -> out
                query (B, H, Lq, E); caches contiguous (B, Hkv, Lmax, E | Ev), block_table
                None, or paged (num_blocks, Hkv, block_size, E | Ev) with block_table
                (B, max_blocks) int32; seqlens_k (B,) int32: keys in each sequence's cache
                (the new tokens already written), query i at position seqlens_k[b] − Lq + i,
                lower-right causal (the window's right bound unused); entries of
                block_table past a sequence's blocks are not read
    attention_support  (forward only: inspection, no autograd)
                attention_support_forward(query, key, attn_mask, alpha, *, scale,
                                          is_causal, enable_gqa, score_options)
                    -> (B, H, Lq) int64
                arguments as attention_forward's (no value): how many keys each query
                row gives a nonzero weight in that backend's attention_forward (the sink
                not counted, a NaN row none), without an (Lq, Lk) block per head beyond
                what the backend's forward holds

A backend that does not implement a score option refuses the call in ``supports`` (dispatch
then falls back, with the reason), naming it with `unimplemented_score_options`; its package
lists the options it implements in ``SCORE_OPTIONS_IMPLEMENTED`` (keys of SCORE_OPTIONS).
Its forward and backward still take every option, and raise if one it lacks is in use
(`refuse_score_options`).

Outputs and gradients come back in the inputs' dtypes (dalpha in alpha's dtype for a
tensor alpha, dsinks in sinks' dtype). Backends trust their arguments: checks live in the
public layer, once.
"""

# The dispatch.Request options of the attention ops that flag a score option in use (the
# public layer sets them, _validation.ScoreOptions.request_flags), and how a refusal names each.
from .._validation import SCORE_OPTIONS


def unimplemented_score_options(request, what: str, implemented=frozenset()) -> str | None:
    """None when ``request`` (a dispatch.Request of an attention op) uses no score option
    outside ``implemented`` (keys of SCORE_OPTIONS), else the reason a backend (``what``:
    "the C++ attention", ...) refuses it, naming each option in use that it lacks."""
    used = [name for option, name in SCORE_OPTIONS.items()
            if request.options.get(option) and option not in implemented]
    if not used:
        return None
    return f"{what} does not implement {', '.join(used)} yet"


def refuse_score_options(what: str, score_options, implemented=frozenset()) -> None:
    """Raise when a backend is called with a score option outside ``implemented`` anyway
    (``supports`` refuses such calls, so dispatch never makes them)."""
    lacking = [flag for flag in score_options.in_use if flag not in implemented]
    if lacking:
        raise RuntimeError(f"{what} has no score option {', '.join(lacking)}; supports() refuses such calls")
