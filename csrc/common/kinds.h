// The kinds that specialise kernels, mirrored from entmax_fast/common.py (the one
// definition; tests/test_architecture.py checks that the values here agree with it).
#pragma once

namespace entmax_fast {

// How alpha enters a kernel: 1, 1.5 and 2 have closed forms; anything else is General.
enum class AlphaKind : int { kGeneral = 0, kSoftmax = 1, kEntmax15 = 2, kSparsemax = 3 };

// How attn_mask enters the attention scores.
enum class MaskKind : int { kNone = 0, kBool = 1, kAdditive = 2 };

// What an attention forward keeps for the backward.
enum class GradKind : int { kNone = 0, kInputs = 1, kAlpha = 2 };

// The proximal operator of a structured mapping: fusedmax (TV) or oscarmax (OSCAR).
enum class Prox : int { kTV = 0, kOSCAR = 1 };

inline AlphaKind alpha_kind(double alpha) {
  if (alpha == 1.0) return AlphaKind::kSoftmax;
  if (alpha == 1.5) return AlphaKind::kEntmax15;
  if (alpha == 2.0) return AlphaKind::kSparsemax;
  return AlphaKind::kGeneral;
}

}  // namespace entmax_fast
