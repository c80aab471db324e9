// The per-row arithmetic of the CPU attention kernels (attention_cpu.cc, row_attention_cpu.cc):
// one definition, so a RowAttention row and a BatchInvariantAttention row are the same operations
// in the same order, bit for bit.
#pragma once

#include <cstdint>

#include "ops_common.h"

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

// q·k in eight fixed lanes over d, summed in a fixed order: vectorisable, and the same arithmetic
// for a row whatever else the call holds.
template <typename T>
inline float lane_dot(const float* q, const T* k, int64_t D) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int l = 0; l < 8; ++l) lane[l] += q[d + l] * to_float(k[d + l]);
  for (; d < D; ++d) lane[d % 8] += q[d] * to_float(k[d]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace loopcast
