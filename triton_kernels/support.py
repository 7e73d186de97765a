"""Row reductions over the support of a thresholded tile, shared by the row-wise and the
attention kernels."""
import triton
import triton.language as tl


@triton.jit
def support_bits(b_d):
    """Per entry of b_d >= 0: (-1 where d = 0 else 0, an unsigned key whose minimum over a
    row is the smallest positive d), to be summed and minimised (`count_and_smallest`).

    No predicate per entry: compiled from `d > 0`, LLVM packed a thread's comparisons into
    integer bit masks and unpacked them for each use, 3-4 integer operations per entry
    (docs/gpu.md, fourth session). d >= 0 orders like its bit pattern; minus one, d = +0
    becomes -1, whose sign bit counts the zeros and whose unsigned value is the largest, so
    the unsigned minimum is the smallest positive d."""
    b_bits = b_d.to(tl.int32, bitcast=True) - 1
    return b_bits >> 31, b_bits.to(tl.uint32, bitcast=True)


@triton.jit
def count_and_smallest(zeros_negated, low, n):
    """(#{d > 0}, smallest positive d) as fp32 from the `support_bits` of n entries, summed
    and minimised (+inf for a row without a positive entry)."""
    count = (zeros_negated + n).to(tl.float32)
    smallest = tl.where(low == 0xFFFFFFFF, float("inf"), (low + 1).to(tl.float32, bitcast=True))
    return count, smallest


@triton.jit
def support_count_and_min(b_d):
    """(#{d > 0}, smallest positive d) per row of b_d >= 0 [R, N], as fp32 [R] each."""
    b_neg, b_low = support_bits(b_d)
    return count_and_smallest(tl.sum(b_neg, axis=1), tl.min(b_low, axis=1), b_d.shape[1])
