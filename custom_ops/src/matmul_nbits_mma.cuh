// BatchInvariantMatMulNBits on the tensor cores, for fp16 / bf16 activations (matmul_nbits_kernel.cuh
// keeps the CUDA-core kernel for fp32, int4 blocks of 16 and LOOPCAST_NBITS_MMA=0): the codes are
// dequantized in registers into T and multiplied by mma.sync m16n8k16 with fp32 accumulation, the
// layout of the fp16 kernel (matmul_mma_cuda.cu, B[N, K]) with a weight chunk of 64 bytes a column.
//
//   grid (CS, tiles), cluster (CS, 1, 1), 256 threads = 8 warps; a tile is 64 output columns.
//   A chunk is 64 bytes of each of the tile's columns (KC = 128 int4 or 64 int8 codes); warp
//   q = rank * 8 + warp owns chunks [q * cpw, (q + 1) * cpw). Lane (g, t) loads 16 bytes of column
//   n0 + 8j + g (j = 0..7), codes k = c * KC + t * KC / 4 .. (+KC / 4), with each one's block scale
//   (and zero point): a warp has 4 KiB of codes in flight, like the fp16 kernel.
//   The warp's activations (A, SwiGLU of A's [gate | up] or the norm prologue's h) are staged once
//   in shared memory after the PDL wait, while the first chunk's codes (constants, loaded before the
//   wait) are in flight.
//
// Dequantization, w = T((q - zero point) * scale):
//   int4: magic-number halves, 8 codes a 32-bit word two at a time: (word >> 4i) & 0x000F000F |
//     bias gives (B + q_i, B + q_{i+4}) exactly (B = 1024 in fp16, 128 in bf16); minus (B + zp) is
//     the exact integer q - zp; times T(scale), one rounding. The pair (q_i, q_{i+4}) fills two
//     k-slots of an MMA, and the activations are paired the same way (byte permutes): still the
//     dot product.
//   int8: fp32 (the CUDA-core kernel's (2^23 + q) - (2^23 + zp), times the scale), rounded to T.
//
// M-invariance: the argument of the fp16 kernel. Output (m, n) is the serial chain of MMAs over the
// warp's chunks (ascending, within a chunk the steps ascending) -> serial sum over the 8 warps ->
// serial sum over the CS ranks; CS, cpw and the rows a launch carries depend only on (K, N, bits).
// An MMA computes each output element from its own A row, B column and accumulator, so zero rows
// and other rows in the 16-row tile do not change it. M > rows: more launches of the same shape.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "cuda_common.cuh"
#include "cuda_launch.h"
#include "mma_common.cuh"
#include "norm_prologue.cuh"

namespace loopcast_cuda {
namespace nbits_mma {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTN = 64;                  // output columns per tile
constexpr int kChunkBytes = 64;          // bytes of one column per chunk (16 a lane)
constexpr int kCapacity = 264;           // 2 blocks per SM on an H100/H200 (a constant, not queried)
constexpr int kMaxCluster = 8;            // H200, down 5632 -> 2048 int4: 6.6 us with 8 (cs 6), 10.2 with 4
constexpr int kRows = 16;                // one MMA row tile
constexpr int kRedStride = kTN + 1;
constexpr int kStageBudget = 96 << 10;   // staged activations per block: two blocks an SM
constexpr int kRedBytes = kWarps * kRows * kRedStride * 4;

// LOOPCAST_NBITS_MMA=0 takes the CUDA-core kernel instead (read at every launch, like LOOPCAST_PDL,
// so a benchmark can time both; the bits differ between the two kernels, never between row counts).
inline bool enabled() {
  const char* v = std::getenv("LOOPCAST_NBITS_MMA");
  return !(v != nullptr && v[0] == '0' && v[1] == '\0');
}

// The largest cluster a plan takes: kMaxCluster, or LOOPCAST_NBITS_MMA_CLUSTER (1..8, a benchmark's
// knob: a process keeps one value, so its rows stay invariant).
inline int max_cluster() {
  const char* v = std::getenv("LOOPCAST_NBITS_MMA_CLUSTER");
  const int c = v != nullptr ? std::atoi(v) : 0;
  return c >= 1 && c <= 8 ? c : kMaxCluster;
}

template <int BITS> __host__ __device__ constexpr int chunk_codes() { return kChunkBytes * 8 / BITS; }

struct Plan {
  int cs, tiles, chunks, cpw, rows, stage_stride;
  bool ok;
};

// From (K, N, bits) only, never from M: the cluster, the chunks a warp, and how many rows a launch
// carries (fewer when a warp's staged k range is long, so the stage fits).
inline Plan plan(int K, int N, int bits) {
  Plan p{};
  const int kc = kChunkBytes * 8 / bits;
  p.tiles = (N + kTN - 1) / kTN;
  p.chunks = (K + kc - 1) / kc;
  p.cs = std::max(1, std::min({max_cluster(), kCapacity / p.tiles, (p.chunks + kWarps - 1) / kWarps}));
  p.cpw = (p.chunks + p.cs * kWarps - 1) / (p.cs * kWarps);
  p.stage_stride = p.cpw * kc + 8;  // +16 B a row: rows on other banks
  p.rows = kRows;
  while (p.rows > 1 && kWarps * p.rows * p.stage_stride * 2 > kStageBudget) p.rows /= 2;
  p.ok = kWarps * p.rows * p.stage_stride * 2 <= kStageBudget && p.tiles <= 65535;  // grid y
  return p;
}

struct Args {
  const uint16_t* A;
  const uint8_t* B;
  const float* scales;
  const uint8_t* zp;  // null: symmetric
  void* Y;
  int M, K, N, block_size, nb, zp_row, chunks, cpw, stage_stride;
  int a_stride;  // K, or 2K with SwiGLU ([gate | up])
  long long row_bytes;
  bool b_vec, a_vec;
  int pf_pre, pf_ahead;  // code chunks prefetched to L2 before the PDL wait / ahead of the loads
  NormPrologue norm;
};

// L2 prefetch of chunk c's codes: columns n0 + lane and n0 + 32 + lane, 64 bytes each.
__device__ __forceinline__ void prefetch_codes(const Args& p, int c, int n0, int lane) {
  const long long byte0 = static_cast<long long>(c) * kChunkBytes;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int col = n0 + lane + 32 * h;
    if (col < p.N && byte0 < p.row_bytes) prefetch_l2(p.B + col * p.row_bytes + byte0);
  }
}

// One chunk's codes of the lane's 8 columns, with each one's block scale and zero point.
struct Weights {
  uint4 q[8];
  float s[8], z[8];
};

template <int BITS>
__device__ __forceinline__ void load_weights(Weights& w, const Args& p, int c, int n0, int g, int t) {
  constexpr int KC = chunk_codes<BITS>();
  const long long byte0 = static_cast<long long>(c) * kChunkBytes + 16 * t;
  const int blk = min((c * KC + t * (KC / 4)) / p.block_size, p.nb - 1);  // a lane's codes share one block
  const bool full = p.b_vec && byte0 + 16 <= p.row_bytes && n0 + kTN <= p.N;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int n = n0 + 8 * j + g;
    w.q[j] = make_uint4(0, 0, 0, 0);
    w.s[j] = 0.0f;  // columns past N: zero weights (never stored)
    w.z[j] = 0.0f;
    if (!full && n >= p.N) continue;
    const uint8_t* src = p.B + static_cast<size_t>(n) * p.row_bytes + byte0;
    if (full || (p.b_vec && byte0 + 16 <= p.row_bytes)) {
      w.q[j] = ld_stream16(src);
    } else if (byte0 < p.row_bytes) {  // bytes past the row read as zero codes (zero activations there)
      uint32_t v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b)
          if (byte0 + 4 * i + b < p.row_bytes) v[i] |= static_cast<uint32_t>(src[4 * i + b]) << (8 * b);
      }
      w.q[j] = make_uint4(v[0], v[1], v[2], v[3]);
    }
    w.s[j] = __ldg(p.scales + static_cast<size_t>(n) * p.nb + blk);
    float zp = static_cast<float>(1 << (BITS - 1));
    if (p.zp != nullptr) {
      const uint8_t zb = __ldg(p.zp + static_cast<size_t>(n) * p.zp_row + (BITS == 4 ? blk / 2 : blk));
      zp = static_cast<float>(BITS == 4 ? ((blk & 1) ? (zb >> 4) : (zb & 0xF)) : zb);
    }
    w.z[j] = zp;
  }
}

template <typename T> struct Deq;
template <> struct Deq<__half> {
  static constexpr uint32_t kBias = 0x64006400u;  // 1024 | q: 1024 + q exactly
  static constexpr float kBase = 1024.0f;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ uint32_t deq(uint32_t biased, uint32_t zb, uint32_t s) {
    const __half2 v = __hmul2_rn(__hsub2(*reinterpret_cast<const __half2*>(&biased), *reinterpret_cast<const __half2*>(&zb)),
                                 *reinterpret_cast<const __half2*>(&s));
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};
template <> struct Deq<__nv_bfloat16> {
  static constexpr uint32_t kBias = 0x43004300u;  // 128 | q: 128 + q exactly (q < 128)
  static constexpr float kBase = 128.0f;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ uint32_t deq(uint32_t biased, uint32_t zb, uint32_t s) {
    const __nv_bfloat162 v =
        __hmul2_rn(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased), *reinterpret_cast<const __nv_bfloat162*>(&zb)),
                   *reinterpret_cast<const __nv_bfloat162*>(&s));
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// Eight activations A[row][k .. k + 8] as T bits (zeros past K), through SwiGLU when SW.
template <typename T, bool SW>
__device__ __forceinline__ uint4 load_a8(const Args& p, int row, int k) {
  if (k >= p.K) return make_uint4(0, 0, 0, 0);
  const uint16_t* src = p.A + static_cast<size_t>(row) * p.a_stride + k;
  const bool vec = p.a_vec && k + 8 <= p.K;
  const int count = min(8, p.K - k);
  const uint4 a = vec ? __ldg(reinterpret_cast<const uint4*>(src)) : load8_partial(src, count);
  if (!SW) return a;
  return swiglu8<T>(a, vec ? __ldg(reinterpret_cast<const uint4*>(src + p.K)) : load8_partial(src + p.K, count));
}

// The warp's activations of rows < M, k in [kb, kb + span) -> act[row][stage_stride] (zeros past
// K): A, SwiGLU(A) (SW) or the norm prologue's h (NP); the values the CUDA-core kernel reads.
template <typename T, bool SW, bool NP>
__device__ void stage_rows(uint16_t* act, const Args& p, int kb, int span, int lane, const float (*inv)[4]) {
  const int per_row = span / 8;
  for (int i = lane; i < p.M * per_row; i += 32) {
    const int row = i / per_row, kk = i % per_row * 8, k = kb + kk;
    uint4 v;
    if constexpr (NP) {
      v = k < p.K ? norm_h8<T>(p.norm, reinterpret_cast<const T*>(p.A), row, k, p.K, inv[row]) : make_uint4(0, 0, 0, 0);
    } else {
      v = load_a8<T, SW>(p, row, k);
    }
    *reinterpret_cast<uint4*>(act + row * p.stage_stride + kk) = v;
  }
  __syncwarp();
}

// The 16-byte activation granule of row `row` at staged offset `off` (zeros for rows >= M).
__device__ __forceinline__ uint4 staged(const uint16_t* act, const Args& p, int row, int off) {
  return row < p.M ? *reinterpret_cast<const uint4*>(act + row * p.stage_stride + off) : make_uint4(0, 0, 0, 0);
}

// One chunk: the lane's 8 columns x KC / 4 codes against its two rows' activations.
template <typename T, int BITS>
__device__ __forceinline__ void mma_weights(float (&acc)[8][4], const Weights& w, const uint16_t* act, const Args& p,
                                            int off, int g) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // word q of each column: codes 8q .. 8q + 7 of the lane's 32
      const uint4 u = staged(act, p, g, off + 8 * q), v = staged(act, p, g + 8, off + 8 * q);
      // activations paired as the codes: (e_i, e_{i+4})
      const uint32_t ag[4] = {__byte_perm(u.x, u.z, 0x5410), __byte_perm(u.x, u.z, 0x7632),
                              __byte_perm(u.y, u.w, 0x5410), __byte_perm(u.y, u.w, 0x7632)};
      const uint32_t ah[4] = {__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                              __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632)};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t word = q == 0 ? w.q[j].x : q == 1 ? w.q[j].y : q == 2 ? w.q[j].z : w.q[j].w;
        // (B + zp) and the scale as T pairs, per use: fewer live registers than one copy a column
        const uint32_t zb = Deq<T>::pack(Deq<T>::kBase + w.z[j], Deq<T>::kBase + w.z[j]);
        const uint32_t sc = Deq<T>::pack(w.s[j], w.s[j]);
        uint32_t b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = Deq<T>::deq(((word >> (4 * i)) & 0x000F000Fu) | Deq<T>::kBias, zb, sc);
        MmaTraits<T>::mma(acc[j], ag[0], ah[0], ag[1], ah[1], b[0], b[1]);  // codes (0, 4), (1, 5)
        MmaTraits<T>::mma(acc[j], ag[2], ah[2], ag[3], ah[3], b[2], b[3]);  // codes (2, 6), (3, 7)
      }
    }
  } else {
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // activations 8q .. 8q + 7 of the lane's 16: words 2q, 2q + 1 of the codes
      const uint4 u = staged(act, p, g, off + 8 * q), v = staged(act, p, g + 8, off + 8 * q);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float zm = 8388608.0f + w.z[j];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t word = 2 * q + h == 0 ? w.q[j].x : 2 * q + h == 1 ? w.q[j].y : 2 * q + h == 2 ? w.q[j].z : w.q[j].w;
          float f[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            f[e] = __fmul_rn(__fsub_rn(__uint_as_float(0x4B000000u | ((word >> (8 * e)) & 0xFFu)), zm), w.s[j]);
          const uint32_t b0 = Deq<T>::pack(f[0], f[1]), b1 = Deq<T>::pack(f[2], f[3]);
          if (h == 0) MmaTraits<T>::mma(acc[j], u.x, v.x, u.y, v.y, b0, b1);
          else MmaTraits<T>::mma(acc[j], u.z, v.z, u.w, v.w, b0, b1);
        }
      }
    }
  }
}

template <typename T, int BITS, bool SW, bool NP>
__global__ void __launch_bounds__(kThreads, 2) nbits_mma_kernel(Args p) {
  static_assert(!(SW && NP), "a projection takes SwiGLU or the norm prologue, not both");
  constexpr int KC = chunk_codes<BITS>();
  __shared__ float norm_inv[NP ? kRows : 1][4];
  __shared__ float norm_red[NP ? (kRows > kNormGroup ? kRows : kNormGroup) : 1][8];
  extern __shared__ __align__(16) float nbits_mma_smem[];
  float* part = nbits_mma_smem;                 // [rows][64], read by the whole cluster
  float* red = nbits_mma_smem + kRows * kTN;    // [warps][rows][65], after the products (aliases the stage)
  uint16_t* stage = reinterpret_cast<uint16_t*>(red);

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int cs = static_cast<int>(cluster.num_blocks());
  const int n0 = blockIdx.y * kTN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int c_begin = (rank * kWarps + warp) * p.cpw;
  const int n = max(0, min(p.chunks, c_begin + p.cpw) - c_begin);

  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

  pdl_trigger();
  Weights w;
  if (n > 0) load_weights<BITS>(w, p, c_begin, n0, g, t);  // constants: before the wait
  int pf_hi = min(n, 1 + p.pf_pre);  // chunks [1, pf_hi) are prefetched (chunk 0 is loaded)
  for (int c = 1; c < pf_hi; ++c) prefetch_codes(p, c_begin + c, n0, lane);
  pdl_wait();
  if (NP) {  // every block: the rows' statistics; the sum's elements spread over the grid
    norm_row_stats<T>(p.norm, reinterpret_cast<const T*>(p.A), p.M, p.K, norm_inv, norm_red);
    norm_write_sum<T>(p.norm, reinterpret_cast<const T*>(p.A), p.M, p.K, norm_inv, blockIdx.y * cs + rank,
                      cs * gridDim.y);
  }
  uint16_t* act = stage + warp * p.M * p.stage_stride;
  if (n > 0) stage_rows<T, SW, NP>(act, p, c_begin * KC, n * KC, lane, norm_inv);
  for (int i = 0; i < n; ++i) {
    for (const int want = min(n, i + 1 + p.pf_ahead); pf_hi < want; ++pf_hi) prefetch_codes(p, c_begin + pf_hi, n0, lane);
    if (i > 0) load_weights<BITS>(w, p, c_begin + i, n0, g, t);
    mma_weights<T, BITS>(acc, w, act, p, i * KC + t * (KC / 4), g);
  }
  __syncthreads();  // every warp has read its stage: red reuses it

#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1);
      if (row < p.M) red[(warp * kRows + row) * kRedStride + 8 * j + 2 * t + (e & 1)] = acc[j][e];
    }
  __syncthreads();
  for (int e = tid; e < p.M * kTN; e += kThreads) {
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) s += red[(q * kRows + e / kTN) * kRedStride + e % kTN];
    part[e] = s;
  }
  T* Y = static_cast<T*>(p.Y);
  if (cs == 1) {
    for (int e = tid; e < p.M * kTN; e += kThreads) {
      const int m = e / kTN, col = n0 + e % kTN;
      if (col < p.N) Y[static_cast<size_t>(m) * p.N + col] = from_f<T>(0.0f + part[e]);
    }
    return;
  }
  cluster.sync();  // every rank's part is complete
  for (int e = rank + cs * tid; e < p.M * kTN; e += cs * kThreads) {
    float s = 0.0f;
    for (int q = 0; q < cs; ++q) s += cluster.map_shared_rank(part, q)[e];
    const int m = e / kTN, col = n0 + e % kTN;
    if (col < p.N) Y[static_cast<size_t>(m) * p.N + col] = from_f<T>(s);
  }
  cluster.sync();  // nobody exits while another rank still reads its part
}

// Whether the tensor-core kernel takes this product (from K, N, bits and the block size only).
inline bool applies(int K, int N, int bits, int block_size) {
  if (!enabled() || (bits == 4 && block_size < 32)) return false;  // int4 blocks of 16 span two a lane
  return plan(K, N, bits).ok;
}

template <typename T, int BITS, bool SW, bool NP>
int launch(Args args, const Plan& pl, cudaStream_t stream) {
  auto kernel = nbits_mma_kernel<T, BITS, SW, NP>;
  const int stage = kWarps * pl.rows * pl.stage_stride * 2;
  const int smem = kRows * kTN * 4 + std::max(stage, kRedBytes);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(launch_kernel(kernel, dim3(pl.cs, pl.tiles, 1), dim3(kThreads, 1, 1), smem, stream, pl.cs,
                                        args));
}

// Y = A · Wᵀ (rows of A through SwiGLU, or the norm prologue's h): launches of pl.rows rows.
template <typename T, int BITS>
int run(const void* A, const uint8_t* B, const float* scales, const uint8_t* zp, void* Y, int M, int K, int N,
        int block_size, bool swiglu, const NormPrologue* norm, cudaStream_t stream) {
  const Plan pl = plan(K, N, BITS);
  Args a{};
  a.B = B;
  a.scales = scales;
  a.zp = zp;
  a.K = K;
  a.N = N;
  a.block_size = block_size;
  a.nb = (K + block_size - 1) / block_size;
  a.zp_row = (a.nb * BITS + 7) / 8;
  a.chunks = pl.chunks;
  a.cpw = pl.cpw;
  a.stage_stride = pl.stage_stride;
  a.a_stride = swiglu ? 2 * K : K;
  a.row_bytes = static_cast<long long>(a.nb) * block_size * BITS / 8;
  a.b_vec = reinterpret_cast<uintptr_t>(B) % 16 == 0 && a.row_bytes % 16 == 0;
  a.pf_pre = env_knob("LOOPCAST_PF_PRE", 0, 0, 1 << 16);
  a.pf_ahead = env_knob("LOOPCAST_PF_AHEAD", 0, 0, 1 << 16);
  for (int m0 = 0; m0 < M; m0 += pl.rows) {  // the same launch for every group of rows
    a.M = std::min(pl.rows, M - m0);
    a.A = static_cast<const uint16_t*>(A) + static_cast<size_t>(m0) * a.a_stride;
    a.Y = static_cast<T*>(Y) + static_cast<size_t>(m0) * N;
    a.a_vec = reinterpret_cast<uintptr_t>(a.A) % 16 == 0 && K % 8 == 0;
    int err;
    if (norm != nullptr) {  // the residual and the sum advance with A
      a.norm = *norm;
      const size_t off = static_cast<size_t>(m0) * K * sizeof(T);
      if (norm->residual) a.norm.residual = static_cast<const char*>(norm->residual) + off;
      if (norm->sum) a.norm.sum = static_cast<char*>(norm->sum) + off;
      err = launch<T, BITS, false, true>(a, pl, stream);
    } else {
      err = swiglu ? launch<T, BITS, true, false>(a, pl, stream) : launch<T, BITS, false, false>(a, pl, stream);
    }
    if (err != 0) return err;
  }
  return 0;
}

}  // namespace nbits_mma
}  // namespace loopcast_cuda
