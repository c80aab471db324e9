// Pieces of the attention kernels (attention_cuda.cu): the rotary expression, the row-validity
// rule, the 16-byte to fp32 conversions and a chunk's scores and weighted values, so a key
// rotated or a chunk partial computed by any of its kernels carries the same bits.
#pragma once

#include <cfloat>

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

// One chunk of positions for one query row, per warp. A lane holds key/value rows
// j_first + r·PPI (r < R) and elements t·VEC .. +VEC of each; LPP lanes share a row. Positions
// past `pos` are masked. chunk_scores: the scaled scores s[r] and the warp's max over the valid
// ones. chunk_values: after the caller has reduced that max over its warps (its own barrier),
// the exponentials' sum and the weighted V sum over the warp's rows, warp-reduced. Both kernels
// (split_attend_kernel, the fused layer's attention phase) call these, so a chunk partial carries
// the same bits in both.
template <typename T, int LPP, int R, int PPI>
__device__ __forceinline__ float chunk_scores(float (&s)[R], const float (&qr)[Vec<T>::N], const uint4 (&kr)[R],
                                              float scale, int j_first, int pos) {
  constexpr int VEC = Vec<T>::N;
  float mloc = -FLT_MAX;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float kf[VEC];
    Vec<T>::cvt(kr[r], kf);
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) dot = fmaf(qr[e], kf[e], dot);
#pragma unroll
    for (int off = LPP / 2; off >= 1; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    s[r] = __fmul_rn(dot, scale);
    if (j_first + r * PPI <= pos) mloc = fmaxf(mloc, s[r]);
  }
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) mloc = fmaxf(mloc, __shfl_xor_sync(0xffffffffu, mloc, off));
  return mloc;
}

template <typename T, int LPP, int R, int PPI>
__device__ __forceinline__ float chunk_values(float (&acc)[Vec<T>::N], const float (&s)[R], const uint4 (&vr)[R],
                                              float mx, int j_first, int pos) {
  constexpr int VEC = Vec<T>::N;
  float lsum = 0.0f;
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (j_first + r * PPI <= pos) {
      const float ex = expf(__fsub_rn(s[r], mx));
      lsum += ex;
      float vf[VEC];
      Vec<T>::cvt(vr[r], vf);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = fmaf(ex, vf[e], acc[e]);
    }
  }
#pragma unroll
  for (int off = LPP; off < 32; off *= 2) {
    lsum += __shfl_xor_sync(0xffffffffu, lsum, off);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], off);
  }
  return lsum;
}

}  // namespace loopcast_cuda
