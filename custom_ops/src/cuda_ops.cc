// The CUDA execution provider's BatchInvariantMatMul, BatchInvariantAttention, ResidualRMSNorm and
// SwiGLU: shape checks on the host, then one call into the CUDA launchers on ORT's compute stream.
// Inputs stay on the device (seqlens_k too: the kernels read it there), and Compute neither
// allocates nor syncs, so the ops can run inside captured CUDA graphs.
#include <algorithm>
#include <string>
#include <vector>

#include "attention_shapes.h"
#include "cuda_launch.h"
#include "cuda_ops.h"
#include "op_schemas.h"

namespace loopcast {
namespace {

void check_launch(int code, const char* op) {
  if (code != 0)
    fail(std::string(op) + " (CUDA): kernel launch failed: " + loopcast_cuda_error_string(code));
}

template <typename T>
struct MatMulCudaKernel {
  MatMulAttrs attrs;
  MatMulCudaKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue a = ctx.GetInput(0), b = ctx.GetInput(1);
    const MatMulDims dims = attrs.dims(a, b);
    Ort::UnownedValue y = ctx.GetOutput(0, dims.y_shape);
    if (dims.rows == 0 || dims.N == 0) return;
    auto launch = attrs.swiglu ? loopcast_cuda_swiglu_matmul : loopcast_cuda_matmul;
    check_launch(launch(static_cast<int>(DTypeOf<T>::value), a.GetTensorRawData(), b.GetTensorRawData(),
                        y.GetTensorMutableRawData(), dims.rows, dims.K, dims.N, attrs.trans_b ? 1 : 0,
                        ctx.GetGPUComputeStream()),
                 "BatchInvariantMatMul");
  }
};

template <typename T>
struct AttentionCudaKernel {
  AttentionAttrs attrs;
  AttentionCudaKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const AttentionShapes s = attention_shapes(ctx, attrs);
    if (s.D != 16 && s.D != 32 && s.D != 64 && s.D != 128)
      fail("BatchInvariantAttention (CUDA): head_dim must be 16, 32, 64 or 128, got " + std::to_string(s.D));
    if (s.T > kLoopcastMaxCudaCapacity)
      fail("BatchInvariantAttention (CUDA): cache capacity " + std::to_string(s.T) + " exceeds " +
           std::to_string(kLoopcastMaxCudaCapacity));
    const void* cos = attrs.do_rotary ? ctx.GetInput(7).GetTensorRawData() : nullptr;
    const void* sin = attrs.do_rotary ? ctx.GetInput(8).GetTensorRawData() : nullptr;
    const int64_t rotary_len = attrs.do_rotary ? ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetShape()[0] : s.T;
    Ort::UnownedValue out = ctx.GetOutput(0, {s.B, s.S, attrs.num_heads * s.D});
    Ort::UnownedValue pk = ctx.GetOutput(1, s.past_shape);
    Ort::UnownedValue pv = ctx.GetOutput(2, s.past_shape);
    check_launch(loopcast_cuda_attention(
                     static_cast<int>(DTypeOf<T>::value), ctx.GetInput(0).GetTensorRawData(),
                     ctx.GetInput(3).GetTensorRawData(), ctx.GetInput(4).GetTensorRawData(),
                     pk.GetTensorMutableRawData(), pv.GetTensorMutableRawData(),
                     ctx.GetInput(5).GetTensorData<int32_t>(), cos, sin, out.GetTensorMutableRawData(),
                     static_cast<int>(s.B), static_cast<int>(s.S), static_cast<int>(attrs.num_heads),
                     static_cast<int>(attrs.kv_num_heads), static_cast<int>(s.D), static_cast<int>(s.T),
                     static_cast<int>(std::min<int64_t>(rotary_len, 1 << 30)), s.scale, attrs.do_rotary ? 1 : 0,
                     ctx.GetGPUComputeStream()),
                 "BatchInvariantAttention");
  }
};

template <typename T>
struct ResidualNormCudaKernel {
  float epsilon;
  ResidualNormCudaKernel(const OrtApi&, const OrtKernelInfo* info) : epsilon(attr_float(info, "epsilon", 1e-6f)) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ResidualNormIO io = residual_norm_io(ctx);
    if (io.H > kLoopcastMaxNormHidden)
      fail("ResidualRMSNorm (CUDA): hidden size " + std::to_string(io.H) + " exceeds " +
           std::to_string(kLoopcastMaxNormHidden));
    if (io.rows == 0 || io.H == 0) return;
    check_launch(loopcast_cuda_residual_rms_norm(static_cast<int>(DTypeOf<T>::value), io.branch, io.residual,
                                                 io.branch_weight, io.loop_weight, io.out_weight, io.sum, io.normed,
                                                 io.rows, io.H, epsilon, ctx.GetGPUComputeStream()),
                 "ResidualRMSNorm");
  }
};

template <typename T>
struct SwiGLUCudaKernel {
  SwiGLUCudaKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue x = ctx.GetInput(0);
    const SwiGLUDims d = swiglu_dims(x.GetTensorTypeAndShapeInfo().GetShape());
    Ort::UnownedValue y = ctx.GetOutput(0, d.out_shape);
    if (d.rows == 0 || d.inter == 0) return;
    check_launch(loopcast_cuda_swiglu(static_cast<int>(DTypeOf<T>::value), x.GetTensorRawData(),
                                      y.GetTensorMutableRawData(), d.rows, d.inter, ctx.GetGPUComputeStream()),
                 "SwiGLU");
  }
};

MatMulOp<MatMulCudaKernel<float>, float, true> g_mm_f32;
MatMulOp<MatMulCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_mm_f16;
MatMulOp<MatMulCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_mm_bf16;
AttentionOp<AttentionCudaKernel<float>, float, true> g_at_f32;
AttentionOp<AttentionCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_at_f16;
AttentionOp<AttentionCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_at_bf16;
ResidualRMSNormOp<ResidualNormCudaKernel<float>, float, true> g_rn_f32;
ResidualRMSNormOp<ResidualNormCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_rn_f16;
ResidualRMSNormOp<ResidualNormCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_rn_bf16;
SwiGLUOp<SwiGLUCudaKernel<float>, float, true> g_sg_f32;
SwiGLUOp<SwiGLUCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_sg_f16;
SwiGLUOp<SwiGLUCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_sg_bf16;

}  // namespace

void add_cuda_ops(Ort::CustomOpDomain& domain) {
  for (OrtCustomOp* op : std::vector<OrtCustomOp*>{&g_mm_f32, &g_mm_f16, &g_mm_bf16, &g_at_f32, &g_at_f16, &g_at_bf16,
                                                   &g_rn_f32, &g_rn_f16, &g_rn_bf16, &g_sg_f32, &g_sg_f16, &g_sg_bf16})
    domain.Add(op);
}

}  // namespace loopcast
