// LaneStep, CPU kernel: the lane schedule of lane_step.h on the host.
#include "cpu_ops.h"
#include "lane_step_op.h"

namespace loopcast {
namespace {

struct LaneStepCpuKernel {
  LaneStepCpuKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const LaneStepShapes s = lane_step_shapes(ctx);
    lane_step(ctx.GetInput(0).GetTensorData<int32_t>(), ctx.GetInput(1).GetTensorData<int64_t>(), s.R,
              ctx.GetOutput(0, s.state).GetTensorMutableData<int32_t>(),
              ctx.GetOutput(1, s.rows).GetTensorMutableData<int32_t>(),
              ctx.GetOutput(2, s.entering).GetTensorMutableData<int32_t>(),
              ctx.GetOutput(3, s.record).GetTensorMutableData<int32_t>());
  }
};

LaneStepOp<LaneStepCpuKernel, false> g_lane_step;

}  // namespace

void add_cpu_lane_step(Ort::CustomOpDomain& domain) { domain.Add(&g_lane_step); }

}  // namespace loopcast
