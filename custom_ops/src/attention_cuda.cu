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
// and keeps (m_c, l_c, a_c) for the merge of chunks 0..p/C in ascending order:
//   M = max m_c, w_c = exp(m_c - M), out = (sum_c w_c a_c) / (sum_c w_c l_c), serial in c.
// They go to a static scratch and the last block of a (row, head) to finish (an atomic counter; it
// only decides who combines) merges them. Under LOOPCAST_ATTN_CLUSTER (a launch knob, off by
// default) the blocks of a (rows, heads) group are one thread-block cluster instead: the partials
// stay in each block's shared memory and, after a cluster barrier, one rank per unit merges them
// in place. Same terms, same bits.
// Which block computes which chunk (blocks stride over chunks; one block serves several rows and
// the q heads of a kv head, so K/V are loaded once for them) is free: it changes no arithmetic.
// The scratch and counters are process-wide statics: calls on one device must not run
// concurrently on different streams (a session runs its steps one at a time). Whether the split
// kernel is used depends on Hq, D and the capacity only (sized for S = 32 rows per batch entry),
// never on B or on S <= 32: a batch that overflows the scratch runs as several launches.
#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>
#include <mutex>

#include "attention_common.cuh"
#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace loopcast_cuda {
namespace {

namespace cg = cooperative_groups;

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


// The split (flash-decoding) kernel: split_attend_kernel, launch_split, KVTable.
#include "attention_split_cuda.cuh"

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
