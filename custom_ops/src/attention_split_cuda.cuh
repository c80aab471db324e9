// BatchInvariantAttention's split (flash-decoding) kernel, CUDA: the numerics and the launch
// (attention_cuda.cu's header comment says what it computes and why rows stay invariant).
// Included once, by attention_cuda.cu, inside its anonymous namespace: one translation unit,
// so the statics below (scratch, counters) exist once.
#pragma once

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

// The cluster merge (CL below): after the barrier that publishes every rank's partials, rank x
// merges units x, x + NB, ... of its group; then a second barrier, so no rank exits (its shared
// memory gone) while a peer still reads it. The merge is the scratch path's, term for term.
// One (row, head)'s output from its nc chunk partials, load(c, j) reading partial c's element j
// (0: its max m, 1: its sum l, 2 + d: its output o[d]): M = max m, then o = Σ e^(m_c - M) o_c over
// Σ e^(m_c - M) l_c in ascending c, the same terms and order for the scratch and cluster merges.
template <typename T, int D, typename Load>
__device__ __forceinline__ void merge_partials(const Load& load, int nc, float* w_s, float* cl_s, float* cm_s,
                                               T* __restrict__ out_row) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float mloc = -FLT_MAX;
  for (int c = tid; c < nc; c += kSplitThreads) {
    const float mc = load(c, 0);
    w_s[c] = mc;
    cl_s[c] = load(c, 1);
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
#pragma unroll 8
    for (int c = 0; c < nc; ++c) {
      const float w = w_s[c];
      L = fmaf(w, cl_s[c], L);
      O = fmaf(w, load(c, 2 + tid), O);
    }
    out_row[tid] = from_f<T>(O / L);
  }
}

template <typename T, int D>
__device__ void cluster_merge(float* part_s, float* w_s, float* cl_s, float* cm_s, T* __restrict__ out, int b, int S,
                              int i0, int i1, int hq0, int n, int HB, int Hq, int NB, int x, int cpb, int cap_eff,
                              int rotary_len, bool do_rotary) {
  constexpr int P = D + 2;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int nunits = (i1 - i0) * HB;
  for (int u = x; u < nunits; u += NB) {
    const int i = i0 + u / HB, p = n + i;
    if (!row_valid(p, cap_eff, rotary_len, do_rotary)) continue;  // uniform
    const int nc = p / kChunk + 1;
    // chunk c's partial: rank c % NB, slot c / NB
    auto load = [&](int c, int j) {
      return cluster.map_shared_rank(part_s, c % NB)[(static_cast<size_t>(u) * cpb + c / NB) * P + j];
    };
    merge_partials<T, D>(load, nc, w_s, cl_s, cm_s, out + (static_cast<size_t>(b * S + i) * Hq + hq0 + u % HB) * D);
    __syncthreads();  // w_s, cl_s, cm_s reuse
  }
  cluster.sync();
}

// grid (NB, Hq/HB, B*nRG): block x takes chunks x, x+NB, ...; y the q heads y*HB..y*HB+HB-1 (one
// kv head); z = b*nRG + rg the rows rg*RG..rg*RG+RG-1.
//
// The new rows' K/V are written to the cache by this kernel (no separate kv_write launch): the
// blocks with x == 0 whose q heads start a kv-head group write their rows, and within the launch
// every block takes positions >= n (the new rows) from qkv instead of the cache, so no block
// reads an entry that this launch writes.
//
// CL (cluster merge): the NB blocks of a (rows, heads) group form one thread-block cluster, each
// keeps its chunks' partials in its own shared memory (chunk c at rank c % NB, slot c / NB), and
// after one cluster barrier rank u % NB merges unit u reading its peers' partials in place: the
// same partials and the same merge expression as the scratch path, so the same bits, without the
// fence, the counter's atomic and the partials' round trip through L2.
template <typename T, int D, bool CL>
__global__ void __launch_bounds__(kSplitThreads) split_attend_kernel(
    const T* __restrict__ qkv, T* __restrict__ pk, T* __restrict__ pv, const int32_t* __restrict__ seqlens,
    const T* __restrict__ cos_cache, const T* __restrict__ sin_cache, T* __restrict__ out, int S, int Hq, int Hkv,
    int cap, int rotary_len, float scale, bool do_rotary, int nch_cap, int HB, int RG, const KVTable tab,
    const int32_t* __restrict__ masked, bool prefetch, int cpb) {
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
  extern __shared__ __align__(16) float cluster_part_s[];  // CL: [units][cpb][P]

  pdl_trigger();
  if (prefetch && tab.rows == 0 && masked == nullptr) {
    // The past K/V rows this block reads, pulled into L2 while the projection before still runs:
    // they were written by earlier steps. seqlens is a step input; should a kernel before this one
    // still be changing it, the addresses stay inside the cache (clamped to cap), and a prefetch
    // is only a hint.
    const int nRG0 = (S + RG - 1) / RG, b = blockIdx.z / nRG0, kvh0 = blockIdx.y * HB / (Hq / Hkv);
    const int past = min(cap, max(0, seqlens[b] + 1 - S));
    constexpr int kLines = (D * static_cast<int>(sizeof(T)) + 127) / 128;
    const char* kbase = reinterpret_cast<const char*>(pk + (static_cast<size_t>(b) * Hkv + kvh0) * cap * D);
    const char* vbase = reinterpret_cast<const char*>(pv + (static_cast<size_t>(b) * Hkv + kvh0) * cap * D);
    for (int c = blockIdx.x; c * kChunk < past; c += gridDim.x)
      for (int e = threadIdx.x; e < kChunk * kLines; e += kSplitThreads) {
        const int j = c * kChunk + e / kLines;
        if (j >= past) break;
        const size_t at = static_cast<size_t>(j) * D * sizeof(T) + 128 * (e % kLines);
        prefetch_l2(kbase + at);
        prefetch_l2(vbase + at);
      }
  }
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
  const bool active = p_hi >= 0 && x * kChunk <= p_hi;  // uniform over the block
  if constexpr (!CL) {
    if (!active) return;
  } else {
    if (!active) {  // nothing to compute, but every rank takes part in the cluster's barriers
      cluster_merge<T, D>(cluster_part_s, w_s, cl_s, cm_s, out, b, S, i0, i1, hq0, n, HB, Hq, NB, x, cpb, cap_eff,
                          rotary_len, do_rotary);
      return;
    }
  }

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
      float* part = CL ? cluster_part_s + (static_cast<size_t>(u) * cpb + c / NB) * P
                       : g_attn_scratch + (static_cast<size_t>(unit) * nch_cap + c) * P;
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

  if constexpr (CL) {
    cluster_merge<T, D>(cluster_part_s, w_s, cl_s, cm_s, out, b, S, i0, i1, hq0, n, HB, Hq, NB, x, cpb, cap_eff,
                          rotary_len, do_rotary);
    return;
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
    auto load = [&](int c, int j) { return __ldcg(part + static_cast<size_t>(c) * P + j); };
    merge_partials<T, D>(load, nc, w_s, cl_s, cm_s, out + static_cast<size_t>(unit) * D);
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

// The cluster merge is a launch knob, off by default: LOOPCAST_ATTN_CLUSTER=N (2..16) takes it with
// clusters of up to N blocks, 0 or unset the scratch path (read at every launch, so a benchmark can
// time both; the bits are the same). On an H200 clusters of 8 shortened the captured Ouro-1.4B
// chain by up to 6 % at 400 past positions and lengthened it by up to 7 % at 1000, where a rank
// takes two chunks one after the other (docs/perf.md, "Split attention's cluster merge").
constexpr int kClusterMax = 16;
constexpr int kClusterPartBytes = 96 << 10;

// Whether the device can place a cluster of nb blocks of this kernel with smem bytes each (a host
// query, not a stream operation: fine while a graph is captured), remembered per shape.
template <typename Kernel>
bool cluster_fits(Kernel kernel, int nb, size_t smem) {
  static const void* last_fn = nullptr;
  static int last_nb = 0;
  static size_t last_smem = 0;
  static bool last_ok = false;
  static std::mutex guard;
  const std::lock_guard<std::mutex> hold(guard);
  const void* fn = reinterpret_cast<const void*>(kernel);
  if (fn == last_fn && nb == last_nb && smem == last_smem) return last_ok;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(nb), 1, 1);
  cfg.blockDim = dim3(kSplitThreads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(nb);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  const bool ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters >= 1;
  if (!ok) (void)cudaGetLastError();
  last_fn = fn;
  last_nb = nb;
  last_smem = smem;
  last_ok = ok;
  return ok;
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
  const bool pf = env_knob("LOOPCAST_ATTN_PF", 0, 0, 1) == 1;
  const dim3 grid_yz(1, Hq / HB, B * nRG);
  // The cluster merge: NB = the cluster, from the capacity (never from the positions, which the
  // device holds), where one block's partials fit its shared memory.
  const int cl_max = env_knob("LOOPCAST_ATTN_CLUSTER", 0, 0, kClusterMax);
  if (cl_max >= 2 && nch >= 2) {
    const int nb = std::min(cl_max, nch), cpb = (nch + nb - 1) / nb;
    const size_t smem = static_cast<size_t>(RG) * HB * cpb * (D + 2) * sizeof(float);
    auto kernel = split_attend_kernel<T, D, true>;
    bool ok = smem <= static_cast<size_t>(kClusterPartBytes) &&
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) ==
                  cudaSuccess;
    if (ok && nb > 8) ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
    if (ok) ok = cluster_fits(kernel, nb, smem);
    if (ok) {
      const cudaError_t err = launch_kernel(kernel, dim3(static_cast<unsigned>(nb), grid_yz.y, grid_yz.z),
                                            dim3(kSplitThreads), smem, stream, nb, qkv, pk, pv, seqlens, cos_cache,
                                            sin_cache, out, S, Hq, Hkv, cap, rotary_len, scale, do_rotary, nch, HB, RG,
                                            tab, masked, pf, cpb);
      if (err == cudaSuccess) return 0;
      (void)cudaGetLastError();  // a cluster this device cannot place: the scratch path below
    }
  }
  long long NB = (split_target_blocks() + cols - 1) / cols;
  if (NB > nch) NB = nch;
  if (NB < 1) NB = 1;
  return static_cast<int>(launch_kernel(split_attend_kernel<T, D, false>,
                                        dim3(static_cast<unsigned>(NB), grid_yz.y, grid_yz.z), dim3(kSplitThreads), 0,
                                        stream, 0, qkv, pk, pv, seqlens, cos_cache, sin_cache, out, S, Hq, Hkv, cap,
                                        rotary_len, scale, do_rotary, nch, HB, RG, tab, masked, pf, 0));
}
