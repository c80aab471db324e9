// SwiGLU of one row on the CPU: out[i] = T(T(silu(gate[i])) · up[i]) in fp32 math, silu rounded
// to T before the product as torch's F.silu(gate) * up does in half precision. One definition
// for the SwiGLU op and the swiglu=1 matmuls' prologue, so their bits agree.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ops_common.h"
#include "vector_math.h"

namespace loopcast {

namespace {

// out[0..n) = silu(g) = g / (1 + exp(-g)) in fp32, exp by exp8; n a multiple of 8.
__attribute__((unused)) LOOPCAST_VECTOR_CLONES void silu_lanes(const float* g, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    float e[8];
    for (int l = 0; l < 8; ++l) e[l] = -g[i + l];
    exp8(e);
    for (int l = 0; l < 8; ++l) out[i + l] = g[i + l] / (1.0f + e[l]);
  }
}

}  // namespace

// silu in eight-lane groups of a fixed 256-element staging buffer, the last group padded with
// zeros: every element takes the same operations whatever the row's length, so a row's bits do
// not depend on the call. (libm's expf, one element at a time, costs about 6 ns an element.) Out
// is T, or float for a prologue that widens.
template <typename T, typename Out>
inline void swiglu_row(const T* gate, const T* up, Out* out, int64_t n) {
  constexpr int64_t kStage = 256;
  float g[kStage], silu[kStage];
  for (int64_t i0 = 0; i0 < n; i0 += kStage) {
    const int64_t m = n - i0 < kStage ? n - i0 : kStage, padded = (m + 7) / 8 * 8;
    for (int64_t l = 0; l < m; ++l) g[l] = to_float(gate[i0 + l]);
    for (int64_t l = m; l < padded; ++l) g[l] = 0.0f;
    silu_lanes(g, silu, padded);
    for (int64_t l = 0; l < m; ++l) {
      const T v = from_float<T>(to_float(from_float<T>(silu[l])) * to_float(up[i0 + l]));
      if constexpr (std::is_same<Out, T>::value) {
        out[i0 + l] = v;
      } else {
        out[i0 + l] = to_float(v);
      }
    }
  }
}

}  // namespace loopcast
