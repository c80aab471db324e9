// BatchInvariantMatMul's fp16 / bf16 path (matmul_cuda.cu keeps the fp32 kernel and the entry points).
//
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
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "cuda_common.cuh"
#include "cuda_launch.h"
#include "matmul_mma.h"
#include "mma_common.cuh"
#include "norm_prologue.cuh"

namespace cg = cooperative_groups;

namespace loopcast_cuda {
namespace {

constexpr int kMmaWarps = 8;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaTN = 64;          // output columns per tile
constexpr int kChunkK = 32;         // k per chunk
constexpr int kMmaCapacity = 264;   // 2 blocks per SM on an H100/H200 (a constant, not queried)
constexpr int kMmaMaxCluster = 4;   // measured on an H200: clusters of 8 cost 2-3 us more than of 4
constexpr int kRedStride = kMmaTN + 1;
constexpr int kMaxRowsPerLaunch = 32;

struct MmaArgs {
  const uint16_t* A;
  const uint16_t* B;
  void* Y;
  int M, K, N, cpw, chunks;
  int a_stride;       // elements per row of A: K, or 2K with SwiGLU (A = [gate | up])
  bool b_vec, a_vec;  // 16-byte weight loads / aligned activation loads allowed
  int pf_pre, pf_ahead;  // weight chunks prefetched to L2 before the PDL wait / ahead of the loads
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

// L2 prefetch of chunk `chunk`'s weights, one line a lane: B[K, N] row k0 + lane (the tile's 64
// columns, 128 bytes); B[N, K] columns n0 + lane and n0 + 32 + lane (64 bytes each).
template <bool TB>
__device__ __forceinline__ void prefetch_chunk(const MmaArgs& p, int chunk, int n0, int lane) {
  const int k0 = chunk * kChunkK;
  if (!TB) {
    if (k0 + lane < p.K && n0 < p.N) prefetch_l2(p.B + static_cast<size_t>(k0 + lane) * p.N + n0);
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = n0 + lane + 32 * h;
      if (col < p.N && k0 < p.K) prefetch_l2(p.B + static_cast<size_t>(col) * p.K + k0);
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
  int pf_hi = min(n, 1 + p.pf_pre);  // chunks [1, pf_hi) are prefetched (chunk 0 is loaded)
  for (int c = 1; c < pf_hi; ++c) prefetch_chunk<TB>(p, c_begin + c, n0, lane);
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
    for (const int want = min(n, i + 1 + p.pf_ahead); pf_hi < want; ++pf_hi)
      prefetch_chunk<TB>(p, c_begin + pf_hi, n0, lane);
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
  // LOOPCAST_MMA_CLUSTER (1..8): a benchmark's knob, like LOOPCAST_NBITS_MMA_CLUSTER (a process
  // keeps one value, so its rows stay invariant; the bits differ between values).
  const int max_cs = env_knob("LOOPCAST_MMA_CLUSTER", kMmaMaxCluster, 1, 8);
  p.cs = std::max(1, std::min({max_cs, kMmaCapacity / p.tiles, p.chunks / kMmaWarps}));
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

// Weight chunks a warp prefetches to L2 before the PDL wait (beyond the one it loads), and how
// far ahead of its loads it keeps prefetching: LOOPCAST_PF_PRE / LOOPCAST_PF_AHEAD.
inline int mma_prefetch_before_wait() { return env_knob("LOOPCAST_PF_PRE", 0, 0, 1 << 16); }
inline int mma_prefetch_ahead() { return env_knob("LOOPCAST_PF_AHEAD", 0, 0, 1 << 16); }

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

}  // namespace

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
  args.pf_pre = mma_prefetch_before_wait();
  args.pf_ahead = mma_prefetch_ahead();
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

template int mma_run<__half, false>(const void*, const void*, void*, int, int, int, bool, const NormPrologue*,
                                    cudaStream_t);
template int mma_run<__half, true>(const void*, const void*, void*, int, int, int, bool, const NormPrologue*,
                                   cudaStream_t);
template int mma_run<__nv_bfloat16, false>(const void*, const void*, void*, int, int, int, bool,
                                           const NormPrologue*, cudaStream_t);
template int mma_run<__nv_bfloat16, true>(const void*, const void*, void*, int, int, int, bool,
                                          const NormPrologue*, cudaStream_t);

}  // namespace loopcast_cuda
