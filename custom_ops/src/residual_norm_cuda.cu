// ResidualRMSNorm, CUDA kernel: the same semantics as residual_norm_cpu.cc.
//
//   grid (rows), 256 threads; thread t owns the granules g = t + 256*j (j < NV) of its row, a
//   granule being V = 16/sizeof(T) consecutive elements (one 16-byte load). The row stays in
//   registers from the branch load to the last store: global memory is read once per input.
//
// Row invariance: a row is one block, and its sum of squares runs in one order fixed by H:
//   serial fmaf over the thread's elements (j, then e ascending) -> xor butterfly over the warp
//   -> serial sum over the 8 warps (every thread does it, so all hold the same bits).
// NV (the register footprint) and the launch shape come from H alone. Whether granules are
// loaded as 16-byte vectors or element by element (alignment) changes no arithmetic: the
// ownership, and so the order, is the same.
//
// Apart from the sum of squares (explicit fmaf), every fp32 operation is an _rn intrinsic, which
// nvcc never contracts: for T = float the roundings to T vanish and residual + g*x would otherwise
// be fusable into an fma. Only enqueues one kernel (with PDL, cuda_common.cuh): no allocation,
// no sync, capturable.
#include <cstdint>
#include <initializer_list>

#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace loopcast_cuda {
namespace {

constexpr int kThreads = 256;  // rms_inverse: 8 warps
constexpr int kWarps = kThreads / 32;

template <typename T> struct alignas(16) Granule {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f(from_f<T>(v)); }

struct NormArgs {
  const void* branch;
  const void* residual;
  const void* weight[3];  // branch, loop, out; null when absent
  void* sum;
  void* normed;
  int H;
  float eps;
  bool vec;  // every pointer 16-byte aligned and H % V == 0
};

// Granule j of this thread: out[e] <- row[(t + 256*j)*V + e], zero past H.
template <typename T>
__device__ __forceinline__ void load(const T* row, int j, int H, bool vec, float (&out)[Granule<T>::N]) {
  constexpr int V = Granule<T>::N;
  const int base = (threadIdx.x + j * kThreads) * V;
  if (vec && base < H) {
    const Granule<T> g = *reinterpret_cast<const Granule<T>*>(row + base);
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = to_f(g.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = base + e < H ? to_f(row[base + e]) : 0.0f;
  }
}

template <typename T, int NV>
__device__ __forceinline__ void store(T* row, int H, bool vec, const float (&x)[NV][Granule<T>::N]) {
  constexpr int V = Granule<T>::N;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int base = (threadIdx.x + j * kThreads) * V;
    if (vec && base < H) {
      Granule<T> g;
#pragma unroll
      for (int e = 0; e < V; ++e) g.v[e] = from_f<T>(x[j][e]);
      *reinterpret_cast<Granule<T>*>(row + base) = g;
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (base + e < H) row[base + e] = from_f<T>(x[j][e]);
    }
  }
}

// x <- T(g * T(x / sqrt(mean(x²) + eps))). `red` is this call's own shared slot, so one barrier
// suffices: no later reduction writes it.
template <typename T, int NV>
__device__ __forceinline__ void rms_norm(float (&x)[NV][Granule<T>::N], const T* __restrict__ g, int H, float eps,
                                         bool vec, float* red) {
  constexpr int V = Granule<T>::N;
  const float inv = rms_inverse<NV, V>(x, H, eps, red, [] { __syncthreads(); });
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float w[V];
    load<T>(g, j, H, vec, w);
#pragma unroll
    for (int e = 0; e < V; ++e) x[j][e] = round_to<T>(__fmul_rn(w[e], round_to<T>(__fmul_rn(x[j][e], inv))));
  }
}

template <typename T, int NV>
__global__ void __launch_bounds__(kThreads) residual_norm_kernel(NormArgs a) {
  constexpr int V = Granule<T>::N;
  __shared__ float red[3][kWarps];  // one slot per reduction
  pdl_trigger();
  pdl_wait();  // branch and residual come from the kernels before this one
  const size_t off = static_cast<size_t>(blockIdx.x) * a.H;
  const T* branch = static_cast<const T*>(a.branch) + off;
  const T* residual = a.residual ? static_cast<const T*>(a.residual) + off : nullptr;
  const T* bw = static_cast<const T*>(a.weight[0]);
  const T* lw = static_cast<const T*>(a.weight[1]);
  const T* ow = static_cast<const T*>(a.weight[2]);
  float x[NV][V];
#pragma unroll
  for (int j = 0; j < NV; ++j) load<T>(branch, j, a.H, a.vec, x[j]);
  if (bw) rms_norm<T, NV>(x, bw, a.H, a.eps, a.vec, red[0]);  // null checks are uniform over the block
  if (residual) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      float r[V];
      load<T>(residual, j, a.H, a.vec, r);
#pragma unroll
      for (int e = 0; e < V; ++e) x[j][e] = round_to<T>(__fadd_rn(r[e], x[j][e]));
    }
  }
  if (lw) rms_norm<T, NV>(x, lw, a.H, a.eps, a.vec, red[1]);
  store<T, NV>(static_cast<T*>(a.sum) + off, a.H, a.vec, x);
  if (ow) {
    rms_norm<T, NV>(x, ow, a.H, a.eps, a.vec, red[2]);
    store<T, NV>(static_cast<T*>(a.normed) + off, a.H, a.vec, x);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
struct ResidualNormLauncher {
  static int run(const void* branch, const void* residual, const void* bw, const void* lw, const void* ow,
                 void* sum, void* normed, int64_t rows, int64_t hidden, float eps, void* stream) {
    if (rows <= 0 || hidden <= 0) return 0;
    if (branch == nullptr || sum == nullptr || (ow == nullptr) != (normed == nullptr) ||
        hidden > kLoopcastMaxNormHidden || rows > 0x7fffffff)
      return static_cast<int>(cudaErrorInvalidValue);
    constexpr int V = Granule<T>::N;
    constexpr int kMaxNV = static_cast<int>(kLoopcastMaxNormHidden / (kThreads * V));  // 16 fp32, 8 fp16/bf16
    static_assert(kMaxNV >= 8, "granules per thread");
    NormArgs a{branch, residual, {bw, lw, ow}, sum, normed, static_cast<int>(hidden), eps, hidden % V == 0};
    const void* sum_c = sum;
    const void* normed_c = normed;
    for (const void* p : {branch, residual, bw, lw, ow, sum_c, normed_c})
      a.vec = a.vec && (p == nullptr || aligned16(p));
    const int granules = static_cast<int>((hidden + V - 1) / V);
    const int nv = (granules + kThreads - 1) / kThreads;  // from H only
    auto s = static_cast<cudaStream_t>(stream);
    const dim3 grid(static_cast<unsigned>(rows));
    auto kernel = nv <= 1 ? residual_norm_kernel<T, 1>
                  : nv <= 2 ? residual_norm_kernel<T, 2>
                  : nv <= 4 ? residual_norm_kernel<T, 4>
                  : nv <= 8 ? residual_norm_kernel<T, 8>
                            : residual_norm_kernel<T, kMaxNV>;
    return static_cast<int>(launch_kernel(kernel, grid, dim3(kThreads), 0, s, 0, a));
  }
};

}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_residual_rms_norm(int dtype, const void* branch, const void* residual,
                                                      const void* branch_weight, const void* loop_weight,
                                                      const void* out_weight, void* sum_out, void* normed_out,
                                                      int64_t rows, int64_t hidden, float epsilon, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::ResidualNormLauncher>(dtype, branch, residual, branch_weight,
                                                                      loop_weight, out_weight, sum_out, normed_out,
                                                                      rows, hidden, epsilon, stream);
}
