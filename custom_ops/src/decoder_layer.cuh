// Shared by the fused decoder-layer kernel (decoder_layer_cuda.cu) and its attention phases
// (decoder_layer_attention.cuh): launch constants, parameters, the projection split, the
// shared-memory layout, mbarrier / TMA wrappers and the grid barrier.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "cuda_launch.h"

namespace loopcast_cuda {
namespace layer {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kLayerThreads = kConsumers + 32;
constexpr int kLayerBlocks = 128;  // a constant (part of the numerics), a power of two (barrier)
constexpr int kTileN = 64;
constexpr int kStageK = 256;
constexpr int kMaxStages = 8;  // the ring takes what shared memory the activations leave (3..6 stages)
constexpr int kStageElems = kTileN * kStageK;
constexpr int kStageBytes = kStageElems * 2;
constexpr int kRows = kLoopcastLayerMaxRows;
constexpr int kRedStride = kTileN + 1;
constexpr int kAttnChunk = 64;
constexpr int kMaxUnits = 4096;  // (tile, k-stage) units per projection
constexpr int kMaxHidden = 8192, kMaxQkv = 16384, kMaxInter = 16384;
constexpr int kMaxQHeads = 32, kMaxAttnUnits = 64;
constexpr int kMaxChunks = kLoopcastLayerMaxCapacity / kAttnChunk;

struct LayerMaps {
  CUtensorMap qkv, o, gate_up, down;
};

struct LayerParams {
  const void *branch, *residual, *branch_norm, *loop_norm, *input_norm;
  void *key_cache, *value_cache;
  const int32_t* seqlens_k;
  const void *cos_cache, *sin_cache, *attn_norm, *post_attn_norm;
  void *sum_out, *mid_out, *mlp_out;
  int M, H, Hq, Hkv, D, I, cap, rotary_len;
  float eps, scale;
  bool rotary;
  int stages;    // weight ring depth
  int inflight;  // weight stages the producer keeps in flight (the rest of the ring fills behind them)
};

// One projection's split (from K and N only) and this block's unit range.
struct Phase {
  int K, N, kst, units, u0, u1;
};
__device__ __forceinline__ Phase phase_of(int K, int N) {
  Phase s;
  s.K = K;
  s.N = N;
  s.kst = (K + kStageK - 1) / kStageK;
  s.units = s.kst * ((N + kTileN - 1) / kTileN);
  if (s.units >= kLayerBlocks) {  // every block gets at least one unit, so a tile's blocks are consecutive
    s.u0 = static_cast<int>(static_cast<long long>(blockIdx.x) * s.units / kLayerBlocks);
    s.u1 = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * s.units / kLayerBlocks);
  } else {  // one unit per block, blocks >= units idle
    s.u0 = min(static_cast<int>(blockIdx.x), s.units);
    s.u1 = min(static_cast<int>(blockIdx.x) + 1, s.units);
  }
  return s;
}
// The block whose range holds unit u (the largest b with b·U/128 <= u, or u itself).
__device__ __forceinline__ int unit_owner(const Phase& s, int u) {
  if (s.units < kLayerBlocks) return u;
  return static_cast<int>((static_cast<long long>(u + 1) * kLayerBlocks - 1) / s.units);
}

// ---- shared memory, mbarriers, TMA ----------------------------------------------------------
// The static device scratch of decoder_layer_cuda.cu, as the phases see it.
struct Scratch {
  float* partials[4];  // per projection: [tile * kst + segment][kRows][64] block partials
  unsigned* tickets;   // grid_barrier
  uint16_t* attn;      // [kRows][Hq * D]
  float* attn_part;    // [kRows][kMaxQHeads][kMaxChunks][D + 2]: m, l, a[D] per chunk
};

struct Smem {
  uint64_t* full;   // [stages]
  uint64_t* empty;  // [stages]
  float* red;       // [8 warps][kRows][65]; attention: [2][8][D] and [4][8]; merge: [3][kMaxChunks]
  uint16_t* ring;   // [stages][256][64]
  uint16_t* act;    // activations [rows][stride]; attention: rotated q [units][D] fp32, then qkv rows
  int stages;
};
constexpr int kRedOffset = 2 * kMaxStages * 8;
constexpr int kRedBytes = kConsumerWarps * kRows * kRedStride * 4;
constexpr int kRingOffset = (kRedOffset + kRedBytes + 1023) / 1024 * 1024;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load_tile(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
          "r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(col), "r"(row)
      : "memory");
}
// The eight consumer warps only (the producer warp never joins).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// Every consumer of every block arrives; tickets keep counting across barriers and launches.
__device__ void grid_barrier(unsigned* tickets) {
  consumer_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned ticket = atomicAdd(tickets, 1u);
    const unsigned target = ticket - ticket % kLayerBlocks + kLayerBlocks;
    unsigned v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(tickets) : "memory");
    } while (static_cast<int>(v - target) < 0);
  }
  consumer_sync();
}

template <typename T> __device__ __forceinline__ float rt(float v) { return to_f(from_f<T>(v)); }

template <typename T> __device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = from_f<T>(f[e]);
  return out;
}
// Output granule (m, n .. n + 8) of a projection: its blocks' partials (flush_tile) summed in
// block order and rounded to T. Every reader computes the same bits.
template <typename T>
__device__ __forceinline__ void partial_granule(float (&out)[8], const Phase& s, const float* region, int m, int n) {
  const int tile = n / kTileN;
  const int nseg = unit_owner(s, (tile + 1) * s.kst - 1) - unit_owner(s, tile * s.kst) + 1;
  const float* q = region + (static_cast<size_t>(tile) * s.kst * kRows + m) * kTileN + n % kTileN;
  float4 a = __ldcg(reinterpret_cast<const float4*>(q)), b = __ldcg(reinterpret_cast<const float4*>(q + 4));
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
#pragma unroll 4
  for (int seg = 1; seg < nseg; ++seg) {
    q += kRows * kTileN;
    a = __ldcg(reinterpret_cast<const float4*>(q));
    b = __ldcg(reinterpret_cast<const float4*>(q + 4));
    out[0] = __fadd_rn(out[0], a.x), out[1] = __fadd_rn(out[1], a.y), out[2] = __fadd_rn(out[2], a.z);
    out[3] = __fadd_rn(out[3], a.w), out[4] = __fadd_rn(out[4], b.x), out[5] = __fadd_rn(out[5], b.y);
    out[6] = __fadd_rn(out[6], b.z), out[7] = __fadd_rn(out[7], b.w);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = rt<T>(out[e]);
}

}  // namespace layer
}  // namespace loopcast_cuda
