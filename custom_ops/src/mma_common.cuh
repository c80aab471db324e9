// The tensor-core pieces of the skinny matmul (matmul_cuda.cu): one m16n8k16 MMA (fp32
// accumulation) per dtype, and a warp's 32-k chunk, so every kernel variant reduces a chunk in
// the same order.
#pragma once

#include <cstdint>

#include "cuda_common.cuh"

namespace loopcast_cuda {

template <typename T> struct MmaTraits;
template <> struct MmaTraits<__half> {
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <> struct MmaTraits<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
// `count` (0..8) consecutive 16-bit elements from p, zero-filled to 8.
__device__ __forceinline__ uint4 load8_partial(const uint16_t* p, int count) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = 2 * i < count ? p[2 * i] : 0u, hi = 2 * i + 1 < count ? p[2 * i + 1] : 0u;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
template <int MT>
struct ChunkRegs {
  uint4 b[8];
  uint32_t a[MT][8];
};

// Two k16 MMAs per chunk; MMA h takes, for lane (g, t), physical k = k0 + 8t + 4h + {0, 1} as
// k-slots {2t, 2t+1} and k0 + 8t + 4h + {2, 3} as k-slots {2t+8, 2t+9}, for A and B alike.
template <typename T, bool TB, int MT>
__device__ __forceinline__ void mma_chunk(float (&acc)[MT][8][4], const ChunkRegs<MT>& r) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t b0, b1;
      if (!TB) {  // pair rows (k, k+1) of column 8g + j: byte permutes of two 16-byte row loads
        const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
        b0 = __byte_perm(word(r.b[4 * h + 0], j >> 1), word(r.b[4 * h + 1], j >> 1), sel);
        b1 = __byte_perm(word(r.b[4 * h + 2], j >> 1), word(r.b[4 * h + 3], j >> 1), sel);
      } else {
        b0 = word(r.b[j], 2 * h);
        b1 = word(r.b[j], 2 * h + 1);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        MmaTraits<T>::mma(acc[mt][j], r.a[mt][2 * h], r.a[mt][4 + 2 * h], r.a[mt][2 * h + 1], r.a[mt][5 + 2 * h],
                          b0, b1);
    }
}

}  // namespace loopcast_cuda
