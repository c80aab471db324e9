// The norm prologue of BatchInvariantMatMul and BatchInvariantMatMulNBits (CPU and CUDA): four
// optional inputs from `first`, in ResidualRMSNorm's order, and the optional output 1,
//
//   first + 0 residual       T [..., K]   (A's shape)
//   first + 1 branch_weight  T [K]
//   first + 2 loop_weight    T [K]
//   first + 3 norm_weight    T [K]        present: the prologue is on
//   output 1  sum            T [..., K]   ResidualRMSNorm's output 0
//
// With norm_weight the op reads A as ResidualRMSNorm's branch and multiplies its normed output
// (ResidualRMSNorm(A, residual, branch_weight, loop_weight, norm_weight) output 1) by the weight,
// bit for bit the two ops in sequence on the same provider; the attribute epsilon is the norm's.
#pragma once

#include <string>
#include <vector>

#include "op_schemas.h"

namespace loopcast {

constexpr size_t kNormPrologueInputs = 4;

struct NormPrologueIO {
  bool on = false;
  const void* residual = nullptr;
  const void* weight[3] = {nullptr, nullptr, nullptr};  // branch, loop, norm
  void* sum = nullptr;                                  // null: output 1 not requested
};

// Checks the prologue's inputs against A [..., K] and allocates output 1 when requested.
inline NormPrologueIO norm_prologue_io(Ort::KernelContext& ctx, size_t first, const std::vector<int64_t>& a_shape,
                                       int64_t K, bool swiglu, const std::string& op) {
  static const char* names[4] = {"residual", "branch_weight", "loop_weight", "norm_weight"};
  NormPrologueIO io;
  Ort::ConstValue in[4] = {optional_input(ctx, first), optional_input(ctx, first + 1),
                           optional_input(ctx, first + 2), optional_input(ctx, first + 3)};
  io.on = static_cast<bool>(in[3]);
  Ort::UnownedValue sum = ctx.GetOutputCount() > 1 ? ctx.GetOutput(1, a_shape) : Ort::UnownedValue(nullptr);
  if (!io.on) {
    for (size_t i = 0; i < 3; ++i)
      if (in[i])
        fail(op + ": input " + std::to_string(first + i) + " (" + names[i] + ") is given without input " +
             std::to_string(first + 3) + " (norm_weight), which turns the norm prologue on");
    if (sum) fail(op + ": output 1 (sum) is requested without input " + std::to_string(first + 3) + " (norm_weight)");
    return io;
  }
  if (swiglu) fail(op + ": swiglu=1 and the norm prologue (norm_weight) do not combine");
  if (in[0]) {
    const auto rs = in[0].GetTensorTypeAndShapeInfo().GetShape();
    if (rs != a_shape)
      fail(op + ": residual " + shape_str(rs) + " must have A's shape " + shape_str(a_shape));
    io.residual = in[0].GetTensorRawData();
  }
  for (size_t i = 1; i < 4; ++i) {
    if (!in[i]) continue;
    const auto ws = in[i].GetTensorTypeAndShapeInfo().GetShape();
    if (ws.size() != 1 || ws[0] != K)
      fail(op + ": " + names[i] + " must be [K] = [" + std::to_string(K) + "], got " + shape_str(ws));
    io.weight[i - 1] = in[i].GetTensorRawData();
  }
  if (sum) io.sum = sum.GetTensorMutableRawData();
  return io;
}

}  // namespace loopcast
