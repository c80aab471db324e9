// LaneStep's ORT signature and checks, shared by the CPU and CUDA registrations (the rule itself
// is lane_step.h).
#pragma once

#include <string>
#include <vector>

#include "lane_step.h"
#include "op_schemas.h"

namespace loopcast {

struct LaneStepShapes {
  int R = 0;
  std::vector<int64_t> state, rows, entering, record;
};

inline LaneStepShapes lane_step_shapes(Ort::KernelContext& ctx) {
  const std::string op = "LaneStep: ";
  const auto ids = ctx.GetInput(1).GetTensorTypeAndShapeInfo().GetShape();
  if (ids.size() != 2 || ids[0] != 1 || ids[1] < 2 || ids[1] > kLaneStepMaxRows)
    fail(op + "ids must be [1, R] with 2 <= R <= " + std::to_string(kLaneStepMaxRows) + ", got " + shape_str(ids));
  LaneStepShapes s;
  s.R = static_cast<int>(ids[1]);
  s.state = {2 * ids[1] + 2};
  const auto state = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape();
  if (state != s.state)
    fail(op + "state must be int32 [2R+2] = " + shape_str(s.state) + " for R = " + std::to_string(s.R) + ", got " +
         shape_str(state));
  s.rows = {ids[1]};
  s.entering = {1, 1};
  s.record = {2 * ids[1] + kLaneRecordExtra};
  return s;
}

// LaneStep(state int32 [2R+2], ids int64 [1, R]) -> state_out, positions, entering, record (lane_step.h).
template <typename Kernel, bool Cuda>
struct LaneStepOp : Ort::CustomOpBase<LaneStepOp<Kernel, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "LaneStep"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  }
  size_t GetOutputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32; }
};

}  // namespace loopcast
