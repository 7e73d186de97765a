"""Row reductions over the support of a thresholded tile, shared by the row-wise and the
attention kernels, and the approximate log2 of their general-alpha passes."""
import triton
import triton.language as tl

from .aot import interpreting

if interpreting():
    @triton.jit
    def store_above(p_base, b_slot, b_last, b_value, b_key, threshold):
        """Stores fp32 b_value at p_base[slot] where b_key > threshold and b_slot <= b_last;
        b_slot and b_last hold 2^23 + slot in fp32 (slot < 2^23). The interpreter runs no
        PTX: tl.store here."""
        b_index = b_slot.to(tl.int32, bitcast=True) - 0x4B000000
        tl.store(p_base + b_index, b_value, mask=(b_key > threshold) & (b_slot <= b_last))

    @triton.jit
    def log2_approx(x):
        """log2 of fp32 x > 0. The interpreter runs no PTX: numpy's log2 here."""
        return tl.log2(x)

    @triton.jit
    def positive_f16(b_key):
        """fp16 1.0 where fp32 b_key > 0, else 0. The interpreter runs no PTX."""
        return (b_key > 0.0).to(tl.float16)
else:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def store_above(p_base, b_slot, b_last, b_value, b_key, threshold):
        """Stores fp32 b_value at p_base[slot] where b_key > threshold and b_slot <= b_last;
        b_slot and b_last hold 2^23 + slot in fp32 (slot < 2^23), whose bits are 0x4B000000
        + slot. A slot past b_last is not stored: a row with hundreds of scores above the
        threshold (alpha 1.25 on random scores) would otherwise write every one of them.

        An elementwise operation, so it runs in the layout its operands have, one
        multiply-add for the address and a predicated store per entry. A tl.store with
        data-dependent addresses is first converted to a "coalesced" layout through shared
        memory, every operand (the 64-bit addresses too), in rounds between barriers: from
        the scores' MMA layout that made the pass capturing scores
        (attention_fwd._threshold_tile) 45 instructions per score, against 24 this way and
        13 without the capture (sm_90, bf16, E 64, alpha 1.5)."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 a; setp.gt.f32 p, $4, $5; "
            "setp.le.and.f32 p, $6, $7, p; "
            "mad.wide.u32 a, $2, 4, $1; @p st.global.b32 [a], $3; mov.b32 $0, 0; }",
            "=r,l,r,r,r,r,r,r",
            [(p_base - 0x4B000000).to(tl.int64), b_slot.to(tl.int32, bitcast=True),
             b_value.to(tl.int32, bitcast=True), b_key, threshold, b_slot, b_last],
            dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def positive_f16(b_key):
        """fp16 1.0 where fp32 b_key > 0, else 0 (NaN: 0): the comparison's fp32 1.0 or 0,
        two of them packed by one conversion (the first entry in the low half). Compiled
        from `(b_key > 0).to(tl.float16)` it was a predicate, a select of the fp16
        constant and a byte permute per pair: sm_90, bf16, E 64, the capture's tile loop
        16.6 -> 15.5 instructions per score at alpha 1.5. (With the comparisons in the
        assembly too, general alpha's capture took 16.7 instead of 19.4, but its passes
        over the tiles without a capture spilled more, 56.8 -> 59.9.)"""
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [(b_key > 0.0).to(tl.float32)],
            dtype=tl.float16, is_pure=True, pack=2)

    @triton.jit
    def log2_approx(x):
        """log2 of fp32 x > 0 by the hardware's approximation (lg2.approx: one MUFU
        instruction, absolute error about 2^-22), not libdevice's log2f (a polynomial: the
        general-alpha row-wise pass loop held 83 instructions per entry with it, 57 with
        this; sm_90). p = d^e then carries a relative error of about e·2^-22·ln 2, below
        1e-6 for e <= 4. Nearer alpha = 1, row-wise rows take log1p where d is near 1
        (`rowwise._log2_base`; elsewhere p <= (7/8)^e keeps the error below 5e-7), and
        attention heads keep the accurate log (`attention_common.log2_base`)."""
        return libdevice.fast_log2f(x)


@triton.jit
def support_bits(b_d):
    """Per entry of b_d >= 0: (-1 where d = 0 else 0, an unsigned key whose minimum over a
    row is the smallest positive d), to be summed and minimised (`count_and_smallest`).

    No predicate per entry: compiled from `d > 0`, LLVM packed a thread's comparisons into
    integer bit masks and unpacked them for each use, 3-4 integer operations per entry
    (sm_90 SASS, triton 3.6, bf16 E 64: a later threshold pass 17.2 -> 13.4 instructions
    per score at alpha 1.5, 15.8 -> 12.1 at alpha 2). d >= 0 orders like its bit pattern;
    minus one, d = +0 becomes -1, whose sign bit counts the zeros and whose unsigned value
    is the largest, so the unsigned minimum is the smallest positive d."""
    b_bits = b_d.to(tl.int32, bitcast=True) - 1
    return b_bits >> 31, b_bits.to(tl.uint32, bitcast=True)


@triton.jit
def count_and_smallest(zeros_negated, low, n):
    """(#{d > 0}, smallest positive d) as fp32 from the `support_bits` of n entries, summed
    and minimised (+inf for a row without a positive entry)."""
    count = (zeros_negated + n).to(tl.float32)
    smallest = tl.where(low == 0xFFFFFFFF, float("inf"), (low + 1).to(tl.float32, bitcast=True))
    return count, smallest
