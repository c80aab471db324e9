// BatchInvariantMatMulNBits, accuracy_level 4 on the CPU: the activation rows, quantized per
// block and stored in operand order (matmul_nbits_q8_cpu.h: the arithmetic; matmul_nbits_q8_cpu.cc:
// the operand order). Every path gives the same bytes, scales and sums: a row's depend on that
// row alone.
#include <algorithm>
#include <cmath>
#include <vector>

#include "matmul_nbits_q8_cpu.h"
#include "matmul_nbits_q8_isa.h"

namespace loopcast {
namespace {

using q8_detail::Isa;
using q8_detail::kLanes;
using q8_detail::operand_k;
using q8_detail::vector_isa;

// operand_k of every byte of a chunk's operand vectors (8 vectors wide, else 2), in order.
std::vector<uint16_t> operand_order(bool wide, int64_t bits) {
  std::vector<uint16_t> out;
  for (int v = 0; v < (wide ? 8 : 2); ++v)
    for (int j = 0; j < 64; ++j) out.push_back(static_cast<uint16_t>(operand_k(wide, bits, v, j)));
  return out;
}

int8_t quantize_value(float x, float inv) {
  float v = std::nearbyint(x * inv);
  if (!(v == v)) return 0;  // NaN (an inf or NaN activation): no UB in the conversion
  return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
}

#ifdef LOOPCAST_Q8_AVX512

// One row's blocks quantized into qk (k order) and sa: quantize_value's steps on 16 lanes at a
// time (the same product, rounding to nearest even, clamp, NaN to 0), so the same bytes.
Q8_TARGET void avx512_quantize_row(const float* a, int64_t K, int64_t bs, int64_t nb, int8_t* qk, float* sa) {
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * bs, k1 = std::min(K, k0 + bs);
    // max(|x|, m): a NaN x keeps m (MAXPS returns its second operand), as std::max does
    __m512 m = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 in = k1 - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k1 - k)) - 1);
      m = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(in, a + k)), m);
    }
    const float amax = _mm512_reduce_max_ps(m);
    sa[b] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int64_t k = k0; k < k1; k += 16) {
      const __mmask16 in = k1 - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k1 - k)) - 1);
      const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, a + k), inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __mmask16 number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
      const __m512 c = _mm512_maskz_mov_ps(number, _mm512_min_ps(_mm512_max_ps(v, lo), hi));
      _mm_mask_storeu_epi8(qk + k, in, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
    }
  }
}

// A chunk's operand vectors from its k-order bytes src, and each lane's Σq (VPDPBUSD by ones:
// a lane's bytes across the chunk's vectors are exactly its k).
Q8_TARGET void avx512_operands(const Q8Chunk& ch, int64_t bits, const int8_t* src, int8_t* q, int32_t* lane_sums) {
  const __m512i ones = _mm512_set1_epi8(1);
  alignas(64) int8_t t[2][64];
  __m512i sum = _mm512_setzero_si512();
  if (ch.wide) {  // v = 2s + h, byte 4l + t: k = 32l + 8s + 2t + h
    for (int j = 0; j < 64; ++j)
      for (int h = 0; h < 2; ++h) t[h][j] = static_cast<int8_t>(8 * (j / 4) + 2 * (j % 4) + h);
    const __m512i pick[2] = {_mm512_load_si512(t[0]), _mm512_load_si512(t[1])};
    const __m512i lanes = _mm512_setr_epi64(0, 32, 64, 96, 128, 160, 192, 224);
    for (int s = 0; s < 4; ++s) {  // qword s of each lane's 32 bytes: lanes 0-7, then 8-15
      const __m512i g0 = _mm512_i64gather_epi64(lanes, src + 8 * s, 1);
      const __m512i g1 = _mm512_i64gather_epi64(lanes, src + 256 + 8 * s, 1);
      for (int h = 0; h < 2; ++h) {
        const __m512i x = _mm512_permutex2var_epi8(g0, pick[h], g1);
        _mm512_storeu_si512(q + 64 * (2 * s + h), x);
        sum = _mm512_dpbusd_epi32(sum, ones, x);
      }
    }
  } else {  // 4 bits: k = 2j + v; 8 bits: k = 8l + 4v + t
    for (int j = 0; j < 64; ++j)
      for (int v = 0; v < 2; ++v)
        t[v][j] = static_cast<int8_t>(bits == 4 ? 2 * j + v : 8 * (j / 4) + 4 * v + j % 4);
    const __m512i x0 = _mm512_loadu_si512(src), x1 = _mm512_loadu_si512(src + 64);
    for (int v = 0; v < 2; ++v) {
      const __m512i x = _mm512_permutex2var_epi8(x0, _mm512_load_si512(t[v]), x1);
      _mm512_storeu_si512(q + 64 * v, x);
      sum = _mm512_dpbusd_epi32(sum, ones, x);
    }
  }
  _mm512_storeu_si512(lane_sums, sum);
}

#endif

}  // namespace

std::vector<Q8Chunk> q8_chunks(int64_t bits, int64_t bs, int64_t nb) {
  const int64_t kb = nb * bs;
  const int64_t n_wide = bits == 4 && bs >= 32 ? kb / 512 : 0;
  std::vector<Q8Chunk> out;
  int64_t offset = 0;
  for (int64_t c = 0; c < n_wide; ++c, offset += 512) out.push_back({true, 512 * c, 512, 32, 8, offset});
  for (int64_t k0 = 512 * n_wide; k0 < kb; k0 += 128, offset += 128) out.push_back({false, k0, 128, 8, 2, offset});
  return out;
}

void q8_prepare_rows(int64_t rows, int64_t bits, int64_t bs, int64_t nb, Q8Rows* out) {
  out->chunks = q8_chunks(bits, bs, nb);
  const int64_t nc = static_cast<int64_t>(out->chunks.size());
  out->n_wide = 0;
  for (const Q8Chunk& ch : out->chunks) out->n_wide += ch.wide ? 1 : 0;
  out->rows = rows;
  out->row_bytes = out->chunks.back().q_offset + out->chunks.back().vecs * 64;
  out->q.assign(static_cast<size_t>(rows * out->row_bytes), 0);
  out->scale.assign(static_cast<size_t>(rows * nc * kLanes), 0.0f);
  out->q_sum.assign(static_cast<size_t>(rows * nc * kLanes), 0.0f);
  out->q_sum_mid.assign(static_cast<size_t>(rows * nc * kLanes), 0);
}

void q8_quantize_row(const float* a, int64_t r, int64_t K, int64_t bits, int64_t bs, int64_t nb, Q8Rows* out) {
  const int64_t nc = static_cast<int64_t>(out->chunks.size());
  thread_local std::vector<int8_t> qk;  // k order, zeros past K
  thread_local std::vector<float> sa;
  qk.assign(static_cast<size_t>(out->row_bytes), 0);
  sa.assign(static_cast<size_t>(nb), 0.0f);
#ifdef LOOPCAST_Q8_AVX512
  if (vector_isa() == Isa::kAvx512) {
    avx512_quantize_row(a, K, bs, nb, qk.data(), sa.data());
    for (int64_t c = 0; c < nc; ++c) {
      const Q8Chunk& ch = out->chunks[static_cast<size_t>(c)];
      const int64_t rc = r * nc + c;
      int32_t sum[kLanes];
      avx512_operands(ch, bits, qk.data() + ch.k0, out->q.data() + r * out->row_bytes + ch.q_offset, sum);
      for (int l = 0; l < kLanes; ++l) {
        const int64_t b = (ch.k0 + ch.lane_k * l) / bs;
        out->scale[rc * kLanes + l] = b < nb ? sa[b] : 0.0f;
        out->q_sum[rc * kLanes + l] = static_cast<float>(sum[l]);
        out->q_sum_mid[rc * kLanes + l] = -(1 << (bits - 1)) * sum[l];
      }
    }
    q8_detail::avx512_upper_clean();
    return;
  }
#endif
  // operand_k of each byte of a chunk's operand vectors, per chunk form (wide; narrow 4 or 8 bits)
  static const std::vector<uint16_t> order[3] = {operand_order(true, 4), operand_order(false, 4),
                                                 operand_order(false, 8)};
  if (vector_isa() == Isa::kAvx2) {
    q8_detail::avx2_quantize_row(a, K, bs, nb, qk.data(), sa.data());
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * bs, k1 = std::min(K, k0 + bs);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(a[k]));
      sa[b] = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t k = k0; k < k1; ++k) qk[k] = quantize_value(a[k], inv);
    }
  }
  for (int64_t c = 0; c < nc; ++c) {
    const Q8Chunk& ch = out->chunks[static_cast<size_t>(c)];
    const int64_t rc = r * nc + c;
    int8_t* q = out->q.data() + r * out->row_bytes + ch.q_offset;
    const int8_t* src = qk.data() + ch.k0;
    const uint16_t* at = order[ch.wide ? 0 : bits == 4 ? 1 : 2].data();
    for (int64_t i = 0; i < ch.vecs * 64; ++i) q[i] = src[at[i]];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t b = (ch.k0 + ch.lane_k * l) / bs;
      int32_t sum = 0;
      for (int64_t t = 0; t < ch.lane_k; ++t) sum += src[ch.lane_k * l + t];
      out->scale[rc * kLanes + l] = b < nb ? sa[b] : 0.0f;
      out->q_sum[rc * kLanes + l] = static_cast<float>(sum);
      out->q_sum_mid[rc * kLanes + l] = -(1 << (bits - 1)) * sum;
    }
  }
}

void q8_quantize_rows(const float* A, int64_t rows, int64_t K, int64_t bits, int64_t bs, int64_t nb, Q8Rows* out) {
  q8_prepare_rows(rows, bits, bs, nb, out);
  for (int64_t r = 0; r < rows; ++r) q8_quantize_row(A + r * K, r, K, bits, bs, nb, out);
}

}  // namespace loopcast
