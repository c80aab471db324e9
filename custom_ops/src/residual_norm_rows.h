// ResidualRMSNorm's arithmetic on the CPU, per row: the op (residual_norm_cpu.cc) and the norm
// prologue of the CPU projections (norm_prologue_io.h) share it, so a fused projection's input is
// the op's normed output bit for bit.
//
//   b      = branch_weight ? norm(branch, branch_weight) : branch
//   s      = residual ? T(residual + b) : b
//   s      = loop_weight ? norm(s, loop_weight) : s      -> sum
//   normed = norm(s, out_weight)                         (only with out_weight)
//
// norm(v, g) = T(g * T(v * 1/sqrt(mean(v²) + eps))), fp32 math with the two roundings of the
// torch reference (normalise in fp32, round to T, scale by the weight, round again).
//
// Row invariance: a row is computed alone, and its sum of squares runs over kLanes partial sums
// combined in a fixed order that depends on H only, never on the number of rows.
#pragma once

#include <cmath>
#include <vector>

#include "ops_common.h"

namespace loopcast {
namespace residual_norm {

template <typename T> inline float round_to(float v) { return to_float(from_float<T>(v)); }

// Lane j takes h ≡ j mod kLanes, h ascending; the lanes are combined pairwise in a fixed order.
// Vectorisable, unlike a single serial sum.
inline float sum_squares(const float* x, int64_t H) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[h + j] * x[h + j];
  for (int j = 0; h < H; ++h, ++j) lanes[j] += x[h] * x[h];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

// x <- norm(x, g), in place.
template <typename T>
void rms_norm(float* x, const T* g, int64_t H, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps);
  for (int64_t h = 0; h < H; ++h) x[h] = round_to<T>(to_float(g[h]) * round_to<T>(x[h] * inv));
}

// rows x H: sum (null: not written) and normed (null without out_weight). Absent inputs are null.
template <typename T>
void rows(const T* branch, const T* residual, const T* bw, const T* lw, const T* ow, T* sum, T* normed,
          int64_t n_rows, int64_t H, float eps) {
  std::vector<float> x(static_cast<size_t>(H));
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t off = r * H;
    for (int64_t h = 0; h < H; ++h) x[h] = to_float(branch[off + h]);
    if (bw) rms_norm(x.data(), bw, H, eps);
    if (residual)
      for (int64_t h = 0; h < H; ++h) x[h] = round_to<T>(to_float(residual[off + h]) + x[h]);
    if (lw) rms_norm(x.data(), lw, H, eps);
    if (sum)
      for (int64_t h = 0; h < H; ++h) sum[off + h] = from_float<T>(x[h]);
    if (ow) {
      rms_norm(x.data(), ow, H, eps);
      for (int64_t h = 0; h < H; ++h) normed[off + h] = from_float<T>(x[h]);
    }
  }
}

}  // namespace residual_norm
}  // namespace loopcast
