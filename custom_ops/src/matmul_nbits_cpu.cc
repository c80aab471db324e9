// BatchInvariantMatMulNBits, CPU kernel (matmul_nbits_op.h: the signature and layout).
//
// Per output column n and per quantization block: the block's weights are dequantized once,
// w = (q - zero_point) · scale in fp32, into a small buffer, and applied to every row of the
// call (rows in tiles of kRowTile, so a tile's activations stay in cache). A dot product keeps
// kLanes partial sums, lane j taking k ≡ j (mod kLanes) in ascending k, combined pairwise in one
// fixed order at the end (BatchInvariantMatMul's trans_b order): it depends on (k, K) only,
// never on the number of rows, the row tile or the thread, so a row's bits do not depend on how
// many rows share the call. Plain multiply and add (no contraction: custom_ops/build.py compiles
// with -ffp-contract=off), so the AVX-512 and AVX2 clones the compiler vectorises (target_clones)
// and the portable one give the same bits.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "matmul_nbits_op.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOOPCAST_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LOOPCAST_CLONES
#endif

namespace loopcast {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowTile = 16;
constexpr int64_t kCols = 16;  // output columns per thread-pool task

struct NBitsJob {
  const float* A;  // [rows, K] fp32 (SwiGLU already applied)
  const uint8_t* B;
  const float* scales;
  const uint8_t* zp;  // null: symmetric
  float* Y;           // [rows, N]
  int64_t rows, K, N, bits, bs, nb, zp_row;
};

// acc[j] += a[k] * w[k] for k ≡ j (mod kLanes), k ascending; a and w start at a multiple of kLanes.
inline void lane_accumulate(float* __restrict acc, const float* __restrict a, const float* __restrict w, int64_t len) {
  int64_t k = 0;
  for (; k + kLanes <= len; k += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[k + j] * w[k + j];
  for (int j = 0; k < len; ++k, ++j) acc[j] += a[k] * w[k];
}

inline float lane_combine(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)  // fixed pairwise combine
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

// Block `blk` of column n, dequantized into w[0 .. bs).
inline void dequantize_block(const NBitsJob& job, int64_t n, int64_t blk, float* __restrict w) {
  const int64_t index = n * job.nb + blk;
  const float scale = job.scales[index];
  float zp = static_cast<float>(1 << (job.bits - 1));
  if (job.zp != nullptr) {
    if (job.bits == 4) {
      const uint8_t z = job.zp[n * job.zp_row + blk / 2];
      zp = static_cast<float>((blk & 1) ? (z >> 4) : (z & 0xF));
    } else {
      zp = static_cast<float>(job.zp[n * job.zp_row + blk]);
    }
  }
  const uint8_t* __restrict p = job.B + index * (job.bs * job.bits / 8);
  if (job.bits == 4) {
    for (int64_t i = 0; i < job.bs / 2; ++i) {
      w[2 * i] = (static_cast<float>(p[i] & 0xF) - zp) * scale;
      w[2 * i + 1] = (static_cast<float>(p[i] >> 4) - zp) * scale;
    }
  } else {
    for (int64_t i = 0; i < job.bs; ++i) w[i] = (static_cast<float>(p[i]) - zp) * scale;
  }
}

LOOPCAST_CLONES void columns_task(const NBitsJob& job, int64_t n0, int64_t n1) {
  alignas(64) float w[256];
  alignas(64) float acc[kRowTile][kLanes];
  for (int64_t r0 = 0; r0 < job.rows; r0 += kRowTile) {
    const int64_t tile = std::min(kRowTile, job.rows - r0);
    const float* a_tile = job.A + r0 * job.K;
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t r = 0; r < tile; ++r)
        for (int j = 0; j < kLanes; ++j) acc[r][j] = 0.0f;
      for (int64_t blk = 0; blk < job.nb; ++blk) {
        dequantize_block(job, n, blk, w);
        const int64_t k0 = blk * job.bs, len = std::min(job.bs, job.K - k0);
        for (int64_t r = 0; r < tile; ++r) lane_accumulate(acc[r], a_tile + r * job.K + k0, w, len);
      }
      for (int64_t r = 0; r < tile; ++r) job.Y[(r0 + r) * job.N + n] = lane_combine(acc[r]);
    }
  }
}

void task(void* data, size_t index) {
  const NBitsJob& job = *static_cast<const NBitsJob*>(data);
  const int64_t n0 = static_cast<int64_t>(index) * kCols;
  columns_task(job, n0, std::min(job.N, n0 + kCols));
}

template <typename T>
struct NBitsCpuKernel {
  NBitsAttrs attrs;
  NBitsCpuKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::UnownedValue y(nullptr);
    const NBitsCall call = nbits_call(ctx, attrs, &y);
    const int64_t rows = call.rows, K = attrs.K, N = attrs.N;
    if (rows == 0) return;
    const T* A = static_cast<const T*>(call.A);
    // Activations in fp32 (SwiGLU of [gate | up] first, with the SwiGLU op's roundings).
    std::vector<float> a_f;
    const float* a_ptr = nullptr;
    if constexpr (std::is_same<T, float>::value) a_ptr = attrs.swiglu ? nullptr : A;
    if (a_ptr == nullptr) {
      a_f.resize(static_cast<size_t>(rows * K));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K; ++k)
          a_f[r * K + k] = attrs.swiglu ? to_float(swiglu_value(A[r * 2 * K + k], A[r * 2 * K + K + k]))
                                        : to_float(A[r * K + k]);
      a_ptr = a_f.data();
    }
    T* Y = y.GetTensorMutableData<T>();
    std::vector<float> y_f;
    float* y_ptr = nullptr;
    if constexpr (std::is_same<T, float>::value) y_ptr = Y;
    if (y_ptr == nullptr) {
      y_f.resize(static_cast<size_t>(rows * N));
      y_ptr = y_f.data();
    }
    NBitsJob job{a_ptr, call.B, call.scales, call.zero_points, y_ptr, rows, K, N,
                 attrs.bits, attrs.block_size, attrs.n_blocks(), attrs.zp_per_row()};
    // Columns split over the session's intra-op threads: each output element is still computed
    // by one task in its fixed order, so threads change nothing in the bits.
    ctx.ParallelFor(&task, static_cast<size_t>((N + kCols - 1) / kCols), 0, &job);
    if (!y_f.empty())
      for (int64_t i = 0; i < rows * N; ++i) Y[i] = from_float<T>(y_f[i]);
  }
};

MatMulNBitsOp<NBitsCpuKernel<float>, float, false> g_f32;
MatMulNBitsOp<NBitsCpuKernel<Ort::Float16_t>, Ort::Float16_t, false> g_f16;
MatMulNBitsOp<NBitsCpuKernel<Ort::BFloat16_t>, Ort::BFloat16_t, false> g_bf16;

}  // namespace

void add_cpu_matmul_nbits(Ort::CustomOpDomain& domain) {
  domain.Add(&g_f32);
  domain.Add(&g_f16);
  domain.Add(&g_bf16);
}

}  // namespace loopcast
