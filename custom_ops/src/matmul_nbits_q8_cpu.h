// BatchInvariantMatMulNBits with accuracy_level 4 on the CPU: int8 activations, integer dot
// products (matmul_nbits_q8_cpu.cc).
//
// Each row's activations are quantized per weight block: sa = max|a| / 127, q = round(a · 127 /
// max|a|), a row's own values only. The K axis is cut into chunks of 128; lane l (0..15) of chunk
// c owns k in [128c + 8l, 128c + 8l + 8), which lies in one block. Per lane, in chunk order:
//
//   i = Σ code_k · q_k (int32, exact)      t = i − zp · Σ q_k      s = sa_block · scale_block
//   acc_l = fma(t, s, acc_l)
//
// and y = the 16 lanes combined pairwise in one fixed order. Every step depends on (k, K,
// block_size) only, never on the rows, the tile, the thread or the ISA: the AVX-512 VNNI path and
// the portable one give the same bits (integer sums are exact; each float step rounds once,
// fma included), so a row's result does not depend on how many rows share the call.
#pragma once

#include <cstdint>
#include <vector>

namespace loopcast {

constexpr int64_t kQ8Chunk = 128;  // k a chunk: 16 lanes of 8

// One call's activations in lane order: per row and chunk, 64 bytes each of the two operand
// vectors (the codes' low/high halves, matmul_nbits_q8_cpu.cc), then per lane the block's scale
// and the lane's sum of q.
struct Q8Rows {
  int64_t rows = 0, chunks = 0;
  std::vector<int8_t> q;      // [rows, chunks, 2, 64]
  std::vector<float> scale;   // [rows, chunks, 16]
  std::vector<float> q_sum;   // [rows, chunks, 16] (exact: |Σ| ≤ 8 · 127)
};

// What the weights are: MatMulNBits' layout (matmul_nbits_op.h). Zero points: float ones
// (fp32, [N · n_blocks]), packed uint8 ones, or neither (2^(bits-1)).
struct Q8Weights {
  const uint8_t* B;
  const float* scales;
  const uint8_t* zp_u8;
  const float* zp_f32;
  int64_t N, bits, bs, nb, zp_row;
};

// Quantizes `rows` rows of fp32 activations [rows, K] (K ≤ n_blocks · block_size).
void q8_quantize_rows(const float* A, int64_t rows, int64_t K, int64_t bits, int64_t bs, int64_t nb, Q8Rows* out);

// Y[r, n] for n in [n0, n1): the AVX-512 VNNI path where the CPU has it (and
// LOOPCAST_CPU_PORTABLE is not 1), else the portable one, with the same bits.
void q8_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y);

}  // namespace loopcast
