// BatchInvariantMatMul, CPU kernel.
//
// Y = A·B (B[K, N]) or, with trans_b=1, Y = A·Bᵀ (B[N, K], e.g. a tied lm_head reading the
// embedding [V, H] in place), fp32 accumulation. Every output element is reduced in an order
// fixed by (k, K) alone whatever the number of rows, so a row's result does not depend on how
// many rows share the call (stock GEMMs pick different kernels and blockings for M = 1 and
// M = W). The weights are read once per call for all rows, as in a GEMV. swiglu=1: A is
// [gate | up] and its SwiGLU (the SwiGLU op's values) is formed first, then multiplied. With
// norm_weight (norm_prologue_io.h) A is ResidualRMSNorm's branch: the op's normed rows
// (residual_norm_rows.h) are formed first, then multiplied.
#include <algorithm>
#include <vector>

#include "cpu_ops.h"
#include "norm_prologue_io.h"
#include "op_schemas.h"
#include "residual_norm_rows.h"
#include "swiglu_row.h"

namespace loopcast {
namespace {

template <typename T>
struct MatMulCpuKernel {
  MatMulAttrs attrs;
  MatMulCpuKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue a = ctx.GetInput(0), b = ctx.GetInput(1);
    const MatMulDims dims = attrs.dims(a, b);
    const int64_t rows = dims.rows, K = dims.K, N = dims.N;
    const NormPrologueIO norm =
        norm_prologue_io(ctx, 2, a.GetTensorTypeAndShapeInfo().GetShape(), K, attrs.swiglu, "BatchInvariantMatMul");
    Ort::UnownedValue y = ctx.GetOutput(0, dims.y_shape);
    const T* A = a.GetTensorData<T>();
    std::vector<T> act;
    if (norm.on) {
      act.resize(static_cast<size_t>(rows * K));
      residual_norm::rows<T>(A, static_cast<const T*>(norm.residual), static_cast<const T*>(norm.weight[0]),
                             static_cast<const T*>(norm.weight[1]), static_cast<const T*>(norm.weight[2]),
                             static_cast<T*>(norm.sum), act.data(), rows, K, attrs.epsilon);
      A = act.data();
    } else if (attrs.swiglu) {
      act.resize(static_cast<size_t>(rows * K));
      for (int64_t r = 0; r < rows; ++r)
        swiglu_row(A + r * 2 * K, A + r * 2 * K + K, act.data() + r * K, K);
      A = act.data();
    }
    const T* B = b.GetTensorData<T>();
    T* Y = y.GetTensorMutableData<T>();
    // Work is split over output columns through the session's intra-op thread pool; every
    // output element is still computed by one task in its fixed order, so threads change
    // nothing in the bits.
    Job job{A, B, Y, rows, K, N, {}};
    if (attrs.trans_b) {
      job.a_f.resize(static_cast<size_t>(rows * K));
      for (int64_t i = 0; i < rows * K; ++i) job.a_f[i] = to_float(A[i]);
      ctx.ParallelFor(&trans_task, static_cast<size_t>((N + kTransChunk - 1) / kTransChunk), 0, &job);
    } else {
      ctx.ParallelFor(&block_task, static_cast<size_t>((N + kBlock - 1) / kBlock), 0, &job);
    }
  }

  static constexpr int64_t kBlock = 512;      // columns per task (an L1-sized accumulator per row)
  static constexpr int64_t kTransChunk = 64;  // outputs per task for trans_b

  struct Job {
    const T* A;
    const T* B;
    T* Y;
    int64_t rows, K, N;
    std::vector<float> a_f;  // trans_b: A converted once
  };

  // acc[r][n] += A[r,k] * B[k,n] for k ascending over one column block: each weight block is
  // read once for all rows, and every element's order is k ascending.
  static void block_task(void* data, size_t index) {
    const Job& job = *static_cast<const Job*>(data);
    const int64_t n0 = static_cast<int64_t>(index) * kBlock;
    const int64_t width = std::min(kBlock, job.N - n0);
    std::vector<float> acc(static_cast<size_t>(job.rows * kBlock), 0.0f);
    std::vector<float> b_f(static_cast<size_t>(kBlock));
    for (int64_t k = 0; k < job.K; ++k) {
      const T* b_row = job.B + k * job.N + n0;
      for (int64_t n = 0; n < width; ++n) b_f[n] = to_float(b_row[n]);
      for (int64_t r = 0; r < job.rows; ++r) {
        const float a_rk = to_float(job.A[r * job.K + k]);
        float* acc_r = acc.data() + r * kBlock;
        for (int64_t n = 0; n < width; ++n) acc_r[n] += a_rk * b_f[n];
      }
    }
    for (int64_t r = 0; r < job.rows; ++r)
      for (int64_t n = 0; n < width; ++n) job.Y[r * job.N + n0 + n] = from_float<T>(acc[r * kBlock + n]);
  }

  // trans_b: each weight row is read once for all rows. A dot product keeps kLanes partial
  // sums (lane j takes k ≡ j mod kLanes, k ascending) combined in one fixed order:
  // vectorisable, and the order depends on (k, K) only, never on the number of rows.
  static void trans_task(void* data, size_t index) {
    const Job& job = *static_cast<const Job*>(data);
    const int64_t n0 = static_cast<int64_t>(index) * kTransChunk;
    const int64_t n1 = std::min(job.N, n0 + kTransChunk);
    std::vector<float> b_f(static_cast<size_t>(job.K));
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < job.K; ++k) b_f[k] = to_float(job.B[n * job.K + k]);
      for (int64_t r = 0; r < job.rows; ++r)
        job.Y[r * job.N + n] = from_float<T>(lane_dot(job.a_f.data() + r * job.K, b_f.data(), job.K));
    }
  }

  static float lane_dot(const float* a, const float* b, int64_t K) {
    constexpr int kLanes = 16;
    float lanes[kLanes] = {};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes)
      for (int j = 0; j < kLanes; ++j) lanes[j] += a[k + j] * b[k + j];
    for (int j = 0; k < K; ++k, ++j) lanes[j] += a[k] * b[k];
    for (int width = kLanes / 2; width > 0; width /= 2)  // fixed pairwise combine
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    return lanes[0];
  }
};

MatMulOp<MatMulCpuKernel<float>, float, false> g_f32;
MatMulOp<MatMulCpuKernel<Ort::Float16_t>, Ort::Float16_t, false> g_f16;
MatMulOp<MatMulCpuKernel<Ort::BFloat16_t>, Ort::BFloat16_t, false> g_bf16;

}  // namespace

void add_cpu_matmul(Ort::CustomOpDomain& domain) {
  domain.Add(&g_f32);
  domain.Add(&g_f16);
  domain.Add(&g_bf16);
}

}  // namespace loopcast
