// Device helpers shared by the CUDA kernels: fp32 conversions of the three element types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace loopcast_cuda {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

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
