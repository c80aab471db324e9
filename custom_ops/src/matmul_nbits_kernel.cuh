// BatchInvariantMatMulNBits, CUDA-core kernel for skinny products (decode M = 1, verify / cycle
// M <= 16; more rows take more passes of 16): Y[M, N] = A[M, K] · Wᵀ with W [N, K] stored
// block-quantized in MatMulNBits' layout (matmul_nbits_op.h), fp32 accumulation.
//
// The product is memory-bound on the weights, which are read once from HBM per pass in 16-byte
// chunks (32 int4 or 16 int8 codes of one column) and dequantized in registers, never written
// back: w = (q - zero_point) · scale in fp32, the CPU kernel's and numpy's expression (q - zp is
// taken exactly as (2^23 + q) - (2^23 + zp) from the code's bits: no int-to-float conversion).
//
//   One wave of 256-thread blocks (8 warps); a warp computes groups of COLS whole columns in a
//   grid-stride loop. Lane l owns chunks l, l + 32, l + 64, ... of each column (a warp reads
//   512 contiguous bytes of a column per step), U chunks a column in flight; the next group's
//   first chunks are loaded while this group computes (the very first before the PDL wait).
//   The block's activation rows (through SwiGLU when fused) are staged once per pass in shared
//   memory as T when they fit in 200 KiB, else each lane reads them through L1.
//
// M-invariance: output (m, n) is reduced as
//   serial fmaf over the lane's k (chunks ascending, k ascending inside one) -> xor butterfly
//   over the 32 lanes of the warp,
// and the chunk width and the lane mapping depend only on the bit width. Rows never interact:
// RPT (rows per pass: 1, 2, 4, 8 or 16, from M), COLS, staging and U only decide which outputs a
// warp computes and where its activations come from (the same T values), never how one is reduced.
//
// fp16 / bf16 activations take the tensor-core kernel instead (matmul_nbits_mma.cuh) except for int4
// blocks of 16 and under LOOPCAST_NBITS_MMA=0; the choice depends on (K, N, bits, block), never on M.
// This header holds the kernels; matmul_nbits_cuda.cu fills the arguments and calls nbits_run,
// whose (T, bits) specializations are compiled one per file (matmul_nbits_<dtype>_int<bits>.cu) so
// that a parallel build compiles them side by side.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"
#include "cuda_launch.h"
#include "matmul_nbits_mma.cuh"
#include "norm_prologue.cuh"

namespace loopcast_cuda {

struct NBitsArgs {
  const void* A;
  const uint8_t* B;
  const float* scales;
  const uint8_t* zp;  // null: symmetric, zero point 2^(bits-1)
  void* Y;
  int M, K, N, block_size, nb, zp_row, chunks;
  int a_stride;         // elements per row of A: K, or 2K with SwiGLU ([gate | up])
  int stage_stride;     // elements per staged row: K rounded up to a chunk's codes
  long long row_bytes;  // bytes per weight row: nb * block_size * bits / 8
  bool b_vec, a_vec;    // aligned vector loads allowed
  bool stage;           // activations staged in shared memory
  NormPrologue norm;    // the norm prologue's inputs (kernels with NP only)
};

// Y = A · Wᵀ for one (T, bits): through SwiGLU, or with the norm prologue, or plain.
template <typename T, int BITS>
int nbits_run(const NBitsArgs& p, bool swiglu, bool norm, cudaStream_t stream);

namespace nbits_detail {

constexpr int kNbWarps = 8;
constexpr int kNbThreads = kNbWarps * 32;
constexpr int kStageBytes = 200 * 1024;  // dynamic shared memory (opted in per kernel)
constexpr float kMagic = 8388608.0f;    // 2^23: (2^23 | q) as a float is 2^23 + q exactly

// Eight activations A[row][k .. k + 8] as fp32 (zeros past K), through SwiGLU when SW.
template <typename T, bool SW>
__device__ __forceinline__ void load_a(float (&a)[8], const NBitsArgs& p, const T* row, int k) {
  if (p.a_vec && k + 8 <= p.K) {
    uint4 raw[sizeof(T) / 2], raw_up[sizeof(T) / 2];  // 8 elements: one 16-byte granule (two for fp32)
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T)) / 2; ++i) {
      raw[i] = __ldg(reinterpret_cast<const uint4*>(row + k) + i);
      if (SW) raw_up[i] = __ldg(reinterpret_cast<const uint4*>(row + p.K + k) + i);
    }
    const T* v = reinterpret_cast<const T*>(raw);
    const T* u = reinterpret_cast<const T*>(raw_up);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = SW ? to_f(swiglu_value(v[e], u[e])) : to_f(v[e]);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int kk = k + e;
    a[e] = kk >= p.K ? 0.0f : SW ? to_f(swiglu_value(row[kk], row[p.K + kk])) : to_f(row[kk]);
  }
}

// The norm prologue's h of row `row` (of the pass), k .. k + 8 (zeros past K): the values that
// stage_rows<NP> stages.
template <typename T>
__device__ __forceinline__ void load_a_norm(float (&a)[8], const NormPrologue& q, const T* A, int row, int k, int K,
                                            const float* inv) {
#pragma unroll
  for (int e = 0; e < 8; ++e) a[e] = norm_value<T>(q, A, row, k + e, K, inv, 3);
}

// Eight staged activations (shared memory, zeros past K: the same values load_a gives).
template <typename T>
__device__ __forceinline__ void load_staged(float (&a)[8], const T* row, int k) {
  uint4 raw[sizeof(T) / 2];
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T)) / 2; ++i) raw[i] = reinterpret_cast<const uint4*>(row + k)[i];
  const T* v = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) a[e] = to_f(v[e]);
}

// Rows m0 .. m0 + RPT of A (SwiGLU applied when SW) into shared memory as T, zero-padded to
// stage_stride (rows past M are skipped); eight elements a thread step.
// NP: the norm prologue's h of the pass's rows (A, q: the pass's branch rows and prologue).
template <typename T, int RPT, bool SW, bool NP = false>
__device__ void stage_rows(T* smem, const NBitsArgs& p, const T* A, int m0, const NormPrologue* q = nullptr,
                           const float (*inv)[4] = nullptr) {
  const int per_row = p.stage_stride / 8;
  for (int i = threadIdx.x; i < RPT * per_row; i += kNbThreads) {
    const int r = i / per_row, k = 8 * (i % per_row);
    if (m0 + r >= p.M) break;  // rows past M are never read
    if constexpr (NP) {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        smem[static_cast<size_t>(r) * p.stage_stride + k + e] = from_f<T>(
            norm_value<T>(*q, A + static_cast<size_t>(m0) * p.K, r, k + e, p.K, inv[r], 3));
      continue;
    }
    const T* row = A + static_cast<size_t>(m0 + r) * p.a_stride;
    uint4 out;
    if (p.a_vec && k + 8 <= p.K) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + k));
      out = SW ? swiglu8<T>(v, __ldg(reinterpret_cast<const uint4*>(row + p.K + k))) : v;
      if constexpr (sizeof(T) == 4) {  // fp32: eight elements are two granules
        const uint4 v2 = __ldg(reinterpret_cast<const uint4*>(row + k) + 1);
        reinterpret_cast<uint4*>(smem + static_cast<size_t>(r) * p.stage_stride + k)[1] = v2;
      }
    } else {
      T v[16 / sizeof(T) >= 8 ? 16 / sizeof(T) : 8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int kk = k + e;
        v[e] = kk >= p.K ? from_f<T>(0.0f) : SW ? swiglu_value(row[kk], row[p.K + kk]) : row[kk];
      }
      if constexpr (sizeof(T) == 4) {
        for (int e = 0; e < 8; ++e) smem[static_cast<size_t>(r) * p.stage_stride + k + e] = v[e];
        continue;
      } else {
        out = *reinterpret_cast<const uint4*>(v);
      }
    }
    reinterpret_cast<uint4*>(smem + static_cast<size_t>(r) * p.stage_stride + k)[0] = out;
  }
}

// One 16-byte chunk of column n's codes (chunk c: k = c·CPC ..) as four words; bytes past the
// row read as zero codes (their activations are zero).
__device__ __forceinline__ uint4 load_chunk(const NBitsArgs& p, int n, int c) {
  const uint8_t* src = p.B + static_cast<size_t>(n) * p.row_bytes + static_cast<size_t>(c) * 16;
  if (p.b_vec) return __ldg(reinterpret_cast<const uint4*>(src));
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const long long at = static_cast<long long>(c) * 16 + 4 * i + b;
      if (at < p.row_bytes) w[i] |= static_cast<uint32_t>(src[4 * i + b]) << (8 * b);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Block `blk`'s scale and 2^23 + zero point of column n.
template <int BITS>
__device__ __forceinline__ void block_params(const NBitsArgs& p, int n, int blk, float& scale, float& zp_magic) {
  const int b = min(blk, p.nb - 1);  // k past the row: zero activations, any finite scale
  scale = __ldg(p.scales + static_cast<size_t>(n) * p.nb + b);
  float zp = static_cast<float>(1 << (BITS - 1));
  if (p.zp != nullptr) {
    const uint8_t z = __ldg(p.zp + static_cast<size_t>(n) * p.zp_row + (BITS == 4 ? b / 2 : b));
    zp = static_cast<float>(BITS == 4 ? ((b & 1) ? (z >> 4) : (z & 0xF)) : z);
  }
  zp_magic = kMagic + zp;
}

// Eight weights of group g (k = c·CPC + 8g ..) of a chunk: (q - zp) · scale.
template <int BITS>
__device__ __forceinline__ void dequantize8(float (&w)[8], const uint4& chunk, int g, float scale, float zp_magic) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t q = BITS == 4 ? (words[g] >> (4 * e)) & 0xFu : (words[2 * g + e / 4] >> (8 * (e % 4))) & 0xFFu;
    w[e] = __fmul_rn(__fsub_rn(__uint_as_float(0x4B000000u | q), zp_magic), scale);
  }
}

// A chunk's codes with its block's scale and 2^23 + zero point (and the next block's when a
// chunk spans two: int4 blocks of 16), loaded together so no load waits inside the products.
struct Chunk {
  uint4 q;
  float s0, z0, s1, z1;
};

template <int BITS>
__device__ __forceinline__ void load_full(Chunk& out, const NBitsArgs& p, int n, int c, bool split_blocks) {
  out.q = load_chunk(p, n, c);
  const int blk = c * (128 / BITS) / p.block_size;
  block_params<BITS>(p, n, blk, out.s0, out.z0);
  if (split_blocks) {
    block_params<BITS>(p, n, blk + 1, out.s1, out.z1);
  } else {
    out.s1 = out.s0;
    out.z1 = out.z0;
  }
}

// Chunks c0, c0 + 32, .. c0 + 32(U-1) of the COLS columns from n0 (absent ones: zero weights).
template <int BITS, int U, int COLS>
__device__ __forceinline__ void load_group(Chunk (&out)[U][COLS], const NBitsArgs& p, int n0, int c0, bool split) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
      if (c0 + 32 * u < p.chunks && n0 + j < p.N) {
        load_full<BITS>(out[u][j], p, n0 + j, c0 + 32 * u, split);
      } else {
        out[u][j] = Chunk{make_uint4(0, 0, 0, 0), 0.0f, kMagic, 0.0f, kMagic};
      }
    }
}

// NP: the norm prologue (norm_prologue.cuh): A holds the branch rows, the product reads h.
template <typename T, int BITS, int RPT, int COLS, int U, bool SW, bool NP>
__global__ void __launch_bounds__(kNbThreads, RPT <= 8 ? 2 : 1) nbits_kernel(NBitsArgs p) {
  static_assert(!(SW && NP), "a projection takes SwiGLU or the norm prologue, not both");
  extern __shared__ __align__(16) unsigned char nbits_smem[];
  __shared__ float norm_inv[NP ? RPT : 1][4];
  __shared__ float norm_red[NP ? (RPT > kNormGroup ? RPT : kNormGroup) : 1][8];
  __shared__ float norm_group_inv[NP ? 3 * kNormGroup : 1];
  // the register path (norm_rows_to_shared) when the rows are staged and short enough
  const bool norm_fast = NP && p.stage && norm_in_registers<T>(p.K);
  NormPrologue q = p.norm;  // the pass's rows of it (NP)
  constexpr int CPC = 128 / BITS;  // codes a 16-byte chunk
  constexpr int G = CPC / 8;       // groups of eight codes a chunk
  T* staged = reinterpret_cast<T*>(nbits_smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* A = static_cast<const T*>(p.A);
  T* Y = static_cast<T*>(p.Y);
  // Warps take column groups of COLS in a grid-stride loop (the grid is sized to the device),
  // so the staged rows serve many columns; each group's first chunks are fetched while the
  // previous group computes, the very first before the PDL wait (weights are constants).
  const int stride = gridDim.x * kNbWarps * COLS;
  const int start = (blockIdx.x * kNbWarps + warp) * COLS;
  const bool split_blocks = p.block_size < CPC;  // int4 blocks of 16: two blocks a chunk

  Chunk nxt[U][COLS];
  if (start < p.N) load_group<BITS, U, COLS>(nxt, p, start, lane, split_blocks);
  pdl_trigger();
  pdl_wait();

  for (int m0 = 0; m0 < p.M; m0 += RPT) {  // uniform over the block
    const T* pass_a = A + static_cast<size_t>(m0) * p.a_stride;
    if (NP) {
      const size_t off = static_cast<size_t>(m0) * p.K;
      if (p.norm.residual) q.residual = static_cast<const T*>(p.norm.residual) + off;
      if (p.norm.sum) q.sum = static_cast<T*>(p.norm.sum) + off;
      if (m0 > 0) __syncthreads();  // the previous pass has read norm_inv and the stage
      const int rows = min(RPT, p.M - m0);
      if (norm_fast) {  // h straight into the stage; block 0 writes the sum
        norm_rows_to_shared<T>(q, pass_a, rows, p.K, p.norm.vec, staged, p.stage_stride, blockIdx.x == 0, norm_red,
                               norm_group_inv);
      } else {
        norm_row_stats<T>(q, pass_a, rows, p.K, norm_inv, norm_red);
        norm_write_sum<T>(q, pass_a, rows, p.K, norm_inv, blockIdx.x, gridDim.x);
      }
    }
    if (p.stage && !norm_fast) {
      if (m0 > 0 && !NP) __syncthreads();  // the previous pass has read the stage
      stage_rows<T, RPT, SW, NP>(staged, p, A, m0, &q, norm_inv);
      __syncthreads();
    }
    if (m0 > 0 && start < p.N) load_group<BITS, U, COLS>(nxt, p, start, lane, split_blocks);
    for (int n0 = start; n0 < p.N; n0 += stride) {
      Chunk chunk[U][COLS];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < COLS; ++j) chunk[u][j] = nxt[u][j];
      if (n0 + stride < p.N) load_group<BITS, U, COLS>(nxt, p, n0 + stride, lane, split_blocks);
      float acc[RPT][COLS];
#pragma unroll
      for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int j = 0; j < COLS; ++j) acc[r][j] = 0.0f;
      for (int c0 = lane; c0 < p.chunks; c0 += 32 * U) {
        if (c0 != lane) load_group<BITS, U, COLS>(chunk, p, n0, c0, split_blocks);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + 32 * u;
          if (c >= p.chunks) break;  // chunks only grow with u
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const int k = c * CPC + 8 * g;
            const bool second = split_blocks && 8 * g >= p.block_size;
            float w[COLS][8];
#pragma unroll
            for (int j = 0; j < COLS; ++j)
              dequantize8<BITS>(w[j], chunk[u][j].q, g, second ? chunk[u][j].s1 : chunk[u][j].s0,
                                second ? chunk[u][j].z1 : chunk[u][j].z0);
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
              if (m0 + r >= p.M) break;  // uniform: rows past M are not computed
              float a[8];
              if (p.stage) {
                load_staged<T>(a, staged + static_cast<size_t>(r) * p.stage_stride, k);
              } else if (NP) {
                load_a_norm<T>(a, q, pass_a, r, k, p.K, norm_inv[r]);
              } else {
                load_a<T, SW>(a, p, A + static_cast<size_t>(m0 + r) * p.a_stride, k);
              }
#pragma unroll
              for (int j = 0; j < COLS; ++j)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][j] = fmaf(a[e], w[j][e], acc[r][j]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
          float v = acc[r][j];
#pragma unroll
          for (int off = 16; off >= 1; off /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
          const int m = m0 + r, n = n0 + j;
          if (lane == 0 && m < p.M && n < p.N) Y[static_cast<size_t>(m) * p.N + n] = from_f<T>(v);
        }
    }
  }
}

template <typename T, int BITS, int RPT, bool SW, bool NP>
int nbits_launch(NBitsArgs args, cudaStream_t stream) {
  // One column a warp (two spill under the two-blocks-an-SM register budget); U chunks in flight.
  constexpr int COLS = 1;
  constexpr int U = RPT <= 4 ? 2 : 1;
  const size_t stage = static_cast<size_t>(RPT) * args.stage_stride * sizeof(T);
  args.stage = stage <= static_cast<size_t>(kStageBytes) && args.stage_stride % 8 == 0;
  static bool opted_in = false;  // a function attribute (host side, not a stream operation)
  if (args.stage && stage > 48 * 1024 && !opted_in) {
    if (cudaFuncSetAttribute(nbits_kernel<T, BITS, RPT, COLS, U, SW, NP>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, kStageBytes) == cudaSuccess)
      opted_in = true;
    else
      args.stage = false;  // the same values through L1
  }
  const int per_block = kNbWarps * COLS;
  const int wanted = (args.N + per_block - 1) / per_block;
  const int resident = device_sm_count() * (RPT <= 8 ? 2 : 1);  // one wave: __launch_bounds__'s blocks an SM
  const int blocks = std::max(1, std::min(wanted, resident));
  return static_cast<int>(launch_kernel(nbits_kernel<T, BITS, RPT, COLS, U, SW, NP>, dim3(blocks, 1, 1),
                                        dim3(kNbThreads, 1, 1), args.stage ? stage : 0, stream, 0, args));
}

template <typename T, int BITS, bool SW, bool NP = false>
int nbits_rows(const NBitsArgs& args, cudaStream_t stream) {
  // Rows per pass from M: only which outputs a pass computes, never how (see the top).
  if (args.M == 1) return nbits_launch<T, BITS, 1, SW, NP>(args, stream);
  if (args.M == 2) return nbits_launch<T, BITS, 2, SW, NP>(args, stream);
  if (args.M <= 4) return nbits_launch<T, BITS, 4, SW, NP>(args, stream);
  if (args.M <= 8) return nbits_launch<T, BITS, 8, SW, NP>(args, stream);
  return nbits_launch<T, BITS, 16, SW, NP>(args, stream);
}

}  // namespace nbits_detail

template <typename T, int BITS>
int nbits_run(const NBitsArgs& p, bool swiglu, bool norm, cudaStream_t stream) {
  using nbits_detail::nbits_rows;
  if constexpr (!std::is_same<T, float>::value) {  // 16-bit activations: the tensor cores (matmul_nbits_mma.cuh)
    if (nbits_mma::applies(p.K, p.N, BITS, p.block_size))
      return nbits_mma::run<T, BITS>(p.A, p.B, p.scales, p.zp, p.Y, p.M, p.K, p.N, p.block_size, swiglu,
                                     norm ? &p.norm : nullptr, stream);
  }
  if (norm) return nbits_rows<T, BITS, false, true>(p, stream);
  return swiglu ? nbits_rows<T, BITS, true>(p, stream) : nbits_rows<T, BITS, false>(p, stream);
}

}  // namespace loopcast_cuda
