// Helpers shared by the CUDA kernels: fp32 conversions of the three element types, and the
// launch with programmatic dependent launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

namespace loopcast_cuda {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// SwiGLU of one element pair, T(T(silu(gate)) * up): explicit _rn operations (no contraction), the
// roundings of the CPU kernels (swiglu_row.h).
template <typename T>
__device__ __forceinline__ T swiglu_value(T gate, T up) {
  const float g = to_f(gate);
  const float silu = to_f(from_f<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g)))));
  return from_f<T>(__fmul_rn(silu, to_f(up)));
}

// 1 / sqrt(mean(x²) + eps) of a row spread over the 8 warps of a 256-thread group (thread
// threadIdx.x holds x[j][e]; zeros past H add nothing), in one order fixed by the layout:
// serial fmaf over the thread's elements (j, then e) -> xor butterfly over the warp -> serial sum
// over the 8 warps (every thread does it, so all hold the same bits). `sync` is the group's
// barrier; red8 holds the 8 warp sums. ResidualRMSNorm and the fused decoder layer's norms both
// reduce here, so they carry the same bits.
template <int NV, int V, typename Sync>
__device__ __forceinline__ float rms_inverse(const float (&x)[NV][V], int H, float eps, float* red8, Sync sync) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int e = 0; e < V; ++e) acc = fmaf(x[j][e], x[j][e], acc);
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
  if ((threadIdx.x & 31) == 0) red8[threadIdx.x >> 5] = acc;
  sync();
  float ss = red8[0];
#pragma unroll
  for (int w = 1; w < 8; ++w) ss = __fadd_rn(ss, red8[w]);
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(H)), eps)));
}

// Eight SwiGLU values from eight gate and eight up elements.
template <typename T>
__device__ __forceinline__ uint4 swiglu8(uint4 gate, uint4 up) {
  const T* g = reinterpret_cast<const T*>(&gate);
  const T* u = reinterpret_cast<const T*>(&up);
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = swiglu_value(g[e], u[e]);
  return out;
}

// Programmatic dependent launch (PDL, sm_90). Kernels launched through launch_kernel() may start
// while the previous kernel on the stream is still finishing, so a decode step's ~1 000 short
// kernels overlap their launch and ramp-up instead of paying them back to back. Rules for every
// such kernel: call pdl_wait() before reading anything an earlier kernel wrote or writing any
// global memory (constant weights may be read before: the matmul prefetches its first weight
// chunks there); pdl_trigger() lets the next kernel launch. The trigger only fires once every
// block of this grid has triggered or exited, so waiting blocks never starve this grid.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" :::); }

// A hint that pulls one global line into L2 (no data returned, no fault, no ordering): the
// projections' and attention's prefetch knobs (off by default: on an H100 they did not shorten the
// layer chain, docs/perf.md). The bits never depend on it.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// The device's SM count, queried once (a host attribute query: not a stream operation, so fine
// under capture); 132 (the H200's) when the query fails.
inline int device_sm_count() {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        v <= 0)
      return 132;
    sms = v;
  }
  return sms;
}

// LOOPCAST_PDL=0 launches without PDL (read at every launch, so a benchmark can compare both in
// one process; launches happen once per captured graph, not per replay).
inline bool pdl_enabled() {
  const char* v = std::getenv("LOOPCAST_PDL");
  return !(v != nullptr && v[0] == '0' && v[1] == '\0');
}

// An integer launch knob from the environment (read at every launch, like LOOPCAST_PDL, so a
// benchmark can time several values in one process): `fallback` when unset or outside [lo, hi].
inline int env_knob(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end != '\0' || x < lo || x > hi) ? fallback : static_cast<int>(x);
}

// cudaLaunchKernelEx with an optional thread-block cluster (cluster_x > 0) and PDL.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          int cluster_x, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = static_cast<unsigned>(cluster_x);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// Launch a dtype-templated functor: 0 fp32, 1 fp16, 2 bf16.
template <template <typename> class F, typename... Args>
int dispatch(int dtype, Args... args) {
  switch (dtype) {
    case 0: return F<float>::run(args...);
    case 1: return F<__half>::run(args...);
    case 2: return F<__nv_bfloat16>::run(args...);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace loopcast_cuda
