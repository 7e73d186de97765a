// Which instruction set the CPU kernels run on.
//
// x86-64 builds target the baseline ISA (SSE2); the General kind's kernels are compiled a
// second time for AVX2+FMA and chosen at run time (cpu_kernel_isa()).
#pragma once

#include <atomic>

#if defined(__GNUC__) && defined(__x86_64__)
#define ENTMAX_FAST_AVX2_KERNELS 1
#define ENTMAX_FAST_ALWAYS_INLINE inline __attribute__((always_inline))
#define ENTMAX_FAST_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define ENTMAX_FAST_AVX2_KERNELS 0
#define ENTMAX_FAST_ALWAYS_INLINE inline
#endif

namespace entmax_fast_cpu {

// The kernel set in use: "avx2-fma" where the CPU has it, else "portable"; a test can force
// "portable" to cover that path on any machine.
enum class KernelIsa { Auto, Portable };

inline std::atomic<int>& kernel_isa_request() {
  static std::atomic<int> request{static_cast<int>(KernelIsa::Auto)};
  return request;
}

inline bool cpu_has_avx2_fma() {
#if ENTMAX_FAST_AVX2_KERNELS
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

inline bool use_avx2_kernels() {
  return cpu_has_avx2_fma() && kernel_isa_request().load(std::memory_order_relaxed) == static_cast<int>(KernelIsa::Auto);
}

inline const char* active_kernel_isa() { return use_avx2_kernels() ? "avx2-fma" : "portable"; }

}  // namespace entmax_fast_cpu
