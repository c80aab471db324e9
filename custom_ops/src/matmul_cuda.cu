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
#include "mma_common.cuh"
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

// ---------------------------------------------------------------------------------------------
// fp16 / bf16: tensor-core kernel (mma.sync m16n8k16, fp32 accumulation), weights streamed from
// HBM straight into registers (128-bit loads), activations padded to 16-row MMA tiles (rows >= M
// are zeros and are never stored). Launched with PDL (cuda_common.cuh): the first weight chunk is
// loaded before waiting for the previous kernel, so a short projection's first HBM round trip
// overlaps the kernel before it. (A cp.async ring keeping 3 chunks in flight per warp measured
// slower on the H200: 14.3 vs 9.9 us for [2048, 6144], 2026-11-29.)
//
//   grid (CS, tiles), cluster (CS, 1, 1), 256 threads = 8 warps; a tile is 64 output columns.
//   K is cut into 32-wide chunks; warp q = rank * 8 + warp owns chunks [q * cpw, (q + 1) * cpw).
//   Per chunk a lane loads 8 x 16 bytes of the weight (a warp: 32 k x 64 columns, 4 KiB) and
//   16 bytes of each of its activation rows, A[row][k0 + 8t .. +8] (lane = 4g + t).
//     trans_b = 0 (B[K, N]): lane (g, t) loads rows k0 + 8t .. +7, columns 8g .. 8g+7; byte
//       permutes pair up consecutive k for the B fragments; n-tile j holds columns {8g' + j}.
//     trans_b = 1 (B[N, K]): lane (g, t) loads B[8j + g][k0 + 8t .. +8] for n-tiles j = 0..7.
//   Both use the same k-slot permutation for A and B (so it is still the dot product): MMA h of a
//   chunk takes k0 + 8t + 4h + {0, 1, 2, 3} as k-slots {2t, 2t+1, 2t+8, 2t+9}.
//   With SwiGLU (the down projection reading [gate | up]) and M <= 5, each warp first computes
//   SwiGLU of its whole k range into shared memory (stage_swiglu_rows) and reads A from there.
//
// M-invariance: output (m, n) is the serial chain of MMAs over the warp's chunks (ascending) ->
// serial sum over the 8 warps -> serial sum over the CS cluster ranks. CS, cpw and the tiling
// depend only on (K, N, dtype). An MMA computes each output element from its own A row, B column
// and accumulator only, so which other rows share the 16-row tile (or are zero padding) does not
// change a row's result; MT (16-row tiles per pass: 1 for M <= 16, else 2) and the prefetch depth
// only change how many rows a launch carries. M > 32: one launch per 32 rows, same launch shape.
constexpr int kMmaWarps = 8;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaTN = 64;          // output columns per tile
constexpr int kChunkK = 32;         // k per chunk
constexpr int kMmaCapacity = 264;   // 2 blocks per SM on an H100/H200 (a constant, not queried)
constexpr int kMmaMaxCluster = 4;   // measured on an H200: clusters of 8 cost 2-3 us more than of 4
constexpr int kRedStride = kMmaTN + 1;
constexpr int kMaxRowsPerLaunch = 32;

// `count` (0..8) consecutive 16-bit elements from p, zero-filled to 8.
__device__ __forceinline__ uint4 load8_partial(const uint16_t* p, int count) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = 2 * i < count ? p[2 * i] : 0u, hi = 2 * i + 1 < count ? p[2 * i + 1] : 0u;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
struct MmaArgs {
  const uint16_t* A;
  const uint16_t* B;
  void* Y;
  int M, K, N, cpw, chunks;
  int a_stride;       // elements per row of A: K, or 2K with SwiGLU (A = [gate | up])
  bool b_vec, a_vec;  // 16-byte weight loads / aligned activation loads allowed
  NormPrologue norm;  // the norm prologue's inputs (kernels with NP only)
};

// The norm prologue's per-row 1/rms (norm_prologue.cuh), in static shared memory.
using NormInv = float (*)[4];

// Aligned 16-byte loads, entirely inside K and the tile's columns: no bounds checks needed.
__device__ __forceinline__ bool chunk_full(const MmaArgs& p, int chunk, int n0) {
  return p.b_vec && p.a_vec && chunk * kChunkK + kChunkK <= p.K && n0 + kMmaTN <= p.N;
}

// Eight activations A[row][k .. k + 8] (count < 8: zero-filled), through SwiGLU when SW (a
// template parameter: the plain kernel keeps its registers).
template <typename T, bool SW>
__device__ __forceinline__ uint4 load_a8(const MmaArgs& p, const uint16_t* src, bool vec, int count) {
  const uint4 a = vec ? __ldg(reinterpret_cast<const uint4*>(src)) : load8_partial(src, count);
  if (!SW) return a;
  return swiglu8<T>(a, vec ? __ldg(reinterpret_cast<const uint4*>(src + p.K)) : load8_partial(src + p.K, count));
}

// Lane (g, t)'s activations A[row][k .. k + 8] for rows g and g + 8 of each 16-row tile (one
// 16-byte load each, two with swiglu); rows >= M and columns >= K are zeros. `full`: aligned and
// inside K.
// NP: the norm prologue's h, formed from the branch rows (norm_h8), instead of A itself.
template <typename T, bool SW, int MT, bool NP = false>
__device__ __forceinline__ void load_a_rows(ChunkRegs<MT>& r, const MmaArgs& p, int k, int g, bool full,
                                            NormInv inv = nullptr) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * mt + g + 8 * h;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (NP) {
        if (row < p.M && k < p.K) v = norm_h8<T>(p.norm, reinterpret_cast<const T*>(p.A), row, k, p.K, inv[row]);
      } else if (row < p.M) {
        const uint16_t* src = p.A + static_cast<size_t>(row) * p.a_stride + k;
        if (full) v = load_a8<T, SW>(p, src, true, 8);
        else if (k < p.K) v = load_a8<T, SW>(p, src, p.a_vec && k + 8 <= p.K, min(8, p.K - k));
      }
      r.a[mt][4 * h + 0] = v.x;
      r.a[mt][4 * h + 1] = v.y;
      r.a[mt][4 * h + 2] = v.z;
      r.a[mt][4 * h + 3] = v.w;
    }
}

// The weight part of a full chunk (chunk_full): 8 aligned 16-byte loads per lane.
template <bool TB, int MT>
__device__ __forceinline__ void load_b_full(ChunkRegs<MT>& r, const MmaArgs& p, int chunk, int n0, int g, int t) {
  const int k = chunk * kChunkK + 8 * t;
  if (!TB) {  // rows k .. k + 7, columns n0 + 8g .. +8
    const uint16_t* src = p.B + static_cast<size_t>(k) * p.N + n0 + 8 * g;
    const size_t N = p.N;
#pragma unroll
    for (int i = 0; i < 8; ++i) r.b[i] = ld_stream16(src + i * N);
  } else {  // columns n0 + 8j + g, k .. k + 7
    const uint16_t* src = p.B + static_cast<size_t>(n0 + g) * p.K + k;
    const size_t K8 = static_cast<size_t>(8) * p.K;
#pragma unroll
    for (int j = 0; j < 8; ++j) r.b[j] = ld_stream16(src + j * K8);
  }
}

// The weight part of chunk `chunk`: aligned 16-byte loads when `full` (chunk_full), otherwise
// every element bounds-checked (zero fill).
template <bool TB, int MT>
__device__ __forceinline__ void load_b(ChunkRegs<MT>& r, const MmaArgs& p, int chunk, int n0, int g, int t, bool full) {
  if (full) {
    load_b_full<TB, MT>(r, p, chunk, n0, g, t);
    return;
  }
  const int k = chunk * kChunkK + 8 * t;
  const int kcount = min(8, p.K - k);
  if (!TB) {
    const int col = n0 + 8 * g;
    const int ncount = min(8, p.N - col);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint16_t* src = p.B + static_cast<size_t>(k + i) * p.N + col;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (i < kcount && ncount > 0) v = (p.b_vec && ncount == 8) ? ld_stream16(src) : load8_partial(src, ncount);
      r.b[i] = v;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int n = n0 + 8 * j + g;
      const uint16_t* src = p.B + static_cast<size_t>(n) * p.K + k;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (n < p.N && kcount > 0) v = (p.b_vec && kcount == 8) ? ld_stream16(src) : load8_partial(src, kcount);
      r.b[j] = v;
    }
  }
}

// Whole chunk in bounds with aligned 16-byte loads: only the row < M predicate is left.
// Otherwise every element is bounds-checked (zero fill).
template <typename T, bool TB, bool SW, int MT, bool NP = false>
__device__ __forceinline__ void load_chunk(ChunkRegs<MT>& r, const MmaArgs& p, int chunk, int n0, int g, int t,
                                           NormInv inv = nullptr) {
  const bool full = chunk_full(p, chunk, n0);
  load_b<TB, MT>(r, p, chunk, n0, g, t, full);
  load_a_rows<T, SW, MT, NP>(r, p, chunk * kChunkK + 8 * t, g, full, inv);
}

// SwiGLU staging (swiglu, M <= kMaxStageRows): the warp's activations SwiGLU(A)[row][kb .. kb + span)
// for rows < M, computed once after the PDL wait by all 32 lanes into shared memory
// act[row][span + 8] (zeros past K), instead of per chunk by the lanes that hold rows < M while
// the others wait. Same swiglu8 on the same elements: the bits do not change.
__host__ __device__ __forceinline__ int stage_stride(int cpw) { return cpw * kChunkK + 8; }  // +16 B: rows on other banks

template <typename T>
__device__ __forceinline__ void stage_swiglu_rows(uint16_t* act, const MmaArgs& p, int kb, int nchunks, int lane) {
  const int stride = stage_stride(p.cpw), per_row = nchunks * (kChunkK / 8);
  for (int gi = lane; gi < p.M * per_row; gi += 32) {
    const int row = gi / per_row, kk = gi % per_row * 8, k = kb + kk;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (k < p.K) {
      const uint16_t* src = p.A + static_cast<size_t>(row) * p.a_stride + k;
      v = load_a8<T, true>(p, src, p.a_vec && k + 8 <= p.K, min(8, p.K - k));
    }
    *reinterpret_cast<uint4*>(act + row * stride + kk) = v;
  }
  __syncwarp();
}

// The norm prologue's rows h [M][norm_stride] in shared memory (norm_rows_to_shared: the values
// load_a_rows<NP> forms per chunk): whole rows, every chunk, +16 B a row (other banks).
__host__ __device__ __forceinline__ int norm_stride(int chunks) { return chunks * kChunkK + 8; }

template <int MT>  // instantiated with MT = 1 only
__device__ __forceinline__ void shared_h_rows(ChunkRegs<MT>& r, const MmaArgs& p, const uint16_t* h, int k, int g) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = g + 8 * hh;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < p.M) v = *reinterpret_cast<const uint4*>(h + row * norm_stride(p.chunks) + k);
    r.a[0][4 * hh + 0] = v.x;
    r.a[0][4 * hh + 1] = v.y;
    r.a[0][4 * hh + 2] = v.z;
    r.a[0][4 * hh + 3] = v.w;
  }
}

// Lane (g, t)'s activation fragment of chunk i (0-based within the warp's range) from the staging.
template <int MT>  // instantiated with MT = 1 only
__device__ __forceinline__ void staged_a_rows(ChunkRegs<MT>& r, const MmaArgs& p, const uint16_t* act, int i, int g,
                                              int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < p.M) v = *reinterpret_cast<const uint4*>(act + row * stage_stride(p.cpw) + i * kChunkK + 8 * t);
    r.a[0][4 * h + 0] = v.x;
    r.a[0][4 * h + 1] = v.y;
    r.a[0][4 * h + 2] = v.z;
    r.a[0][4 * h + 3] = v.w;
  }
}

// ST: the activations staged in shared memory (stage_swiglu_rows / stage_norm_rows; MT = 1 only).
// NP: the norm prologue (norm_prologue.cuh): A holds the branch rows, the product reads h.
template <typename T, bool TB, bool SW, int MT, bool ST, bool NP>
__global__ void __launch_bounds__(kMmaThreads, 2) mma_matmul_kernel(MmaArgs p) {
  static_assert(!ST || ((SW || NP) && MT == 1), "staging is for the SwiGLU or norm kernel with one row tile");
  static_assert(!(SW && NP), "a projection takes SwiGLU or the norm prologue, not both");
  __shared__ float norm_inv[NP ? kMaxRowsPerLaunch : 1][4];
  __shared__ float norm_red[NP ? kMaxRowsPerLaunch : 1][8];  // >= kNormGroup rows
  __shared__ float norm_group_inv[NP ? 3 * kNormGroup : 1];
  constexpr int ROWS = 16 * MT;
  extern __shared__ __align__(16) float mma_smem[];
  float* red = mma_smem;                                 // [warps][ROWS][65] (padded: fewer bank conflicts)
  float* part = mma_smem + kMmaWarps * ROWS * kRedStride;  // [ROWS][64], read by the whole cluster

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int cs = static_cast<int>(cluster.num_blocks());
  const int n0 = blockIdx.y * kMmaTN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int c_begin = (rank * kMmaWarps + warp) * p.cpw;
  const int n = max(0, min(p.chunks, c_begin + p.cpw) - c_begin);

  float acc[MT][8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.0f;

  // The first chunk's weights are constants: load them before waiting for the kernel that
  // writes A (MT = 1 only: with two row tiles the extra registers spill). One chunk (8 x 16-byte
  // weight loads per lane) in flight per warp; 16 warps per SM keep enough bytes in flight
  // (register double-buffering measured slower: it spills).
  pdl_trigger();
  ChunkRegs<MT> first;
  const bool first_full = MT == 1 && n > 0 && chunk_full(p, c_begin, n0);
  if (first_full) load_b_full<TB, MT>(first, p, c_begin, n0, g, t);
  pdl_wait();
  uint16_t* hrow = reinterpret_cast<uint16_t*>(part + ROWS * kMmaTN);  // NP && ST: h [M][norm_stride]
  if (NP && ST) {  // every block forms the rows' h in shared memory; block (0, 0) writes the sum
    norm_rows_to_shared<T>(p.norm, reinterpret_cast<const T*>(p.A), p.M, p.K, p.norm.vec, reinterpret_cast<T*>(hrow),
                           norm_stride(p.chunks), blockIdx.x == 0 && blockIdx.y == 0, norm_red, norm_group_inv);
  } else if (NP) {  // every block: the rows' statistics; the sum's elements spread over the grid
    norm_row_stats<T>(p.norm, reinterpret_cast<const T*>(p.A), p.M, p.K, norm_inv, norm_red);
    norm_write_sum<T>(p.norm, reinterpret_cast<const T*>(p.A), p.M, p.K, norm_inv, blockIdx.y * cs + rank,
                      cs * gridDim.y);
  }
  uint16_t* act = hrow + warp * p.M * stage_stride(p.cpw);
  if (ST && !NP) stage_swiglu_rows<T>(act, p, c_begin * kChunkK, n, lane);
  for (int i = 0; i < n; ++i) {
    ChunkRegs<MT> x;
    if (i == 0 && first_full) {
#pragma unroll
      for (int q = 0; q < 8; ++q) x.b[q] = first.b[q];
      if (ST && NP) shared_h_rows(x, p, hrow, c_begin * kChunkK + 8 * t, g);
      else if (ST) staged_a_rows(x, p, act, 0, g, t);
      else load_a_rows<T, SW, MT, NP>(x, p, c_begin * kChunkK + 8 * t, g, true, norm_inv);
    } else if (ST) {
      load_b<TB, MT>(x, p, c_begin + i, n0, g, t, chunk_full(p, c_begin + i, n0));
      if (NP) shared_h_rows(x, p, hrow, (c_begin + i) * kChunkK + 8 * t, g);
      else staged_a_rows(x, p, act, i, g, t);
    } else {
      load_chunk<T, TB, SW, MT, NP>(x, p, c_begin + i, n0, g, t, norm_inv);
    }
    mma_chunk<T, TB, MT>(acc, x);
  }

  // This warp's partial -> red[warp]; rows >= M are padding and are dropped here.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mt + g + 8 * (e >> 1);
        const int slot = 2 * t + (e & 1);
        const int col = TB ? 8 * j + slot : 8 * slot + j;
        if (row < p.M) red[(warp * ROWS + row) * kRedStride + col] = acc[mt][j][e];
      }
  __syncthreads();
  const int rows = min(p.M, ROWS);
  for (int e = tid; e < rows * kMmaTN; e += kMmaThreads) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) s += red[(w * ROWS + e / kMmaTN) * kRedStride + e % kMmaTN];
    part[e] = s;
  }
  T* Y = static_cast<T*>(p.Y);
  if (cs == 1) {
    for (int e = tid; e < rows * kMmaTN; e += kMmaThreads) {
      const int m = e / kMmaTN, col = n0 + e % kMmaTN;
      if (col < p.N) Y[static_cast<size_t>(m) * p.N + col] = from_f<T>(0.0f + part[e]);
    }
    return;
  }
  cluster.sync();  // every rank's part is complete
  for (int e = rank + cs * tid; e < rows * kMmaTN; e += cs * kMmaThreads) {
    float s = 0.0f;
    for (int q = 0; q < cs; ++q) s += cluster.map_shared_rank(part, q)[e];
    const int m = e / kMmaTN, col = n0 + e % kMmaTN;
    if (col < p.N) Y[static_cast<size_t>(m) * p.N + col] = from_f<T>(s);
  }
  cluster.sync();  // nobody exits while another rank still reads its part
}

struct MmaPlan {
  int cs, tiles, chunks, cpw;
};

// From (K, N) only, never from M.
inline MmaPlan mma_plan(int K, int N) {
  MmaPlan p{};
  p.tiles = (N + kMmaTN - 1) / kMmaTN;
  p.chunks = (K + kChunkK - 1) / kChunkK;
  p.cs = std::max(1, std::min({kMmaMaxCluster, kMmaCapacity / p.tiles, p.chunks / kMmaWarps}));
  const int warps = p.cs * kMmaWarps;
  p.cpw = (p.chunks + warps - 1) / warps;
  return p;
}

// SwiGLU staging: at most this much shared memory per block, so two blocks still fit on an SM,
// and only for few rows: staging moves the SwiGLU work ahead of the first MMA, where it no longer
// overlaps the weight loads. H200, [5632, 2048] fp16, µs staged / per chunk: M = 1 11.0 / 13.8,
// M = 5 14.2 / 14.4, M = 16 23.1 / 20.1 (tools/bench/bench_matmul_cuda.py, docs/perf.md).
constexpr int kMaxStageBytes = 64 << 10;
constexpr int kMaxStageRows = 5;
// The norm prologue stages h for every MT = 1 launch that fits (no expf: forming h per chunk
// gains no overlap); 72 KiB + the reduction buffers still leave two blocks an SM.
constexpr int kMaxNormStageBytes = 72 << 10;

// LOOPCAST_SWIGLU_STAGE=0 computes SwiGLU per chunk instead (read at every launch, like
// LOOPCAST_PDL, so a benchmark can time both; the bits are the same).
inline bool swiglu_stage_enabled() {
  const char* v = std::getenv("LOOPCAST_SWIGLU_STAGE");
  return !(v != nullptr && v[0] == '0' && v[1] == '\0');
}

template <typename T, bool TB, bool SW, int MT, bool NP = false, bool ST = false>
int mma_launch(const MmaArgs& args, const MmaPlan& plan, cudaStream_t stream) {
  if constexpr (SW && MT == 1 && !ST) {  // stage SwiGLU when it fits (the same bits either way)
    if (args.M <= kMaxStageRows && kMmaWarps * args.M * stage_stride(plan.cpw) * 2 <= kMaxStageBytes &&
        swiglu_stage_enabled())
      return mma_launch<T, TB, true, 1, false, true>(args, plan, stream);
  }
  if constexpr (NP && MT == 1 && !ST) {  // h in shared memory when it fits (the same bits either way)
    if (norm_in_registers<T>(args.K) && args.M * norm_stride(plan.chunks) * 2 <= kMaxNormStageBytes)
      return mma_launch<T, TB, false, 1, true, true>(args, plan, stream);
  }
  auto kernel = mma_matmul_kernel<T, TB, SW, MT, ST, NP>;
  int smem = (kMmaWarps * kRedStride + kMmaTN) * 16 * MT * static_cast<int>(sizeof(float));
  if (ST) smem += NP ? args.M * norm_stride(plan.chunks) * 2 : kMmaWarps * args.M * stage_stride(plan.cpw) * 2;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(launch_kernel(kernel, dim3(plan.cs, plan.tiles, 1), dim3(kMmaThreads, 1, 1), smem, stream,
                                        plan.cs, args));
}

template <typename T, bool TB>
int mma_run(const void* A, const void* B, void* Y, int M, int K, int N, bool swiglu, const NormPrologue* norm,
            cudaStream_t stream) {
  const MmaPlan plan = mma_plan(K, N);
  MmaArgs args{};
  args.B = static_cast<const uint16_t*>(B);
  args.K = K;
  args.N = N;
  args.a_stride = swiglu ? 2 * K : K;
  args.cpw = plan.cpw;
  args.chunks = plan.chunks;
  args.b_vec = reinterpret_cast<uintptr_t>(B) % 16 == 0 && (TB ? K % 8 == 0 : N % 8 == 0);
  for (int m0 = 0; m0 < M; m0 += kMaxRowsPerLaunch) {  // same launch shape for every 32-row group
    const int rows = std::min(kMaxRowsPerLaunch, M - m0);
    args.A = static_cast<const uint16_t*>(A) + static_cast<size_t>(m0) * args.a_stride;
    args.Y = static_cast<T*>(Y) + static_cast<size_t>(m0) * N;
    args.M = rows;
    const uintptr_t a_addr = reinterpret_cast<uintptr_t>(args.A);
    args.a_vec = a_addr % 16 == 0 && K % 8 == 0;  // every 16-byte granule of A (gate and up) aligned
    if (norm != nullptr) {  // the residual and the sum advance with A
      args.norm = *norm;
      const size_t off = static_cast<size_t>(m0) * K * sizeof(T);
      if (norm->residual) args.norm.residual = static_cast<const char*>(norm->residual) + off;
      if (norm->sum) args.norm.sum = static_cast<char*>(norm->sum) + off;
      const int err = rows <= 16 ? mma_launch<T, TB, false, 1, true>(args, plan, stream)
                                 : mma_launch<T, TB, false, 2, true>(args, plan, stream);
      if (err != 0) return err;
      continue;
    }
    const int err = swiglu ? (rows <= 16 ? mma_launch<T, TB, true, 1>(args, plan, stream)
                                         : mma_launch<T, TB, true, 2>(args, plan, stream))
                           : (rows <= 16 ? mma_launch<T, TB, false, 1>(args, plan, stream)
                                         : mma_launch<T, TB, false, 2>(args, plan, stream));
    if (err != 0) return err;
  }
  return 0;
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
