// BatchInvariantMatMulNBits, accuracy_level 4 on the CPU: the AVX2 + FMA path, for CPUs without
// AVX-512 VNNI (matmul_nbits_q8_cpu.h: the arithmetic; matmul_nbits_q8_cpu.cc: the operand order,
// the portable and AVX-512 paths).
//
// A chunk's 16 lanes are two 256-bit halves (lanes 0-7 and 8-15), each computed as the other
// paths compute a lane: its exact integer sum i, t = float(i) − zp·Σq, acc = fma(t, sa·sw, acc),
// then the 16 lanes combined in lanes_combine's pairs. So the same bits as the portable and
// AVX-512 paths, whatever the row count or the tile.
//
// The integer sums are exact although VPMADDUBSW adds its two products in a saturating int16:
//   4 bits: codes ≤ 15 and |q| ≤ 127, so a pair is ≤ 3810, and the 8 vectors of a wide chunk
//     sum to ≤ 30480 < 2^15 in int16 before one VPMADDWD widens them;
//   8 bits: codes up to 255 would saturate, so the product is taken as (code − 128)·q
//     (|code − 128| ≤ 128 as the unsigned operand, q carrying its sign: a pair ≤ 32512), and the
//     128·Σq it leaves out is the symmetric correction the other paths add (q_sum_mid).
#include "matmul_nbits_q8_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define LOOPCAST_Q8_AVX2 1
#define AVX2_TARGET __attribute__((target("avx2,fma")))
#define AVX2_INLINE AVX2_TARGET inline __attribute__((always_inline))
#endif

namespace loopcast {
namespace q8_detail {

#ifdef LOOPCAST_Q8_AVX2
namespace {

enum ZeroPoints { kNoZeroPoints, kPackedZeroPoints, kFloatZeroPoints };

// Where chunk c lies in every column (the same for all), computed once a call.
struct Place {
  int64_t byte0;  // first code byte in a column
  int64_t bytes;  // code bytes present: fewer than the chunk's in a partial last chunk
  bool full;
  bool live[2];   // whether half h has a lane before the last block's end
  int64_t first;  // first block
  // per half h: the lanes' blocks come from 8 blocks loaded at first + base[h] (those present
  // masked in), lane i taking element pick[h][i]; a lane past the last block reads 0
  int64_t base[2];
  alignas(32) int32_t pick[2][8];
  alignas(32) int32_t present[2][8];
  // packed zero points: up to 16 bytes from zp_byte0; per lane the byte (a PSHUFB index) and
  // the shift that hold its block's zero point (past the last block: the last block's)
  int64_t zp_byte0, zp_bytes;
  alignas(16) int8_t zp_pick[2][16];
  alignas(32) int32_t zp_shift[2][8];
};

std::vector<Place> chunk_places(const Q8Weights& w, const std::vector<Q8Chunk>& chunks) {
  std::vector<Place> out(chunks.size());
  const int64_t col_bytes = w.nb * w.bs * w.bits / 8;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const Q8Chunk& ch = chunks[c];
    Place& p = out[c];
    p.byte0 = ch.k0 * w.bits / 8;
    const int64_t chunk_bytes = ch.chunk_k * w.bits / 8;
    p.bytes = std::min(chunk_bytes, col_bytes - p.byte0);
    p.full = p.bytes == chunk_bytes;
    p.first = ch.k0 / w.bs;
    const int64_t count = std::min<int64_t>(std::max<int64_t>(1, ch.chunk_k / w.bs), w.nb - p.first);
    const int64_t last = p.first + count - 1;
    p.zp_byte0 = w.bits == 4 ? p.first / 2 : p.first;
    p.zp_bytes = (w.bits == 4 ? last / 2 : last) - p.zp_byte0 + 1;
    for (int h = 0; h < 2; ++h) {
      // lane_k ≤ block size, so a half's 8 lanes span at most 8 blocks
      p.base[h] = ch.lane_k * 8 * h / w.bs;
      p.live[h] = ch.lane_k * 8 * h / w.bs < count;  // its first lane's block is present
      std::memset(p.zp_pick[h], -1, sizeof(p.zp_pick[h]));  // PSHUFB: index −1 gives 0
      for (int i = 0; i < 8; ++i) {
        const int64_t rb = ch.lane_k * (8 * h + i) / w.bs;
        p.pick[h][i] = static_cast<int32_t>(rb - p.base[h]);
        p.present[h][i] = p.base[h] + i < count ? -1 : 0;
        const int64_t b = std::min(last, p.first + rb);
        p.zp_pick[h][i] = static_cast<int8_t>((w.bits == 4 ? b / 2 : b) - p.zp_byte0);
        p.zp_shift[h][i] = w.bits == 4 ? static_cast<int32_t>(4 * (b & 1)) : 0;
      }
    }
  }
  return out;
}

// Half h's block scales and zero points of column n for chunk `at`.
template <int BITS, int ZP>
AVX2_INLINE void lane_params(const Q8Weights& w, int64_t n, const Place& at, int h, __m256* sw, __m256* zp) {
  const int64_t row = n * w.nb + at.first + at.base[h];
  const __m256i pick = _mm256_load_si256(reinterpret_cast<const __m256i*>(at.pick[h]));
  const __m256i present = _mm256_load_si256(reinterpret_cast<const __m256i*>(at.present[h]));
  *sw = _mm256_permutevar8x32_ps(_mm256_maskload_ps(w.scales + row, present), pick);
  if constexpr (ZP == kFloatZeroPoints) {
    *zp = _mm256_permutevar8x32_ps(_mm256_maskload_ps(w.zp_f32 + row, present), pick);
  } else if constexpr (ZP == kPackedZeroPoints) {
    const uint8_t* src = w.zp_u8 + n * w.zp_row + at.zp_byte0;
    __m128i bytes;
    if (n * w.zp_row + at.zp_byte0 + 16 <= w.N * w.zp_row) {
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    } else {  // the last column's last bytes: no read past the buffer
      alignas(16) uint8_t tail[16] = {};
      std::memcpy(tail, src, static_cast<size_t>(at.zp_bytes));
      bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
    }
    const __m128i lane_bytes = _mm_shuffle_epi8(bytes, _mm_load_si128(reinterpret_cast<const __m128i*>(at.zp_pick[h])));
    const __m256i z = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(lane_bytes),
                                        _mm256_load_si256(reinterpret_cast<const __m256i*>(at.zp_shift[h])));
    *zp = _mm256_cvtepi32_ps(_mm256_and_si256(z, _mm256_set1_epi32(BITS == 4 ? 0xF : 0xFF)));
  } else {
    *zp = _mm256_set1_ps(static_cast<float>(1 << (BITS - 1)));
  }
}

// Half h's code vectors of a chunk whose bytes start at p, in the operand order of
// matmul_nbits_q8_cpu.cc (lanes 8h..8h+7 of each 64-byte operand vector); 8-bit codes as
// code − 128 (signed).
template <int BITS, int VECS>
AVX2_INLINE void half_codes(const uint8_t* p, int h, __m256i* codes) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  if constexpr (VECS == 8) {
    // wide: lane l's 16 bytes hold its 4 steps (dword s: k = 32l + 8s + 2t + h); a 4 × 4 dword
    // transpose of lanes (a | a + 4) gives step s of the half's 8 lanes in order
    const uint8_t* b = p + 128 * h;
    __m256i x[4];
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a)
      x[a] = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * a))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * (a + 4))), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(x[0], x[1]), t1 = _mm256_unpacklo_epi32(x[2], x[3]);
    const __m256i t2 = _mm256_unpackhi_epi32(x[0], x[1]), t3 = _mm256_unpackhi_epi32(x[2], x[3]);
    const __m256i s[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1), _mm256_unpacklo_epi64(t2, t3),
                          _mm256_unpackhi_epi64(t2, t3)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      codes[2 * i] = _mm256_and_si256(s[i], nib);
      codes[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(s[i], 4), nib);
    }
  } else if constexpr (BITS == 4) {  // narrow: byte j's low nibble is k = 2j, its high one 2j + 1
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    codes[0] = _mm256_and_si256(x, nib);
    codes[1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), nib);
  } else {  // 8 bits: lane l's vector 0 is dword 2l of the chunk, vector 1 dword 2l + 1
    const __m256 r0 = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h)));
    const __m256 r1 = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32)));
    const __m256i even = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(r0, r1, _MM_SHUFFLE(2, 0, 2, 0))),
                                                  _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i odd = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(r0, r1, _MM_SHUFFLE(3, 1, 3, 1))),
                                                 _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    codes[0] = _mm256_xor_si256(even, bias);
    codes[1] = _mm256_xor_si256(odd, bias);
  }
}

// A half's integer lane sums Σ code·q over the chunk's VECS vectors (8 bits: Σ (code − 128)·q);
// q points at the half's bytes of operand vector 0 (vector v at q + 64 v).
AVX2_INLINE __m256i operand(const int8_t* q, int v) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * v));
}

template <int BITS, int VECS>
AVX2_INLINE __m256i lane_dot(const __m256i* codes, const int8_t* q) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    __m256i s = _mm256_maddubs_epi16(codes[0], operand(q, 0));
#pragma GCC unroll 8
    for (int v = 1; v < VECS; ++v) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(codes[v], operand(q, v)));
    return _mm256_madd_epi16(s, ones);
  } else {
    __m256i d = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int v = 0; v < VECS; ++v)
      d = _mm256_add_epi32(
          d, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(codes[v]), _mm256_sign_epi8(operand(q, v), codes[v])),
                               ones));
    return d;
  }
}

// lanes_combine's pairs (j with j + 8, then j + 4, j + 2, j + 1) on the two halves.
AVX2_INLINE float combine16(__m256 lo, __m256 hi) {
  const __m256 a = _mm256_add_ps(lo, hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// The same chunk's codes and scales kPrefetchCols columns ahead, into L1 (the weights stream
// from DRAM once a call).
constexpr int64_t kPrefetchCols = 16;

// Chunks [c0, c1) (all of VECS vectors) of rows r0..r0+R of columns n..n+C-1 into acc. The C
// columns' chains are independent: interleaved, they keep the core busy where one column's
// chain (unpack, dot, fma, combine) would leave it waiting.
template <int C, int R, int BITS, int VECS, int ZP>
AVX2_INLINE void span(const Q8Rows& a, const Q8Weights& w, const Place* places, int64_t c0, int64_t c1, int64_t r0,
                      int64_t n, bool prefetch, __m256 (&acc)[C][R][2]) {
  const int64_t nc = static_cast<int64_t>(a.chunks.size());
  const int64_t col_bytes = w.nb * w.bs * BITS / 8;
  for (int64_t c = c0; c < c1; ++c) {
    const Q8Chunk& ch = a.chunks[static_cast<size_t>(c)];
    const Place& at = places[c];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      if (prefetch && n + j + kPrefetchCols < w.N) {
        const char* ahead = reinterpret_cast<const char*>(w.B + (n + j + kPrefetchCols) * col_bytes + at.byte0);
        for (int64_t i = 0; i < at.bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + (n + j + kPrefetchCols) * w.nb + at.first),
                     _MM_HINT_T0);
      }
    }
    const uint8_t* p[C];
    alignas(32) uint8_t tail[C][128];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) {
      p[j] = w.B + (n + j) * col_bytes + at.byte0;
      // A partial last chunk reads on into the next column: the codes of its absent k meet q = 0
      // (the operand is zero past K), so they add nothing, and those lanes' scales are 0. Only a
      // chunk that would run past the tensor's end copies.
      if (!at.full && (n + j) * col_bytes + at.byte0 + ch.chunk_k * BITS / 8 > w.N * col_bytes) {
        std::memset(tail[j], 0, sizeof(tail[j]));
        std::memcpy(tail[j], p[j], static_cast<size_t>(at.bytes));
        p[j] = tail[j];
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      // Every lane past the last block: each would add t·(sa·sw) = 0·0 to an accumulator that
      // is never −0 (it starts at +0, and a sum is −0 only when both terms are), so skipping
      // the half leaves the same bits.
      if (!at.live[h]) continue;
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        __m256 sw, zp;
        lane_params<BITS, ZP>(w, n + j, at, h, &sw, &zp);
        __m256i codes[VECS];
        half_codes<BITS, VECS>(p[j], h, codes);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const int64_t rc = (r0 + i) * nc + c;
          const int8_t* q = a.q.data() + (r0 + i) * a.row_bytes + ch.q_offset + 32 * h;
          const __m256 sa = _mm256_loadu_ps(a.scale.data() + rc * 16 + 8 * h);
          const __m256i mid =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_sum_mid.data() + rc * 16 + 8 * h));
          __m256i d = lane_dot<BITS, VECS>(codes, q);
          // 4 bits: Σ code·q, less 2^(bits−1)·Σq without zero points; 8 bits: Σ (code − 128)·q,
          // which is that already, and Σ code·q with zero points
          if constexpr (BITS == 4 && ZP == kNoZeroPoints) d = _mm256_add_epi32(d, mid);
          if constexpr (BITS == 8 && ZP != kNoZeroPoints) d = _mm256_sub_epi32(d, mid);
          __m256 t = _mm256_cvtepi32_ps(d);
          if constexpr (ZP != kNoZeroPoints)
            t = _mm256_fnmadd_ps(zp, _mm256_loadu_ps(a.q_sum.data() + rc * 16 + 8 * h), t);
          acc[j][i][h] = _mm256_fmadd_ps(t, _mm256_mul_ps(sa, sw), acc[j][i][h]);
        }
      }
    }
  }
}

// Rows r0..r0+R of columns n..n+C-1, every chunk (the wide ones, then the narrow ones).
template <int C, int R, int BITS, int ZP>
AVX2_TARGET void column_rows(const Q8Rows& a, const Q8Weights& w, const Place* places, int64_t r0, int64_t n,
                             float* Y) {
  __m256 acc[C][R][2];
#pragma GCC unroll 4
  for (int j = 0; j < C; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[j][i][0] = acc[j][i][1] = _mm256_setzero_ps();
  const int64_t nc = static_cast<int64_t>(a.chunks.size());
  if constexpr (BITS == 4) span<C, R, 4, 8, ZP>(a, w, places, 0, a.n_wide, r0, n, r0 == 0, acc);
  span<C, R, BITS, 2, ZP>(a, w, places, a.n_wide, nc, r0, n, r0 == 0, acc);
  for (int j = 0; j < C; ++j)
    for (int i = 0; i < R; ++i) Y[(r0 + i) * w.N + n + j] = combine16(acc[j][i][0], acc[j][i][1]);
}

// The rows in groups of four per column: a column's codes (under 1 KiB for K ≤ 2048 at 4 bits)
// stay in L1 while each group unpacks them, and four rows' accumulators fit the 16 registers;
// the one to three rows left take two columns at a time (one row alone: four). No grouping
// changes a row's arithmetic, so none changes its bits.
template <int BITS, int ZP>
AVX2_TARGET void columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  const std::vector<Place> places = chunk_places(w, a.chunks);
  const Place* at = places.data();
  const int64_t full = a.rows / 4 * 4;
  int64_t n = n0;
  for (; n < n1; ++n) {
    for (int64_t r = 0; r < full; r += 4) column_rows<1, 4, BITS, ZP>(a, w, at, r, n, Y);
    if (a.rows == full) continue;
    if (a.rows == 1 && n + 3 < n1) {  // one row: four columns at a time
      column_rows<4, 1, BITS, ZP>(a, w, at, 0, n, Y);
      n += 3;
      continue;
    }
    if (n + 1 < n1) {  // two columns of the rows left
      switch (a.rows - full) {
        case 3: column_rows<2, 3, BITS, ZP>(a, w, at, full, n, Y); break;
        case 2: column_rows<2, 2, BITS, ZP>(a, w, at, full, n, Y); break;
        default: column_rows<2, 1, BITS, ZP>(a, w, at, full, n, Y); break;
      }
      for (int64_t r = 0; r < full; r += 4) column_rows<1, 4, BITS, ZP>(a, w, at, r, n + 1, Y);
      ++n;
      continue;
    }
    switch (a.rows - full) {
      case 3: column_rows<1, 3, BITS, ZP>(a, w, at, full, n, Y); break;
      case 2: column_rows<1, 2, BITS, ZP>(a, w, at, full, n, Y); break;
      default: column_rows<1, 1, BITS, ZP>(a, w, at, full, n, Y); break;
    }
  }
}

template <int BITS>
void columns_zp(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  if (w.zp_f32 != nullptr)
    columns<BITS, kFloatZeroPoints>(a, w, n0, n1, Y);
  else if (w.zp_u8 != nullptr)
    columns<BITS, kPackedZeroPoints>(a, w, n0, n1, Y);
  else
    columns<BITS, kNoZeroPoints>(a, w, n0, n1, Y);
}

// The upper halves cleared before returning to code that may run legacy SSE (libm's expf).
AVX2_TARGET void upper_state_clean() { _mm256_zeroupper(); }

// quantize_value (matmul_nbits_q8_rows.cc) for one value: the tail of a block under 8 values.
inline int8_t quantize_one(float x, float inv) {
  const float v = std::nearbyint(x * inv);
  if (!(v == v)) return 0;
  return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
}

AVX2_TARGET void quantize_row(const float* a, int64_t K, int64_t bs, int64_t nb, int8_t* qk, float* sa) {
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * bs, k1 = std::min(K, k0 + bs);
    // max(|x|, m): a NaN x keeps m (MAXPS returns its second operand), as std::max(m, |x|) does;
    // m is never NaN, so the order of the maxima changes nothing
    __m256 m = _mm256_setzero_ps();
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(a + k)), m);
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
    for (; k < k1; ++k) amax = std::max(amax, std::fabs(a[k]));
    sa[b] = amax / 127.0f;
    const float inv_s = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 inv = _mm256_set1_ps(inv_s);
    for (k = k0; k + 8 <= k1; k += 8) {
      const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(a + k), inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 c = _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_ORD_Q), _mm256_min_ps(_mm256_max_ps(v, lo), hi));
      const __m256i i32 = _mm256_cvtps_epi32(c);
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qk + k), _mm_packs_epi16(i16, i16));
    }
    for (; k < k1; ++k) qk[k] = quantize_one(a[k], inv_s);
  }
}

}  // namespace

bool avx2_available() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

void avx2_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  if (w.bits == 4)
    columns_zp<4>(a, w, n0, n1, Y);
  else
    columns_zp<8>(a, w, n0, n1, Y);
  upper_state_clean();
}

void avx2_quantize_row(const float* a, int64_t K, int64_t bs, int64_t nb, int8_t* qk, float* sa) {
  quantize_row(a, K, bs, nb, qk, sa);
  upper_state_clean();
}

#else  // not x86-64 GCC: no AVX2 path (q8_columns then takes the portable one)

bool avx2_available() { return false; }
void avx2_columns(const Q8Rows&, const Q8Weights&, int64_t, int64_t, float*) {}
void avx2_quantize_row(const float*, int64_t, int64_t, int64_t, int8_t*, float*) {}

#endif

}  // namespace q8_detail
}  // namespace loopcast
