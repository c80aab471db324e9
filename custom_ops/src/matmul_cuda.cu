// BatchInvariantMatMul, CUDA kernel for skinny products (decode M = 1, verify M <= 32).
//
// The product is memory-bound on the weight B, so each block copies one weight slice
// [k-slice, 128-byte column tile] from HBM to shared memory once (cp.async, 16-byte granules)
// and applies it to every row of A, 1..8 rows per pass (more rows: more passes over the same
// shared-memory slice). A thread block cluster of CS blocks splits K; ranks combine through
// distributed shared memory, so no scratch buffer and no atomics are needed.
//
//   grid (CS, tiles), cluster (CS, 1, 1), 256 threads = 8 granules x 32 k-lanes
//   thread (g, kl): columns g*VEC..g*VEC+VEC-1 of the tile, k = k_begin + kl + 32*j (j ascending)
//
// M-invariance: the reduction of output (m, n) is
//   serial fmaf over the thread's k (ascending) -> xor-butterfly over the 4 k-lanes of a warp
//   -> serial sum over the 8 warps -> serial sum over the CS cluster ranks,
// and CS, the k-slices and the tile width depend only on (K, N, dtype). Rows never interact:
// the rows-per-pass template (1, 2, 4, 8) only changes which rows a pass computes, not how.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "cuda_common.cuh"
#include "cuda_launch.h"
#include "matmul_mma.h"
#include "norm_prologue.cuh"

namespace cg = cooperative_groups;

namespace loopcast_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kGranules = 8;                      // 16-byte granules per tile row
constexpr int kLanesK = kThreads / kGranules;     // 32 k-lanes
constexpr int kWarps = kThreads / 32;
constexpr int kSliceRows = 704;                   // smem slice: 704 x 128 B = 88 KiB, 2 blocks/SM
constexpr int kTargetBlocks = 264;                // ~2 per SM on an H100/H200; a constant, not
                                                  // queried, so the reduction order is the same on every GPU
constexpr int kMaxCluster = 8;                    // portable cluster size

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// Copy rows [s0, s0+slen) x columns [n0, n0+TN) of the weight into bs[slen][TN] (columns past N
// are left unset: their outputs are never stored).
template <typename T>
__device__ void load_slice(T* bs, const T* __restrict__ B, int K, int N, int s0, int slen, int n0, bool trans_b,
                           bool vec_ok) {
  constexpr int VEC = 16 / sizeof(T), TN = kGranules * VEC;
  const int tid = threadIdx.x;
  if (!trans_b) {  // B[K, N]: a tile row is 128 contiguous bytes
    if (vec_ok) {
      for (int idx = tid; idx < slen * kGranules; idx += kThreads) {
        const int kk = idx / kGranules, gg = idx % kGranules, n = n0 + gg * VEC;
        if (n < N) cp_async16(bs + kk * TN + gg * VEC, B + static_cast<size_t>(s0 + kk) * N + n);
      }
      cp_async_wait_all();
    } else {
      for (int idx = tid; idx < slen * TN; idx += kThreads) {
        const int kk = idx / TN, c = idx % TN, n = n0 + c;
        bs[kk * TN + c] = n < N ? B[static_cast<size_t>(s0 + kk) * N + n] : from_f<T>(0.0f);
      }
    }
  } else {  // B[N, K]: read along k (coalesced), transpose into the [k][n] slice
    if (vec_ok) {  // K % VEC == 0 and slices start at multiples of 32, so granules never straddle
      const int chunks = slen / VEC;
      for (int idx = tid; idx < TN * chunks; idx += kThreads) {
        const int c = idx / chunks, kc = idx % chunks, n = n0 + c;
        if (n >= N) continue;
        const uint4 raw = *reinterpret_cast<const uint4*>(B + static_cast<size_t>(n) * K + s0 + kc * VEC);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < VEC; ++j) bs[(kc * VEC + j) * TN + c] = v[j];
      }
    } else {
      for (int idx = tid; idx < TN * slen; idx += kThreads) {
        const int c = idx / slen, kk = idx % slen, n = n0 + c;
        bs[kk * TN + c] = n < N ? B[static_cast<size_t>(n) * K + s0 + kk] : from_f<T>(0.0f);
      }
    }
  }
}

// A row r starts at A + r * a_stride; swiglu: the element at k is swiglu(A[r][k], A[r][K + k]).
template <typename T, int RPT>
__global__ void __launch_bounds__(kThreads) matmul_kernel(const T* __restrict__ A, const T* __restrict__ B,
                                                          T* __restrict__ Y, int M, int K, int N, int ks,
                                                          bool trans_b, bool vec_ok, int a_stride, bool swiglu,
                                                          NormPrologue norm, bool has_norm) {
  constexpr int VEC = 16 / sizeof(T), TN = kGranules * VEC;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* bs = reinterpret_cast<T*>(smem_raw);  // [min(ks, kSliceRows)][TN]
  __shared__ float red[kWarps][RPT][TN];   // per-warp partials
  __shared__ float part[RPT * TN];         // this block's partial, read by the whole cluster
  __shared__ float norm_inv[32][4];        // the norm prologue (launches of <= 32 rows)
  __shared__ float norm_red[32][8];

  pdl_trigger();
  pdl_wait();  // fp32 is not the hot path: no weight prefetch before the wait
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int cs = static_cast<int>(cluster.num_blocks());
  if (has_norm) {  // uniform
    norm_row_stats<T>(norm, A, M, K, norm_inv, norm_red);
    norm_write_sum<T>(norm, A, M, K, norm_inv, blockIdx.y * cs + rank, cs * gridDim.y);
  }
  const int n0 = blockIdx.y * TN;
  const int k_begin = min(K, rank * ks), k_end = min(K, k_begin + ks);
  const int tid = threadIdx.x, g = tid % kGranules, kl = tid / kGranules;
  const int lane = tid & 31, warp = tid >> 5;
  const int nsub = (k_end - k_begin + kSliceRows - 1) / kSliceRows;

  for (int m0 = 0; m0 < M; m0 += RPT) {  // uniform over the cluster: every rank syncs equally often
    float acc[RPT][VEC];
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
      for (int c = 0; c < VEC; ++c) acc[r][c] = 0.0f;
    const T* a_rows[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) a_rows[r] = A + static_cast<size_t>(min(m0 + r, M - 1)) * a_stride;  // rows >= M: discarded

    for (int sub = 0; sub < nsub; ++sub) {
      const int s0 = k_begin + sub * kSliceRows, slen = min(kSliceRows, k_end - s0);
      if (m0 == 0 || nsub > 1) {  // one slice: loaded once, reused by every pass
        __syncthreads();
        load_slice(bs, B, K, N, s0, slen, n0, trans_b, vec_ok);
        __syncthreads();
      }
      // k-lane kl takes k = s0 + kl + 32*j; kSliceRows % 32 == 0, so across slices this is
      // still k_begin + kl + 32*j in ascending order.
      for (int kk = kl; kk < slen; kk += kLanesK) {
        const uint4 raw = *reinterpret_cast<const uint4*>(bs + kk * TN + g * VEC);
        const T* bv = reinterpret_cast<const T*>(&raw);
        float b[VEC];
#pragma unroll
        for (int c = 0; c < VEC; ++c) b[c] = to_f(bv[c]);
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
          const int row = min(m0 + r, M - 1);
          const float a = has_norm ? norm_value<T>(norm, A, row, s0 + kk, K, norm_inv[row], 3)
                          : swiglu ? to_f(swiglu_value(__ldg(a_rows[r] + s0 + kk), __ldg(a_rows[r] + K + s0 + kk)))
                                   : to_f(__ldg(a_rows[r] + s0 + kk));
#pragma unroll
          for (int c = 0; c < VEC; ++c) acc[r][c] = fmaf(a, b[c], acc[r][c]);
        }
      }
    }
    // k-lanes kl%4 = 0..3 sit on lane bits 3 and 4.
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
      for (int c = 0; c < VEC; ++c) {
        float v = acc[r][c];
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        if (lane < kGranules) red[warp][r][g * VEC + c] = v;
      }
    __syncthreads();
    for (int e = tid; e < RPT * TN; e += kThreads) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[w][e / TN][e % TN];
      part[e] = s;
    }
    cluster.sync();  // every rank's part is complete
    for (int e = rank + cs * tid; e < RPT * TN; e += cs * kThreads) {
      float s = 0.0f;
      for (int q = 0; q < cs; ++q) s += cluster.map_shared_rank(part, q)[e];
      const int m = m0 + e / TN, n = n0 + e % TN;
      if (m < M && n < N) Y[static_cast<size_t>(m) * N + n] = from_f<T>(s);
    }
    cluster.sync();  // nobody overwrites part (or exits) while another rank still reads it
  }
}

struct Plan {
  int cs, ks, tiles, smem;
};

// Launch shape from (K, N, dtype) only, never from M.
template <typename T>
Plan plan_for(int K, int N) {
  constexpr int VEC = 16 / sizeof(T), TN = kGranules * VEC;
  Plan p{};
  p.tiles = (N + TN - 1) / TN;
  p.cs = 1;
  while (p.cs < kMaxCluster && p.tiles * p.cs < kTargetBlocks && K >= p.cs * 2 * 64) p.cs *= 2;
  auto slice = [&](int cs) { return ((K + cs - 1) / cs + kLanesK - 1) / kLanesK * kLanesK; };
  while (p.cs < kMaxCluster && slice(p.cs) > kSliceRows && K >= p.cs * 2 * 64) p.cs *= 2;
  p.ks = slice(p.cs);
  p.smem = std::min(p.ks, kSliceRows) * TN * static_cast<int>(sizeof(T));
  return p;
}

template <typename T, int RPT>
int launch(const T* A, const T* B, T* Y, int M, int K, int N, bool trans_b, bool swiglu, const NormPrologue* norm,
           cudaStream_t stream) {
  const Plan p = plan_for<T>(K, N);
  auto kernel = matmul_kernel<T, RPT>;
  // Not a stream operation: allowed while a graph is being captured.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kSliceRows * kGranules * 16);
  if (err != cudaSuccess) return static_cast<int>(err);
  constexpr int VEC = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(B) % 16 == 0;
  const bool vec_ok = aligned && (trans_b ? K % VEC == 0 : N % VEC == 0);
  return static_cast<int>(launch_kernel(kernel, dim3(p.cs, p.tiles, 1), dim3(kThreads, 1, 1), p.smem, stream, p.cs, A, B,
                                        Y, M, K, N, p.ks, trans_b, vec_ok, swiglu ? 2 * K : K, swiglu,
                                        norm ? *norm : NormPrologue{}, norm != nullptr));
}

template <typename T>
struct MatMulLauncher {
  static int run(const void* A, const void* B, void* Y, int64_t M, int64_t K, int64_t N, int trans_b, int swiglu,
                 const NormPrologue* norm, void* stream) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || K > (1 << 29) || N > (1 << 30) || M > (1 << 30) || (N + 63) / 64 > 65535)
      return static_cast<int>(cudaErrorInvalidValue);
    if (norm != nullptr && (swiglu || norm->weight[2] == nullptr)) return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    const int m = static_cast<int>(M), k = static_cast<int>(K), n = static_cast<int>(N);
    if constexpr (!std::is_same<T, float>::value) {
      return trans_b ? mma_run<T, true>(A, B, Y, m, k, n, swiglu != 0, norm, s)
                     : mma_run<T, false>(A, B, Y, m, k, n, swiglu != 0, norm, s);
    } else {
      auto a = static_cast<const T*>(A);
      auto b = static_cast<const T*>(B);
      auto y = static_cast<T*>(Y);
      if (norm != nullptr) {  // the prologue's statistics hold 32 rows: one launch per 32 rows
        for (int m0 = 0; m0 < m; m0 += 32) {
          const int rows = std::min(32, m - m0);
          NormPrologue q = *norm;
          const size_t off = static_cast<size_t>(m0) * k;
          if (q.residual) q.residual = static_cast<const T*>(q.residual) + off;
          if (q.sum) q.sum = static_cast<T*>(q.sum) + off;
          const int err = launch<T, 8>(a + off, b, y + static_cast<size_t>(m0) * n, rows, k, n, trans_b != 0, false,
                                       &q, s);
          if (err != 0) return err;
        }
        return 0;
      }
      // Rows per pass: only how many rows share a pass, never how a row is reduced.
      if (m == 1) return launch<T, 1>(a, b, y, m, k, n, trans_b != 0, swiglu != 0, nullptr, s);
      if (m == 2) return launch<T, 2>(a, b, y, m, k, n, trans_b != 0, swiglu != 0, nullptr, s);
      if (m <= 4) return launch<T, 4>(a, b, y, m, k, n, trans_b != 0, swiglu != 0, nullptr, s);
      return launch<T, 8>(a, b, y, m, k, n, trans_b != 0, swiglu != 0, nullptr, s);
    }
  }
};

}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_matmul(int dtype, const void* A, const void* B, void* Y, int64_t M, int64_t K,
                                           int64_t N, int trans_b, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::MatMulLauncher>(dtype, A, B, Y, M, K, N, trans_b, 0,
                                                                 static_cast<const loopcast_cuda::NormPrologue*>(nullptr),
                                                                 stream);
}

LOOPCAST_CUDA_API int loopcast_cuda_norm_matmul(int dtype, const void* A, const void* residual,
                                                const void* branch_weight, const void* loop_weight,
                                                const void* norm_weight, float epsilon, void* sum_out, const void* B,
                                                void* Y, int64_t M, int64_t K, int64_t N, int trans_b, void* stream) {
  if (norm_weight == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  loopcast_cuda::NormPrologue norm{residual, {branch_weight, loop_weight, norm_weight}, sum_out, epsilon, false};
  norm.vec = loopcast_cuda::norm_vec_ok(norm, A, K, dtype == 0 ? 4 : 8);
  return loopcast_cuda::dispatch<loopcast_cuda::MatMulLauncher>(dtype, A, B, Y, M, K, N, trans_b, 0, &norm, stream);
}

LOOPCAST_CUDA_API int loopcast_cuda_swiglu_matmul(int dtype, const void* A, const void* B, void* Y, int64_t M,
                                                  int64_t K, int64_t N, int trans_b, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::MatMulLauncher>(dtype, A, B, Y, M, K, N, trans_b, 1,
                                                                 static_cast<const loopcast_cuda::NormPrologue*>(nullptr),
                                                                 stream);
}

LOOPCAST_CUDA_API const char* loopcast_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
