// FusedDecoderLayer, CUDA: one persistent kernel per decoder-layer application for M <= 8 rows
// (decode and verify), instead of seven dependent kernels (norm, qkv, attention, o_proj, norm,
// gate/up, down). Semantics (the chain of the separate ops, cuda_launch.h):
//
//   x   = ResidualRMSNorm sum (branch, residual, branch_norm, loop_norm)        -> sum_out
//   h   = n_in(x);  qkv = h·Wqkv;  a = attention(qkv, cache, rotary) · Wo       (cache rows written)
//   x1  = x + (attn_norm ? n_a(a) : a)                                         -> mid_out
//   m   = SwiGLU(n_post(x1)·Wgu) · Wdown                                        -> mlp_out
//
// Why one kernel: at M = 1 every dependent kernel costs ~4.5 µs of ramp and drain on an H200
// whatever its size (docs/perf.md), half of a decode step; here the weights could keep flowing.
// Status: correct and row-invariant (tests/custom_ops/test_cuda_decoder_layer.py), but it measures
// SLOWER than the seven-kernel chain (6.68 vs 5.60 ms for 96 layers, fp16 M = 1, H200,
// tools/bench_decoder_layer_cuda.py; docs/perf.md has the per-phase timeline), so no graph uses
// it yet: an experiment kept with its tests and benchmark.
//
//   grid 128 blocks (all resident: one per SM), 9 warps each.
//   warp 8 (producer) streams this block's weight tiles for all four projections, in order,
//     through a shared-memory ring with TMA (box 256 k x 64 columns = 32 KiB; 3..6 stages, what
//     the activations leave, at most `inflight` of them outstanding); it needs no activations,
//     so it runs ahead across the phases and the grid barriers below.
//   warps 0-7 (consumers) run the phases, separated by grid barriers (a global ticket counter):
//     P0 norms -> qkv | P1 attention partials | merge | P2 o_proj | P3 norms -> gate/up |
//     P4 SwiGLU -> down | mlp_out. A norm or SwiGLU prologue is computed by every block for every row
//     (L2-resident) into a shared-memory activation buffer; block 0 alone writes sum_out / mid_out.
//
// Matmul phase, B[K, N] ([K, N] row-major, the graphs' weight_T): units (tile of 64 columns,
// 256-row k-stage), tile-major; block b takes units [b·U/128, (b+1)·U/128) (one unit per block
// when U < 128). Warp w of a unit takes k rows 32w..32w+31 as one mma_chunk (mma_common.cuh).
// Output (m, n) is
//   serial MMA chain over the block's k-stages of the tile (ascending), per warp
//   -> serial sum over the 8 warps -> serial sum over the tile's blocks (ascending), rounded to T
// by whoever reads the output after the next grid barrier (partial_granule: the attention phase
// for qkv, the norms for o_proj, the SwiGLU staging for gate/up, a last phase for mlp_out).
// The split depends on (K, N) only. An MMA row never sees another row, so a row's bits do not
// depend on M: every verify row equals the M = 1 row. Attention: decoder_layer_attention.cuh.
//
// Scratch (intermediates, partials, counters) is process-wide static device memory: calls on one
// device must not run concurrently (a session runs its steps one at a time). Launched with PDL:
// the producer starts streaming the first weights while the previous kernel finishes.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "attention_common.cuh"
#include "cuda_common.cuh"
#include "cuda_launch.h"
#include "decoder_layer.cuh"
#include "decoder_layer_attention.cuh"
#include "mma_common.cuh"

namespace loopcast_cuda {
namespace {

using namespace layer;  // NOLINT: the kernel's own header

__device__ __align__(16) float g_partials[4][kMaxUnits * kRows * kTileN];  // per projection
__device__ unsigned g_barrier;  // tickets; a multiple of kLayerBlocks between launches
__device__ __align__(16) uint16_t g_attn[kRows * kMaxHidden];
__device__ float g_attn_part[static_cast<size_t>(kRows) * kMaxQHeads * kMaxChunks * (128 + 2)];
// Per block, globaltimer (ns) at the phase marks of the last launch (loopcast_cuda_decoder_layer_timeline).
__device__ unsigned long long g_timeline[kLayerBlocks][kLoopcastLayerTimelineMarks];

// ---- prologues --------------------------------------------------------------------------------
// Granule j of this consumer thread: elements (tid + 256j)·8 .. +8 (H % 8 == 0: never straddles H).
__device__ __forceinline__ int granule_k(int j) { return (threadIdx.x + j * kConsumers) * 8; }

template <int NV, bool CONST>
__device__ __forceinline__ void load_granules(uint4 (&g)[NV], const void* src, int H) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int k = granule_k(j);
    const uint4* q = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(src) + k);
    g[j] = src != nullptr && k < H ? (CONST ? __ldg(q) : __ldcg(q)) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// x <- T(w · T(x / sqrt(mean(x²) + eps))), reduced by rms_inverse (cuda_common.cuh) as
// ResidualRMSNorm is, so the norms carry its bits.
template <typename T, int NV>
__device__ void norm_in_place(float (&x)[NV][8], const uint4 (&w)[NV], int H, float eps, float* red8) {
  const float inv = rms_inverse<NV, 8>(x, H, eps, red8, [] { consumer_sync(); });
  consumer_sync();  // red8 is reused by the next reduction
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float wf[8];
    Vec<T>::cvt(w[j], wf);  // zeros past H
#pragma unroll
    for (int e = 0; e < 8; ++e) x[j][e] = rt<T>(__fmul_rn(wf[e], rt<T>(__fmul_rn(x[j][e], inv))));
  }
}

template <typename T, int NV>
struct NormWeights {  // this thread's granules of a norm's weights (zeros when absent)
  uint4 w[NV];
  bool present;
  __device__ void load(const void* src, int H) {
    present = src != nullptr;
    load_granules<NV, true>(w, src, H);
  }
};

// act[m] = n_out(s), s = [n_loop](residual + [n_b](branch)), for every row; block 0 writes s. The
// branch is a T tensor, or (`deferred`) the partials of a projection. Every load of a row is
// issued before the first reduction: one L2 round trip, not five.
template <typename T, int NV>
__device__ void norm_rows(const void* branch, const void* residual, const NormWeights<T, NV>& bw,
                          const NormWeights<T, NV>& lw, const NormWeights<T, NV>& ow, void* sum_out, uint16_t* act,
                          int stride, int kpad, int M, int H, float eps, float* red8, const Phase* deferred = nullptr) {
  for (int m = 0; m < M; ++m) {
    uint4 xb[NV], xr[NV];
    load_granules<NV, false>(xb, deferred ? nullptr : static_cast<const uint16_t*>(branch) + static_cast<size_t>(m) * H, H);
    load_granules<NV, false>(xr, residual ? static_cast<const uint16_t*>(residual) + static_cast<size_t>(m) * H
                                          : nullptr, H);
    float x[NV][8];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (deferred == nullptr) {
        Vec<T>::cvt(xb[j], x[j]);
      } else if (granule_k(j) < H) {  // branch = the partials of a deferred projection
        partial_granule<T>(x[j], *deferred, static_cast<const float*>(branch), m, granule_k(j));
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) x[j][e] = 0.0f;
      }
    }
    if (bw.present) norm_in_place<T, NV>(x, bw.w, H, eps, red8);  // uniform over the block
    if (residual) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        float r[8];
        Vec<T>::cvt(xr[j], r);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[j][e] = rt<T>(__fadd_rn(r[e], x[j][e]));
      }
    }
    if (lw.present) norm_in_place<T, NV>(x, lw.w, H, eps, red8);
#pragma unroll
    for (int j = 0; j < NV; ++j)
      if (blockIdx.x == 0 && granule_k(j) < H)
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(sum_out) + static_cast<size_t>(m) * H + granule_k(j)) =
            pack8<T>(x[j]);
    norm_in_place<T, NV>(x, ow.w, H, eps, red8);
#pragma unroll
    for (int j = 0; j < NV; ++j)
      if (granule_k(j) < kpad) *reinterpret_cast<uint4*>(act + m * stride + granule_k(j)) = pack8<T>(x[j]);
  }
  for (int k = NV * kConsumers * 8 + threadIdx.x * 8; k < kpad; k += kConsumers * 8)
    for (int m = 0; m < M; ++m) *reinterpret_cast<uint4*>(act + m * stride + k) = make_uint4(0u, 0u, 0u, 0u);
}

// act[m][k] = src[m][k] for k < K, zeros up to kpad; four 16-byte loads in flight per thread.
__device__ void stage_rows(const uint16_t* src, int K, int M, uint16_t* act, int stride, int kpad) {
  const int gpr = kpad / 8, total = M * gpr;
  for (int base = threadIdx.x; base < total; base += 4 * kConsumers) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int gi = base + j * kConsumers, m = gi / gpr, k = gi % gpr * 8;
      v[j] = gi < total && k < K ? __ldcg(reinterpret_cast<const uint4*>(src + static_cast<size_t>(m) * K + k))
                                 : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int gi = base + j * kConsumers;
      if (gi < total) *reinterpret_cast<uint4*>(act + gi / gpr * stride + gi % gpr * 8) = v[j];
    }
  }
}

// act[m][k] = SwiGLU(gate, up) from the deferred gate/up projection's partials, zeros up to kpad.
template <typename T>
__device__ void stage_swiglu(const Phase& gu, const float* region, int I, int M, uint16_t* act, int stride, int kpad) {
  const int gpr = kpad / 8;
  for (int gi = threadIdx.x; gi < M * gpr; gi += kConsumers) {
    const int m = gi / gpr, k = gi % gpr * 8;
    uint4 out = make_uint4(0u, 0u, 0u, 0u);
    if (k < I) {
      float g[8], u[8];
      partial_granule<T>(g, gu, region, m, k);
      partial_granule<T>(u, gu, region, m, I + k);
      T* o = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = swiglu_value(from_f<T>(g[e]), from_f<T>(u[e]));
    }
    *reinterpret_cast<uint4*>(act + m * stride + k) = out;
  }
}

// ---- matmul phase -----------------------------------------------------------------------------
// The block's partial of one tile -> region (read back after the next grid barrier with
// partial_granule: no atomics, no per-tile fences on the critical path).
__device__ void flush_tile(const Phase& s, int tile, float (&acc)[1][8][4], int M, float* region, const Smem& sm) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (g < M) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) sm.red[(warp * kRows + g) * kRedStride + 8 * (2 * t + e) + j] = acc[0][j][e];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][j][e] = 0.0f;
  consumer_sync();
  float* part = region + (static_cast<size_t>(tile) * s.kst + blockIdx.x - unit_owner(s, tile * s.kst)) * kRows * kTileN;
  for (int e = tid; e < M * kTileN; e += kConsumers) {
    const int row = e / kTileN, col = e % kTileN;
    float v = sm.red[row * kRedStride + col];
#pragma unroll
    for (int q = 1; q < kConsumerWarps; ++q) v = __fadd_rn(v, sm.red[(q * kRows + row) * kRedStride + col]);
    __stcg(part + e, v);
  }
  consumer_sync();  // red is reused; the grid barrier after the phase publishes the partials
}

template <typename T>
__device__ void matmul_phase(const Phase& s, int M, float* region, const Smem& sm, int& it) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int stride = s.kst * kStageK + 8;  // +16 bytes: rows of A fall on different banks
  float acc[1][8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][j][e] = 0.0f;
  int cur = -1;
  for (int u = s.u0; u < s.u1; ++u, ++it) {
    const int tile = u / s.kst, ks = u % s.kst;
    if (tile != cur) {
      if (cur >= 0) flush_tile(s, cur, acc, M, region, sm);
      cur = tile;
    }
    const int stage = it % sm.stages;
    mbar_wait(sm.full + stage, (it / sm.stages) & 1);
    const int row0 = 32 * warp + 8 * t;
    const uint16_t* bs = sm.ring + stage * kStageElems + row0 * kTileN + 8 * g;
    ChunkRegs<1> r;
#pragma unroll
    for (int i = 0; i < 8; ++i) r.b[i] = *reinterpret_cast<const uint4*>(bs + i * kTileN);
    uint4 a = make_uint4(0u, 0u, 0u, 0u);
    if (g < M) a = *reinterpret_cast<const uint4*>(sm.act + g * stride + ks * kStageK + row0);
    r.a[0][0] = a.x;
    r.a[0][1] = a.y;
    r.a[0][2] = a.z;
    r.a[0][3] = a.w;
#pragma unroll
    for (int q = 4; q < 8; ++q) r.a[0][q] = 0u;  // rows 8..15 of the MMA tile
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.empty + stage);  // the slot is in registers: the producer may refill it
    mma_chunk<T, false, 1>(acc, r);
  }
  if (cur >= 0) flush_tile(s, cur, acc, M, region, sm);
}

// ---- the kernel -------------------------------------------------------------------------------
template <typename T, int D, int NV>
__global__ void __launch_bounds__(kLayerThreads, 1)
    decoder_layer_kernel(const __grid_constant__ LayerMaps maps, const LayerParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  Smem sm;
  sm.full = reinterpret_cast<uint64_t*>(smem);
  sm.empty = sm.full + kMaxStages;
  sm.red = reinterpret_cast<float*>(smem + kRedOffset);
  sm.ring = reinterpret_cast<uint16_t*>(smem + kRingOffset);
  sm.act = reinterpret_cast<uint16_t*>(smem + kRingOffset + p.stages * kStageBytes);
  sm.stages = p.stages;
  const int tid = threadIdx.x, warp = tid >> 5;
  const Scratch sc{{g_partials[0], g_partials[1], g_partials[2], g_partials[3]}, &g_barrier, g_attn, g_attn_part};
  // The norm weights (constants) are requested before the producer's first weight tiles, so they do
  // not queue behind megabytes of TMA traffic.
  NormWeights<T, NV> w_branch, w_loop, w_in, w_attn, w_post;
  if (warp < kConsumerWarps) {
    w_branch.load(p.branch_norm, p.H);
    w_loop.load(p.loop_norm, p.H);
    w_in.load(p.input_norm, p.H);
    w_attn.load(p.attn_norm, p.H);
    w_post.load(p.post_attn_norm, p.H);
  }
  if (tid == 0) {
    for (int s = 0; s < sm.stages; ++s) {
      mbar_init(sm.full + s, 1);
      mbar_init(sm.empty + s, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  pdl_trigger();
  const int A = p.Hq * D;
  const Phase ph[4] = {phase_of(p.H, (p.Hq + 2 * p.Hkv) * D), phase_of(A, p.H), phase_of(p.H, 2 * p.I),
                       phase_of(p.I, p.H)};

  if (warp == kConsumerWarps) {  // producer: weights only, so no wait for the previous kernel
    if ((tid & 31) == 0) {
      const CUtensorMap* map[4] = {&maps.qkv, &maps.o, &maps.gate_up, &maps.down};
      int it = 0;
      for (int f = 0; f < 4; ++f)
        for (int u = ph[f].u0; u < ph[f].u1; ++u, ++it) {
          const int stage = it % sm.stages;
          if (it >= sm.stages) mbar_wait(sm.empty + stage, ((it / sm.stages) - 1) & 1);
          // At most `inflight` tiles outstanding: deeper queues only add latency to everyone's
          // loads (so does pulling later tiles into L2 meanwhile: measured slower, docs/perf.md).
          if (it >= p.inflight)
            mbar_wait(sm.full + (it - p.inflight) % sm.stages, ((it - p.inflight) / sm.stages) & 1);
          mbar_expect_tx(sm.full + stage, kStageBytes);
          tma_load_tile(sm.ring + stage * kStageElems, map[f], sm.full + stage, (u / ph[f].kst) * kTileN,
                        (u % ph[f].kst) * kStageK);
        }
    }
    return;
  }

  int mark = 0;
  auto stamp = [&] {
    if (tid == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
      g_timeline[blockIdx.x][mark] = t;
    }
    ++mark;
  };
  stamp();
  pdl_wait();  // branch, residual, seqlens and the scratch belong to earlier kernels until here
  stamp();
  int it = 0;
  // P0: the opening norms, then qkv.
  norm_rows<T, NV>(p.branch, p.residual, w_branch, w_loop, w_in, p.sum_out, sm.act,
                   ph[0].kst * kStageK + 8, ph[0].kst * kStageK, p.M, p.H, p.eps, sm.red);
  consumer_sync();
  stamp();
  matmul_phase<T>(ph[0], p.M, sc.partials[0], sm, it);
  stamp();
  grid_barrier(sc.tickets);
  stamp();
  // P1: attention over the cache: chunk partials, then their merge.
  attention_phase<T, D>(p, ph[0], sm, sc);
  stamp();
  grid_barrier(sc.tickets);
  stamp();
  attention_combine<T, D>(p, sm, sc);
  grid_barrier(sc.tickets);
  stamp();
  // P2: o_proj over the attention rows.
  stage_rows(sc.attn, A, p.M, sm.act, ph[1].kst * kStageK + 8, ph[1].kst * kStageK);
  consumer_sync();
  matmul_phase<T>(ph[1], p.M, sc.partials[1], sm, it);
  stamp();
  grid_barrier(sc.tickets);
  stamp();
  // P3: residual add with the sandwich norm, the post-attention norm, then gate/up.
  w_loop.present = false;
  norm_rows<T, NV>(sc.partials[1], p.sum_out, w_attn, w_loop, w_post, p.mid_out, sm.act,
                   ph[2].kst * kStageK + 8, ph[2].kst * kStageK, p.M, p.H, p.eps, sm.red, &ph[1]);
  consumer_sync();
  matmul_phase<T>(ph[2], p.M, sc.partials[2], sm, it);
  stamp();
  grid_barrier(sc.tickets);
  stamp();
  // P4: SwiGLU of [gate | up], then down.
  stage_swiglu<T>(ph[2], sc.partials[2], p.I, p.M, sm.act, ph[3].kst * kStageK + 8, ph[3].kst * kStageK);
  consumer_sync();
  matmul_phase<T>(ph[3], p.M, sc.partials[3], sm, it);
  stamp();
  grid_barrier(sc.tickets);
  // mlp_out from the down partials, its granules spread over every consumer thread of the grid.
  for (int gi = blockIdx.x * kConsumers + tid; gi < p.M * (p.H / 8); gi += kLayerBlocks * kConsumers) {
    const int m = gi / (p.H / 8), k = gi % (p.H / 8) * 8;
    float f[8];
    partial_granule<T>(f, ph[3], sc.partials[3], m, k);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.mlp_out) + static_cast<size_t>(m) * p.H + k) = pack8<T>(f);
  }
  stamp();
}

// ---- host -------------------------------------------------------------------------------------
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [K, N] weight as 2-D tiles of 256 rows x 64 columns (out of range: zeros).
bool weight_map(CUtensorMap* map, const void* w, int K, int N, bool bf16) {
  auto encode = encode_fn();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(K)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(N) * 2};
  const cuuint32_t box[2] = {kTileN, kStageK};
  const cuuint32_t estr[2] = {1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                const_cast<void*>(w), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int units_of(int K, int N) { return ((K + kStageK - 1) / kStageK) * ((N + kTileN - 1) / kTileN); }
int kpad_of(int K) { return (K + kStageK - 1) / kStageK * kStageK; }

template <typename T, int D, int NV>
int launch_layer(const LayerMaps& maps, LayerParams p, cudaStream_t stream) {
  auto kernel = decoder_layer_kernel<T, D, NV>;
  // Activations take M rows; the weight ring takes the rest (deeper for fewer rows).
  const int kmax = std::max(std::max(kpad_of(p.H), kpad_of(p.Hq * D)), kpad_of(p.I));
  const int group = p.Hq / p.Hkv;  // attention: rotated q (fp32) and one kv head's qkv rows (T)
  const int act_bytes = std::max(p.M * (kmax + 8) * 2, p.M * group * D * 4 + p.M * (group + 2) * D * 2);
  int dev = 0, sms = 0, optin = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return static_cast<int>(err);
  p.stages = std::min(kMaxStages, (optin - kRingOffset - act_bytes) / kStageBytes);
  if (p.stages < 2) return static_cast<int>(cudaErrorInvalidValue);
  const char* env = std::getenv("LOOPCAST_LAYER_INFLIGHT");  // an experiment switch, read per launch
  p.inflight = std::max(1, std::min(p.stages, env != nullptr ? std::atoi(env) : 2));
  const int smem = kRingOffset + p.stages * kStageBytes + act_bytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kLayerThreads, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  // Grid barriers need every block resident at once.
  if (static_cast<long long>(sms) * per_sm < kLayerBlocks) return static_cast<int>(cudaErrorNotSupported);
  return static_cast<int>(launch_kernel(kernel, dim3(kLayerBlocks), dim3(kLayerThreads), smem, stream, 0, maps, p));
}

template <typename T>
struct LayerLauncher {
  static int run(const LoopcastLayerArgs* a, void* stream) {
    const int M = a->rows, H = a->hidden, Hq = a->num_heads, Hkv = a->kv_num_heads, D = a->head_dim,
              I = a->intermediate;
    const bool ok_shape = M >= 1 && M <= kRows && (D == 64 || D == 128) && Hkv >= 1 && Hq % Hkv == 0 &&
                          Hq <= kMaxQHeads && (Hq / Hkv) * M <= kMaxAttnUnits && H >= 8 && H % 8 == 0 &&
                          H <= kMaxHidden && Hq * D <= kMaxHidden && (Hq + 2 * Hkv) * D <= kMaxQkv && I >= 8 &&
                          I % 8 == 0 && I <= kMaxInter && a->capacity >= 1 &&
                          a->capacity <= kLoopcastLayerMaxCapacity && units_of(H, (Hq + 2 * Hkv) * D) <= kMaxUnits &&
                          units_of(H, 2 * I) <= kMaxUnits && units_of(I, H) <= kMaxUnits &&
                          units_of(Hq * D, H) <= kMaxUnits;
    if (!ok_shape || a->branch == nullptr || a->input_norm == nullptr || a->post_attn_norm == nullptr ||
        a->sum_out == nullptr || a->mid_out == nullptr || a->mlp_out == nullptr || a->seqlens_k == nullptr ||
        (a->do_rotary && (a->cos_cache == nullptr || a->sin_cache == nullptr)))
      return static_cast<int>(cudaErrorInvalidValue);
    for (const void* w : {a->qkv_weight, a->o_weight, a->gate_up_weight, a->down_weight})
      if (w == nullptr || reinterpret_cast<uintptr_t>(w) % 16 != 0) return static_cast<int>(cudaErrorInvalidValue);
    const bool bf16 = std::is_same<T, __nv_bfloat16>::value;
    LayerMaps maps;
    if (!weight_map(&maps.qkv, a->qkv_weight, H, (Hq + 2 * Hkv) * D, bf16) ||
        !weight_map(&maps.o, a->o_weight, Hq * D, H, bf16) ||
        !weight_map(&maps.gate_up, a->gate_up_weight, H, 2 * I, bf16) ||
        !weight_map(&maps.down, a->down_weight, I, H, bf16))
      return static_cast<int>(cudaErrorInvalidValue);
    LayerParams p{a->branch, a->residual, a->branch_norm, a->loop_norm, a->input_norm, a->key_cache,
                  a->value_cache, a->seqlens_k, a->cos_cache, a->sin_cache, a->attn_norm, a->post_attn_norm,
                  a->sum_out, a->mid_out, a->mlp_out, M, H, Hq, Hkv, D, I, a->capacity,
                  a->do_rotary ? a->rotary_len : a->capacity, a->epsilon, a->scale, a->do_rotary != 0, 0, 0};
    const void* acts[] = {a->branch, a->residual, a->branch_norm, a->loop_norm, a->input_norm, a->attn_norm,
                          a->post_attn_norm, a->sum_out, a->mid_out, a->mlp_out};
    for (const void* q : acts)
      if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return static_cast<int>(cudaErrorInvalidValue);
    auto s = static_cast<cudaStream_t>(stream);
    const int nv = (H / 8 + kConsumers - 1) / kConsumers;  // granules per consumer thread, from H only
    if (D == 64) {
      return nv <= 1 ? launch_layer<T, 64, 1>(maps, p, s) : nv <= 2 ? launch_layer<T, 64, 2>(maps, p, s)
                                                                     : launch_layer<T, 64, 4>(maps, p, s);
    }
    return nv <= 1 ? launch_layer<T, 128, 1>(maps, p, s) : nv <= 2 ? launch_layer<T, 128, 2>(maps, p, s)
                                                                    : launch_layer<T, 128, 4>(maps, p, s);
  }
};

template <>
struct LayerLauncher<float> {
  static int run(const LoopcastLayerArgs*, void*) { return static_cast<int>(cudaErrorNotSupported); }
};

}  // namespace
}  // namespace loopcast_cuda

LOOPCAST_CUDA_API int loopcast_cuda_decoder_layer(int dtype, const LoopcastLayerArgs* args, void* stream) {
  if (args == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  return loopcast_cuda::dispatch<loopcast_cuda::LayerLauncher>(dtype, args, stream);
}

LOOPCAST_CUDA_API int loopcast_cuda_decoder_layer_timeline(unsigned long long* out) {
  return static_cast<int>(cudaMemcpyFromSymbol(out, loopcast_cuda::g_timeline, sizeof(loopcast_cuda::g_timeline)));
}

