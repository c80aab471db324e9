// Eight-lane fp32 arithmetic shared by the CPU kernels, in GCC vector extensions: plain IEEE
// operations (-ffp-contract=off), so every ISA clone (target_clones) and the portable build give
// the same bits. Helpers take and return no vectors (that would change the ABI between clones).
#pragma once

#include <cstdint>
#include <cstring>

// ISA clones of a vector loop: each gives the same bits (the rule above), the fastest runs.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOOPCAST_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LOOPCAST_VECTOR_CLONES
#endif

namespace loopcast {
namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// e[0..8) = exp(e) within 2 ulp, each lane clamped to [-87, 88] first (NaN stays NaN): x = n·ln2
// + r (n rounded to nearest, ln2 in two parts), e^r by Cephes' degree-6 polynomial, times 2^n
// from the exponent bits. Below -87 it gives about 2^-126; at 88, 1.65e38 (finite).
inline __attribute__((always_inline)) void exp8(float* e) {
  f32x8 x;
  std::memcpy(&x, e, sizeof x);
  const f32x8 lo = f32x8{} - 87.0f, hi = f32x8{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32x8 magic = f32x8{} + 12582912.0f;  // 1.5·2^23: adding and subtracting it rounds to an integer
  const f32x8 n = (x * 1.44269504088896341f + magic) - magic;
  f32x8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
  f32x8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  p = p * scale;
  std::memcpy(e, &p, sizeof p);
}

// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]: one level of combine8's pairs for two
// vectors of lanes at once (a macro: helpers pass no vectors).
#define LOOPCAST_ADJACENT_PAIRS(a, b)                         \
  (__builtin_shuffle(a, b, i32x8{0, 2, 8, 10, 4, 6, 12, 14}) + \
   __builtin_shuffle(a, b, i32x8{1, 3, 9, 11, 5, 7, 13, 15}))

// combine8 of 8 keys' lane vectors acc[0..8) into out[0..8): combine8's pairs for the 8 keys
// together (the keys transposed across the vectors as they combine: the same additions of the
// same operands, so the same bits, in 7 vector adds where 8 keys alone take 56 scalar ones).
inline __attribute__((always_inline)) void combine8x8(const f32x8* acc, float* out) {
  const f32x8 p0 = LOOPCAST_ADJACENT_PAIRS(acc[0], acc[1]), p1 = LOOPCAST_ADJACENT_PAIRS(acc[2], acc[3]);
  const f32x8 p2 = LOOPCAST_ADJACENT_PAIRS(acc[4], acc[5]), p3 = LOOPCAST_ADJACENT_PAIRS(acc[6], acc[7]);
  // per key: (l0+l1)+(l2+l3) in lanes 0-3, (l4+l5)+(l6+l7) in lanes 4-7 (keys 0-3, then 4-7)
  const f32x8 g0 = LOOPCAST_ADJACENT_PAIRS(p0, p1), g1 = LOOPCAST_ADJACENT_PAIRS(p2, p3);
  const f32x8 sums = __builtin_shuffle(g0, g1, i32x8{0, 1, 2, 3, 8, 9, 10, 11}) +
                     __builtin_shuffle(g0, g1, i32x8{4, 5, 6, 7, 12, 13, 14, 15});
  std::memcpy(out, &sums, sizeof sums);
}

}  // namespace
}  // namespace loopcast
