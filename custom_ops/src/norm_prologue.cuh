// The RMSNorm prologue of a projection (BatchInvariantMatMul / BatchInvariantMatMulNBits with a
// norm_weight input): the kernel's input rows are ResidualRMSNorm's branch, and the product reads
// ResidualRMSNorm's normed output in their place, formed as the rows are loaded, so the norm costs
// no launch of its own:
//
//   s1 = residual + n_b(A)      (each part optional, as ResidualRMSNorm)
//   s2 = n_loop(s1)             -> sum (the new residual stream; written when sum is not null)
//   h  = n_out(s2)              the projection's input
//
// Every block computes each row's 1/rms itself in ResidualRMSNorm's kernel order (256 threads,
// thread t owning the granules t + 256·j: serial fmaf over its elements -> xor butterfly over the
// warp -> serial sum over the 8 warps, rms_inverse in cuda_common.cuh), and every element with
// the same _rn operations, so h and sum carry exactly the bits of loopcast_cuda_residual_rms_norm:
// the fused projection equals the norm kernel followed by the plain projection, for every M.
#pragma once

#include <cstdint>

#include "cuda_common.cuh"

namespace loopcast_cuda {

struct NormPrologue {
  const void* residual;   // null: no residual add
  const void* weight[3];  // branch, loop, out (out is never null: it is what turns the prologue on)
  void* sum;              // null: the sum is not written
  float eps;
  bool vec;               // every pointer 16-byte aligned and H a multiple of the granule
};

constexpr int kNormThreads = 256;  // rms_inverse's layout: the kernels that take the prologue have 256 threads

template <typename T> __device__ __forceinline__ float norm_round(float v) { return to_f(from_f<T>(v)); }

// Element k of row `row` (branch row A + row·H) after the prologue's stage `upto`:
// 0 the branch, 1 s1, 2 s2, 3 h; inv[0..2] are the row's 1/rms of the three norms (only those
// of the stages before `upto` are read). Zero past H.
template <typename T>
__device__ __forceinline__ float norm_value(const NormPrologue& q, const T* A, int row, int k, int H,
                                            const float* inv, int upto) {
  if (k >= H) return 0.0f;
  const size_t at = static_cast<size_t>(row) * H + k;
  float x = to_f(A[at]);
  if (upto == 0) return x;
  const T* const* w = reinterpret_cast<const T* const*>(q.weight);
  if (w[0] != nullptr) x = norm_round<T>(__fmul_rn(to_f(w[0][k]), norm_round<T>(__fmul_rn(x, inv[0]))));
  if (q.residual != nullptr) x = norm_round<T>(__fadd_rn(to_f(static_cast<const T*>(q.residual)[at]), x));
  if (upto == 1) return x;
  if (w[1] != nullptr) x = norm_round<T>(__fmul_rn(to_f(w[1][k]), norm_round<T>(__fmul_rn(x, inv[1]))));
  if (upto == 2) return x;
  return norm_round<T>(__fmul_rn(to_f(w[2][k]), norm_round<T>(__fmul_rn(x, inv[2]))));
}

// inv[m][0..2] for rows m < M of A [M, H], by the whole block (uniform: every thread calls it).
// red is [M][8] floats of shared memory. Each norm's sum of squares in rms_inverse's order; its
// input is the previous stage (norm 0: the branch, 1: s1, 2: s2).
template <typename T>
__device__ void norm_row_stats(const NormPrologue& q, const T* A, int M, int H, float (*inv)[4], float (*red)[8]) {
  constexpr int V = 16 / sizeof(T);  // a granule: one 16-byte load in ResidualRMSNorm's kernel
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int m = tid; m < M; m += kNormThreads) inv[m][0] = inv[m][1] = inv[m][2] = 1.0f;
  __syncthreads();
  for (int s = 0; s < 3; ++s) {
    if (q.weight[s] == nullptr) continue;  // uniform
    for (int m = 0; m < M; ++m) {
      float acc = 0.0f;
      for (int base = tid * V; base < H; base += kNormThreads * V)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float x = norm_value<T>(q, A, m, base + e, H, inv[m], s);
          acc = fmaf(x, x, acc);
        }
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
      if (lane == 0) red[m][warp] = acc;
    }
    __syncthreads();
    for (int m = tid; m < M; m += kNormThreads) {
      float ss = red[m][0];
#pragma unroll
      for (int w = 1; w < 8; ++w) ss = __fadd_rn(ss, red[m][w]);
      inv[m][s] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(H)), q.eps)));
    }
    __syncthreads();
  }
}

// s2 of rows m < M into q.sum, the elements spread over the grid's `blocks` blocks (this one is
// `block`); a no-op when sum is null. Called after the PDL wait (it writes global memory).
template <typename T>
__device__ void norm_write_sum(const NormPrologue& q, const T* A, int M, int H, const float (*inv)[4], int block,
                               int blocks) {
  if (q.sum == nullptr) return;
  T* sum = static_cast<T*>(q.sum);
  const long long total = static_cast<long long>(M) * H;
  for (long long i = static_cast<long long>(block) * kNormThreads + threadIdx.x; i < total;
       i += static_cast<long long>(blocks) * kNormThreads) {
    const int m = static_cast<int>(i / H), k = static_cast<int>(i % H);
    sum[i] = from_f<T>(norm_value<T>(q, A, m, k, H, inv[m], 2));
  }
}

// -- The register path: rows of at most 256 granules (H <= 2048 in 16-bit, 1024 in fp32), where
// thread t owns granule t alone, ResidualRMSNorm's kernel with NV = 1. The block loads
// kNormGroup rows at once (one round trip for their branch and residual granules), keeps them in
// registers through the three norms, writes h into shared memory (the projection reads it from
// there) and, in one block, the sum. Same order and roundings as norm_row_stats / norm_value.
constexpr int kNormGroup = 4;

template <typename T> __host__ __device__ constexpr int norm_granule() { return 16 / static_cast<int>(sizeof(T)); }
template <typename T> __host__ __device__ constexpr bool norm_in_registers(int H) {
  return H <= kNormThreads * norm_granule<T>();
}

// Granule `base` .. base + V of p as raw bits (zeros past H); vec: 16-byte aligned, H % V == 0.
template <typename T>
__device__ __forceinline__ uint4 norm_load_raw(const T* p, int base, int H, bool vec) {
  constexpr int V = norm_granule<T>();
  if (vec && base + V <= H) return __ldg(reinterpret_cast<const uint4*>(p + base));
  uint4 out = make_uint4(0, 0, 0, 0);
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int e = 0; e < V; ++e) o[e] = base + e < H ? p[base + e] : from_f<T>(0.0f);
  return out;
}

template <typename T>
__device__ __forceinline__ void norm_unpack(const uint4& raw, float (&x)[norm_granule<T>()]) {
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int e = 0; e < norm_granule<T>(); ++e) x[e] = to_f(v[e]);
}

// Each group row's 1/rms of x (the thread's granule), rms_inverse's order: serial fmaf over the
// granule -> xor butterfly -> serial sum over the 8 warps; inv[i] in shared memory for all threads.
template <int V>
__device__ __forceinline__ void norm_group_inverse(const float (&x)[kNormGroup][V], int rows, int H, float eps,
                                                   float (*red)[8], float* inv) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < kNormGroup; ++i) {
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < V; ++e) acc = fmaf(x[i][e], x[i][e], acc);
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
    if (lane == 0) red[i][warp] = acc;
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    float ss = red[threadIdx.x][0];
#pragma unroll
    for (int w = 1; w < 8; ++w) ss = __fadd_rn(ss, red[threadIdx.x][w]);
    inv[threadIdx.x] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(H)), eps)));
  }
  __syncthreads();
}

// h of rows m < M of A [M, H] into h_out (shared memory, row stride h_stride >= H, zeros from H
// to h_stride); the sum too when write_sum (one block of the grid). H <= 256·V
// (norm_in_registers). red: [kNormGroup][8], inv: [3 · kNormGroup] floats of shared memory.
template <typename T>
__device__ void norm_rows_to_shared(const NormPrologue& q, const T* A, int M, int H, bool vec, T* h_out,
                                    int h_stride, bool write_sum, float (*red)[8], float* inv) {
  constexpr int V = norm_granule<T>(), G = kNormGroup;
  const int base = threadIdx.x * V;
  const T* const* w = reinterpret_cast<const T* const*>(q.weight);
  const T* residual = static_cast<const T*>(q.residual);
  T* sum = write_sum ? static_cast<T*>(q.sum) : nullptr;
  uint4 wraw[3];
#pragma unroll
  for (int s = 0; s < 3; ++s) wraw[s] = w[s] ? norm_load_raw<T>(w[s], base, H, vec) : make_uint4(0, 0, 0, 0);
  for (int m0 = 0; m0 < M; m0 += G) {  // uniform over the block
    const int rows = min(G, M - m0);
    uint4 xr[G], rr[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const size_t row = static_cast<size_t>(m0 + i) * H;
      xr[i] = i < rows ? norm_load_raw<T>(A + row, base, H, vec) : make_uint4(0, 0, 0, 0);
      rr[i] = i < rows && residual ? norm_load_raw<T>(residual + row, base, H, vec) : make_uint4(0, 0, 0, 0);
    }
    float x[G][V];
#pragma unroll
    for (int i = 0; i < G; ++i) norm_unpack<T>(xr[i], x[i]);
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      if (s == 1 && residual) {  // s1 = residual + n_b(branch)
#pragma unroll
        for (int i = 0; i < G; ++i) {
          float r[V];
          norm_unpack<T>(rr[i], r);
#pragma unroll
          for (int e = 0; e < V; ++e) x[i][e] = norm_round<T>(__fadd_rn(r[e], x[i][e]));
        }
      }
      if (s == 2 && sum != nullptr) {  // s2, before the out norm
#pragma unroll
        for (int i = 0; i < G; ++i) {
          if (i >= rows || base >= H) continue;
          uint4 raw;
          T* o = reinterpret_cast<T*>(&raw);
#pragma unroll
          for (int e = 0; e < V; ++e) o[e] = from_f<T>(x[i][e]);
          T* dst = sum + static_cast<size_t>(m0 + i) * H + base;
          if (vec && base + V <= H) {
            *reinterpret_cast<uint4*>(dst) = raw;
          } else {
            for (int e = 0; e < V && base + e < H; ++e) dst[e] = o[e];
          }
        }
      }
      if (w[s] == nullptr) continue;  // uniform
      norm_group_inverse<V>(x, rows, H, q.eps, red, inv + s * G);
      float g[V];
      norm_unpack<T>(wraw[s], g);
#pragma unroll
      for (int i = 0; i < G; ++i)
#pragma unroll
        for (int e = 0; e < V; ++e)
          x[i][e] = norm_round<T>(__fmul_rn(g[e], norm_round<T>(__fmul_rn(x[i][e], inv[s * G + i]))));
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (i >= rows || base >= H) continue;
      T* dst = h_out + static_cast<size_t>(m0 + i) * h_stride + base;
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (base + e < H) dst[e] = from_f<T>(x[i][e]);
    }
  }
  const int pad = h_stride - H;  // zeros past H: the partial last chunk reads them
  for (int i = threadIdx.x; i < M * pad; i += kNormThreads) h_out[static_cast<size_t>(i / pad) * h_stride + H + i % pad] = from_f<T>(0.0f);
  __syncthreads();
}

// The prologue's `vec` for rows of H elements (host side).
inline bool norm_vec_ok(const NormPrologue& q, const void* A, int64_t H, int granule) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool ok = H % granule == 0 && aligned(A) && aligned(q.residual) && aligned(q.sum);
  for (const void* w : q.weight) ok = ok && aligned(w);
  return ok;
}

// Eight elements of h as T bits (16-bit T), k .. k + 8 of row m.
template <typename T>
__device__ __forceinline__ uint4 norm_h8(const NormPrologue& q, const T* A, int m, int k, int H, const float* inv) {
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = from_f<T>(norm_value<T>(q, A, m, k + e, H, inv, 3));
  return out;
}

}  // namespace loopcast_cuda
