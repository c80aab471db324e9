// Two attention rows at once on AVX-512 (attention_row_math.h's attend_causal_rows): a 16-lane
// register holds row a's eight lanes in its low half and row b's in its high half, and a key or a
// value is broadcast to both halves by its load. Each half is the same IEEE multiplies and adds
// of the same operands, in the same order, as the row's own eight-lane arithmetic, so the bits
// are the same; the two rows take one instruction where they took two.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vector_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
// GCC's intrinsics pass an "undefined" vector as the unmasked source, which -Werror reads as
// (maybe-)uninitialized once inlined (as in matmul_nbits_q8_cpu.cc).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#define LOOPCAST_ROW_PAIRS 1
#define LOOPCAST_PAIR_TARGET __attribute__((target("avx512f,avx512dq")))
#endif

namespace loopcast {
namespace {

#ifdef LOOPCAST_ROW_PAIRS

inline bool row_pairs_available() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return ok;
}

LOOPCAST_PAIR_TARGET inline __m512 both_halves(const float* x) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(x)); }

// score_keys' scores of rows a and b for the keys t < count / 8 · 8 (which both rows see), eight
// keys at a time: dot8x8's lanes per half, then combine8x8 and the scale per row. Returns the
// keys scored; each row's others are score_keys' own.
template <int D>
LOOPCAST_PAIR_TARGET int64_t score_pair(const float* qa, const float* qb, const float* keys, int64_t count,
                                        float scale, float* sa, float* sb) {
  constexpr int V = D / 8;
  __m512 qp[V];
  for (int i = 0; i < V; ++i)
    qp[i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + 8 * i)), _mm256_loadu_ps(qb + 8 * i), 1);
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    const float* k = keys + t * D;
    __m512 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i)
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) acc[u] = _mm512_add_ps(acc[u], _mm512_mul_ps(qp[i], both_halves(k + u * D + 8 * i)));
    f32x8 lanes[2][8];
    for (int u = 0; u < 8; ++u) {
      _mm256_storeu_ps(reinterpret_cast<float*>(&lanes[0][u]), _mm512_castps512_ps256(acc[u]));
      _mm256_storeu_ps(reinterpret_cast<float*>(&lanes[1][u]), _mm512_extractf32x8_ps(acc[u], 1));
    }
    combine8x8(lanes[0], sa + t);
    combine8x8(lanes[1], sb + t);
    for (int u = 0; u < 8; ++u) {
      sa[t + u] *= scale;
      sb[t + u] *= scale;
    }
  }
  return t;
}

// weighted_rows of rows a and b (weights ea, eb over ca, cb keys) into acc_a, acc_b: the keys both
// see in the two halves, then the longer row's own keys on its half's accumulator, alone.
template <int D>
LOOPCAST_PAIR_TARGET void weighted_pair(const float* ea, const float* eb, int64_t ca, int64_t cb, const float* values,
                                        float* acc_a, float* acc_b) {
  constexpr int V = D / 8;
  __m512 a[V];
  for (int i = 0; i < V; ++i) a[i] = _mm512_setzero_ps();
  const int64_t both = std::min(ca, cb);
  for (int64_t j = 0; j < both; ++j) {
    const float* v = values + j * D;
    const __m512 w = _mm512_mask_broadcastss_ps(_mm512_set1_ps(ea[j]), 0xFF00, _mm_set_ss(eb[j]));
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) a[i] = _mm512_add_ps(a[i], _mm512_mul_ps(w, both_halves(v + 8 * i)));
  }
  const bool a_longer = ca > cb;
  const float* e = a_longer ? ea : eb;
  __m256 rest[V];
  for (int i = 0; i < V; ++i) {
    const __m256 lo = _mm512_castps512_ps256(a[i]), hi = _mm512_extractf32x8_ps(a[i], 1);
    _mm256_storeu_ps((a_longer ? acc_b : acc_a) + 8 * i, a_longer ? hi : lo);  // that row is done
    rest[i] = a_longer ? lo : hi;
  }
  for (int64_t j = both; j < std::max(ca, cb); ++j) {
    const float* v = values + j * D;
    const __m256 w = _mm256_set1_ps(e[j]);
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) rest[i] = _mm256_add_ps(rest[i], _mm256_mul_ps(w, _mm256_loadu_ps(v + 8 * i)));
  }
  for (int i = 0; i < V; ++i) _mm256_storeu_ps((a_longer ? acc_a : acc_b) + 8 * i, rest[i]);
}

#pragma GCC diagnostic pop
#endif

}  // namespace
}  // namespace loopcast
