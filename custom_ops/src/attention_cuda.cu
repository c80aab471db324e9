// BatchInvariantAttention, CUDA kernels: the same semantics as attention_cpu.cc.
//
//   split      one launch (flash decoding, below) that also writes the new rows' rotated k
//              (fp32, rounded to T as stored) and v into present[b, h, p, :],
//              p = seqlens_k[b] + 1 - S + i, taking those rows from qkv while it runs.
//   serial     when the static scratch cannot hold the partials: kv_write, grid (S, B), then the
//              serial kernel (grid (Hq, S, B), one block per row and head over the cache 0..p).
// The launches share one stream, so row i's KV is visible to rows > i of the same call. n is read
// from seqlens_k in device memory: nothing crosses to the host, so every launch can be captured.
//
// Row invariance: a row reads only the cache and its own q, and every reduction order is a fixed
// function of p and head_dim, never of S or of the grid.
//
// Split kernel. Positions are cut into fixed chunks [cC, cC+C), C = kChunk; a row at position p
// uses chunks 0..p/C (the last one partial). For each (row, q head, chunk) a block computes the
// chunk's max m_c, sum of exponentials l_c and weighted V sum a_c[D] in a fixed order:
//   q·k     lane t of a position owns d = t*VEC..t*VEC+VEC-1 (one 128-bit load), serial fmaf,
//           then an xor butterfly over the LPP = D/VEC lanes of the position
//   l, a    position group g (PPI = 128/LPP groups) sums positions g, g+PPI, ... serially, then
//           an xor butterfly over the groups of a warp, then serially over the 4 warps
// and stores (m_c, l_c, a_c) to a static scratch. The last block of a (row, head) to finish (an
// atomic counter; it only decides who combines) merges chunks 0..p/C in ascending order:
//   M = max m_c, w_c = exp(m_c - M), out = (sum_c w_c a_c) / (sum_c w_c l_c), serial in c.
// Which block computes which chunk (blocks stride over chunks; one block serves several rows and
// the q heads of a kv head, so K/V are loaded once for them) is free: it changes no arithmetic.
// The scratch and counters are process-wide statics: calls on one device must not run
// concurrently on different streams (a session runs its steps one at a time). Whether the split
// kernel is used depends on Hq, D and the capacity only (sized for S = 32 rows per batch entry),
// never on B or on S <= 32: a batch that overflows the scratch runs as several launches.
#include <algorithm>
#include <cfloat>

#include "attention_common.cuh"
#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace loopcast_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename T>
__global__ void kv_write_kernel(const T* __restrict__ qkv, T* __restrict__ pk, T* __restrict__ pv,
                                const int32_t* __restrict__ seqlens, const T* __restrict__ cos_cache,
                                const T* __restrict__ sin_cache, int S, int Hq, int Hkv, int D, int cap,
                                int rotary_len, bool do_rotary) {
  pdl_trigger();
  pdl_wait();
  const int i = blockIdx.x, b = blockIdx.y;
  const int p = seqlens[b] + 1 - S + i;
  if (p < 0 || p >= cap || (do_rotary && p >= rotary_len)) return;  // out of range: nothing is written
  const int half = D / 2;
  const T* row = qkv + static_cast<size_t>(b * S + i) * (Hq + 2 * Hkv) * D;
  for (int e = threadIdx.x; e < Hkv * D; e += blockDim.x) {
    const int h = e / D, d = e % D;
    const size_t dst = (static_cast<size_t>(b * Hkv + h) * cap + p) * D + d;
    pv[dst] = row[(Hq + Hkv + h) * D + d];
    pk[dst] = from_f<T>(rotated(row + (Hq + h) * D, d, half, p, cos_cache, sin_cache, do_rotary));
  }
}

// TPR = D/4 threads per position, each owning 4 consecutive d; G = 256/TPR position groups.
template <typename T, int TPR>
__global__ void __launch_bounds__(kThreads) attend_kernel(const T* __restrict__ qkv, const T* __restrict__ pk,
                                                          const T* __restrict__ pv,
                                                          const int32_t* __restrict__ seqlens,
                                                          const T* __restrict__ cos_cache,
                                                          const T* __restrict__ sin_cache, T* __restrict__ out,
                                                          int S, int Hq, int Hkv, int cap, int rotary_len,
                                                          float scale, bool do_rotary) {
  constexpr int D = TPR * 4, G = kThreads / TPR, half = D / 2;
  extern __shared__ float scores[];  // [cap]
  __shared__ float q[D];
  __shared__ float comb[G][D];
  __shared__ float wred[kWarps];
  __shared__ float stat[2];  // max, sum

  pdl_trigger();
  pdl_wait();
  const int h = blockIdx.x, i = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int p = seqlens[b] + 1 - S + i;
  T* o = out + (static_cast<size_t>(b * S + i) * Hq + h) * D;
  if (p < 0 || p >= cap || (do_rotary && p >= rotary_len)) {  // uniform over the block
    for (int d = tid; d < D; d += kThreads) o[d] = from_f<T>(0.0f);
    return;
  }
  const T* row = qkv + static_cast<size_t>(b * S + i) * (Hq + 2 * Hkv) * D + h * D;
  for (int d = tid; d < D; d += kThreads) q[d] = rotated(row, d, half, p, cos_cache, sin_cache, do_rotary);
  __syncthreads();

  const int grp = tid / TPR, t = tid % TPR;
  const int kvh = h / (Hq / Hkv);
  const T* kc = pk + static_cast<size_t>(b * Hkv + kvh) * cap * D;
  const T* vc = pv + static_cast<size_t>(b * Hkv + kvh) * cap * D;
  float qr[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) qr[c] = q[4 * t + c];

  // Scores. The loop bound is uniform over the block so every lane reaches the shuffles.
  float mx = -FLT_MAX;
  for (int jb = 0; jb <= p; jb += G) {
    const int j = jb + grp;
    float dot = 0.0f;
    if (j <= p) {
      const T* k = kc + static_cast<size_t>(j) * D + 4 * t;
#pragma unroll
      for (int c = 0; c < 4; ++c) dot = fmaf(qr[c], to_f(k[c]), dot);
    }
#pragma unroll
    for (int off = TPR / 2; off >= 1; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (j <= p) {
      const float sc = dot * scale;
      if (t == 0) scores[j] = sc;
      mx = fmaxf(mx, sc);
    }
  }
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) wred[warp] = mx;
  __syncthreads();
  if (tid == 0) {
    float m = wred[0];
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, wred[w]);
    stat[0] = m;
  }
  __syncthreads();
  mx = stat[0];

  float sum = 0.0f;
  for (int j = tid; j <= p; j += kThreads) {
    const float e = expf(scores[j] - mx);
    scores[j] = e;
    sum += e;
  }
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  __syncthreads();  // wred reuse, and every exp is in scores
  if (lane == 0) wred[warp] = sum;
  __syncthreads();
  if (tid == 0) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += wred[w];
    stat[1] = s;
  }

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = grp; j <= p; j += G) {
    const float e = scores[j];
    const T* v = vc + static_cast<size_t>(j) * D + 4 * t;
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] = fmaf(e, to_f(v[c]), acc[c]);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) comb[grp][4 * t + c] = acc[c];
  __syncthreads();
  const float denom = stat[1];
  for (int d = tid; d < D; d += kThreads) {
    float s = 0.0f;
    for (int g = 0; g < G; ++g) s += comb[g][d];
    o[d] = from_f<T>(s / denom);
  }
}

template <typename T, int TPR>
int launch_attend(const T* qkv, const T* pk, const T* pv, const int32_t* seqlens, const T* cos_cache,
                  const T* sin_cache, T* out, int B, int S, int Hq, int Hkv, int cap, int rotary_len, float scale,
                  bool do_rotary, cudaStream_t stream) {
  auto kernel = attend_kernel<T, TPR>;
  const size_t smem = static_cast<size_t>(cap) * sizeof(float);
  if (smem > 48 * 1024) {  // not a stream operation: allowed while a graph is being captured
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return static_cast<int>(launch_kernel(kernel, dim3(Hq, S, B), dim3(kThreads), smem, stream, 0, qkv, pk, pv, seqlens,
                                        cos_cache, sin_cache, out, S, Hq, Hkv, cap, rotary_len, scale, do_rotary));
}


// ---------------------------------------------------------------------------------------------
// Split (flash-decoding) kernel.

constexpr int kChunk = 64;                 // positions per chunk: part of the numerics, fixed
constexpr int kSplitThreads = 128;
constexpr int kSplitWarps = kSplitThreads / 32;
constexpr int kMaxChunks = (kLoopcastMaxCudaCapacity + kChunk - 1) / kChunk;
constexpr int kMaxUnitsPerBlock = 16;      // (row, q head) pairs one block serves
constexpr int kSplitRowsBound = 32;        // the scratch is sized for this many rows
constexpr size_t kScratchFloats = size_t(12) << 20;  // 48 MiB of partials
constexpr int kMaxUnits = 1 << 16;

// RowAttention's rows as the kernel's batch entries (S = 1 each), every entry on its own KV
// buffer pair: entry b's cache is k[b] / v[b] instead of pk / pv + b * Hkv * cap * D. rows = 0:
// the ordinary contiguous [B, Hkv, cap, D] buffers. sequences (device, [rows]) or null: entry b's
// cache is batch entry sequences[b] of its pair's [entries, Hkv, cap, D] buffers (RowAttention's
// sequence index); an index outside 0..entries-1 makes the row write nothing and output zeros.
constexpr int kRowTableMax = 32;
struct KVTable {
  void* k[kRowTableMax];
  void* v[kRowTableMax];
  int rows;
  const int32_t* sequences;
  int entries;
};

__device__ float g_attn_scratch[kScratchFloats];       // [B*S*Hq][nch][2 + D]: m, l, a[D]
__device__ unsigned int g_attn_counters[kMaxUnits];    // zero between launches

// K (rotated, rounded to T) and V of new row i (position p) for dims t*VEC .. t*VEC+VEC-1, from
// qkv: exactly what the cache holds for that position once it is written.
template <typename T, int D>
__device__ __forceinline__ void new_kv(const T* __restrict__ qkv, const T* __restrict__ cos_cache,
                                       const T* __restrict__ sin_cache, int b, int S, int i, int p, int Hq, int Hkv,
                                       int kvh, int t, bool do_rotary, uint4& k_out, uint4& v_out) {
  constexpr int VEC = Vec<T>::N;
  const T* row = qkv + static_cast<size_t>(b * S + i) * (Hq + 2 * Hkv) * D;
  const T* k = row + (Hq + kvh) * D;
  const T* v = row + (Hq + Hkv + kvh) * D;
  T* ko = reinterpret_cast<T*>(&k_out);
  T* vo = reinterpret_cast<T*>(&v_out);
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const int d = t * VEC + e;
    ko[e] = from_f<T>(rotated(k, d, D / 2, p, cos_cache, sin_cache, do_rotary));
    vo[e] = v[d];
  }
}

// grid (NB, Hq/HB, B*nRG): block x takes chunks x, x+NB, ...; y the q heads y*HB..y*HB+HB-1 (one
// kv head); z = b*nRG + rg the rows rg*RG..rg*RG+RG-1.
//
// The new rows' K/V are written to the cache by this kernel (no separate kv_write launch): the
// blocks with x == 0 whose q heads start a kv-head group write their rows, and within the launch
// every block takes positions >= n (the new rows) from qkv instead of the cache, so no block
// reads an entry that this launch writes.
template <typename T, int D>
__global__ void __launch_bounds__(kSplitThreads) split_attend_kernel(
    const T* __restrict__ qkv, T* __restrict__ pk, T* __restrict__ pv, const int32_t* __restrict__ seqlens,
    const T* __restrict__ cos_cache, const T* __restrict__ sin_cache, T* __restrict__ out, int S, int Hq, int Hkv,
    int cap, int rotary_len, float scale, bool do_rotary, int nch_cap, int HB, int RG, const KVTable tab,
    const int32_t* __restrict__ masked) {
  constexpr int VEC = Vec<T>::N, LPP = D / VEC, PPI = kSplitThreads / LPP, R = kChunk / PPI, half = D / 2;
  static_assert(LPP >= 1 && LPP <= 32 && 32 % LPP == 0 && kChunk % PPI == 0 && D <= kSplitThreads, "layout");
  constexpr int P = D + 2;  // floats per chunk partial
  __shared__ float q_s[kMaxUnitsPerBlock][D];
  __shared__ float mx_s[2][kSplitWarps];
  __shared__ float l_s2[2][kSplitWarps];
  __shared__ float red_s[2][kSplitWarps][D];
  __shared__ float w_s[kMaxChunks];
  __shared__ float cl_s[kMaxChunks];
  __shared__ float cm_s[kSplitWarps];
  __shared__ int last_s[kMaxUnitsPerBlock];

  pdl_trigger();
  pdl_wait();  // also orders this launch's use of the static scratch and counters after the last one's
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t = tid % LPP, g = tid / LPP;
  const int nRG = (S + RG - 1) / RG;
  const int b = blockIdx.z / nRG, i0 = (blockIdx.z % nRG) * RG, i1 = min(S, i0 + RG);
  const int hq0 = blockIdx.y * HB, kvh = hq0 / (Hq / Hkv);
  int n = seqlens[b] + 1 - S;
  // Tree verify (RowAttention's masked_keys; one row per batch entry, S = 1): keys [lo, hi)
  // leave the row's sequence. The kernel runs at the row's logical position n - (hi - lo) — the
  // decode row's chunks, rotation and key order there — reading key j >= lo from cache position
  // j + shift and writing the row's own K/V at its cache position. A row inside its own masked
  // range (the CPU refuses it) writes nothing and outputs zeros, as an out-of-range row does.
  int lo = 0, shift = 0, cap_eff = cap;
  if (masked != nullptr) {
    const int mlo = masked[2 * b], mhi = masked[2 * b + 1];
    if (mlo < 0 || mhi < mlo || (n >= mlo && n < mhi)) {
      cap_eff = -1;
    } else if (n >= mhi) {
      lo = mlo;
      shift = mhi - mlo;
      n -= shift;
      cap_eff = cap - shift;
    }
  }
  size_t entry = 0;  // the row's batch entry of its pair (the sequence index), in elements
  if (tab.sequences != nullptr) {
    const int sq = tab.sequences[b];
    if (sq < 0 || sq >= tab.entries)
      cap_eff = -1;
    else
      entry = static_cast<size_t>(sq) * Hkv * cap * D;
  }
  const int NB = gridDim.x, x = blockIdx.x;
  const int nunits = (i1 - i0) * HB;  // unit u: row i0 + u / HB, head hq0 + u % HB
  T* const kb = tab.rows ? static_cast<T*>(tab.k[b]) + entry : pk + static_cast<size_t>(b) * Hkv * cap * D;
  T* const vb = tab.rows ? static_cast<T*>(tab.v[b]) + entry : pv + static_cast<size_t>(b) * Hkv * cap * D;

  // Rows out of range get zeros (block x == 0); valid rows form one interval of i.
  int p_hi = -1;
  for (int i = i0; i < i1; ++i) {
    const int p = n + i;
    if (row_valid(p, cap_eff, rotary_len, do_rotary)) {
      p_hi = p;
    } else if (x == 0) {
      for (int e = tid; e < HB * D; e += kSplitThreads)
        out[(static_cast<size_t>(b * S + i) * Hq + hq0 + e / D) * D + e % D] = from_f<T>(0.0f);
    }
  }
  if (p_hi < 0 || x * kChunk > p_hi) return;  // uniform over the block

  // Rotated q of every unit (the same expression in every block: the same bits).
  for (int e = tid; e < nunits * D; e += kSplitThreads) {
    const int u = e / D, d = e % D, i = i0 + u / HB, h = hq0 + u % HB, p = n + i;
    if (!row_valid(p, cap_eff, rotary_len, do_rotary)) continue;
    const T* row = qkv + static_cast<size_t>(b * S + i) * (Hq + 2 * Hkv) * D + h * D;
    q_s[u][d] = rotated(row, d, half, p, cos_cache, sin_cache, do_rotary);
  }
  if (x == 0 && hq0 % (Hq / Hkv) == 0) {  // this block's new rows -> the cache (see above)
    for (int e = tid; e < (i1 - i0) * D; e += kSplitThreads) {
      const int i = i0 + e / D, d = e % D, p = n + i;
      if (!row_valid(p, cap_eff, rotary_len, do_rotary)) continue;
      const T* row = qkv + static_cast<size_t>(b * S + i) * (Hq + 2 * Hkv) * D;
      const size_t dst = (static_cast<size_t>(kvh) * cap + p + shift) * D + d;
      kb[dst] = from_f<T>(rotated(row + (Hq + kvh) * D, d, half, p, cos_cache, sin_cache, do_rotary));
      vb[dst] = row[(Hq + Hkv + kvh) * D + d];
    }
  }
  __syncthreads();

  const T* kc = kb + static_cast<size_t>(kvh) * cap * D + t * VEC;
  const T* vc = vb + static_cast<size_t>(kvh) * cap * D + t * VEC;
  int buf = 0;
  for (int c = x; c * kChunk <= p_hi; c += NB) {
    const int j0 = c * kChunk;
    uint4 kr[R], vr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int j = j0 + g + r * PPI;
      kr[r] = make_uint4(0u, 0u, 0u, 0u);
      vr[r] = make_uint4(0u, 0u, 0u, 0u);
      if (j <= p_hi && j >= n) {  // a new row: not in the cache yet within this launch
        new_kv<T, D>(qkv, cos_cache, sin_cache, b, S, j - n, j, Hq, Hkv, kvh, t, do_rotary, kr[r], vr[r]);
      } else if (j <= p_hi) {
        const size_t at = static_cast<size_t>(j >= lo ? j + shift : j) * D;  // shift 0: unmasked
        kr[r] = __ldg(reinterpret_cast<const uint4*>(kc + at));
        vr[r] = __ldg(reinterpret_cast<const uint4*>(vc + at));
      }
    }
    for (int u = 0; u < nunits; ++u) {
      const int i = i0 + u / HB, p = n + i;
      if (!row_valid(p, cap_eff, rotary_len, do_rotary) || p < j0) continue;  // uniform
      float qr[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) qr[e] = q_s[u][t * VEC + e];
      float s[R];
      const float mloc = chunk_scores<T, LPP, R, PPI>(s, qr, kr, scale, j0 + g, p);
      if (lane == 0) mx_s[buf][warp] = mloc;
      __syncthreads();
      float m = mx_s[buf][0];
#pragma unroll
      for (int w = 1; w < kSplitWarps; ++w) m = fmaxf(m, mx_s[buf][w]);
      float acc[VEC];
      const float lsum = chunk_values<T, LPP, R, PPI>(acc, s, vr, m, j0 + g, p);
      if (lane < LPP) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) red_s[buf][warp][t * VEC + e] = acc[e];
      }
      if (lane == 0) l_s2[buf][warp] = lsum;
      __syncthreads();
      const int unit = (b * S + i) * Hq + hq0 + u % HB;
      float* part = g_attn_scratch + (static_cast<size_t>(unit) * nch_cap + c) * P;
      if (tid < D) {
        float a = red_s[buf][0][tid];
#pragma unroll
        for (int w = 1; w < kSplitWarps; ++w) a += red_s[buf][w][tid];
        part[2 + tid] = a;
      }
      if (tid == 0) {
        float l = l_s2[buf][0];
#pragma unroll
        for (int w = 1; w < kSplitWarps; ++w) l += l_s2[buf][w];
        part[0] = m;
        part[1] = l;
      }
      buf ^= 1;  // double-buffered shared memory: no third barrier per unit
    }
  }

  // Count this block in for every unit it served; the last one in merges that unit's chunks.
  __threadfence();
  __syncthreads();
  if (tid < nunits) {
    const int i = i0 + tid / HB, p = n + i;
    int last = 0;
    if (row_valid(p, cap_eff, rotary_len, do_rotary) && x * kChunk <= p) {
      const int nc = p / kChunk + 1;
      const unsigned expected = static_cast<unsigned>(min(NB, nc));
      const int unit = (b * S + i) * Hq + hq0 + tid % HB;
      last = atomicAdd(&g_attn_counters[unit], 1u) == expected - 1u;
    }
    last_s[tid] = last;
  }
  __syncthreads();
  for (int u = 0; u < nunits; ++u) {
    if (!last_s[u]) continue;  // uniform
    __threadfence();
    const int i = i0 + u / HB, p = n + i, nc = p / kChunk + 1;
    const int unit = (b * S + i) * Hq + hq0 + u % HB;
    const float* part = g_attn_scratch + static_cast<size_t>(unit) * nch_cap * P;
    float mloc = -FLT_MAX;
    for (int c = tid; c < nc; c += kSplitThreads) {
      const float mc = __ldcg(part + static_cast<size_t>(c) * P);
      w_s[c] = mc;
      cl_s[c] = __ldcg(part + static_cast<size_t>(c) * P + 1);
      mloc = fmaxf(mloc, mc);
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) mloc = fmaxf(mloc, __shfl_xor_sync(0xffffffffu, mloc, off));
    if (lane == 0) cm_s[warp] = mloc;
    __syncthreads();
    float M = cm_s[0];
#pragma unroll
    for (int w = 1; w < kSplitWarps; ++w) M = fmaxf(M, cm_s[w]);
    for (int c = tid; c < nc; c += kSplitThreads) w_s[c] = expf(__fsub_rn(w_s[c], M));
    __syncthreads();
    if (tid < D) {
      float L = 0.0f, O = 0.0f;
      const float* a = part + 2 + tid;
#pragma unroll 8
      for (int c = 0; c < nc; ++c) {
        const float w = w_s[c];
        L = fmaf(w, cl_s[c], L);
        O = fmaf(w, __ldcg(a + static_cast<size_t>(c) * P), O);
      }
      out[(static_cast<size_t>(b * S + i) * Hq + hq0 + u % HB) * D + tid] = from_f<T>(O / L);
    }
    if (tid == 0) g_attn_counters[unit] = 0u;  // every block of this unit has counted in
    __syncthreads();  // w_s, cl_s, cm_s reuse
  }
}

int split_target_blocks() { return 4 * device_sm_count(); }

// Whether the split kernel serves this shape: depends on B, Hq, Hkv, D and cap, never on S <= 32.
bool split_fits(int B, int S, int Hq, int Hkv, int D, int cap) {
  const long long rows = static_cast<long long>(B) * (S > kSplitRowsBound ? S : kSplitRowsBound);
  const long long units = rows * Hq;
  const long long nch = (cap + kChunk - 1) / kChunk;
  (void)Hkv;
  return units <= kMaxUnits && units * nch * (D + 2) <= static_cast<long long>(kScratchFloats) && nch <= kMaxChunks;
}

template <typename T, int D>
int launch_split(const T* qkv, T* pk, T* pv, const int32_t* seqlens, const T* cos_cache,
                 const T* sin_cache, T* out, int B, int S, int Hq, int Hkv, int cap, int rotary_len, float scale,
                 bool do_rotary, cudaStream_t stream, const KVTable& tab = KVTable{},
                 const int32_t* masked = nullptr) {
  const int group = Hq / Hkv;
  int HB = group;
  while (HB > kMaxUnitsPerBlock) HB = HB % 2 == 0 ? HB / 2 : 1;
  int nRG = (S * HB + 3) / 4;  // about 4 (row, head) units per block
  if (nRG > S) nRG = S;
  if (nRG < 1) nRG = 1;
  const int RG = (S + nRG - 1) / nRG;
  nRG = (S + RG - 1) / RG;
  const int nch = (cap + kChunk - 1) / kChunk;
  const long long cols = static_cast<long long>(Hq / HB) * B * nRG;
  if (static_cast<long long>(B) * nRG > 65535 || Hq / HB > 65535) return static_cast<int>(cudaErrorInvalidValue);
  long long NB = (split_target_blocks() + cols - 1) / cols;
  if (NB > nch) NB = nch;
  if (NB < 1) NB = 1;
  return static_cast<int>(launch_kernel(split_attend_kernel<T, D>, dim3(static_cast<unsigned>(NB), Hq / HB, B * nRG),
                                        dim3(kSplitThreads), 0, stream, 0, qkv, pk, pv, seqlens, cos_cache, sin_cache,
                                        out, S, Hq, Hkv, cap, rotary_len, scale, do_rotary, nch, HB, RG, tab,
                                        masked));
}

template <typename T>
struct AttentionLauncher {
  static int run(const void* qkv_, const void* past_k, const void* past_v, void* present_k, void* present_v,
                 const int32_t* seqlens, const void* cos_, const void* sin_, void* out_, int B, int S, int Hq, int Hkv,
                 int D, int cap, int rotary_len, float scale, int do_rotary, const int32_t* masked, void* stream_) {
    if (B <= 0 || S <= 0) return 0;
    if (masked != nullptr && S != 1) return static_cast<int>(cudaErrorInvalidValue);  // one row per entry
    if (Hkv <= 0 || Hq % Hkv != 0 || cap <= 0 || cap > kLoopcastMaxCudaCapacity || S > 65535 || B > 65535 ||
        Hq > 65535)
      return static_cast<int>(cudaErrorInvalidValue);
    auto stream = static_cast<cudaStream_t>(stream_);
    auto qkv = static_cast<const T*>(qkv_);
    auto pk = static_cast<T*>(present_k);
    auto pv = static_cast<T*>(present_v);
    auto cs = static_cast<const T*>(cos_);
    auto sn = static_cast<const T*>(sin_);
    auto out = static_cast<T*>(out_);
    const size_t bytes = static_cast<size_t>(B) * Hkv * cap * D * sizeof(T);
    // past and present are usually one buffer (IO binding); copy only when they differ.
    if (present_k != past_k) {
      cudaError_t err = cudaMemcpyAsync(present_k, past_k, bytes, cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return static_cast<int>(err);
    }
    if (present_v != past_v) {
      cudaError_t err = cudaMemcpyAsync(present_v, past_v, bytes, cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return static_cast<int>(err);
    }
    const bool rot = do_rotary != 0;
    // Which kernel (and so which arithmetic) serves a row is decided per row, as for a one-row
    // call: a batch of sequences must give each row the bits of its own decode step (serving
    // never changes a greedy token). A batch whose partials overflow the static scratch runs as
    // several launches of batch entries; the split kernel's arithmetic per (row, head) does not
    // depend on the batch or the grid.
    const long long units_per_entry = static_cast<long long>(S) * Hq;
    const long long per_entry = units_per_entry * ((cap + kChunk - 1) / kChunk) * (D + 2);
    const long long group = split_fits(1, S, Hq, Hkv, D, cap)
                                ? std::min(static_cast<long long>(kScratchFloats) / per_entry,
                                           static_cast<long long>(kMaxUnits) / units_per_entry)
                                : 0;
    if (group >= 1) {  // the split kernel writes the new K/V itself
      const size_t width = static_cast<size_t>(Hq + 2 * Hkv) * D, cache = static_cast<size_t>(Hkv) * cap * D;
      for (int b0 = 0; b0 < B; b0 += static_cast<int>(group)) {
        const int nb = static_cast<int>(std::min<long long>(group, B - b0));
        const T* q = qkv + static_cast<size_t>(b0) * S * width;
        T* o = out + static_cast<size_t>(b0) * S * Hq * D;
        int code = 0;
        switch (D) {
          case 16: code = launch_split<T, 16>(q, pk + b0 * cache, pv + b0 * cache, seqlens + b0, cs, sn, o, nb, S, Hq, Hkv, cap, rotary_len, scale, rot, stream, KVTable{}, masked ? masked + 2 * b0 : nullptr); break;
          case 32: code = launch_split<T, 32>(q, pk + b0 * cache, pv + b0 * cache, seqlens + b0, cs, sn, o, nb, S, Hq, Hkv, cap, rotary_len, scale, rot, stream, KVTable{}, masked ? masked + 2 * b0 : nullptr); break;
          case 64: code = launch_split<T, 64>(q, pk + b0 * cache, pv + b0 * cache, seqlens + b0, cs, sn, o, nb, S, Hq, Hkv, cap, rotary_len, scale, rot, stream, KVTable{}, masked ? masked + 2 * b0 : nullptr); break;
          case 128: code = launch_split<T, 128>(q, pk + b0 * cache, pv + b0 * cache, seqlens + b0, cs, sn, o, nb, S, Hq, Hkv, cap, rotary_len, scale, rot, stream, KVTable{}, masked ? masked + 2 * b0 : nullptr); break;
          default: return static_cast<int>(cudaErrorInvalidValue);
        }
        if (code != 0) return code;
      }
      return 0;
    }
    if (masked != nullptr) return static_cast<int>(cudaErrorNotSupported);  // masked keys: the split kernel only
    cudaError_t err = launch_kernel(kv_write_kernel<T>, dim3(S, B), dim3(kThreads), 0, stream, 0, qkv, pk, pv, seqlens,
                                    cs, sn, S, Hq, Hkv, D, cap, rotary_len, rot);
    if (err != cudaSuccess) return static_cast<int>(err);
    switch (D) {
      case 16: return launch_attend<T, 4>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, rot, stream);
      case 32: return launch_attend<T, 8>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, rot, stream);
      case 64: return launch_attend<T, 16>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, rot, stream);
      case 128: return launch_attend<T, 32>(qkv, pk, pv, seqlens, cs, sn, out, B, S, Hq, Hkv, cap, rotary_len, scale, rot, stream);
      default: return static_cast<int>(cudaErrorInvalidValue);
    }
  }
};

// RowAttention in one launch: row i is batch entry i (S = 1) of the split kernel on its own pair.
// Only where the one-row decode call takes the split kernel too (the same decision, so the same
// arithmetic per (row, head)); otherwise cudaErrorNotSupported and the caller launches per row.
template <typename T>
struct RowAttentionLauncher {
  static int run(const void* qkv, void* const* keys, void* const* values, const int32_t* positions,
                 const int32_t* masked, const int32_t* sequences, int entries, const void* cos_, const void* sin_,
                 void* out, int rows, int Hq, int Hkv, int D, int cap, int rotary_len, float scale, int do_rotary,
                 void* stream_) {
    if (rows <= 0) return 0;
    if (rows > kRowTableMax || !split_fits(1, 1, Hq, Hkv, D, cap) || Hkv <= 0 || Hq % Hkv != 0 ||
        cap > kLoopcastMaxCudaCapacity)
      return static_cast<int>(cudaErrorNotSupported);
    KVTable tab{};
    for (int i = 0; i < rows; ++i) {
      tab.k[i] = keys[i];
      tab.v[i] = values[i];
    }
    tab.rows = rows;
    tab.sequences = sequences;
    tab.entries = entries;
    auto stream = static_cast<cudaStream_t>(stream_);
    auto q = static_cast<const T*>(qkv);
    auto cs = static_cast<const T*>(cos_);
    auto sn = static_cast<const T*>(sin_);
    auto o = static_cast<T*>(out);
    const bool rot = do_rotary != 0;
    switch (D) {
      case 16: return launch_split<T, 16>(q, nullptr, nullptr, positions, cs, sn, o, rows, 1, Hq, Hkv, cap, rotary_len, scale, rot, stream, tab, masked);
      case 32: return launch_split<T, 32>(q, nullptr, nullptr, positions, cs, sn, o, rows, 1, Hq, Hkv, cap, rotary_len, scale, rot, stream, tab, masked);
      case 64: return launch_split<T, 64>(q, nullptr, nullptr, positions, cs, sn, o, rows, 1, Hq, Hkv, cap, rotary_len, scale, rot, stream, tab, masked);
      case 128: return launch_split<T, 128>(q, nullptr, nullptr, positions, cs, sn, o, rows, 1, Hq, Hkv, cap, rotary_len, scale, rot, stream, tab, masked);
      default: return static_cast<int>(cudaErrorInvalidValue);
    }
  }
};

}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_attention(int dtype, const void* qkv, const void* past_k, const void* past_v,
                                              void* present_k, void* present_v, const int32_t* seqlens_k,
                                              const void* cos_cache, const void* sin_cache, void* out, int B, int S,
                                              int num_heads, int kv_num_heads, int head_dim, int capacity,
                                              int rotary_len, float scale, int do_rotary, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::AttentionLauncher>(
      dtype, qkv, past_k, past_v, present_k, present_v, seqlens_k, cos_cache, sin_cache, out, B, S, num_heads,
      kv_num_heads, head_dim, capacity, rotary_len, scale, do_rotary, static_cast<const int32_t*>(nullptr), stream);
}

LOOPCAST_CUDA_API int loopcast_cuda_masked_attention(int dtype, const void* qkv, const void* past_k,
                                                     const void* past_v, void* present_k, void* present_v,
                                                     const int32_t* seqlens_k, const int32_t* masked_keys,
                                                     const void* cos_cache, const void* sin_cache, void* out, int B,
                                                     int num_heads, int kv_num_heads, int head_dim, int capacity,
                                                     int rotary_len, float scale, int do_rotary, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::AttentionLauncher>(
      dtype, qkv, past_k, past_v, present_k, present_v, seqlens_k, cos_cache, sin_cache, out, B, 1, num_heads,
      kv_num_heads, head_dim, capacity, rotary_len, scale, do_rotary, masked_keys, stream);
}

LOOPCAST_CUDA_API int loopcast_cuda_row_attention(int dtype, const void* qkv, void* const* keys, void* const* values,
                                                  const int32_t* positions, const int32_t* masked_keys,
                                                  const int32_t* sequences, int entries, const void* cos_cache,
                                                  const void* sin_cache, void* out, int rows, int num_heads,
                                                  int kv_num_heads, int head_dim, int capacity, int rotary_len,
                                                  float scale, int do_rotary, void* stream) {
  return loopcast_cuda::dispatch<loopcast_cuda::RowAttentionLauncher>(
      dtype, qkv, keys, values, positions, masked_keys, sequences, entries, cos_cache, sin_cache, out, rows,
      num_heads, kv_num_heads, head_dim, capacity, rotary_len, scale, do_rotary, stream);
}
