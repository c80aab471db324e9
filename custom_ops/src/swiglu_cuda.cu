// SwiGLU, CUDA kernel: the same semantics as swiglu_cpu.cc, out = T(T(silu(gate)) * up).
//
// Elementwise, so a row never depends on the others. A thread computes one granule of V = 16 /
// sizeof(T) outputs from one 16-byte load of gate and one of up when the pointers are aligned
// and I % V == 0 (then no granule straddles the gate|up boundary or a row), else one element.
// The grid comes from the element count (grid-stride beyond the launch limit). Only enqueues one
// kernel: no allocation, no sync, capturable.
#include <algorithm>
#include <cstdint>

#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace loopcast_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;

template <typename T> struct alignas(16) Granule {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// n = rows * I / V granules; granule k is row k / (I/V), columns (k % (I/V)) * V ...
template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_vec_kernel(const T* gate_up, T* out, int64_t n, int64_t I) {
  pdl_trigger();
  pdl_wait();  // gate_up comes from the projection before
  constexpr int V = Granule<T>::N;
  const int64_t per_row = I / V;
  for (int64_t k = blockIdx.x * int64_t(kThreads) + threadIdx.x; k < n; k += int64_t(gridDim.x) * kThreads) {
    const int64_t r = k / per_row, c = (k % per_row) * V;
    const T* g = gate_up + r * 2 * I + c;
    const Granule<T> gv = *reinterpret_cast<const Granule<T>*>(g);
    const Granule<T> uv = *reinterpret_cast<const Granule<T>*>(g + I);
    Granule<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = swiglu_value(gv.v[e], uv.v[e]);
    *reinterpret_cast<Granule<T>*>(out + r * I + c) = o;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* gate_up, T* out, int64_t n, int64_t I) {
  pdl_trigger();
  pdl_wait();
  for (int64_t k = blockIdx.x * int64_t(kThreads) + threadIdx.x; k < n; k += int64_t(gridDim.x) * kThreads) {
    const int64_t r = k / I, c = k % I;
    out[k] = swiglu_value(gate_up[r * 2 * I + c], gate_up[r * 2 * I + I + c]);
  }
}

template <typename T>
struct SwiGLULauncher {
  static int run(const void* gate_up, void* out, int64_t rows, int64_t inter, void* stream) {
    if (rows <= 0 || inter <= 0) return 0;
    if (gate_up == nullptr || out == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    constexpr int V = Granule<T>::N;
    auto in = static_cast<const T*>(gate_up);
    auto o = static_cast<T*>(out);
    auto s = static_cast<cudaStream_t>(stream);
    const bool vec = inter % V == 0 && reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(out) % 16 == 0;
    const int64_t n = vec ? rows * (inter / V) : rows * inter;
    const unsigned blocks = static_cast<unsigned>(std::min(kMaxBlocks, (n + kThreads - 1) / kThreads));
    return static_cast<int>(launch_kernel(vec ? swiglu_vec_kernel<T> : swiglu_kernel<T>, dim3(blocks), dim3(kThreads),
                                          0, s, 0, in, o, n, inter));
  }
};

}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_swiglu(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                                           void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::SwiGLULauncher>(dtype, gate_up, out, rows, inter, stream);
}
