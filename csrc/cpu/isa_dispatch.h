// Which instruction set the CPU kernels run on.
//
// x86-64 builds target the baseline ISA (SSE2); the vector kernels are compiled a second time
// for AVX2+FMA, and the General kind's passes a third time for AVX-512, each chosen at run
// time (cpu_kernel_isa()).
#pragma once

#include <atomic>

#if defined(__GNUC__) && defined(__x86_64__)
#define ENTMAX_FAST_AVX2_KERNELS 1
#define ENTMAX_FAST_ALWAYS_INLINE inline __attribute__((always_inline))
#define ENTMAX_FAST_TARGET_AVX2 __attribute__((target("avx2,fma")))
// 512-bit vectors asked for explicitly from GCC, whose tuning for some AVX-512 CPUs
// (-mtune=skylake-avx512, checked with GCC 12) would otherwise keep the loops at 256 bits;
// clang ignores a whole target attribute naming that option, and uses 512 bits without it.
#if defined(__clang__)
#define ENTMAX_FAST_TARGET_AVX512 __attribute__((target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw")))
#else
#define ENTMAX_FAST_TARGET_AVX512 \
  __attribute__((target("avx2,fma,avx512f,avx512dq,avx512vl,avx512bw,prefer-vector-width=512")))
#endif
#else
#define ENTMAX_FAST_AVX2_KERNELS 0
#define ENTMAX_FAST_ALWAYS_INLINE inline
#endif

namespace entmax_fast_cpu {

// The kernel set in use: "avx512" where the CPU has it, else "avx2-fma" where it has that,
// else "portable"; a test can force a set below the CPU's to cover it on any machine.
enum class KernelIsa { Auto, Avx2, Portable };

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

// The CPU can run the AVX-512 kernels, and its OS saves the 512-bit registers (GCC's feature
// bits include that check).
inline bool cpu_has_avx512() {
#if ENTMAX_FAST_AVX2_KERNELS
  static const bool has = cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

inline KernelIsa requested_kernel_isa() {
  return static_cast<KernelIsa>(kernel_isa_request().load(std::memory_order_relaxed));
}

// True under the AVX-512 set as well: the kernels without an AVX-512 version run their AVX2 one.
inline bool use_avx2_kernels() { return cpu_has_avx2_fma() && requested_kernel_isa() != KernelIsa::Portable; }

inline bool use_avx512_kernels() { return cpu_has_avx512() && requested_kernel_isa() == KernelIsa::Auto; }

inline const char* active_kernel_isa() {
  if (use_avx512_kernels()) return "avx512";
  return use_avx2_kernels() ? "avx2-fma" : "portable";
}

}  // namespace entmax_fast_cpu
