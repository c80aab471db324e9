// SwiGLU, CPU kernel: out = T(T(silu(gate)) * up) over gate_up = [gate | up], fp32 math. silu is
// rounded to T before the product, as torch's F.silu(gate) * up does in half precision.
// Elementwise, so a row never depends on the other rows of the call.
#include "cpu_ops.h"
#include "op_schemas.h"
#include "swiglu_row.h"

namespace loopcast {
namespace {

template <typename T>
struct SwiGLUCpuKernel {
  SwiGLUCpuKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue x = ctx.GetInput(0);
    const SwiGLUDims d = swiglu_dims(x.GetTensorTypeAndShapeInfo().GetShape());
    const T* in = x.GetTensorData<T>();
    T* out = ctx.GetOutput(0, d.out_shape).GetTensorMutableData<T>();
    const int64_t I = d.inter;
    for (int64_t r = 0; r < d.rows; ++r) {
      const T* gate = in + r * 2 * I;
      const T* up = gate + I;
      T* o = out + r * I;
      swiglu_row(gate, up, o, I);
    }
  }
};

SwiGLUOp<SwiGLUCpuKernel<float>, float, false> g_f32;
SwiGLUOp<SwiGLUCpuKernel<Ort::Float16_t>, Ort::Float16_t, false> g_f16;
SwiGLUOp<SwiGLUCpuKernel<Ort::BFloat16_t>, Ort::BFloat16_t, false> g_bf16;

}  // namespace

void add_cpu_swiglu(Ort::CustomOpDomain& domain) {
  domain.Add(&g_f32);
  domain.Add(&g_f16);
  domain.Add(&g_bf16);
}

}  // namespace loopcast
