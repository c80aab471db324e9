// BatchInvariantMatMul, CPU kernel.
//
// Y = A·B (B[K, N]) or, with trans_b=1, Y = A·Bᵀ (B[N, K], e.g. a tied lm_head reading the
// embedding [V, H] in place), fp32 accumulation. Every output element is reduced over
// k = 0..K-1 in ascending order whatever the number of rows, so a row's result does not depend on
// how many rows share the call (stock GEMMs pick different kernels and blockings for M = 1 and
// M = W).
#include <algorithm>
#include <vector>

#include "cpu_ops.h"
#include "op_schemas.h"

namespace loopcast {
namespace {

template <typename T>
struct MatMulCpuKernel {
  bool trans_b;
  MatMulCpuKernel(const OrtApi&, const OrtKernelInfo* info) : trans_b(attr_int(info, "trans_b", 0) != 0) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue a = ctx.GetInput(0), b = ctx.GetInput(1);
    const MatMulDims dims = matmul_dims(a.GetTensorTypeAndShapeInfo().GetShape(),
                                        b.GetTensorTypeAndShapeInfo().GetShape(), trans_b);
    const int64_t rows = dims.rows, K = dims.K, N = dims.N;
    Ort::UnownedValue y = ctx.GetOutput(0, dims.y_shape);
    const T* A = a.GetTensorData<T>();
    const T* B = b.GetTensorData<T>();
    T* Y = y.GetTensorMutableData<T>();
    std::vector<float> acc(static_cast<size_t>(N));
    for (int64_t r = 0; r < rows; ++r) {
      const T* a_row = A + r * K;
      if (trans_b) {
        // One serial dot product per output, k ascending.
        for (int64_t n = 0; n < N; ++n) {
          const T* b_row = B + n * K;
          float s = 0.0f;
          for (int64_t k = 0; k < K; ++k) s += to_float(a_row[k]) * to_float(b_row[k]);
          acc[n] = s;
        }
      } else {
        // acc[n] += A[r,k] * B[k,n] for k ascending: the same order per element as above, and B
        // is read row by row (contiguous), which vectorises over n without reassociating k.
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < K; ++k) {
          const float a_rk = to_float(a_row[k]);
          const T* b_row = B + k * N;
          for (int64_t n = 0; n < N; ++n) acc[n] += a_rk * to_float(b_row[n]);
        }
      }
      for (int64_t n = 0; n < N; ++n) Y[r * N + n] = from_float<T>(acc[n]);
    }
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
