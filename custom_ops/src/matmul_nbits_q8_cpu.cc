// BatchInvariantMatMulNBits, accuracy_level 4 on the CPU (matmul_nbits_q8_cpu.h: the arithmetic).
//
// Operand order: the activations are stored in the order the codes unpack to, so VPDPBUSD
// (unsigned codes × signed activations, 4 products a 32-bit lane) pairs them with no shuffle of
// the activations. Operand vector v, byte j = 4l + t (lane l) holds k = operand_k(v, j) of the
// chunk:
//   narrow, 4 bits: one 64-byte load; v = 0 the low nibbles (k = 2j), v = 1 the high (2j + 1)
//   narrow, 8 bits: two loads, one VPERMT2B each: v = 0 holds k = 8l + t, v = 1 k = 8l + 4 + t
//   wide (4 bits): four loads transposed (VPERMT2D, VSHUFI64X2) into four steps s, each split
//     into nibbles (v = 2s + h): k = 32l + 8s + 2t + h, so a lane sums 32 k of one block.
#include "matmul_nbits_q8_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "matmul_nbits_q8_isa.h"

namespace loopcast {
namespace {

using q8_detail::Isa;
using q8_detail::kLanes;
using q8_detail::operand_k;

float lanes_combine(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)  // fixed pairwise combine
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

// A lane's weight scale and zero point for column n, chunk c (scale 0 past the last block).
void column_lanes(const Q8Weights& w, const Q8Chunk& ch, int64_t n, float* sw, float* zp) {
  for (int l = 0; l < kLanes; ++l) {
    const int64_t b = (ch.k0 + ch.lane_k * l) / w.bs;
    const bool in = b < w.nb;
    sw[l] = in ? w.scales[n * w.nb + b] : 0.0f;
    if (w.zp_f32 != nullptr) {
      zp[l] = in ? w.zp_f32[n * w.nb + b] : 0.0f;
    } else if (w.zp_u8 != nullptr) {
      const uint8_t z = in ? w.zp_u8[n * w.zp_row + (w.bits == 4 ? b / 2 : b)] : 0;
      zp[l] = static_cast<float>(w.bits == 4 ? ((b & 1) ? (z >> 4) : (z & 0xF)) : z);
    } else {
      zp[l] = static_cast<float>(1 << (w.bits - 1));
    }
  }
}

uint8_t code_at(const Q8Weights& w, int64_t n, int64_t k) {
  if (k >= w.nb * w.bs) return 0;
  const uint8_t* col = w.B + n * w.nb * w.bs * w.bits / 8;
  return w.bits == 4 ? ((col[k / 2] >> (4 * (k & 1))) & 0xF) : col[k];
}

void portable_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  const int64_t nc = static_cast<int64_t>(a.chunks.size());
  float sw[kLanes], zp[kLanes];
  uint8_t codes[8 * 64];
  for (int64_t n = n0; n < n1; ++n) {
    std::vector<float> lanes(static_cast<size_t>(a.rows * kLanes), 0.0f);
    for (int64_t c = 0; c < nc; ++c) {
      const Q8Chunk& ch = a.chunks[static_cast<size_t>(c)];
      column_lanes(w, ch, n, sw, zp);
      for (int v = 0; v < ch.vecs; ++v)
        for (int j = 0; j < 64; ++j) codes[v * 64 + j] = code_at(w, n, ch.k0 + operand_k(ch.wide, w.bits, v, j));
      for (int64_t r = 0; r < a.rows; ++r) {
        const int64_t rc = r * nc + c;
        const int8_t* q = a.q.data() + r * a.row_bytes + ch.q_offset;
        for (int l = 0; l < kLanes; ++l) {
          int32_t i = 0;
          for (int v = 0; v < ch.vecs; ++v)
            for (int t = 0; t < 4; ++t) i += codes[v * 64 + 4 * l + t] * q[v * 64 + 4 * l + t];
          const float tv = std::fma(-zp[l], a.q_sum[rc * kLanes + l], static_cast<float>(i));
          const float s = a.scale[rc * kLanes + l] * sw[l];
          float& acc = lanes[static_cast<size_t>(r * kLanes + l)];
          acc = std::fma(tv, s, acc);
        }
      }
    }
    for (int64_t r = 0; r < a.rows; ++r) Y[r * w.N + n] = lanes_combine(lanes.data() + r * kLanes);
  }
}

#ifdef LOOPCAST_Q8_AVX512

enum ZeroPoints { kNoZeroPoints, kPackedZeroPoints, kFloatZeroPoints };

// Where chunk c lies in every column (the same for all): computed once a call, so the column
// loop does no division.
struct ChunkPlace {
  int64_t byte0;      // first code byte in a column
  __mmask64 m[4];     // code bytes present in each 64-byte load (the last chunk may be partial)
  int64_t first;      // first block
  __mmask16 blocks;   // blocks present, from `first`
  // packed zero points: the bytes from zp_byte0 (zp_bytes of them), and per lane the dword of
  // those bytes (one byte each) and the shift that hold its block's zero point
  int64_t zp_byte0;
  __mmask16 zp_bytes;
  alignas(64) int32_t zp_index[16], zp_shift[16];
};

std::vector<ChunkPlace> chunk_places(const Q8Weights& w, const std::vector<Q8Chunk>& chunks) {
  std::vector<ChunkPlace> out(chunks.size());
  const int64_t col_bytes = w.nb * w.bs * w.bits / 8;
  auto mask = [](int64_t n) { return n >= 64 ? ~0ULL : n <= 0 ? 0ULL : ((1ULL << n) - 1); };
  for (size_t c = 0; c < chunks.size(); ++c) {
    ChunkPlace& p = out[c];
    p.byte0 = chunks[c].k0 * w.bits / 8;
    for (int i = 0; i < 4; ++i) p.m[i] = mask(col_bytes - p.byte0 - 64 * i);
    p.first = chunks[c].k0 / w.bs;
    const int64_t count = std::min<int64_t>(std::max<int64_t>(1, chunks[c].chunk_k / w.bs), w.nb - p.first);
    p.blocks = static_cast<__mmask16>((1u << count) - 1);
    const int64_t last = p.first + count - 1;  // last block present
    p.zp_byte0 = w.bits == 4 ? p.first / 2 : p.first;
    const int64_t bytes = (w.bits == 4 ? last / 2 : last) - p.zp_byte0 + 1;
    p.zp_bytes = static_cast<__mmask16>((1u << bytes) - 1);
    for (int l = 0; l < 16; ++l) {
      const int64_t b = std::min(last, p.first + chunks[c].lane_k * l / w.bs);  // past the last: scale 0
      p.zp_index[l] = static_cast<int32_t>((w.bits == 4 ? b / 2 : b) - p.zp_byte0);
      p.zp_shift[l] = w.bits == 4 ? static_cast<int32_t>(4 * (b & 1)) : 0;
    }
  }
  return out;
}

Q8_INLINE __m512i index_of(int which) {  // the constant shuffles of the code loads
  alignas(64) int8_t b[64];
  alignas(64) int32_t d[16];
  if (which < 2) {  // narrow 8-bit: VPERMT2B picks, from two loads, k = 8l + 4·which + t
    for (int j = 0; j < 64; ++j) b[j] = static_cast<int8_t>(8 * (j / 4) + 4 * which + j % 4);
    return _mm512_load_si512(b);
  }
  // wide: VPERMT2D picks, from two loads (8 lanes' 4 steps each), steps 2·(which−2) and +1
  for (int q = 0; q < 16; ++q) d[q] = 4 * (q % 8) + 2 * (which - 2) + q / 8;
  return _mm512_load_si512(d);
}

template <int BITS, int ZP>
Q8_INLINE void column_scales(const Q8Weights& w, const Q8Chunk& ch, int64_t n, const ChunkPlace& at,
                             __m512i block_of_lane, __m512* sw, __m512* zp) {
  const int64_t row = n * w.nb + at.first;
  *sw = _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(at.blocks, w.scales + row));
  if constexpr (ZP == kFloatZeroPoints) {
    *zp = _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(at.blocks, w.zp_f32 + row));
  } else if constexpr (ZP == kPackedZeroPoints) {
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(at.zp_bytes, w.zp_u8 + n * w.zp_row + at.zp_byte0));
    const __m512i z = _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_load_si512(at.zp_index), bytes),
                                        _mm512_load_si512(at.zp_shift));
    *zp = _mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(BITS == 4 ? 0xF : 0xFF)));
  } else {
    *zp = _mm512_set1_ps(static_cast<float>(1 << (BITS - 1)));
  }
}

// The chunk's code vectors of column n (VECS of them, the operand order above).
template <int BITS, int VECS>
Q8_INLINE void column_codes(const Q8Weights& w, int64_t n, const ChunkPlace& at, const __m512i* idx, __m512i* codes) {
  const uint8_t* p = w.B + n * (w.nb * w.bs * BITS / 8) + at.byte0;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  if constexpr (VECS == 8) {
    const __m512i v0 = _mm512_maskz_loadu_epi8(at.m[0], p), v1 = _mm512_maskz_loadu_epi8(at.m[1], p + 64);
    const __m512i v2 = _mm512_maskz_loadu_epi8(at.m[2], p + 128), v3 = _mm512_maskz_loadu_epi8(at.m[3], p + 192);
    const __m512i xa = _mm512_permutex2var_epi32(v0, idx[2], v1), xb = _mm512_permutex2var_epi32(v0, idx[3], v1);
    const __m512i ya = _mm512_permutex2var_epi32(v2, idx[2], v3), yb = _mm512_permutex2var_epi32(v2, idx[3], v3);
    const __m512i s[4] = {_mm512_shuffle_i64x2(xa, ya, 0x44), _mm512_shuffle_i64x2(xa, ya, 0xEE),
                          _mm512_shuffle_i64x2(xb, yb, 0x44), _mm512_shuffle_i64x2(xb, yb, 0xEE)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      codes[2 * i] = _mm512_and_si512(s[i], nib);
      codes[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(s[i], 4), nib);
    }
  } else if constexpr (BITS == 4) {
    const __m512i v = _mm512_maskz_loadu_epi8(at.m[0], p);
    codes[0] = _mm512_and_si512(v, nib);
    codes[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  } else {
    const __m512i v0 = _mm512_maskz_loadu_epi8(at.m[0], p), v1 = _mm512_maskz_loadu_epi8(at.m[1], p + 64);
    codes[0] = _mm512_permutex2var_epi8(v0, idx[0], v1);
    codes[1] = _mm512_permutex2var_epi8(v0, idx[1], v1);
  }
}

// The same chunk's codes and scales kPrefetchCols columns ahead, into L1: the weights stream
// from DRAM once a call, and the hardware prefetcher alone leaves the column loop waiting.
constexpr int64_t kPrefetchCols = 16;

template <int BITS, int VECS>
Q8_INLINE void prefetch_ahead(const Q8Weights& w, int64_t n, const ChunkPlace& at) {
  if (n + kPrefetchCols >= w.N) return;
  const int64_t col_bytes = w.nb * w.bs * BITS / 8;
  const char* p = reinterpret_cast<const char*>(w.B + (n + kPrefetchCols) * col_bytes + at.byte0);
  constexpr int kLines = BITS == 4 ? VECS / 2 : VECS;  // 64-byte lines of the chunk's codes
#pragma GCC unroll 4
  for (int i = 0; i < kLines; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w.scales + (n + kPrefetchCols) * w.nb + at.first), _MM_HINT_T0);
}

// One span of chunks [c0, c1) (all with VECS vectors) of R rows × C columns into acc.
// Without zero points the symmetric correction −2^(bits−1)·Σq starts the integer sum (exact, so
// the same t as the fp32 step).
template <int R, int C, int BITS, int VECS, int ZP>
Q8_INLINE void span(const Q8Rows& a, const Q8Weights& w, const ChunkPlace* places, const __m512i* idx, int64_t c0,
                    int64_t c1, int64_t r0, int64_t n0, __m512i block_of_lane, __m512 (&acc)[R][C]) {
  const int64_t nc = static_cast<int64_t>(a.chunks.size());
  for (int64_t c = c0; c < c1; ++c) {
    const Q8Chunk& ch = a.chunks[static_cast<size_t>(c)];
    __m512i codes[C][VECS];
    __m512 sw[C], zp[C];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      prefetch_ahead<BITS, VECS>(w, n0 + j, places[c]);
      column_codes<BITS, VECS>(w, n0 + j, places[c], idx, codes[j]);
      column_scales<BITS, ZP>(w, ch, n0 + j, places[c], block_of_lane, &sw[j], &zp[j]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int64_t rc = (r0 + i) * nc + c;
      const int8_t* q = a.q.data() + (r0 + i) * a.row_bytes + ch.q_offset;
      const __m512 sa = _mm512_loadu_ps(a.scale.data() + rc * kLanes);
      const __m512 qs = _mm512_loadu_ps(a.q_sum.data() + rc * kLanes);
      const __m512i mid = _mm512_loadu_si512(a.q_sum_mid.data() + rc * kLanes);
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        // Integer sums are exact, so any split gives the same i: a small tile takes two chains so
        // VPDPBUSD's latency overlaps; four or more (row, column) chains overlap on their own,
        // and one chain each saves an add and a zeroing a chunk.
        __m512i d0 = ZP == kNoZeroPoints ? mid : _mm512_setzero_si512();
        __m512 t;
        if constexpr (R * C >= 4) {
#pragma GCC unroll 8
          for (int v = 0; v < VECS; ++v) d0 = _mm512_dpbusd_epi32(d0, codes[j][v], _mm512_loadu_si512(q + 64 * v));
          t = _mm512_cvtepi32_ps(d0);
        } else {
          __m512i d1 = _mm512_setzero_si512();
#pragma GCC unroll 8
          for (int v = 0; v < VECS; v += 2) {
            d0 = _mm512_dpbusd_epi32(d0, codes[j][v], _mm512_loadu_si512(q + 64 * v));
            d1 = _mm512_dpbusd_epi32(d1, codes[j][v + 1], _mm512_loadu_si512(q + 64 * v + 64));
          }
          t = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
        }
        if constexpr (ZP != kNoZeroPoints) t = _mm512_fnmadd_ps(zp[j], qs, t);
        acc[i][j] = _mm512_fmadd_ps(t, _mm512_mul_ps(sa, sw[j]), acc[i][j]);
      }
    }
  }
}

// lanes_combine's pairs (j with j + 8, then j + 4, j + 2, j + 1) as in-register shuffles: the
// same additions of the same operands, so the same bits, without a store and 15 scalar adds.
Q8_INLINE float combine16(__m512 x) {
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(3, 2, 3, 2)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 1, 1, 1)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(3, 2, 3, 2)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 1, 1, 1)));
  return _mm512_cvtss_f32(x);
}

// lanes_combine for 16 columns at once: the same pairs of the same column's lanes (j with j + 8,
// then j + 4, j + 2, j + 1), so the same bits, with the columns transposed across the vectors as
// they reduce: 45 shuffles and adds for 16 columns where one column alone takes 8.
// v[c] holds column c's 16 lanes; the sums come out in the lane order kCombinedColumn names.
Q8_INLINE __m512 combine_columns(const __m512* v) {
  __m512 t[8], u[4], x[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // lanes j + 8: two columns a vector, 8 partials each
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // j + 4: four columns a vector, 4 partials each (one per 128 bits)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // j + 2: eight columns a vector, 2 partials each
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // j + 1: sixteen columns, one sum each
  return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Which column's sum lane l of combine_columns holds, found by running it on vectors whose
// lanes all hold their column's number (a sum of 16 equal lanes is 16 times the column).
Q8_TARGET __m512i combined_order() {
  alignas(64) __m512 v[16];
  for (int c = 0; c < 16; ++c) v[c] = _mm512_set1_ps(static_cast<float>(c));
  alignas(64) float sums[16];
  _mm512_store_ps(sums, combine_columns(v));
  alignas(64) int32_t lane_of_column[16];
  for (int l = 0; l < 16; ++l) lane_of_column[static_cast<int>(sums[l]) / 16] = l;
  return _mm512_load_si512(lane_of_column);
}

// R rows × C columns, every chunk (the wide ones, then the narrow ones), the accumulators in
// registers (the loops over R and C are unrolled so that the arrays become registers). One row
// combines its lanes column by column into Y (its few lane vectors leave the combine nothing
// to share); more rows leave each row's C lane vectors at lanes[i · 16 + j] for
// combine_columns, which costs each row an eighth of combine16 a column.
template <int R, int C, int BITS, int ZP>
Q8_TARGET void tile(const Q8Rows& a, const Q8Weights& w, const ChunkPlace* places, const __m512i* idx,
                    const __m512i* block_of_lane, int64_t r0, int64_t n0, __m512* lanes, float* Y) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm512_setzero_ps();
  const int64_t nc = static_cast<int64_t>(a.chunks.size());
  if constexpr (BITS == 4) span<R, C, 4, 8, ZP>(a, w, places, idx, 0, a.n_wide, r0, n0, block_of_lane[0], acc);
  span<R, C, BITS, 2, ZP>(a, w, places, idx, a.n_wide, nc, r0, n0, block_of_lane[1], acc);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      if constexpr (R == 1)
        Y[(r0 + i) * w.N + n0 + j] = combine16(acc[i][j]);
      else
        _mm512_store_ps(reinterpret_cast<float*>(lanes + i * 16 + j), acc[i][j]);
    }
}

// Rows r0..r0+R of columns [n0, n1): groups of 16 columns, each in tiles of C columns; then, for
// more than one row, each row's 16 columns combined at once. A group short of 16 columns
// combines stale lanes beside its own, which no column's sum reads.
template <int R, int BITS, int ZP>
Q8_TARGET void columns_pass(const Q8Rows& a, const Q8Weights& w, const ChunkPlace* at, const __m512i* idx,
                            const __m512i* block_of_lane, __m512i order, int64_t r0, int64_t n0, int64_t n1,
                            float* Y) {
  // Two columns a tile (four for one or two 8-bit rows): each row's operand, scale and sum loads
  // then serve two columns. One column a tile at eight rows measured 1.3-1.5x the time a row,
  // although two wide 4-bit columns' codes and eight rows' accumulators overfill the registers.
  constexpr int C = BITS == 4 ? 2 : (R <= 2 ? 4 : 2);
  alignas(64) __m512 lanes[R == 1 ? 1 : R * 16];
  for (__m512& v : lanes) v = _mm512_setzero_ps();
  for (int64_t g0 = n0; g0 < n1; g0 += 16) {
    const int64_t g = std::min<int64_t>(16, n1 - g0);
    int64_t j = 0;
    for (; j + C <= g; j += C)
      tile<R, C, BITS, ZP>(a, w, at, idx, block_of_lane, r0, g0 + j, R == 1 ? nullptr : lanes + j, Y);
    for (; j < g; ++j) tile<R, 1, BITS, ZP>(a, w, at, idx, block_of_lane, r0, g0 + j, R == 1 ? nullptr : lanes + j, Y);
    if constexpr (R > 1) {
      const __mmask16 keep = static_cast<__mmask16>((1u << g) - 1);
      for (int i = 0; i < R; ++i) {
        const __m512 sums = _mm512_permutexvar_ps(order, combine_columns(lanes + i * 16));
        _mm512_mask_storeu_ps(Y + (r0 + i) * w.N + g0, keep, sums);
      }
    }
  }
}

template <int BITS, int ZP>
Q8_TARGET void avx512_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  alignas(64) int32_t blk[2][kLanes];
  for (int l = 0; l < kLanes; ++l) {  // chunks start on a block
    blk[0][l] = static_cast<int32_t>((32 * l) / w.bs);
    blk[1][l] = static_cast<int32_t>((8 * l) / w.bs);
  }
  const __m512i block_of_lane[2] = {_mm512_load_si512(blk[0]), _mm512_load_si512(blk[1])};
  const __m512i idx[4] = {index_of(0), index_of(1), index_of(2), index_of(3)};
  const std::vector<ChunkPlace> places = chunk_places(w, a.chunks);
  const ChunkPlace* at = places.data();
  const __m512i order = combined_order();
  int64_t r = 0;
  // eight rows share each column's unpacked codes (a verify step's width), and the rows left
  // over share them in one tile of their count: the codes stream through the cache once a
  // call for any count up to eight. A row's arithmetic is the same in every tile, so the
  // tiling never changes its bits.
  for (; r + 8 <= a.rows; r += 8) columns_pass<8, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y);
  switch (a.rows - r) {
    case 7: columns_pass<7, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y); break;
    case 6: columns_pass<6, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y); break;
    case 5: columns_pass<5, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y); break;
    case 4: columns_pass<4, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y); break;
    case 3: columns_pass<3, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y); break;
    case 2: columns_pass<2, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y); break;
    case 1: columns_pass<1, BITS, ZP>(a, w, at, idx, block_of_lane, order, r, n0, n1, Y); break;
    default: break;
  }
}

template <int BITS>
void avx512_columns_zp(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  if (w.zp_f32 != nullptr)
    avx512_columns<BITS, kFloatZeroPoints>(a, w, n0, n1, Y);
  else if (w.zp_u8 != nullptr)
    avx512_columns<BITS, kPackedZeroPoints>(a, w, n0, n1, Y);
  else
    avx512_columns<BITS, kNoZeroPoints>(a, w, n0, n1, Y);
}

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  return has;
}

#endif

}  // namespace

namespace q8_detail {

#ifdef LOOPCAST_Q8_AVX512
Q8_TARGET static void zeroupper() { _mm256_zeroupper(); }
void avx512_upper_clean() { zeroupper(); }
#else
void avx512_upper_clean() {}
#endif

Isa vector_isa() {
  const char* portable = std::getenv("LOOPCAST_CPU_PORTABLE");
  if (portable != nullptr && std::strcmp(portable, "1") == 0) return Isa::kPortable;
  const char* cap = std::getenv("LOOPCAST_CPU_ISA");
  const bool avx512_ok = cap == nullptr || std::strcmp(cap, "avx512") == 0;
  const bool avx2_ok = avx512_ok || std::strcmp(cap, "avx2") == 0;
#ifdef LOOPCAST_Q8_AVX512
  if (avx512_ok && cpu_has_vnni()) return Isa::kAvx512;
#endif
  if (avx2_ok && avx2_available()) return Isa::kAvx2;
  return Isa::kPortable;
}

}  // namespace q8_detail

void q8_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  switch (q8_detail::vector_isa()) {
#ifdef LOOPCAST_Q8_AVX512
    case Isa::kAvx512:
      if (w.bits == 4)
        avx512_columns_zp<4>(a, w, n0, n1, Y);
      else
        avx512_columns_zp<8>(a, w, n0, n1, Y);
      q8_detail::avx512_upper_clean();
      return;
#endif
    case Isa::kAvx2: q8_detail::avx2_columns(a, w, n0, n1, Y); return;
    default: portable_columns(a, w, n0, n1, Y); return;
  }
}

}  // namespace loopcast
