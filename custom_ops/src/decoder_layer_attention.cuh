// The attention phases of the fused decoder layer (decoder_layer_cuda.cu): chunk partials over the
// KV cache, then their merge. Each item first sums its kv head's slice of the qkv projection's
// partials into shared memory; the new rows' K/V come from there and are written to the cache.
//
// Items (kv head, 64-position chunk) are strided over the 128 blocks; per (row, q head) an item
// computes the chunk's max, sum of exponentials and weighted V sum in the fixed order of
// attention_cuda.cu's split kernel (a row reads only the cache and its own q), and after a grid
// barrier every (row, q head) is merged in ascending chunk order by one block. Nothing depends on
// the number of rows, so every verify row equals the decode row.
#pragma once

#include <cfloat>

#include "attention_common.cuh"
#include "decoder_layer.cuh"

namespace loopcast_cuda {
namespace layer {

template <typename T, int D>
__device__ void attention_phase(const LayerParams& p, const Phase& qkv_phase, const Smem& sm, const Scratch& sc) {
  constexpr int VEC = 8, LPP = D / VEC, PPI = kConsumers / LPP, R = kAttnChunk / PPI, half = D / 2, P = D + 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = tid % LPP, grp = tid / LPP;
  const int M = p.M, GQ = p.Hq / p.Hkv, QS = (GQ + 2) * D;
  const T* cs = static_cast<const T*>(p.cos_cache);
  const T* sn = static_cast<const T*>(p.sin_cache);
  T* kc = static_cast<T*>(p.key_cache);
  T* vc = static_cast<T*>(p.value_cache);
  const int n = p.seqlens_k[0] + 1 - M;
  int i_lo = M, i_hi = 0;  // valid rows: one interval (the combine writes zeros for the others)
  for (int i = 0; i < M; ++i)
    if (row_valid(n + i, p.cap, p.rotary_len, p.rotary)) i_lo = min(i_lo, i), i_hi = i + 1;
  if (i_lo >= i_hi) return;
  const int p_hi = n + i_hi - 1, nch = p_hi / kAttnChunk + 1;
  float* q_s = reinterpret_cast<float*>(sm.act);  // [units][D]
  T* qkv_s = reinterpret_cast<T*>(sm.act + M * GQ * D * 2);  // [rows][GQ q heads | k | v of the item's kv head]
  float* red_s = sm.red;                        // [2][8][D]
  float* mx_s = sm.red + 2 * kConsumerWarps * D;  // [2][8]
  float* l_s = mx_s + 2 * kConsumerWarps;         // [2][8]
  int buf = 0;
  for (int item = blockIdx.x; item < p.Hkv * nch; item += kLayerBlocks) {
    const int kvh = item % p.Hkv, c = item / p.Hkv, j0 = c * kAttnChunk;
    const int first_i = max(i_lo, j0 - n), nunits = (i_hi - first_i) * GQ;
    // This kv head's slice of qkv for the valid rows, from the projection's partials.
    for (int gi = tid; gi < (i_hi - i_lo) * (QS / 8); gi += kConsumers) {
      const int i = i_lo + gi / (QS / 8), c8 = gi % (QS / 8) * 8, slot = c8 / D, d = c8 % D;
      const int col = (slot < GQ ? kvh * GQ + slot : slot == GQ ? p.Hq + kvh : p.Hq + p.Hkv + kvh) * D + d;
      float f[8];
      partial_granule<T>(f, qkv_phase, sc.partials[0], i, col);
      *reinterpret_cast<uint4*>(qkv_s + i * QS + c8) = pack8<T>(f);
    }
    consumer_sync();
    for (int e = tid; e < nunits * D; e += kConsumers) {
      const int u = e / D, d = e % D, i = first_i + u / GQ;
      q_s[u * D + d] = rotated(qkv_s + i * QS + (u % GQ) * D, d, half, n + i, cs, sn, p.rotary);
    }
    // New rows in this chunk -> the cache (nobody reads them from the cache in this launch).
    const int jn0 = max(j0, n + i_lo), jn1 = min(j0 + kAttnChunk, p_hi + 1);
    for (int e = tid; e < max(0, jn1 - jn0) * D; e += kConsumers) {
      const int j = jn0 + e / D, d = e % D;
      const T* row = qkv_s + (j - n) * QS;
      const size_t dst = (static_cast<size_t>(kvh) * p.cap + j) * D + d;
      kc[dst] = from_f<T>(rotated(row + GQ * D, d, half, j, cs, sn, p.rotary));
      vc[dst] = row[(GQ + 1) * D + d];
    }
    uint4 kr[R], vr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int j = j0 + grp + r * PPI;
      kr[r] = vr[r] = make_uint4(0u, 0u, 0u, 0u);
      if (j <= p_hi && j >= n) {  // a new row: from qkv, rotated as the cache will hold it
        const T* row = qkv_s + (j - n) * QS;
        T* ko = reinterpret_cast<T*>(&kr[r]);
        T* vo = reinterpret_cast<T*>(&vr[r]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          ko[e] = from_f<T>(rotated(row + GQ * D, t * VEC + e, half, j, cs, sn, p.rotary));
          vo[e] = row[(GQ + 1) * D + t * VEC + e];
        }
      } else if (j <= p_hi) {
        const size_t off = (static_cast<size_t>(kvh) * p.cap + j) * D + t * VEC;
        kr[r] = __ldg(reinterpret_cast<const uint4*>(kc + off));
        vr[r] = __ldg(reinterpret_cast<const uint4*>(vc + off));
      }
    }
    consumer_sync();  // q_s complete
    for (int u = 0; u < nunits; ++u) {
      const int i = first_i + u / GQ, hq = kvh * GQ + u % GQ, pos = n + i;
      float qr[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) qr[e] = q_s[u * D + t * VEC + e];
      float s[R];
      const float mloc = chunk_scores<T, LPP, R, PPI>(s, qr, kr, p.scale, j0 + grp, pos);
      if (lane == 0) mx_s[buf * kConsumerWarps + warp] = mloc;
      consumer_sync();
      float mx = mx_s[buf * kConsumerWarps];
#pragma unroll
      for (int q = 1; q < kConsumerWarps; ++q) mx = fmaxf(mx, mx_s[buf * kConsumerWarps + q]);
      float acc[VEC];
      const float lsum = chunk_values<T, LPP, R, PPI>(acc, s, vr, mx, j0 + grp, pos);
      if (lane < LPP)
#pragma unroll
        for (int e = 0; e < VEC; ++e) red_s[(buf * kConsumerWarps + warp) * D + t * VEC + e] = acc[e];
      if (lane == 0) l_s[buf * kConsumerWarps + warp] = lsum;
      consumer_sync();
      float* part = sc.attn_part + ((static_cast<size_t>(i) * kMaxQHeads + hq) * kMaxChunks + c) * P;
      if (tid < D) {
        float v = red_s[buf * kConsumerWarps * D + tid];
#pragma unroll
        for (int q = 1; q < kConsumerWarps; ++q) v += red_s[(buf * kConsumerWarps + q) * D + tid];
        __stcg(part + 2 + tid, v);
      }
      if (tid == 0) {
        float l = l_s[buf * kConsumerWarps];
#pragma unroll
        for (int q = 1; q < kConsumerWarps; ++q) l += l_s[buf * kConsumerWarps + q];
        __stcg(part, mx);
        __stcg(part + 1, l);
      }
      buf ^= 1;  // double-buffered reductions: no third barrier per unit
    }
    consumer_sync();  // q_s is reused by the next item
  }
}

// Merge the chunks of each (row, q head) in ascending order (units strided over the blocks):
// M = max m_c, w_c = exp(m_c - M), out = (sum w_c a_c) / (sum w_c l_c). Invalid rows: zeros.
template <typename T, int D>
__device__ void attention_combine(const LayerParams& p, const Smem& sm, const Scratch& sc) {
  constexpr int P = D + 2;
  const int tid = threadIdx.x, n = p.seqlens_k[0] + 1 - p.M;
  float* m_s = sm.red;
  float* l_s = m_s + kMaxChunks;
  float* w_s = l_s + kMaxChunks;
  for (int unit = blockIdx.x; unit < p.M * p.Hq; unit += kLayerBlocks) {
    const int i = unit / p.Hq, hq = unit % p.Hq, pos = n + i;
    T* o = reinterpret_cast<T*>(sc.attn) + static_cast<size_t>(i) * p.Hq * D + hq * D;
    if (!row_valid(pos, p.cap, p.rotary_len, p.rotary)) {  // uniform
      for (int d = tid; d < D; d += kConsumers) o[d] = from_f<T>(0.0f);
      continue;
    }
    const int nc = pos / kAttnChunk + 1;
    const float* part = sc.attn_part + (static_cast<size_t>(i) * kMaxQHeads + hq) * kMaxChunks * P;
    for (int c = tid; c < nc; c += kConsumers) {
      m_s[c] = __ldcg(part + c * P);
      l_s[c] = __ldcg(part + c * P + 1);
    }
    consumer_sync();
    float mx = m_s[0];
    for (int c = 1; c < nc; ++c) mx = fmaxf(mx, m_s[c]);
    for (int c = tid; c < nc; c += kConsumers) w_s[c] = expf(__fsub_rn(m_s[c], mx));
    consumer_sync();
    if (tid < D) {
      float L = 0.0f, O = 0.0f;
#pragma unroll 8
      for (int c = 0; c < nc; ++c) {
        const float w = w_s[c];
        L = fmaf(w, l_s[c], L);
        O = fmaf(w, __ldcg(part + c * P + 2 + tid), O);
      }
      o[tid] = from_f<T>(O / L);
    }
    consumer_sync();  // m_s, l_s, w_s reuse
  }
}

}  // namespace layer
}  // namespace loopcast_cuda
