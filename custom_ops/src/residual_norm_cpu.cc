// ResidualRMSNorm, CPU kernel: the residual add of a sandwich layer and the RMSNorms around it,
// in one pass over each row (the arithmetic: residual_norm_rows.h).
#include "cpu_ops.h"
#include "op_schemas.h"
#include "residual_norm_rows.h"

namespace loopcast {
namespace {

template <typename T>
struct ResidualNormCpuKernel {
  float epsilon;
  ResidualNormCpuKernel(const OrtApi&, const OrtKernelInfo* info) : epsilon(attr_float(info, "epsilon", 1e-6f)) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ResidualNormIO io = residual_norm_io(ctx);
    residual_norm::rows<T>(static_cast<const T*>(io.branch), static_cast<const T*>(io.residual),
                           static_cast<const T*>(io.branch_weight), static_cast<const T*>(io.loop_weight),
                           static_cast<const T*>(io.out_weight), static_cast<T*>(io.sum), static_cast<T*>(io.normed),
                           io.rows, io.H, epsilon);
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
