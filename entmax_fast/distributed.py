"""Context-parallel entmax attention on ``torch.distributed``: one sequence split across the
ranks of a process group, each rank holding a shard of the queries, keys and values.

α-entmax needs each row's threshold τ over *all* of the row's keys, so softmax's
ring attention (partial results merged by their log-sum-exp) does not apply. Both methods
here give every query row all of its keys on one rank, so the threshold is computed whole
and the result is exact (the single-device op on the same rows, up to rounding):

- ``"all_to_all"`` (Ulysses): the sequence-sharded q, k, v become head-sharded (H/P heads
  of the whole sequence on each rank) by one ``all_to_all_single`` each, attention runs on
  them unchanged, and a second all-to-all brings the output back to sequence shards. The
  backward is the transposed exchange. Needs H and Hkv divisible by P.
- ``"all_gather"`` (Llama 3's context parallelism): every rank all-gathers K and V, keeps
  its own queries, and attends each of its query chunks to the keys it needs (causal: the
  keys up to the chunk's end, bottom-right aligned). The backward reduce-scatters dK, dV.

Layouts (:func:`shard`): ``"contiguous"`` gives rank r the r-th of P slices;
``"balanced"`` splits the sequence into 2P chunks and gives rank r chunks r and 2P−1−r, so
every rank has the same causal work. docs/context_parallel.md compares the methods
(communication, memory, measured time).

Importing this module initialises nothing; every function needs an initialised process
group (``torch.distributed.init_process_group``) when called.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._validation import causal_bias, check_is_causal, check_window_size
from .attention import entmax_attention
from .common import NO_WINDOW

__all__ = ["shard", "unshard", "context_parallel_attention", "context_parallel", "current_attention",
           "LAYOUTS", "METHODS"]

LAYOUTS = ("balanced", "contiguous")
METHODS = ("auto", "all_to_all", "all_gather")

# The device types each collective backend runs all_to_all_single, all_gather and
# reduce_scatter on.
_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",)}


# --------------------------------------------------------------------------------------
# Layouts: which chunks of the sequence each rank holds.

def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunk_count(world_size: int, layout: str) -> int:
    return 2 * world_size if layout == "balanced" else world_size


def _rank_chunks(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """The chunks (of :func:`_chunk_count`) rank ``rank`` holds, in its shard's order."""
    return (rank, 2 * world_size - 1 - rank) if layout == "balanced" else (rank,)


def _split_for_ranks(x, dim, world_size, layout, along_sequence):
    """``x`` cut into the P parts rank j receives: along the sequence, rank j's chunks of
    the layout (joined); along another dim (heads), P equal slices."""
    if not along_sequence or layout == "contiguous":
        return list(x.chunk(world_size, dim))
    chunks = x.chunk(_chunk_count(world_size, layout), dim)
    return [torch.cat([chunks[chunk] for chunk in _rank_chunks(rank, world_size, layout)], dim)
            for rank in range(world_size)]


def _join_from_ranks(parts, dim, world_size, layout, along_sequence):
    """Inverse of :func:`_split_for_ranks`: ``parts[j]`` came from rank j; along the
    sequence the result is in sequence order (one copy, straight from the parts)."""
    if not along_sequence or layout == "contiguous":
        return torch.cat(parts, dim)
    pieces = {}
    for rank, part in enumerate(parts):
        for chunk, piece in zip(_rank_chunks(rank, world_size, layout), part.chunk(2, dim)):
            pieces[chunk] = piece
    return torch.cat([pieces[chunk] for chunk in range(_chunk_count(world_size, layout))], dim)


# --------------------------------------------------------------------------------------
# Process group checks.

def _group_info(group) -> tuple[int, int]:
    """(world size, rank) of ``group``; a clear error without an initialised process group."""
    if not dist.is_available():
        raise RuntimeError("entmax_fast.distributed needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "(e.g. under torchrun) before using entmax_fast.distributed")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return dist.get_world_size(group), rank


def _check_group_device(group, name, tensor):
    """A tensor whose device the group's collective backend cannot use fails here, named,
    rather than inside the collective."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        # A group with a backend per device type, e.g. "cpu:gloo,cuda:nccl".
        devices = tuple(part.split(":")[0] for part in backend.split(","))
    else:
        devices = _BACKEND_DEVICES.get(backend)
    if devices is not None and tensor.device.type not in devices:
        raise ValueError(f"{name} is on {tensor.device}, which the process group's {backend!r} backend cannot "
                         f"use (it runs on {', '.join(devices)}); move the tensors or use a group of a matching "
                         f"backend (gloo for CPU, nccl for CUDA)")


def _check_equal_across_ranks(group, world_size, device, shapes: dict):
    """Every rank must pass tensors of one shape (each holds an equal shard). Checked with
    one small all_gather of the shapes, so that all ranks raise the same error rather than
    hang or fail inside a collective of mismatched sizes."""
    names = list(shapes)
    width = max(len(shape) for shape in shapes.values()) + 1
    rows = [[len(shapes[name]), *shapes[name]] + [0] * (width - 1 - len(shapes[name])) for name in names]
    local = torch.tensor(rows, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    for index, name in enumerate(names):
        per_rank = [tuple(row[index, 1:1 + int(row[index, 0])].tolist()) for row in gathered]
        if len(set(per_rank)) > 1:
            listing = ", ".join(f"rank {rank}: {shape}" for rank, shape in enumerate(per_rank))
            raise ValueError(f"{name} must have the same shape on every rank (each rank holds an equal shard of "
                             f"the sequence), got {listing}")


# --------------------------------------------------------------------------------------
# Differentiable collectives along one dim.

def _as_communicable(x):
    """Collective backends do not all move bool tensors: those travel as uint8."""
    return (x.to(torch.uint8), True) if x.dtype == torch.bool else (x, False)


def _gather_sequence(x, dim, group, world_size, layout):
    """Every rank's shard ``x`` gathered into the whole sequence along ``dim``, in sequence
    order (no autograd)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=group)
    return _join_from_ranks(parts, dim, world_size, layout, along_sequence=True)


class _AllGatherSequence(torch.autograd.Function):
    """Every rank's shard gathered into the whole sequence along ``dim``, in sequence order.
    The backward sums the ranks' gradients of this rank's shard (reduce_scatter): the
    gathered tensor is used on every rank, and each use contributes to the shard's gradient."""

    @staticmethod
    def forward(ctx, x, dim, group, world_size, layout):
        ctx.args = dim, group, world_size, layout
        x, was_bool = _as_communicable(x)
        out = _gather_sequence(x, dim, group, world_size, layout)
        return out.bool() if was_bool else out

    @staticmethod
    def backward(ctx, grad):
        dim, group, world_size, layout = ctx.args
        pieces = [piece.contiguous() for piece in _split_for_ranks(grad, dim, world_size, layout, along_sequence=True)]
        out = torch.empty_like(pieces[0])
        dist.reduce_scatter(out, pieces, group=group)
        return out, None, None, None, None


class _GatheredSpans(torch.autograd.Function):
    """Spans ``[start, end)`` along the sequence (dim 2) of every rank's shard gathered in
    sequence order: one output per span, views of one gathered tensor. The backward adds
    each span's gradient in place into the ranks' parts and reduce-scatters them. Slicing
    one gathered tensor instead would fill each span's gradient out to the whole length in
    the backward, and split the sum into the ranks' parts in another copy."""

    @staticmethod
    def forward(ctx, x, spans, group, world_size, layout):
        ctx.set_materialize_grads(False)
        ctx.args = x.shape, x.dtype, x.device, spans, group, world_size, layout
        whole = _gather_sequence(x, 2, group, world_size, layout)
        return tuple(whole[:, :, start:end] for start, end in spans)

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device, spans, group, world_size, layout = ctx.args
        size = shape[2] * world_size // _chunk_count(world_size, layout)
        # where each chunk of the sequence lies in the ranks' parts: (rank, first row)
        place = {chunk: (rank, slot * size) for rank in range(world_size)
                 for slot, chunk in enumerate(_rank_chunks(rank, world_size, layout))}
        # every rank takes part in the reduce-scatter, even with no gradient of its own
        parts = torch.zeros(world_size, *shape, dtype=dtype, device=device)
        for grad, (start, end) in zip(grads, spans):
            if grad is None:
                continue
            for chunk in range(start // size, -(-end // size)):
                lo, hi = max(start, chunk * size), min(end, (chunk + 1) * size)
                rank, row = place[chunk]
                row += lo - chunk * size
                parts[rank, :, :, row:row + hi - lo] += grad[:, :, lo - start:hi - start]
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.reduce_scatter(out, list(parts.unbind(0)), group=group)
        return out, None, None, None, None


def _all_to_all(x, scatter_dim, gather_dim, sequence_dim, group, world_size, layout):
    """Cut ``x`` into P parts along ``scatter_dim``, send part j to rank j, and join the
    parts received along ``gather_dim``; whichever of the two is ``sequence_dim`` follows
    the layout (:func:`_split_for_ranks`, :func:`_join_from_ranks`)."""
    x, was_bool = _as_communicable(x)
    send = torch.stack(_split_for_ranks(x, scatter_dim, world_size, layout, scatter_dim == sequence_dim))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    out = _join_from_ranks(list(received.unbind(0)), gather_dim, world_size, layout, gather_dim == sequence_dim)
    return out.bool() if was_bool else out


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all` with its transpose (the exchange with the dims swapped) as the
    backward."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, sequence_dim, group, world_size, layout):
        ctx.args = scatter_dim, gather_dim, sequence_dim, group, world_size, layout
        return _all_to_all(x, scatter_dim, gather_dim, sequence_dim, group, world_size, layout)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, sequence_dim, group, world_size, layout = ctx.args
        return (_all_to_all(grad, gather_dim, scatter_dim, sequence_dim, group, world_size, layout),
                None, None, None, None, None, None)


# --------------------------------------------------------------------------------------
# shard / unshard

def _check_seq_dim(x, seq_dim, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, numbers.Integral) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim must be an int indexing one of {name}'s {x.dim()} dims, got {seq_dim!r}")
    return int(seq_dim) % x.dim()


def shard(x, *, seq_dim=2, group=None, layout="balanced"):
    """This rank's shard of the whole sequence ``x`` (the same tensor on every rank).

    Args:
        x: any tensor holding the whole sequence along ``seq_dim``: q, k, v (B, H, L, E),
            token ids (B, L) with ``seq_dim=1``, position ids, labels, a mask's rows.
        seq_dim: the sequence dim.
        group: the process group (default: the default group).
        layout: ``"balanced"`` (rank r gets chunks r and 2P−1−r of 2P, equal causal work)
            or ``"contiguous"`` (rank r gets the r-th of P slices).

    Returns a tensor of length L/P along ``seq_dim`` (differentiable: slices of ``x``).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: unknown layout, bad seq_dim, or L not divisible by P (contiguous) or 2P
            (balanced).
    """
    _check_layout(layout)
    seq_dim = _check_seq_dim(x, seq_dim, "x")
    world_size, rank = _group_info(group)
    length, chunks = x.shape[seq_dim], _chunk_count(world_size, layout)
    if length % chunks:
        raise ValueError(f"x's length along seq_dim={seq_dim} ({length}) must be divisible by {chunks} for "
                         f"layout={layout!r} on {world_size} ranks")
    pieces = x.chunk(chunks, seq_dim) if length else [x] * chunks
    mine = [pieces[chunk] for chunk in _rank_chunks(rank, world_size, layout)]
    return mine[0] if len(mine) == 1 else torch.cat(mine, seq_dim)


def unshard(x_local, *, seq_dim=2, group=None, layout="balanced"):
    """The whole sequence from every rank's shard (the inverse of :func:`shard`): an
    all_gather, then the chunks put back in sequence order. Differentiable: the backward
    sums the ranks' gradients of this rank's shard (reduce_scatter), so that a loss on the
    whole tensor computed on every rank, gradients summed over ranks as DDP does, counts
    each use.

    Args:
        x_local: this rank's shard; same shape on every rank.
        seq_dim, group, layout: as in :func:`shard`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: unknown layout, bad seq_dim, shards of different shapes across ranks,
            an odd shard length for the balanced layout, or a device the group cannot use.
    """
    _check_layout(layout)
    seq_dim = _check_seq_dim(x_local, seq_dim, "x_local")
    world_size, _ = _group_info(group)
    _check_group_device(group, "x_local", x_local)
    _check_equal_across_ranks(group, world_size, x_local.device, {"x_local": tuple(x_local.shape)})
    if layout == "balanced" and x_local.shape[seq_dim] % 2:
        raise ValueError(f"x_local's length along seq_dim={seq_dim} ({x_local.shape[seq_dim]}) must be even for "
                         f"layout='balanced' (two chunks per rank)")
    return _AllGatherSequence.apply(x_local, seq_dim, group, world_size, layout)


# --------------------------------------------------------------------------------------
# Attention

def _choose_method(heads, kv_heads, world_size, has_mask, needs_whole_rows):
    """``method="auto"``'s rule (docs/context_parallel.md, "Choosing a method").

    Per rank and layer, forward plus backward, the all-to-all receives (P−1)/P of q, k, v,
    the output and their four gradients: 4·(P−1)/P·(H + Hkv)·B·(L/P)·E elements; the
    all-gather receives the other ranks' K and V and their partial dK, dV:
    4·(P−1)·Hkv·B·(L/P)·E. L, B and E scale both alike, so the all-to-all moves less iff
    H + Hkv < P·Hkv. At equality (MHA on two ranks) the all-to-all is taken: it
    holds (H + Hkv)/P heads of the whole sequence per rank, not all Hkv of K and V. A mask
    tips the choice to the all-gather, which reads its rows where they are; the all-to-all
    would move B·H·(L/P)·L mask entries, more than q, k and v.
    """
    divisible = heads % world_size == 0 and kv_heads % world_size == 0
    if needs_whole_rows:
        return "all_to_all" if divisible else None
    if not divisible or has_mask:
        return "all_gather"
    return "all_to_all" if heads + kv_heads <= world_size * kv_heads else "all_gather"


def _mask_4d(mask):
    return mask.view(*(1,) * (4 - mask.dim()), *mask.shape)


def _check_mask(attn_mask, batch, heads, local, length):
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor, a causal CausalBias or None, got {type(attn_mask).__name__}")
    target = (batch, heads, local, length)
    try:
        if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, target) != target:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask must be this rank's rows of the whole sequence's mask (rows in the shard's "
                         f"order, keys in sequence order): broadcastable to (B, H, L/P, L) = {target}, got shape "
                         f"{tuple(attn_mask.shape)}") from None
    return _mask_4d(attn_mask)


def _slice_heads(tensor, heads, rank, world_size, dim=-1):
    """This rank's heads of a per-head tensor (α, sinks, ALiBi slopes); others pass through."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[dim] != heads:
        return tensor
    per_rank = heads // world_size
    return tensor.narrow(dim, rank * per_rank, per_rank)


def _attention_all_to_all(query, key, value, mask, *, world_size, rank, group, layout, alpha, sinks,
                          alibi_slopes, **options):
    heads = query.shape[1]

    def to_heads(x):
        return _AllToAll.apply(x, 1, 2, 2, group, world_size, layout)

    q, k, v = to_heads(query), to_heads(key), to_heads(value)
    if mask is not None:
        local = query.shape[2]
        if mask.shape[2] == local and mask.shape[1] == heads:
            mask = to_heads(mask)
        elif mask.shape[2] == local:
            mask = _AllGatherSequence.apply(mask, 2, group, world_size, layout)
        else:
            mask = _slice_heads(mask, heads, rank, world_size, dim=1)
    out = entmax_attention(q, k, v, attn_mask=mask, alpha=_slice_heads(alpha, heads, rank, world_size),
                           sinks=_slice_heads(sinks, heads, rank, world_size),
                           alibi_slopes=_slice_heads(alibi_slopes, heads, rank, world_size), **options)
    return _AllToAll.apply(out, 2, 1, 2, group, world_size, layout)


def _attention_all_gather(query, key, value, mask, *, world_size, rank, group, layout, is_causal, window_size,
                          **options):
    length = key.shape[2] * world_size
    if not is_causal:
        keys, values = (_GatheredSpans.apply(x, ((0, length),), group, world_size, layout)[0] for x in (key, value))
        return entmax_attention(query, keys, values, attn_mask=mask, is_causal=False, window_size=window_size,
                                **options)
    left = window_size[0]
    chunks = _rank_chunks(rank, world_size, layout)
    size = query.shape[2] // len(chunks)
    # The chunk's queries sit at offset..offset+size−1 and, causal, see no key past its end;
    # a window's left bound drops the keys before offset − left as well. The window (left,
    # 0) is the lower-right causal mask of these Lq = size, Lk = end − start (query i at key
    # position i + Lk − Lq, its global position minus start).
    spans = tuple(((max(0, chunk * size - left) if left >= 0 else 0), (chunk + 1) * size) for chunk in chunks)
    keys, values = (_GatheredSpans.apply(x, spans, group, world_size, layout) for x in (key, value))
    outs = []
    for index, (start, end) in enumerate(spans):
        rows = slice(index * size, (index + 1) * size)
        chunk_mask = None
        if mask is not None:
            chunk_mask = mask[:, :, rows] if mask.shape[2] > 1 else mask
            chunk_mask = chunk_mask[..., start:end] if mask.shape[3] > 1 else chunk_mask
        outs.append(entmax_attention(query[:, :, rows], keys[index], values[index], attn_mask=chunk_mask,
                                     is_causal=False, window_size=(left, 0), **options))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


@dataclass(frozen=True)
class _CheckedCall:
    """What :func:`context_parallel_attention`'s checks establish: the group's size and this
    rank, and the causal flag, window and mask rows as the methods take them."""
    world_size: int
    rank: int
    is_causal: bool
    window_size: tuple[int, int]
    mask: torch.Tensor | None


def _checked_call(query, key, value, attn_mask, dropout_p, is_causal, window_size, group, layout, method,
                  check_across_ranks) -> _CheckedCall:
    """Every check of a call on this rank's own arguments, and with ``check_across_ranks``
    the shapes compared across ranks; a CausalBias becomes is_causal, and so does a window
    (left, 0), which with Lq = Lk holds the causal mask."""
    _check_layout(layout)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_is_causal(is_causal)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 for context-parallel attention (an exact dropout would need the "
                         f"single device's random mask), got {dropout_p!r}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be this rank's shard, a 4-D tensor (B, H, L/P, E), got {shape}")
    world_size, rank = _group_info(group)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_group_device(group, name, tensor)
    bias = causal_bias(attn_mask)
    tensor_mask = None if bias is not None else attn_mask
    if check_across_ranks:
        shapes = {"query": tuple(query.shape), "key": tuple(key.shape), "value": tuple(value.shape)}
        if isinstance(tensor_mask, torch.Tensor):
            shapes["attn_mask"] = tuple(tensor_mask.shape)
        _check_equal_across_ranks(group, world_size, query.device, shapes)
    local = query.shape[2]
    if key.shape[2] != local or value.shape[2] != local:
        raise ValueError(f"query, key and value shards must have the same length (context parallelism splits "
                         f"one sequence: self-attention), got {local}, {key.shape[2]}, {value.shape[2]}")
    if layout == "balanced" and local % 2:
        raise ValueError(f"the shards' length ({local}) must be even for layout='balanced' (two chunks per rank)")
    length = local * world_size
    if bias is not None:
        if (bias.seq_len_q, bias.seq_len_kv) != (length, length):
            raise ValueError(f"attn_mask is a CausalBias for (Lq, Lk) = ({bias.seq_len_q}, {bias.seq_len_kv}), "
                             f"but the whole sequence has (L, L) = ({length}, {length})")
        is_causal = True
    mask = None
    if tensor_mask is not None:
        mask = _check_mask(tensor_mask, query.shape[0], query.shape[1], local, length)
    window_size = check_window_size(window_size)
    if window_size[1] == 0:
        is_causal = True
    return _CheckedCall(world_size, rank, is_causal, window_size, mask)


def _method_for(method, call: _CheckedCall, heads, kv_heads, alibi_slopes) -> str:
    """``method`` checked against the heads, the window and ALiBi; "auto" resolved by
    :func:`_choose_method`."""
    world_size = call.world_size
    needs_whole_rows = not call.is_causal and (call.window_size != NO_WINDOW or alibi_slopes is not None)
    if method == "auto":
        method = _choose_method(heads, kv_heads, world_size, call.mask is not None, needs_whole_rows)
        if method is None:
            raise ValueError(f"a non-causal window_size or alibi_slopes runs only on method='all_to_all', which "
                             f"needs H ({heads}) and Hkv ({kv_heads}) divisible by the {world_size} ranks")
    if method == "all_to_all":
        if heads % world_size or kv_heads % world_size:
            raise ValueError(f"method='all_to_all' needs the query heads H ({heads}) and key/value heads Hkv "
                             f"({kv_heads}) divisible by the {world_size} ranks; use method='all_gather'")
    elif needs_whole_rows:
        raise ValueError("method='all_gather' takes window_size and alibi_slopes only with causal attention "
                         "(its query chunks see keys from their start); use method='all_to_all'")
    return method


def context_parallel_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False, *, alpha=1.5, window_size=NO_WINDOW, softcap=0.0,
                               alibi_slopes=None, sinks=None, group=None, layout="balanced", method="auto",
                               check_across_ranks=False):
    """This rank's shard of :func:`entmax_fast.entmax_attention` on the whole sequence, whose
    queries, keys and values are split across the ranks of ``group`` (:func:`shard`).
    Forward and backward are exact: each query row's threshold is taken over all its keys.

    Args:
        query: (B, H, L/P, E), key: (B, Hkv, L/P, E), value: (B, Hkv, L/P, Ev): this rank's
            shards (self-attention over one sequence of length L; equal shapes on every rank).
        attn_mask: None; a bool (True = attend) or float mask of this rank's rows of the
            whole (B, H, L, L) mask, broadcastable to (B, H, L/P, L), rows in the shard's
            order and keys in sequence order (``shard(mask, seq_dim=2)`` of the whole
            mask); or ``causal_lower_right(L, L)`` / ``causal_upper_left(L, L)``, which is
            ``is_causal``. The all-to-all moves mask rows to the ranks of their heads (an
            all-to-all for a mask per head, an all-gather of the rows for a mask shared by
            the heads).
        dropout_p: must be 0 (the dropout pattern would differ from the single device's).
        is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes, sinks: as
            in :func:`entmax_fast.entmax_attention`, on the whole sequence's positions. A
            tensor α (H,), the sinks and float masks get gradients: each rank gets the part
            from its rows, so that summing over the group (as DDP does for replicated
            parameters) gives the single-device gradient.
        group: the process group (default: the default group).
        layout: how the sequence was sharded: ``"balanced"`` or ``"contiguous"``.
        method: ``"all_to_all"`` (Ulysses; H and Hkv divisible by P), ``"all_gather"``
            (K and V gathered on every rank) or ``"auto"``: the all-gather when the heads
            do not divide by P or a tensor mask is given, else the method that moves fewer
            bytes, the all-to-all iff H + Hkv ≤ P·Hkv. A non-causal window or ALiBi needs
            whole rows of positions and runs on the all-to-all.
        check_across_ranks: first compare the shards' shapes across the ranks (one
            all_gather of the shapes and a device-to-host copy), so that every rank raises
            the same ValueError for mismatched shards instead of failing or hanging inside
            a collective. Off by default: per layer and step it would be a collective and a
            host sync. Inside :func:`context_parallel` the block's first call checks.

    Returns (B, H, L/P, Ev): this rank's rows of the whole sequence's attention.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: is_causal is not a bool.
        ValueError: unknown layout or method; dropout_p > 0; shards of different shapes on
            different ranks (with ``check_across_ranks``); query, key and value shards of
            different lengths; an odd
            shard length for the balanced layout; H or Hkv not divisible by P for
            ``method="all_to_all"``; a non-causal window or ALiBi on the all-gather; a
            mask not of this rank's rows; a device the group's backend cannot use; and
            every error of :func:`entmax_fast.entmax_attention`.
    """
    call = _checked_call(query, key, value, attn_mask, dropout_p, is_causal, window_size, group, layout, method,
                         check_across_ranks)
    method = _method_for(method, call, query.shape[1], key.shape[1], alibi_slopes)
    run = _attention_all_to_all if method == "all_to_all" else _attention_all_gather
    return run(query, key, value, call.mask, world_size=call.world_size, rank=call.rank, group=group,
               layout=layout, is_causal=call.is_causal, window_size=call.window_size, scale=scale,
               enable_gqa=enable_gqa, alpha=alpha, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


# --------------------------------------------------------------------------------------
# Context manager

@dataclass
class _Context:
    group: object
    layout: str
    method: str
    # Whether an attention call of the block has compared the shards' shapes across the
    # ranks: its first call does, which every rank makes (they run the same model code).
    checked_across_ranks: bool = False


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("entmax_fast_context_parallel", default=None)


@contextlib.contextmanager
def context_parallel(group=None, *, layout="balanced", method="auto"):
    """Within this block, the entmax attention of ``MultiheadEntmaxAttention`` (its fused
    path, ``need_weights=False``) and of the Hugging Face implementations of
    :mod:`entmax_fast.hf` runs as :func:`context_parallel_attention` on this rank's shard,
    so a model trains with context parallelism without changes to its attention code.

    The model's inputs must be this rank's shards (:func:`shard` with the same group and
    layout), positions included (e.g. ``position_ids`` for rotary embeddings), and the
    attention self-attention over the whole sequence: causal, or bidirectional without a
    mask (masks of local shape are refused; padding masks are not supported).

    The block's first attention call compares the shards' shapes across the ranks (a
    collective and a host sync, once); the later calls check only on their own rank.

    Args:
        group: the process group (default: the default group).
        layout: the layout the inputs were sharded with.
        method: as in :func:`context_parallel_attention`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: unknown layout or method.
    """
    _check_layout(layout)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _group_info(group)
    token = _CURRENT.set(_Context(group, layout, method))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_attention():
    """The attention function in effect: :func:`context_parallel_attention` bound to the
    innermost :func:`context_parallel` block's group, layout and method, or None outside
    one. It takes :func:`entmax_fast.entmax_attention`'s arguments. The block's first call
    compares the shards' shapes across the ranks (``check_across_ranks``), later calls do not."""
    context = _CURRENT.get()
    if context is None:
        return None
    return functools.partial(_attention_in_block, context)


def _attention_in_block(context, *args, **kwargs):
    out = context_parallel_attention(*args, group=context.group, layout=context.layout, method=context.method,
                                     check_across_ranks=not context.checked_across_ranks, **kwargs)
    context.checked_across_ranks = True
    return out
