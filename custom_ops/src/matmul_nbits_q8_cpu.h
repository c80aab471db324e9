// BatchInvariantMatMulNBits with accuracy_level 4 on the CPU: int8 activations, integer dot
// products (matmul_nbits_q8_cpu.cc).
//
// Each row's activations are quantized per weight block: sa = max|a| / 127, q = round(a · 127 /
// max|a|), a row's own values only. The K axis is cut into chunks; lane l (0..15) of a chunk owns
// a run of k inside one block (the layout, below). Per lane, in chunk order:
//
//   i = Σ code_k · q_k (int32, exact)      t = i − zp · Σ q_k      s = sa_block · scale_block
//   acc_l = fma(t, s, acc_l)
//
// and y = the 16 lanes combined pairwise in one fixed order. Every step depends on (k, K, bits,
// block_size) only, never on the rows, the tile, the thread or the ISA: the AVX-512 VNNI, AVX2 and
// portable paths give the same bits (integer sums are exact; each float step rounds once,
// fma included), so a row's result does not depend on how many rows share the call.
//
// Layouts: 4-bit weights in blocks of 32 or more take "wide" chunks of 512 k, a lane 32 k (the
// fewest float steps a product), and the rest of K (under 512) chunks of 128 k; 8-bit weights and
// 4-bit blocks of 16 take chunks of 128 k, a lane 8 k.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

namespace loopcast {

// 64-byte aligned storage for the operand rows: every 512-bit load of an operand then sits in
// one cache line (an unaligned one splits across two and costs two loads; measured 1.3x the
// verify rows' time).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT(google-explicit-constructor)
  T* allocate(size_t n) {
    const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

struct Q8Chunk {
  bool wide;
  int64_t k0, chunk_k, lane_k, vecs;  // first k, k a chunk, k a lane, 64-byte operand vectors
  int64_t q_offset;                   // its operand bytes' offset in a row
};

// The chunks of a K axis stored as n_blocks · block_size (a function of bits and block size).
std::vector<Q8Chunk> q8_chunks(int64_t bits, int64_t block_size, int64_t n_blocks);

// One call's activations in operand order: per row and chunk, `vecs` vectors of 64 bytes (the
// order the codes unpack to, matmul_nbits_q8_cpu.cc), then per lane the block's scale and the
// lane's sum of q (as fp32: exact, and as −2^(bits-1)·Σq, the symmetric correction).
struct Q8Rows {
  std::vector<Q8Chunk> chunks;
  int64_t rows = 0, row_bytes = 0, n_wide = 0;  // the wide chunks come first
  AlignedVector<int8_t> q;           // [rows, row_bytes]
  AlignedVector<float> scale;        // [rows, chunks, 16]
  AlignedVector<float> q_sum;        // [rows, chunks, 16]
  AlignedVector<int32_t> q_sum_mid;  // [rows, chunks, 16]: −2^(bits−1) · Σq
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
// The same in two steps, for callers that quantize the rows in parallel: the buffers for `rows`
// rows, then row r from its activations a (each row's bytes depend on that row alone).
void q8_prepare_rows(int64_t rows, int64_t bits, int64_t bs, int64_t nb, Q8Rows* out);
void q8_quantize_row(const float* a, int64_t r, int64_t K, int64_t bits, int64_t bs, int64_t nb, Q8Rows* out);

// Y[r, n] for n in [n0, n1), with the same bits on every path: AVX-512 VNNI where the CPU has
// it, else AVX2 + FMA, else the portable one. LOOPCAST_CPU_ISA=portable|avx2|avx512 caps the
// path at that one (tests compare their bits; LOOPCAST_CPU_PORTABLE=1 is the portable cap).
void q8_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y);

namespace q8_detail {
// The AVX2 + FMA path (matmul_nbits_q8_avx2.cc).
bool avx2_available();
void avx2_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y);
// One row's blocks quantized into qk (k order, K of them) and sa (per block): the portable
// quantize's bytes and scales, 8 lanes at a time.
void avx2_quantize_row(const float* a, int64_t K, int64_t bs, int64_t nb, int8_t* qk, float* sa);
}  // namespace q8_detail

}  // namespace loopcast
