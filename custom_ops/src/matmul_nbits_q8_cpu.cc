// BatchInvariantMatMulNBits, accuracy_level 4 on the CPU (matmul_nbits_q8_cpu.h: the arithmetic).
//
// Operand order: a chunk's codes come out of one 64-byte load (4 bits: byte j holds k = 2j and
// 2j + 1) or two (8 bits), and the activations are stored in the order the codes unpack to, so
// VPDPBUSD (unsigned codes × signed activations, 4 products a lane) needs no shuffle on the
// 4-bit path: "lo" pairs the low nibbles with the even k, "hi" the high nibbles with the odd k.
// 8 bits: "lo" holds k0..k0+3 of each lane, "hi" k0+4..k0+7 (one VPERMT2B each).
#include "matmul_nbits_q8_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
// GCC's intrinsics pass an "undefined" vector as the unmasked source, which -Werror reads as
// maybe-uninitialized once inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define LOOPCAST_Q8_AVX512 1
#define Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma")))
#define Q8_INLINE Q8_TARGET inline __attribute__((always_inline))
#endif

namespace loopcast {
namespace {

constexpr int kLanes = 16;

// k of byte j of the lo / hi operand in a chunk (the codes' order, above).
inline int64_t lo_k(int64_t bits, int j) { return bits == 4 ? 2 * j : 8 * (j / 4) + j % 4; }
inline int64_t hi_k(int64_t bits, int j) { return bits == 4 ? 2 * j + 1 : 8 * (j / 4) + 4 + j % 4; }

float lanes_combine(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)  // fixed pairwise combine
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

int8_t quantize_value(float x, float inv) {
  float v = std::nearbyint(x * inv);
  if (!(v == v)) return 0;  // NaN (an inf or NaN activation): no UB in the conversion
  return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
}

// A lane's zero point and weight scale for column n, chunk c (0 scale past the last block).
void column_lanes(const Q8Weights& w, int64_t n, int64_t c, float* sw, float* zp) {
  for (int l = 0; l < kLanes; ++l) {
    const int64_t b = (kQ8Chunk * c + 8 * l) / w.bs;
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
  float sw[kLanes], zp[kLanes];
  for (int64_t n = n0; n < n1; ++n) {
    std::vector<float> lanes(static_cast<size_t>(a.rows * kLanes), 0.0f);
    for (int64_t c = 0; c < a.chunks; ++c) {
      column_lanes(w, n, c, sw, zp);
      uint8_t lo[64], hi[64];
      for (int j = 0; j < 64; ++j) {
        lo[j] = code_at(w, n, kQ8Chunk * c + lo_k(w.bits, j));
        hi[j] = code_at(w, n, kQ8Chunk * c + hi_k(w.bits, j));
      }
      for (int64_t r = 0; r < a.rows; ++r) {
        const int8_t* q = a.q.data() + (r * a.chunks + c) * 128;
        const float* sa = a.scale.data() + (r * a.chunks + c) * kLanes;
        const float* qs = a.q_sum.data() + (r * a.chunks + c) * kLanes;
        for (int l = 0; l < kLanes; ++l) {
          int32_t i = 0;
          for (int t = 0; t < 4; ++t) i += lo[4 * l + t] * q[4 * l + t] + hi[4 * l + t] * q[64 + 4 * l + t];
          const float tv = std::fma(-zp[l], qs[l], static_cast<float>(i));
          const float s = sa[l] * sw[l];
          float& acc = lanes[static_cast<size_t>(r * kLanes + l)];
          acc = std::fma(tv, s, acc);
        }
      }
    }
    for (int64_t r = 0; r < a.rows; ++r) Y[r * w.N + n] = lanes_combine(lanes.data() + r * kLanes);
  }
}

#ifdef LOOPCAST_Q8_AVX512

struct ColChunk {
  __m512i lo, hi;
  __m512 sw, zp;
};

Q8_INLINE __m512i byte_index(bool hi) {
  alignas(64) int8_t idx[64];
  for (int j = 0; j < 64; ++j) idx[j] = static_cast<int8_t>(hi_k(8, j) - (hi ? 0 : 4));
  return _mm512_load_si512(idx);
}

enum ZeroPoints { kNoZeroPoints, kPackedZeroPoints, kFloatZeroPoints };

// Where chunk c lies in every column (the same for all): computed once a call, so the column
// loop does no division.
struct ChunkPlace {
  int64_t byte0;           // first code byte in a column
  __mmask64 m0, m1;        // code bytes present (the last chunk may be partial)
  int64_t first;           // first block
  __mmask16 blocks;        // blocks present, from `first`
};

std::vector<ChunkPlace> chunk_places(const Q8Weights& w, int64_t chunks) {
  std::vector<ChunkPlace> out(static_cast<size_t>(chunks));
  const int64_t col_bytes = w.nb * w.bs * w.bits / 8, chunk_bytes = kQ8Chunk * w.bits / 8;
  auto mask = [](int64_t n) { return n >= 64 ? ~0ULL : n <= 0 ? 0ULL : ((1ULL << n) - 1); };
  for (int64_t c = 0; c < chunks; ++c) {
    ChunkPlace& p = out[static_cast<size_t>(c)];
    p.byte0 = chunk_bytes * c;
    p.m0 = mask(col_bytes - p.byte0);
    p.m1 = mask(col_bytes - p.byte0 - 64);
    p.first = kQ8Chunk * c / w.bs;
    const int64_t count = std::min<int64_t>(std::max<int64_t>(1, kQ8Chunk / w.bs), w.nb - p.first);
    p.blocks = static_cast<__mmask16>((1u << count) - 1);
  }
  return out;
}

template <int BITS, int ZP>
Q8_INLINE void load_column(const Q8Weights& w, int64_t n, int64_t c, const ChunkPlace& at, __m512i block_of_lane,
                           ColChunk* cc) {
  const uint8_t* p = w.B + n * (w.nb * w.bs * BITS / 8) + at.byte0;
  if constexpr (BITS == 4) {
    const __m512i v = _mm512_maskz_loadu_epi8(at.m0, p);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    cc->lo = _mm512_and_si512(v, nib);
    cc->hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  } else {
    const __m512i v0 = _mm512_maskz_loadu_epi8(at.m0, p);
    const __m512i v1 = _mm512_maskz_loadu_epi8(at.m1, p + 64);
    cc->lo = _mm512_permutex2var_epi8(v0, byte_index(false), v1);
    cc->hi = _mm512_permutex2var_epi8(v0, byte_index(true), v1);
  }
  const int64_t row = n * w.nb + at.first;
  cc->sw = _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(at.blocks, w.scales + row));
  if constexpr (ZP == kFloatZeroPoints) {
    cc->zp = _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(at.blocks, w.zp_f32 + row));
  } else if constexpr (ZP == kPackedZeroPoints) {
    alignas(64) float sw[kLanes], zp[kLanes];
    column_lanes(w, n, c, sw, zp);
    cc->zp = _mm512_load_ps(zp);
  } else {
    cc->zp = _mm512_set1_ps(static_cast<float>(1 << (BITS - 1)));
  }
}

// R rows × C columns, every chunk, the accumulators in registers (the loops over R and C are
// unrolled so that the arrays become registers).
template <int R, int C, int BITS, int ZP>
Q8_TARGET void tile(const Q8Rows& a, const Q8Weights& w, const ChunkPlace* places, int64_t r0, int64_t n0,
                    __m512i block_of_lane, float* Y) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm512_setzero_ps();
  for (int64_t c = 0; c < a.chunks; ++c) {
    ColChunk cc[C];
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) load_column<BITS, ZP>(w, n0 + j, c, places[c], block_of_lane, &cc[j]);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const int64_t rc = (r0 + i) * a.chunks + c;
      const __m512i alo = _mm512_loadu_si512(a.q.data() + rc * 128);
      const __m512i ahi = _mm512_loadu_si512(a.q.data() + rc * 128 + 64);
      const __m512 sa = _mm512_loadu_ps(a.scale.data() + rc * kLanes);
      const __m512 qs = _mm512_loadu_ps(a.q_sum.data() + rc * kLanes);
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cc[j].lo, alo);
        d = _mm512_dpbusd_epi32(d, cc[j].hi, ahi);
        const __m512 t = _mm512_fnmadd_ps(cc[j].zp, qs, _mm512_cvtepi32_ps(d));
        acc[i][j] = _mm512_fmadd_ps(t, _mm512_mul_ps(sa, cc[j].sw), acc[i][j]);
      }
    }
  }
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      _mm512_store_ps(lanes, acc[i][j]);
      Y[(r0 + i) * w.N + n0 + j] = lanes_combine(lanes);
    }
}

template <int BITS, int ZP>
Q8_TARGET void avx512_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
  alignas(64) int32_t blk[kLanes];
  for (int l = 0; l < kLanes; ++l) blk[l] = static_cast<int32_t>((8 * l) / w.bs);  // chunks start on a block
  const __m512i block_of_lane = _mm512_load_si512(blk);
  const std::vector<ChunkPlace> places = chunk_places(w, a.chunks);
  const ChunkPlace* at = places.data();
  int64_t r = 0;
  for (; r + 4 <= a.rows; r += 4) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) tile<4, 2, BITS, ZP>(a, w, at, r, n, block_of_lane, Y);
    for (; n < n1; ++n) tile<4, 1, BITS, ZP>(a, w, at, r, n, block_of_lane, Y);
  }
  for (; r < a.rows; ++r) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile<1, 4, BITS, ZP>(a, w, at, r, n, block_of_lane, Y);
    for (; n < n1; ++n) tile<1, 1, BITS, ZP>(a, w, at, r, n, block_of_lane, Y);
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

void q8_quantize_rows(const float* A, int64_t rows, int64_t K, int64_t bits, int64_t bs, int64_t nb, Q8Rows* out) {
  const int64_t chunks = (nb * bs + kQ8Chunk - 1) / kQ8Chunk;
  out->rows = rows;
  out->chunks = chunks;
  out->q.assign(static_cast<size_t>(rows * chunks * 128), 0);
  out->scale.assign(static_cast<size_t>(rows * chunks * kLanes), 0.0f);
  out->q_sum.assign(static_cast<size_t>(rows * chunks * kLanes), 0.0f);
  std::vector<int8_t> qk(static_cast<size_t>(chunks * kQ8Chunk));
  std::vector<float> sa(static_cast<size_t>(nb));
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = A + r * K;
    std::fill(qk.begin(), qk.end(), 0);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * bs, k1 = std::min(K, k0 + bs);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(a[k]));
      sa[b] = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t k = k0; k < k1; ++k) qk[k] = quantize_value(a[k], inv);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      int8_t* q = out->q.data() + (r * chunks + c) * 128;
      const int8_t* src = qk.data() + c * kQ8Chunk;
      for (int j = 0; j < 64; ++j) {
        q[j] = src[lo_k(bits, j)];
        q[64 + j] = src[hi_k(bits, j)];
      }
      for (int l = 0; l < kLanes; ++l) {
        const int64_t b = (kQ8Chunk * c + 8 * l) / bs;
        int32_t sum = 0;
        for (int t = 0; t < 8; ++t) sum += src[8 * l + t];
        out->scale[(r * chunks + c) * kLanes + l] = b < nb ? sa[b] : 0.0f;
        out->q_sum[(r * chunks + c) * kLanes + l] = static_cast<float>(sum);
      }
    }
  }
}

void q8_columns(const Q8Rows& a, const Q8Weights& w, int64_t n0, int64_t n1, float* Y) {
#ifdef LOOPCAST_Q8_AVX512
  const char* portable = std::getenv("LOOPCAST_CPU_PORTABLE");  // tests compare the two paths' bits
  if (cpu_has_vnni() && !(portable != nullptr && std::strcmp(portable, "1") == 0)) {
    if (w.bits == 4)
      avx512_columns_zp<4>(a, w, n0, n1, Y);
    else
      avx512_columns_zp<8>(a, w, n0, n1, Y);
    return;
  }
#endif
  portable_columns(a, w, n0, n1, Y);
}

}  // namespace loopcast
