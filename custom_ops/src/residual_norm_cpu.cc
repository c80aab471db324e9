// ResidualRMSNorm, CPU kernel: the residual add of a sandwich layer and the RMSNorms around it,
// in one pass over each row.
//
//   b      = branch_weight ? norm(branch, branch_weight) : branch
//   s      = residual ? T(residual + b) : b
//   s      = loop_weight ? norm(s, loop_weight) : s      -> sum
//   normed = norm(s, out_weight)                         (only with out_weight)
//
// norm(v, g) = T(g * T(v * 1/sqrt(mean(v²) + eps))), fp32 math with the two roundings of the
// torch reference (normalise in fp32, round to T, scale by the weight, round again).
//
// Row invariance: a row is computed alone, and its sum of squares runs over kLanes partial sums
// combined in a fixed order that depends on H only, never on the number of rows.
#include <cmath>
#include <vector>

#include "cpu_ops.h"
#include "op_schemas.h"

namespace loopcast {
namespace {

template <typename T> inline float round_to(float v) { return to_float(from_float<T>(v)); }

// Lane j takes h ≡ j mod kLanes, h ascending; the lanes are combined pairwise in a fixed order.
// Vectorisable, unlike a single serial sum.
float sum_squares(const float* x, int64_t H) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[h + j] * x[h + j];
  for (int j = 0; h < H; ++h, ++j) lanes[j] += x[h] * x[h];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

// x <- norm(x, g), in place.
template <typename T>
void rms_norm(float* x, const T* g, int64_t H, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps);
  for (int64_t h = 0; h < H; ++h) x[h] = round_to<T>(to_float(g[h]) * round_to<T>(x[h] * inv));
}

template <typename T>
struct ResidualNormCpuKernel {
  float epsilon;
  ResidualNormCpuKernel(const OrtApi&, const OrtKernelInfo* info) : epsilon(attr_float(info, "epsilon", 1e-6f)) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ResidualNormIO io = residual_norm_io(ctx);
    const int64_t H = io.H;
    const T* branch = static_cast<const T*>(io.branch);
    const T* residual = static_cast<const T*>(io.residual);
    const T* bw = static_cast<const T*>(io.branch_weight);
    const T* lw = static_cast<const T*>(io.loop_weight);
    const T* ow = static_cast<const T*>(io.out_weight);
    T* sum = static_cast<T*>(io.sum);
    T* normed = static_cast<T*>(io.normed);
    std::vector<float> x(static_cast<size_t>(H));
    for (int64_t r = 0; r < io.rows; ++r) {
      const int64_t off = r * H;
      for (int64_t h = 0; h < H; ++h) x[h] = to_float(branch[off + h]);
      if (bw) rms_norm(x.data(), bw, H, epsilon);
      if (residual)
        for (int64_t h = 0; h < H; ++h) x[h] = round_to<T>(to_float(residual[off + h]) + x[h]);
      if (lw) rms_norm(x.data(), lw, H, epsilon);
      for (int64_t h = 0; h < H; ++h) sum[off + h] = from_float<T>(x[h]);
      if (ow) {
        rms_norm(x.data(), ow, H, epsilon);
        for (int64_t h = 0; h < H; ++h) normed[off + h] = from_float<T>(x[h]);
      }
    }
  }
};

ResidualRMSNormOp<ResidualNormCpuKernel<float>, float, false> g_f32;
ResidualRMSNormOp<ResidualNormCpuKernel<Ort::Float16_t>, Ort::Float16_t, false> g_f16;
ResidualRMSNormOp<ResidualNormCpuKernel<Ort::BFloat16_t>, Ort::BFloat16_t, false> g_bf16;

}  // namespace

void add_cpu_residual_norm(Ort::CustomOpDomain& domain) {
  domain.Add(&g_f32);
  domain.Add(&g_f16);
  domain.Add(&g_bf16);
}

}  // namespace loopcast
