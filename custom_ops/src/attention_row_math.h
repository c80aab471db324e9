// The per-row arithmetic of the CPU attention kernels (attention_cpu.cc, row_attention_cpu.cc):
// one definition, so a RowAttention row and a BatchInvariantAttention row are the same operations
// in the same order, bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_row_pairs.h"
#include "ops_common.h"
#include "vector_math.h"

namespace loopcast {

// Rotate-half (NeoX) rotary in fp32: out = [x1*cos - x2*sin, x2*cos + x1*sin].
template <typename T>
inline void rotate(const T* x, const T* cos_row, const T* sin_row, int64_t D, bool do_rotary, float* out) {
  const int64_t h = D / 2;
  if (!do_rotary) {
    for (int64_t d = 0; d < D; ++d) out[d] = to_float(x[d]);
    return;
  }
  for (int64_t d = 0; d < h; ++d) {
    const float x1 = to_float(x[d]), x2 = to_float(x[d + h]);
    const float c = to_float(cos_row[d]), s = to_float(sin_row[d]);
    out[d] = x1 * c - x2 * s;
    out[d + h] = x2 * c + x1 * s;
  }
}

// The softmax-weighted sum of one row, in fp32 over fp32 keys and values (16-bit caches are
// widened first: exact), in an order fixed by the row's visible keys alone:
//   q·k       eight fixed lanes over d (lane l takes d ≡ l mod 8, ascending), combined pairwise
//   weights   e_t = exp8(s_t - max) over the visible keys t = 0, 1, ... in ascending position
//             (exp8: one polynomial, below), their sum in eight fixed lanes over t
//   output    acc += e_t · v_t in ascending t, then acc / sum
// Plain IEEE multiplies and adds (-ffp-contract=off), so the ISA clones below (target_clones:
// AVX-512, AVX2, the baseline) give the same bits, and a row is the same whatever else the call
// holds. BatchInvariantAttention's rows (attend_causal_rows) and RowAttention's (attend_row) are
// these operations, so a pipeline row equals the decode row bit for bit.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOOPCAST_ROW_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LOOPCAST_ROW_CLONES
#endif
#define LOOPCAST_ROW_INLINE inline __attribute__((always_inline))

namespace {

LOOPCAST_ROW_INLINE float combine8(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// Helpers take and return no vectors (that would change the ABI between the clones).
LOOPCAST_ROW_INLINE float dot8(const float* q, const float* k, int64_t D) {
  f32x8 acc = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    f32x8 a, b;
    std::memcpy(&a, q + d, sizeof a);
    std::memcpy(&b, k + d, sizeof b);
    acc += a * b;
  }
  float lane[8];
  std::memcpy(lane, &acc, sizeof lane);
  for (; d < D; ++d) lane[d % 8] += q[d] * k[d];
  return combine8(lane);
}

// dot8 of q with keys k, k + D, k + 2D, k + 3D into out[0..4): four independent chains (each key's
// arithmetic exactly dot8's), so the adds' latency overlaps.
LOOPCAST_ROW_INLINE void dot8x4(const float* q, const float* k, int64_t D, float* out) {
  if (D % 8) {
    for (int u = 0; u < 4; ++u) out[u] = dot8(q, k + u * D, D);
    return;
  }
  f32x8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t d = 0; d < D; d += 8) {
    f32x8 a, b0, b1, b2, b3;
    std::memcpy(&a, q + d, sizeof a);
    std::memcpy(&b0, k + d, sizeof b0);
    std::memcpy(&b1, k + D + d, sizeof b1);
    std::memcpy(&b2, k + 2 * D + d, sizeof b2);
    std::memcpy(&b3, k + 3 * D + d, sizeof b3);
    a0 += a * b0;
    a1 += a * b1;
    a2 += a * b2;
    a3 += a * b3;
  }
  float lane[4][8];
  std::memcpy(lane[0], &a0, sizeof lane[0]);
  std::memcpy(lane[1], &a1, sizeof lane[1]);
  std::memcpy(lane[2], &a2, sizeof lane[2]);
  std::memcpy(lane[3], &a3, sizeof lane[3]);
  for (int u = 0; u < 4; ++u) out[u] = combine8(lane[u]);
}

// dot8 of q with the 8 keys k, k + D, ..., k + 7D into out[0..8): each key's lanes are dot8's,
// combined by combine8x8.
LOOPCAST_ROW_INLINE void dot8x8(const float* q, const float* k, int64_t D, float* out) {
  f32x8 acc[8] = {};
  for (int64_t d = 0; d < D; d += 8) {
    f32x8 a;
    std::memcpy(&a, q + d, sizeof a);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      f32x8 b;
      std::memcpy(&b, k + u * D + d, sizeof b);
      acc[u] += a * b;
    }
  }
  combine8x8(acc, out);
}

// scores[t] = dot8(q, key t)·scale for the keys t = from..count-1 stored contiguously from `keys`.
LOOPCAST_ROW_INLINE void score_keys(const float* q, const float* keys, int64_t count, int64_t D, float scale,
                                    float* scores, int64_t from = 0) {
  int64_t t = from;
  if (D % 8 == 0) {
    for (; t + 8 <= count; t += 8) {
      dot8x8(q, keys + t * D, D, scores + t);
      for (int u = 0; u < 8; ++u) scores[t + u] *= scale;
    }
  }
  for (; t + 4 <= count; t += 4) {
    dot8x4(q, keys + t * D, D, scores + t);
    for (int u = 0; u < 4; ++u) scores[t + u] *= scale;
  }
  for (; t < count; ++t) scores[t] = dot8(q, keys + t * D, D) * scale;
}

// e[0..8) = exp(e - mx) for e <= mx: exp8 (vector_math.h) of the differences.
LOOPCAST_ROW_INLINE void exp8_minus(float* e, float mx) {
  for (int l = 0; l < 8; ++l) e[l] = e[l] - mx;
  exp8(e);
}

// e[0..n): scores in, weights exp(s - max) out; returns their sum (eight fixed lanes over t).
LOOPCAST_ROW_INLINE float softmax_weights(float* e, int64_t n) {
  float mx = e[0];
  for (int64_t t = 1; t < n; ++t) mx = e[t] > mx ? e[t] : mx;
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    exp8_minus(e + t, mx);
    for (int l = 0; l < 8; ++l) lane[l] += e[t + l];
  }
  if (t < n) {  // the tail padded with the max (the padding's weights are dropped)
    float pad[8];
    for (int l = 0; l < 8; ++l) pad[l] = t + l < n ? e[t + l] : mx;
    exp8_minus(pad, mx);
    for (int l = 0; t + l < n; ++l) {
      e[t + l] = pad[l];
      lane[l] += pad[l];
    }
  }
  return combine8(lane);
}

LOOPCAST_ROW_INLINE void add_weighted(float* __restrict acc, float e, const float* __restrict v, int64_t D) {
  for (int64_t d = 0; d < D; ++d) acc[d] += e * v[d];
}

// acc[r] = Σ_j e_rj · v_j over row r's keys j = 0..counts[r]-1 in ascending j, for a head size D
// known at compile time: add_weighted's products and sums in the same order (so the same bits),
// with the row's accumulator in registers for its whole key loop instead of a load and a store a
// key. Rows outer: the values are read again for each row, from the cache.
template <int D>
LOOPCAST_ROW_INLINE void weighted_rows(const float* scores, int64_t stride, const int64_t* counts, int64_t rows,
                                       const float* values, float* acc) {
  constexpr int V = D / 8;
  for (int64_t r = 0; r < rows; ++r) {
    f32x8 a[V] = {};
    const float* e = scores + r * stride;
    for (int64_t j = 0; j < counts[r]; ++j) {
      const float* v = values + j * D;
      const f32x8 w = f32x8{} + e[j];
#pragma GCC unroll 16
      for (int i = 0; i < V; ++i) {
        f32x8 x;
        std::memcpy(&x, v + 8 * i, sizeof x);
        a[i] += w * x;
      }
    }
    std::memcpy(acc + r * D, a, sizeof a);
  }
}

// BatchInvariantAttention's rows that share one (sequence, kv head): row r sees keys
// 0..counts[r]-1. q [rows, D] rotated; keys, values [max count, D]; scores [rows, stride] (stride >=
// every count), acc [rows, D] and sums [rows] scratch; out [rows, D]. A row's operations are the
// same whatever rows share the call (on AVX-512, rows in pairs: attention_row_pairs.h, the same
// bits); the weighted sum keeps each row's accumulator in registers
// over its keys where the head size is 32, 64 or 128 (weighted_rows), else runs keys outer, rows
// inner (a value's load then serves every row that sees it).
__attribute__((unused)) LOOPCAST_ROW_CLONES void attend_causal_rows(const float* q, int64_t rows, const int64_t* counts,
                                                                    const float* keys, const float* values, int64_t D,
                                                                    float scale, int64_t stride, float* scores,
                                                                    float* acc, float* sums, float* out) {
  int64_t most = 0;
  int64_t paired = 0;  // rows 0..paired-1 go two at a time (attention_row_pairs.h)
#ifdef LOOPCAST_ROW_PAIRS
  if ((D == 32 || D == 64 || D == 128) && row_pairs_available()) paired = rows / 2 * 2;
#endif
  for (int64_t r = 0; r < rows; ++r) {
    int64_t from = 0;  // keys scored with the row's pair
#ifdef LOOPCAST_ROW_PAIRS
    if (r % 2 == 0 && r < paired) {
      const int64_t both = std::min(counts[r], counts[r + 1]);
      float *sa = scores + r * stride, *sb = sa + stride;
      from = D == 32   ? score_pair<32>(q + r * D, q + (r + 1) * D, keys, both, scale, sa, sb)
             : D == 64 ? score_pair<64>(q + r * D, q + (r + 1) * D, keys, both, scale, sa, sb)
                       : score_pair<128>(q + r * D, q + (r + 1) * D, keys, both, scale, sa, sb);
    } else if (r < paired) {
      from = std::min(counts[r], counts[r - 1]) / 8 * 8;
    }
#endif
    score_keys(q + r * D, keys, counts[r], D, scale, scores + r * stride, from);
    sums[r] = softmax_weights(scores + r * stride, counts[r]);
    most = std::max(most, counts[r]);
  }
  if (D == 32 || D == 64 || D == 128) {
#ifdef LOOPCAST_ROW_PAIRS
    for (int64_t r = 0; r < paired; r += 2) {
      const float *ea = scores + r * stride, *eb = ea + stride;
      if (D == 32) weighted_pair<32>(ea, eb, counts[r], counts[r + 1], values, acc + r * D, acc + (r + 1) * D);
      if (D == 64) weighted_pair<64>(ea, eb, counts[r], counts[r + 1], values, acc + r * D, acc + (r + 1) * D);
      if (D == 128) weighted_pair<128>(ea, eb, counts[r], counts[r + 1], values, acc + r * D, acc + (r + 1) * D);
    }
#endif
    const int64_t left = rows - paired;
    if (D == 64) weighted_rows<64>(scores + paired * stride, stride, counts + paired, left, values, acc + paired * D);
    if (D == 128) weighted_rows<128>(scores + paired * stride, stride, counts + paired, left, values, acc + paired * D);
    if (D == 32) weighted_rows<32>(scores + paired * stride, stride, counts + paired, left, values, acc + paired * D);
  } else {
    std::fill(acc, acc + rows * D, 0.0f);
    for (int64_t j = 0; j < most; ++j)
      for (int64_t r = 0; r < rows; ++r)
        if (j < counts[r]) add_weighted(acc + r * D, scores[r * stride + j], values + j * D, D);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] / sums[r];
}

// RowAttention's row: keys 0..p except [lo, hi), the same operations over the visible keys.
__attribute__((unused)) LOOPCAST_ROW_CLONES void attend_row(const float* q, int64_t p, int64_t lo, int64_t hi, const float* keys,
                                    const float* values, int64_t D, float scale, float* scores, float* acc,
                                    float* out) {
  // the visible keys are 0..min(lo, p+1)-1 and hi..p: two contiguous runs, scored in one order
  const bool masked = hi > lo;
  const int64_t below = masked ? std::min(lo, p + 1) : p + 1;
  const int64_t above = masked ? std::max<int64_t>(0, p + 1 - hi) : 0;
  score_keys(q, keys, below, D, scale, scores);
  if (above > 0) score_keys(q, keys + hi * D, above, D, scale, scores + below);
  int64_t t = below + above;
  const float sum = softmax_weights(scores, t);
  std::fill(acc, acc + D, 0.0f);
  t = 0;
  for (int64_t j = 0; j <= p; ++j)
    if (j < lo || j >= hi) add_weighted(acc, scores[t++], values + j * D, D);
  for (int64_t d = 0; d < D; ++d) out[d] = acc[d] / sum;
}

}  // namespace

// The fp32 view of a cache's rows 0..count-1 ([count, D] from `data`): the data itself for fp32,
// else widened into `scratch`.
template <typename T>
inline const float* rows_f32(const T* data, int64_t count, int64_t D, std::vector<float>& scratch) {
  if constexpr (std::is_same<T, float>::value) {
    return data;
  } else {
    scratch.resize(static_cast<size_t>(count * D));
    for (int64_t e = 0; e < count * D; ++e) scratch[static_cast<size_t>(e)] = to_float(data[e]);
    return scratch.data();
  }
}

}  // namespace loopcast
