// BatchInvariantAttention, CUDA kernels: the same semantics as attention_cpu.cc.
//
//   1. kv_write   grid (S, B): rotate the new rows' k (fp32, rounded to T as stored) and copy v
//                 into present[b, h, p, :], p = seqlens_k[b] + 1 - S + i.
//   2. attend     grid (Hq, S, B), 256 threads: row i, q head h over the stored cache 0..p.
// Two launches on one stream, so row i's KV is visible to rows > i of the same call. n is read
// from seqlens_k in device memory: nothing crosses to the host, so both launches can be captured.
//
// Row invariance: a row reads only the cache and its own q, and every reduction order is a
// fixed function of p and head_dim:
//   q·k   4 d per thread (serial fmaf), xor-butterfly over the D/4 threads of a position
//   sum   thread t sums positions t, t+256, ... serially -> warp butterfly -> serial over 8 warps
//   p·v   group g (of 256/(D/4) groups) sums positions g, g+G, ... serially -> serial over groups
// The max is exact in any order.
#include <cfloat>

#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace loopcast_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename T>
__global__ void kv_write_kernel(const T* __restrict__ qkv, T* __restrict__ pk, T* __restrict__ pv,
                                const int32_t* __restrict__ seqlens, const T* __restrict__ cos_cache,
                                const T* __restrict__ sin_cache, int S, int Hq, int Hkv, int D, int cap,
                                int rotary_len, bool do_rotary) {
  const int i = blockIdx.x, b = blockIdx.y;
  const int p = seqlens[b] + 1 - S + i;
  if (p < 0 || p >= cap || (do_rotary && p >= rotary_len)) return;  // out of range: nothing is written
  const int half = D / 2;
  const T* row = qkv + static_cast<size_t>(b * S + i) * (Hq + 2 * Hkv) * D;
  for (int e = threadIdx.x; e < Hkv * D; e += blockDim.x) {
    const int h = e / D, d = e % D;
    const size_t dst = (static_cast<size_t>(b * Hkv + h) * cap + p) * D + d;
    pv[dst] = row[(Hq + Hkv + h) * D + d];
    const T* k = row + (Hq + h) * D;
    if (!do_rotary) {
      pk[dst] = k[d];
    } else if (d < half) {
      const float x1 = to_f(k[d]), x2 = to_f(k[d + half]);
      const float c = to_f(cos_cache[p * half + d]), s = to_f(sin_cache[p * half + d]);
      pk[dst] = from_f<T>(x1 * c - x2 * s);
    } else {
      const float x1 = to_f(k[d - half]), x2 = to_f(k[d]);
      const float c = to_f(cos_cache[p * half + d - half]), s = to_f(sin_cache[p * half + d - half]);
      pk[dst] = from_f<T>(x2 * c + x1 * s);
    }
  }
}

// TPR = D/4 threads per position, each owning 4 consecutive d; G = 256/TPR position groups.
template <typename T, int TPR>
__global__ void __launch_bounds__(kThreads) attend_kernel(const T* __restrict__ qkv, const T* __restrict__ pk,
                                                          const T* __restrict__ pv,
                                                          const int32_t* __restrict__ seqlens,
                                                          const T* __restrict__ cos_cache,
                                                          const T* __restrict__ sin_cache, T* __restrict__ out,
                                                          int S, int Hq, int Hkv, int cap, int rotary_len,
                                                          float scale, bool do_rotary) {
  constexpr int D = TPR * 4, G = kThreads / TPR, half = D / 2;
  extern __shared__ float scores[];  // [cap]
  __shared__ float q[D];
  __shared__ float comb[G][D];
  __shared__ float wred[kWarps];
  __shared__ float stat[2];  // max, sum

  const int h = blockIdx.x, i = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int p = seqlens[b] + 1 - S + i;
  T* o = out + (static_cast<size_t>(b * S + i) * Hq + h) * D;
  if (p < 0 || p >= cap || (do_rotary && p >= rotary_len)) {  // uniform over the block
    for (int d = tid; d < D; d += kThreads) o[d] = from_f<T>(0.0f);
    return;
  }
  const T* row = qkv + static_cast<size_t>(b * S + i) * (Hq + 2 * Hkv) * D + h * D;
  for (int d = tid; d < D; d += kThreads) {
    if (!do_rotary) {
      q[d] = to_f(row[d]);
    } else {
      const int dd = d < half ? d : d - half;
      const float x1 = to_f(row[dd]), x2 = to_f(row[dd + half]);
      const float c = to_f(cos_cache[p * half + dd]), s = to_f(sin_cache[p * half + dd]);
      q[d] = d < half ? x1 * c - x2 * s : x2 * c + x1 * s;
    }
  }
  __syncthreads();

  const int grp = tid / TPR, t = tid % TPR;
  const int kvh = h / (Hq / Hkv);
  const T* kc = pk + static_cast<size_t>(b * Hkv + kvh) * cap * D;
  const T* vc = pv + static_cast<size_t>(b * Hkv + kvh) * cap * D;
  float qr[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) qr[c] = q[4 * t + c];

  // Scores. The loop bound is uniform over the block so every lane reaches the shuffles.
  float mx = -FLT_MAX;
  for (int jb = 0; jb <= p; jb += G) {
    const int j = jb + grp;
    float dot = 0.0f;
    if (j <= p) {
      const T* k = kc + static_cast<size_t>(j) * D + 4 * t;
#pragma unroll
      for (int c = 0; c < 4; ++c) dot = fmaf(qr[c], to_f(k[c]), dot);
    }
#pragma unroll
    for (int off = TPR / 2; off >= 1; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (j <= p) {
      const float sc = dot * scale;
      if (t == 0) scores[j] = sc;
      mx = fmaxf(mx, sc);
    }
  }
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) wred[warp] = mx;
  __syncthreads();
  if (tid == 0) {
    float m = wred[0];
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, wred[w]);
    stat[0] = m;
  }
  __syncthreads();
  mx = stat[0];

  float sum = 0.0f;
  for (int j = tid; j <= p; j += kThreads) {
    const float e = expf(scores[j] - mx);
    scores[j] = e;
    sum += e;
  }
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  __syncthreads();  // wred reuse, and every exp is in scores
  if (lane == 0) wred[warp] = sum;
  __syncthreads();
  if (tid == 0) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += wred[w];
    stat[1] = s;
  }

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = grp; j <= p; j += G) {
    const float e = scores[j];
    const T* v = vc + static_cast<size_t>(j) * D + 4 * t;
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] = fmaf(e, to_f(v[c]), acc[c]);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) comb[grp][4 * t + c] = acc[c];
  __syncthreads();
  const float denom = stat[1];
  for (int d = tid; d < D; d += kThreads) {
    float s = 0.0f;
    for (int g = 0; g < G; ++g) s += comb[g][d];
    o[d] = from_f<T>(s / denom);
  }
}

template <typename T, int TPR>
int launch_attend(const T* qkv, const T* pk, const T* pv, const int32_t* seqlens, const T* cos_cache,
                  const T* sin_cache, T* out, int B, int S, int Hq, int Hkv, int cap, int rotary_len, float scale,
                  bool do_rotary, cudaStream_t stream) {
  auto kernel = attend_kernel<T, TPR>;
  const size_t smem = static_cast<size_t>(cap) * sizeof(float);
  if (smem > 48 * 1024) {  // not a stream operation: allowed while a graph is being captured
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  kernel<<<dim3(Hq, S, B), kThreads, smem, stream>>>(qkv, pk, pv, seqlens, cos_cache, sin_cache, out, S, Hq, Hkv, cap,
                                                     rotary_len, scale, do_rotary);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
struct AttentionLauncher {
  static int run(const void* qkv_, const void* past_k, const void* past_v, void* present_k, void* present_v,
                 const int32_t* seqlens, const void* cos_, const void* sin_, void* out_, int B, int S, int Hq, int Hkv,
                 int D, int cap, int rotary_len, float scale, int do_rotary, void* stream_) {
    if (B <= 0 || S <= 0) return 0;
    if (Hkv <= 0 || Hq % Hkv != 0 || cap <= 0 || cap > kLoopcastMaxCudaCapacity || S > 65535 || B > 65535 ||
        Hq > 65535)
      return static_cast<int>(cudaErrorInvalidValue);
    auto stream = static_cast<cudaStream_t>(stream_);
    auto qkv = static_cast<const T*>(qkv_);
    auto pk = static_cast<T*>(present_k);
    auto pv = static_cast<T*>(present_v);
    auto cs = static_cast<const T*>(cos_);
    auto sn = static_cast<const T*>(sin_);
    auto out = static_cast<T*>(out_);
    const size_t bytes = static_cast<size_t>(B) * Hkv * cap * D * sizeof(T);
    // past and present are usually one buffer (IO binding); copy only when they differ.
    if (present_k != past_k) {
      cudaError_t err = cudaMemcpyAsync(present_k, past_k, bytes, cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return static_cast<int>(err);
    }
    if (present_v != past_v) {
      cudaError_t err = cudaMemcpyAsync(present_v, past_v, bytes, cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return static_cast<int>(err);
    }
    kv_write_kernel<T><<<dim3(S, B), kThreads, 0, stream>>>(qkv, pk, pv, seqlens, cs, sn, S, Hq, Hkv, D, cap,
                                                            rotary_len, do_rotary != 0);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
    switch (D) {
      case 16: return launch_attend<T, 4>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, do_rotary != 0, stream);
      case 32: return launch_attend<T, 8>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, do_rotary != 0, stream);
      case 64: return launch_attend<T, 16>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, do_rotary != 0, stream);
      case 128: return launch_attend<T, 32>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, do_rotary != 0, stream);
      default: return static_cast<int>(cudaErrorInvalidValue);
    }
  }
};

}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_attention(int dtype, const void* qkv, const void* past_k, const void* past_v,
                                              void* present_k, void* present_v, const int32_t* seqlens_k,
                                              const void* cos_cache, const void* sin_cache, void* out, int B, int S,
                                              int num_heads, int kv_num_heads, int head_dim, int capacity,
                                              int rotary_len, float scale, int do_rotary, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::AttentionLauncher>(
      dtype, qkv, past_k, past_v, present_k, present_v, seqlens_k, cos_cache, sin_cache, out, B, S, num_heads,
      kv_num_heads, head_dim, capacity, rotary_len, scale, do_rotary, stream);
}
