// Pieces shared by the attention kernels (attention_cuda.cu) and the fused decoder layer's
// attention phase (decoder_layer_cuda.cu): the rotary expression, the row-validity rule and the
// 16-byte to fp32 conversions, so a key rotated by either kernel carries the same bits.
#pragma once

#include "cuda_common.cuh"

namespace loopcast_cuda {

// Element d of a head vector x at position p after rotate-half rotary (fp32, the expression of
// kv_write_kernel and of the q rotation, so every path gives the same bits).
template <typename T>
__device__ __forceinline__ float rotated(const T* x, int d, int half, int p, const T* cos_cache, const T* sin_cache,
                                         bool do_rotary) {
  if (!do_rotary) return to_f(x[d]);
  const int dd = d < half ? d : d - half;
  const float x1 = to_f(x[dd]), x2 = to_f(x[dd + half]);
  const float c = to_f(cos_cache[p * half + dd]), s = to_f(sin_cache[p * half + dd]);
  return d < half ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)) : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

template <typename T> struct Vec;
template <> struct Vec<float> {
  static constexpr int N = 4;
  __device__ static void cvt(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
};
template <> struct Vec<__half> {
  static constexpr int N = 8;
  __device__ static void cvt(const uint4& u, float* f) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] & 0xffffu)));
      f[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] >> 16)));
    }
  }
};
template <> struct Vec<__nv_bfloat16> {
  static constexpr int N = 8;
  __device__ static void cvt(const uint4& u, float* f) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  }
};

__device__ __forceinline__ bool row_valid(int p, int cap, int rotary_len, bool do_rotary) {
  return p >= 0 && p < cap && !(do_rotary && p >= rotary_len);
}

}  // namespace loopcast_cuda
