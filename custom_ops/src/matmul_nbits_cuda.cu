// BatchInvariantMatMulNBits, CUDA kernel for skinny products (decode M = 1, verify / cycle
// M <= 16; more rows take more passes of 16): Y[M, N] = A[M, K] · Wᵀ with W [N, K] stored
// block-quantized in MatMulNBits' layout (matmul_nbits_op.h), fp32 accumulation.
//
// The product is memory-bound on the weights, which are read once from HBM per pass and
// dequantized in registers as they arrive ("in the prologue" of each k-step), never written
// back: w = (q - zero_point) · scale in fp32, the CPU kernel's and numpy's expression.
//
//   grid (ceil(N / COLS)), 256 threads = 8 warps; a block owns COLS output columns.
//   K is cut into 256-wide steps; warp w owns steps [w·spw, (w+1)·spw) (spw = ceil(steps / 8)).
//   In a step, lane l owns k = 256·s + 8l .. +8: per column one 4-byte (int4) or 8-byte (int8)
//   weight load (a warp reads 128 or 256 contiguous bytes of a column) and, per row, one
//   16-byte activation load (fp16/bf16; two for fp32) reused for all COLS columns. The next
//   step's weight loads are issued before this step's products.
//
// M-invariance: output (m, n) is reduced as
//   serial fmaf over the lane's k (ascending) -> xor butterfly over the 32 lanes of the warp ->
//   serial sum over the 8 warps (ascending),
// and spw, the step width and the lane mapping depend only on K. Rows never interact: RPT
// (rows per pass: 1, 2, 4, 8 or 16, from M) and COLS (columns per block, from RPT) only decide
// which outputs a block computes, never how one is reduced.
#include <algorithm>
#include <cstdint>

#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace loopcast_cuda {
namespace {

constexpr int kNbWarps = 8;
constexpr int kNbThreads = kNbWarps * 32;
constexpr int kStepK = 256;  // k per warp step: 32 lanes x 8

struct NBitsArgs {
  const void* A;
  const uint8_t* B;
  const float* scales;
  const uint8_t* zp;  // null: symmetric, zero point 2^(bits-1)
  void* Y;
  int M, K, N, block_size, nb, zp_row, spw;
  int a_stride;       // elements per row of A: K, or 2K with SwiGLU ([gate | up])
  long long row_bytes;  // bytes per weight row: nb * block_size * bits / 8
  bool b_vec, a_vec;  // aligned vector loads allowed
};

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

// Column n's eight codes at k .. k + 8 (k < K, a multiple of 8: inside one block) with their
// block's scale and zero point, as loaded (dequantised later: the next step's loads are issued
// before this step's products).
template <int BITS>
struct Codes {
  uint32_t q[BITS / 4];  // 8 codes: one word (4 bits) or two (8 bits)
  float scale, zp;
};

template <int BITS>
__device__ __forceinline__ void load_codes(Codes<BITS>& c, const NBitsArgs& p, int n, int k) {
  const int blk = k / p.block_size;
  const int index = n * p.nb + blk;
  c.scale = __ldg(p.scales + index);
  c.zp = static_cast<float>(1 << (BITS - 1));
  if (p.zp != nullptr) {
    const uint8_t z = __ldg(p.zp + static_cast<size_t>(n) * p.zp_row + (BITS == 4 ? blk / 2 : blk));
    c.zp = static_cast<float>(BITS == 4 ? ((blk & 1) ? (z >> 4) : (z & 0xF)) : z);
  }
  const uint8_t* src = p.B + static_cast<size_t>(n) * p.row_bytes + static_cast<size_t>(k) * BITS / 8;
  if (p.b_vec) {
    if constexpr (BITS == 4) {
      c.q[0] = __ldg(reinterpret_cast<const unsigned int*>(src));
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
      c.q[0] = v.x;
      c.q[1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < BITS / 4; ++i)
      c.q[i] = src[4 * i] | (src[4 * i + 1] << 8) | (src[4 * i + 2] << 16) | (static_cast<uint32_t>(src[4 * i + 3]) << 24);
  }
}

// w = (q - zero_point) · scale, value e at k + e (4 bits: the low nibble first).
template <int BITS>
__device__ __forceinline__ void dequantize(float (&w)[8], const Codes<BITS>& c) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t q = BITS == 4 ? (c.q[0] >> (4 * e)) & 0xF : (c.q[e / 4] >> (8 * (e % 4))) & 0xFF;
    w[e] = __fmul_rn(static_cast<float>(q) - c.zp, c.scale);
  }
}

template <typename T, int BITS, int RPT, int COLS, bool SW>
__global__ void __launch_bounds__(kNbThreads, RPT <= 2 ? 3 : 2) nbits_kernel(NBitsArgs p) {
  __shared__ float red[kNbWarps][RPT][COLS];
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * COLS;
  const int s_begin = warp * p.spw;
  const int s_end = min(s_begin + p.spw, (p.K + kStepK - 1) / kStepK);
  const T* A = static_cast<const T*>(p.A);
  T* Y = static_cast<T*>(p.Y);

  for (int m0 = 0; m0 < p.M; m0 += RPT) {  // uniform over the block
    float acc[RPT][COLS];
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
      for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
    // Software pipeline: step s + 1's codes are loaded before step s's products (the order of
    // the products, k ascending, is unchanged). Columns past N load nothing and are never stored.
    Codes<BITS> cur[COLS] = {}, next[COLS] = {};
    auto load_step = [&](Codes<BITS>(&c)[COLS], int s) {
      const int k = s * kStepK + 8 * lane;
#pragma unroll
      for (int j = 0; j < COLS; ++j)
        if (k < p.K && n0 + j < p.N) load_codes<BITS>(c[j], p, n0 + j, k);
    };
    if (s_begin < s_end) load_step(cur, s_begin);
    for (int s = s_begin; s < s_end; ++s) {
      if (s + 1 < s_end) load_step(next, s + 1);
      const int k = s * kStepK + 8 * lane;
      if (k < p.K) {
        // Each acc[r][c] takes fmaf over e ascending either way; only the register footprint
        // differs: few rows keep every row's activations, many rows every column's weights.
        if constexpr (RPT <= 4) {
          float a[RPT][8];
#pragma unroll
          for (int r = 0; r < RPT; ++r)
            load_a<T, SW>(a[r], p, A + static_cast<size_t>(min(m0 + r, p.M - 1)) * p.a_stride, k);  // rows >= M: discarded
#pragma unroll
          for (int c = 0; c < COLS; ++c) {
            float w[8];
            dequantize<BITS>(w, cur[c]);
#pragma unroll
            for (int r = 0; r < RPT; ++r)
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[r][c] = fmaf(a[r][e], w[e], acc[r][c]);
          }
        } else {
          float w[COLS][8];
#pragma unroll
          for (int c = 0; c < COLS; ++c) dequantize<BITS>(w[c], cur[c]);
#pragma unroll
          for (int r = 0; r < RPT; ++r) {
            float a[8];
            load_a<T, SW>(a, p, A + static_cast<size_t>(min(m0 + r, p.M - 1)) * p.a_stride, k);
#pragma unroll
            for (int c = 0; c < COLS; ++c)
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[r][c] = fmaf(a[e], w[c][e], acc[r][c]);
          }
        }
      }
#pragma unroll
      for (int c = 0; c < COLS; ++c) cur[c] = next[c];
    }
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
      for (int c = 0; c < COLS; ++c) {
        float v = acc[r][c];
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
        if (lane == 0) red[warp][r][c] = v;
      }
    __syncthreads();
    if (threadIdx.x < RPT * COLS) {
      const int r = threadIdx.x / COLS, c = threadIdx.x % COLS;
      float sum = red[0][r][c];
#pragma unroll
      for (int q = 1; q < kNbWarps; ++q) sum = __fadd_rn(sum, red[q][r][c]);
      const int m = m0 + r, n = n0 + c;
      if (m < p.M && n < p.N) Y[static_cast<size_t>(m) * p.N + n] = from_f<T>(sum);
    }
    __syncthreads();  // red is rewritten by the next pass
  }
}

template <typename T, int BITS, int RPT, bool SW>
int nbits_launch(const NBitsArgs& args, cudaStream_t stream) {
  // registers: acc[RPT][COLS], two steps' codes per column, and a[RPT][8] or w[COLS][8] (nbits_kernel)
  constexpr int COLS = RPT <= 8 ? 4 : 2;
  const int blocks = (args.N + COLS - 1) / COLS;
  return static_cast<int>(launch_kernel(nbits_kernel<T, BITS, RPT, COLS, SW>, dim3(blocks, 1, 1),
                                        dim3(kNbThreads, 1, 1), 0, stream, 0, args));
}

template <typename T, int BITS, bool SW>
int nbits_rows(const NBitsArgs& args, cudaStream_t stream) {
  // Rows per pass from M: only which outputs a pass computes, never how (see the top).
  if (args.M == 1) return nbits_launch<T, BITS, 1, SW>(args, stream);
  if (args.M == 2) return nbits_launch<T, BITS, 2, SW>(args, stream);
  if (args.M <= 4) return nbits_launch<T, BITS, 4, SW>(args, stream);
  if (args.M <= 8) return nbits_launch<T, BITS, 8, SW>(args, stream);
  return nbits_launch<T, BITS, 16, SW>(args, stream);
}

template <typename T>
struct NBitsLauncher {
  static int run(const void* A, const void* B, const float* scales, const uint8_t* zp, void* Y, int64_t M, int64_t K,
                 int64_t N, int bits, int block_size, int swiglu, void* stream) {
    if (M <= 0 || N <= 0) return 0;
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
    const int steps = static_cast<int>((K + kStepK - 1) / kStepK);
    p.spw = (steps + kNbWarps - 1) / kNbWarps;  // from K only
    p.a_stride = static_cast<int>(swiglu ? 2 * K : K);
    p.row_bytes = static_cast<long long>(p.nb) * block_size * bits / 8;
    p.b_vec = reinterpret_cast<uintptr_t>(B) % 8 == 0;  // rows are whole blocks: >= 8 bytes each
    p.a_vec = reinterpret_cast<uintptr_t>(A) % 16 == 0 && K % 8 == 0;
    if (static_cast<long long>(N) * p.nb > (1LL << 31)) return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    if (bits == 4) return swiglu ? nbits_rows<T, 4, true>(p, s) : nbits_rows<T, 4, false>(p, s);
    return swiglu ? nbits_rows<T, 8, true>(p, s) : nbits_rows<T, 8, false>(p, s);
  }
};

}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_matmul_nbits(int dtype, const void* A, const void* B, const float* scales,
                                                 const uint8_t* zero_points, void* Y, int64_t M, int64_t K, int64_t N,
                                                 int bits, int block_size, int swiglu, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::NBitsLauncher>(dtype, A, B, scales, zero_points, Y, M, K, N, bits,
                                                               block_size, swiglu, stream);
}
