// BatchInvariantMatMulNBits on CUDA: the C entry points. The kernels and their M-invariance
// argument are in matmul_nbits_kernel.cuh; each (dtype, bits) is compiled in its own file.
#include "matmul_nbits_kernel.cuh"

namespace loopcast_cuda {

// compiled in matmul_nbits_<dtype>_int<bits>.cu
extern template int nbits_run<float, 4>(const NBitsArgs&, bool, bool, cudaStream_t);
extern template int nbits_run<float, 8>(const NBitsArgs&, bool, bool, cudaStream_t);
extern template int nbits_run<__half, 4>(const NBitsArgs&, bool, bool, cudaStream_t);
extern template int nbits_run<__half, 8>(const NBitsArgs&, bool, bool, cudaStream_t);
extern template int nbits_run<__nv_bfloat16, 4>(const NBitsArgs&, bool, bool, cudaStream_t);
extern template int nbits_run<__nv_bfloat16, 8>(const NBitsArgs&, bool, bool, cudaStream_t);

namespace {

template <typename T>
struct NBitsLauncher {
  static int run(const void* A, const void* B, const float* scales, const uint8_t* zp, void* Y, int64_t M, int64_t K,
                 int64_t N, int bits, int block_size, int swiglu, const NormPrologue* norm, void* stream) {
    if (M <= 0 || N <= 0) return 0;
    if (norm != nullptr && (swiglu || norm->weight[2] == nullptr)) return static_cast<int>(cudaErrorInvalidValue);
    if (K <= 0 || K > (1 << 28) || N > (1 << 30) || M > (1 << 30) || (bits != 4 && bits != 8) || block_size < 16 ||
        block_size > 256 || (block_size & (block_size - 1)) != 0)
      return static_cast<int>(cudaErrorInvalidValue);
    NBitsArgs p{};
    p.A = A;
    p.B = static_cast<const uint8_t*>(B);
    p.scales = scales;
    p.zp = zp;
    p.Y = Y;
    p.M = static_cast<int>(M);
    p.K = static_cast<int>(K);
    p.N = static_cast<int>(N);
    p.block_size = block_size;
    p.nb = static_cast<int>((K + block_size - 1) / block_size);
    p.zp_row = (p.nb * bits + 7) / 8;
    const int cpc = 128 / bits;  // codes a 16-byte chunk
    p.chunks = static_cast<int>((K + cpc - 1) / cpc);
    p.a_stride = static_cast<int>(swiglu ? 2 * K : K);
    p.stage_stride = p.chunks * cpc;
    p.row_bytes = static_cast<long long>(p.nb) * block_size * bits / 8;
    // 16-byte chunk loads: rows that are whole chunks (int4 blocks of 16 are 8 bytes) on an aligned base
    p.b_vec = reinterpret_cast<uintptr_t>(B) % 16 == 0 && p.row_bytes % 16 == 0;
    p.a_vec = reinterpret_cast<uintptr_t>(A) % 16 == 0 && K % 8 == 0;
    if (static_cast<long long>(N) * p.nb > (1LL << 31)) return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    if (norm != nullptr) p.norm = *norm;
    return bits == 4 ? nbits_run<T, 4>(p, swiglu != 0, norm != nullptr, s)
                     : nbits_run<T, 8>(p, swiglu != 0, norm != nullptr, s);
  }
};


}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_matmul_nbits(int dtype, const void* A, const void* B, const float* scales,
                                                 const uint8_t* zero_points, void* Y, int64_t M, int64_t K, int64_t N,
                                                 int bits, int block_size, int swiglu, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::NBitsLauncher>(dtype, A, B, scales, zero_points, Y, M, K, N, bits,
                                                               block_size, swiglu,
                                                               static_cast<const loopcast_cuda::NormPrologue*>(nullptr),
                                                               stream);
}

LOOPCAST_CUDA_API int loopcast_cuda_norm_matmul_nbits(int dtype, const void* A, const void* residual,
                                                      const void* branch_weight, const void* loop_weight,
                                                      const void* norm_weight, float epsilon, void* sum_out,
                                                      const void* B, const float* scales, const uint8_t* zero_points,
                                                      void* Y, int64_t M, int64_t K, int64_t N, int bits,
                                                      int block_size, void* stream) {
  if (norm_weight == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  loopcast_cuda::NormPrologue norm{residual, {branch_weight, loop_weight, norm_weight}, sum_out, epsilon, false};
  norm.vec = loopcast_cuda::norm_vec_ok(norm, A, K, dtype == 0 ? 4 : 8);
  return loopcast_cuda::dispatch<loopcast_cuda::NBitsLauncher>(dtype, A, B, scales, zero_points, Y, M, K, N, bits,
                                                               block_size, 0, &norm, stream);
}
