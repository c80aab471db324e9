// BatchInvariantMatMulNBits, CPU kernel (matmul_nbits_op.h: the signature and layout).
//
// Per group of kGroup output columns and tile of kRowTile rows, the columns' weights are
// dequantized once, w = (q - zero_point) · scale in fp32, into a buffer, and applied to every
// row of the tile (for decode, M = 1: one tile). A dot product keeps 16 partial sums, lane j
// taking k ≡ j (mod 16) in ascending k (activations padded with zeros to a multiple of 16),
// combined pairwise in one fixed order at the end (BatchInvariantMatMul's trans_b order): the
// order depends on (k, K) only, never on the number of rows, the tile, the group or the thread,
// so a row's bits do not depend on how many rows share the call. The 16 lanes are one GCC
// vector (one AVX-512 register, two AVX2 ones); the kGroup columns' chains are independent, so
// one row keeps several FMA-free multiply-add chains in flight. Plain multiply and add (no
// contraction: custom_ops/build.py compiles with -ffp-contract=off), so the AVX-512 and AVX2
// clones (target_clones) and the portable one give the same bits.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "matmul_nbits_op.h"
#include "matmul_nbits_q8_cpu.h"
#include "residual_norm_rows.h"
#include "swiglu_row.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOOPCAST_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LOOPCAST_CLONES
#endif

namespace loopcast {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowTile = 16;
constexpr int kGroup = 4;      // columns dequantized together (independent chains per row)
constexpr int64_t kCols = 16;  // output columns per thread-pool task

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr u32x16 kShift4 = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
constexpr u32x16 kShift8 = {0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24};
constexpr u32x16 kFirstHalf = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
constexpr u32x16 kQuarter = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

// Helpers are always inlined into the cloned task (compiled for its ISA there); none takes or
// returns a vector (that would change the ABI between the clones).
#define LOOPCAST_INLINE inline __attribute__((always_inline))

struct NBitsJob {
  const float* A;  // [rows, Kp] fp32, SwiGLU already applied, zeros from K to Kp
  const uint8_t* B;
  const float* scales;
  const uint8_t* zp;  // packed uint8; both null: symmetric
  const float* zp_f32;
  float* Y;           // [rows, N]
  int64_t rows, K, Kp, N, bits, bs, nb, zp_row;
};

// Column n dequantized into w[0 .. nb·bs) (padding past K holds the zero weights the exporter
// quantized there; the activations are zero there too).
LOOPCAST_INLINE void dequantize_column(const NBitsJob& job, int64_t n, float* __restrict w) {
  const int64_t blob = job.bs * job.bits / 8;
  for (int64_t blk = 0; blk < job.nb; ++blk) {
    const int64_t index = n * job.nb + blk;
    float zp = static_cast<float>(1 << (job.bits - 1));
    if (job.zp_f32 != nullptr) {
      zp = job.zp_f32[index];
    } else if (job.zp != nullptr) {
      const uint8_t z = job.zp[n * job.zp_row + (job.bits == 4 ? blk / 2 : blk)];
      zp = static_cast<float>(job.bits == 4 ? ((blk & 1) ? (z >> 4) : (z & 0xF)) : z);
    }
    const f32x16 zv = zp - f32x16{}, sv = job.scales[index] - f32x16{};
    const uint8_t* p = job.B + index * blob;
    float* out = w + blk * job.bs;
    for (int64_t i = 0; i < job.bs / 16; ++i) {
      // 16 codes as uint32 lanes: each lane shifts its own copy (broadcast, then selected) of
      // the word holding its code (GCC lowers broadcasts, selects and per-lane shifts to vector
      // instructions; byte shuffles and byte -> float conversions it scalarises). 4 bits: value j is nibble j of 8 bytes (the
      // low nibble first); 8 bits: byte j of 16 bytes.
      u32x16 q;
      if (job.bits == 4) {
        uint32_t w[2];
        std::memcpy(w, p + 8 * i, 8);
        q = kFirstHalf ? w[0] + u32x16{} : w[1] + u32x16{};
        q = (q >> kShift4) & 0xF;
      } else {
        uint32_t w[4];
        std::memcpy(w, p + 16 * i, 16);
        q = kQuarter == 0 ? w[0] + u32x16{} : kQuarter == 1 ? w[1] + u32x16{} : kQuarter == 2 ? w[2] + u32x16{} : w[3] + u32x16{};
        q = (q >> kShift8) & 0xFF;
      }
      const f32x16 v = (__builtin_convertvector(reinterpret_cast<i32x16&>(q), f32x16) - zv) * sv;  // codes < 256: exact
      std::memcpy(out + 16 * i, &v, sizeof v);
    }
  }
}

LOOPCAST_INLINE float lane_combine(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)  // fixed pairwise combine
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

LOOPCAST_CLONES void columns_task(const NBitsJob& job, int64_t n0, int64_t n1, float* w) {
  const int64_t stride = job.nb * job.bs;  // one dequantized column in w
  for (int64_t r0 = 0; r0 < job.rows; r0 += kRowTile) {
    const int64_t r1 = std::min(job.rows, r0 + kRowTile);
    for (int64_t g = n0; g < n1; g += kGroup) {
      const int cols = static_cast<int>(std::min<int64_t>(kGroup, n1 - g));
      for (int c = 0; c < cols; ++c) dequantize_column(job, g + c, w + c * stride);
      for (int64_t r = r0; r < r1; ++r) {
        const float* a = job.A + r * job.Kp;
        f32x16 acc[kGroup] = {};
        for (int64_t k = 0; k < job.Kp; k += kLanes) {
          f32x16 av, wv;
          std::memcpy(&av, a + k, sizeof av);
          for (int c = 0; c < kGroup; ++c) {  // columns past `cols`: computed, never stored
            std::memcpy(&wv, w + c * stride + k, sizeof wv);
            acc[c] += av * wv;
          }
        }
        float lanes[kGroup][kLanes];
        std::memcpy(lanes, acc, sizeof lanes);
        for (int c = 0; c < cols; ++c) job.Y[r * job.N + g + c] = lane_combine(lanes[c]);
      }
    }
  }
}

void task(void* data, size_t index) {
  const NBitsJob& job = *static_cast<const NBitsJob*>(data);
  const int64_t n0 = static_cast<int64_t>(index) * kCols;
  thread_local std::vector<float> w;  // kGroup dequantized columns, reused across calls
  w.resize(static_cast<size_t>(kGroup * job.nb * job.bs));
  columns_task(job, n0, std::min(job.N, n0 + kCols), w.data());
}

struct Q8Job {
  Q8Rows rows;
  Q8Weights w;
  float* Y;
};

// Wider tasks than the fp32 path's: each sets up its chunk table once (the split never changes the bits)
constexpr int64_t kQ8Cols = 64;

void q8_task(void* data, size_t index) {
  const Q8Job& job = *static_cast<const Q8Job*>(data);
  const int64_t n0 = static_cast<int64_t>(index) * kQ8Cols;
  q8_columns(job.rows, job.w, n0, std::min(job.w.N, n0 + kQ8Cols), job.Y);
}

// Row r's activations in fp32 (SwiGLU of [gate | up] first, with the SwiGLU op's roundings),
// padded with zeros to Kp, then quantized to int8 where q8 is set (accuracy level 4).
template <typename T>
struct RowPrep {
  const T* A;
  float* a_f;
  int64_t K, Kp;
  bool swiglu;
  Q8Rows* q8;
  int64_t bits, block_size, n_blocks;

  static void run(void* data, size_t index) {
    const RowPrep& p = *static_cast<const RowPrep*>(data);
    const int64_t r = static_cast<int64_t>(index), K = p.K;
    float* row = p.a_f + r * p.Kp;
    if (p.swiglu) {
      swiglu_row(p.A + r * 2 * K, p.A + r * 2 * K + K, row, K);
    } else {
      for (int64_t k = 0; k < K; ++k) row[k] = to_float(p.A[r * K + k]);
    }
    if (p.q8 != nullptr) q8_quantize_row(row, r, p.Kp, p.bits, p.block_size, p.n_blocks, p.q8);
  }
};

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
    std::vector<T> normed;  // the norm prologue's rows (norm_prologue_io.h), formed first
    if (call.norm.on) {
      normed.resize(static_cast<size_t>(rows * K));
      residual_norm::rows<T>(A, static_cast<const T*>(call.norm.residual), static_cast<const T*>(call.norm.weight[0]),
                             static_cast<const T*>(call.norm.weight[1]), static_cast<const T*>(call.norm.weight[2]),
                             static_cast<T*>(call.norm.sum), normed.data(), rows, K, attrs.epsilon);
      A = normed.data();
    }
    // Each row padded with zeros to a multiple of 16 (RowPrep).
    const int64_t Kp = (K + kLanes - 1) / kLanes * kLanes;
    std::vector<float> a_f(static_cast<size_t>(rows * Kp), 0.0f);
    RowPrep<T> prep{A, a_f.data(), K, Kp, attrs.swiglu, nullptr, attrs.bits, attrs.block_size, attrs.n_blocks()};
    T* Y = y.GetTensorMutableData<T>();
    std::vector<float> y_f;
    float* y_ptr = nullptr;
    if constexpr (std::is_same<T, float>::value) y_ptr = Y;
    if (y_ptr == nullptr) {
      y_f.resize(static_cast<size_t>(rows * N));
      y_ptr = y_f.data();
    }
    // Columns split over the session's intra-op threads: each output element is still computed
    // by one task in its fixed order, so threads change nothing in the bits.
    const size_t tasks = static_cast<size_t>((N + kCols - 1) / kCols);
    if (attrs.accuracy_level == 4) {
      Q8Job q8;
      q8_prepare_rows(rows, attrs.bits, attrs.block_size, attrs.n_blocks(), &q8.rows);
      prep.q8 = &q8.rows;
      // Each row's prologue and quantization on its own task: a row's bytes are its own, and a
      // verify call's rows would otherwise wait on one thread before the column split.
      if (rows > 1) {
        ctx.ParallelFor(&RowPrep<T>::run, static_cast<size_t>(rows), 0, &prep);
      } else {
        RowPrep<T>::run(&prep, 0);
      }
      q8.w = Q8Weights{call.B, call.scales, call.zero_points, call.float_zero_points, N, attrs.bits,
                       attrs.block_size, attrs.n_blocks(), attrs.zp_per_row()};
      q8.Y = y_ptr;
      ctx.ParallelFor(&q8_task, static_cast<size_t>((N + kQ8Cols - 1) / kQ8Cols), 0, &q8);
    } else {
      for (int64_t r = 0; r < rows; ++r) RowPrep<T>::run(&prep, static_cast<size_t>(r));
      NBitsJob job{a_f.data(), call.B, call.scales, call.zero_points, call.float_zero_points, y_ptr, rows, K, Kp, N,
                   attrs.bits, attrs.block_size, attrs.n_blocks(), attrs.zp_per_row()};
      ctx.ParallelFor(&task, tasks, 0, &job);
    }
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
