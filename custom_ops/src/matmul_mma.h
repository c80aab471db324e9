// The fp16 / bf16 tensor-core BatchInvariantMatMul (matmul_mma_cuda.cu), called by matmul_cuda.cu's
// launcher: Y[M, N] = A[M, K] x B (B[K, N], or B[N, K] when TB), optionally SwiGLU of A's
// [gate | up] halves or the RMSNorm prologue; rows invariant to M (see the kernel's comment).
#pragma once

#include <cuda_runtime.h>

#include "norm_prologue.cuh"

namespace loopcast_cuda {

template <typename T, bool TB>
int mma_run(const void* A, const void* B, void* Y, int M, int K, int N, bool swiglu, const NormPrologue* norm,
            cudaStream_t stream);

}  // namespace loopcast_cuda
