// The int8-activation kernels' vector paths (matmul_nbits_q8_cpu.h: the arithmetic they share):
// which one runs, and the operand order the activation rows (matmul_nbits_q8_rows.cc) and the
// column loops (matmul_nbits_q8_cpu.cc) agree on.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
// GCC's intrinsics pass an "undefined" vector as the unmasked source, which -Werror reads as
// (maybe-)uninitialized once inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#define LOOPCAST_Q8_AVX512 1
#define Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma")))
#define Q8_INLINE Q8_TARGET inline __attribute__((always_inline))
#endif

namespace loopcast {
namespace q8_detail {

constexpr int kLanes = 16;

enum class Isa { kPortable, kAvx2, kAvx512 };

// The widest path this CPU runs, at most LOOPCAST_CPU_ISA's (read at every call, so tests can
// compare the paths' bits in one process).
Isa vector_isa();

// The 512-bit registers' upper halves cleared before returning to code that may run legacy SSE
// instructions (libm's expf in the SwiGLU prologue, ORT's own kernels): with them left dirty,
// every such instruction after an AVX-512 tile pays a state-merge penalty (the same call at one
// row count measured 2.4x slower). Every path that ran AVX-512 code ends here.
void avx512_upper_clean();

// k within the chunk of byte j of operand vector v (matmul_nbits_q8_cpu.cc's header comment).
inline int64_t operand_k(bool wide, int64_t bits, int v, int j) {
  const int l = j / 4, t = j % 4;
  if (wide) return 32 * l + 8 * (v / 2) + 2 * t + v % 2;
  return bits == 4 ? 2 * j + v : 8 * l + 4 * v + t;
}

}  // namespace q8_detail
}  // namespace loopcast
