// The op signatures, shared by the CPU and CUDA registrations so both providers expose exactly
// the same inputs, outputs and types, and the checks both kernels run before computing. Kernel is
// the per-provider implementation.
#pragma once

#include "ops_common.h"

namespace loopcast {

struct MatMulDims {
  int64_t rows = 1, K = 0, N = 0;
  std::vector<int64_t> y_shape;
};

// A[..., K] with B[K, N] (or B[N, K] when trans_b) -> Y[..., N]; rows = product of A's leading dims.
// swiglu: A is [..., 2K] = [gate | up] and the product reads T(T(silu(gate))·up) in its place (the
// MLP's activation applied as the down projection loads its input: no separate kernel).
inline MatMulDims matmul_dims(const std::vector<int64_t>& a, const std::vector<int64_t>& b, bool trans_b,
                              bool swiglu = false) {
  MatMulDims d;
  d.K = b.size() == 2 ? b[trans_b ? 1 : 0] : -1;
  d.N = b.size() == 2 ? b[trans_b ? 0 : 1] : -1;
  if (a.empty() || b.size() != 2 || a.back() != (swiglu ? 2 * d.K : d.K))
    fail(std::string("BatchInvariantMatMul: expects ") + (swiglu ? "A[..., 2K] (swiglu=1: gate | up)" : "A[..., K]") +
         " and " + (trans_b ? "B[N, K] (trans_b=1)" : "B[K, N]") + ", got A" + shape_str(a) + " and B" + shape_str(b));
  for (size_t i = 0; i + 1 < a.size(); ++i) d.rows *= a[i];
  d.y_shape.assign(a.begin(), a.end() - 1);
  d.y_shape.push_back(d.N);
  return d;
}

// BatchInvariantMatMul's attributes, read once per kernel, and the shapes of one call (CPU and CUDA).
struct MatMulAttrs {
  bool trans_b, swiglu;
  float epsilon;  // the norm prologue's (norm_prologue_io.h)
  explicit MatMulAttrs(const OrtKernelInfo* info)
      : trans_b(attr_int(info, "trans_b", 0) != 0),
        swiglu(attr_int(info, "swiglu", 0) != 0),
        epsilon(attr_float(info, "epsilon", 1e-6f)) {}
  MatMulDims dims(const Ort::ConstValue& a, const Ort::ConstValue& b) const {
    return matmul_dims(a.GetTensorTypeAndShapeInfo().GetShape(), b.GetTensorTypeAndShapeInfo().GetShape(), trans_b,
                       swiglu);
  }
};

inline const char* provider_name(bool cuda) { return cuda ? "CUDAExecutionProvider" : "CPUExecutionProvider"; }

// BatchInvariantMatMul(A[..., K], B[K, N] or B[N, K] with trans_b=1, residual?, branch_weight?,
// loop_weight?, norm_weight?) -> Y[..., N], sum?; with swiglu=1 A is [..., 2K] and the op computes
// SwiGLU(A)·B; with norm_weight, the norm prologue (norm_prologue_io.h).
template <typename Kernel, typename T, bool Cuda>
struct MatMulOp : Ort::CustomOpBase<MatMulOp<Kernel, T, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "BatchInvariantMatMul"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ElementType<T>::value; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 2 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
};

// BatchInvariantAttention: the packed-QKV form of com.microsoft.GroupQueryAttention that our
// graphs use. Inputs 0 query, 1 key (absent), 2 value (absent), 3 past_key, 4 past_value,
// 5 seqlens_k, 6 total_sequence_length, 7 cos_cache, 8 sin_cache.
// Outputs 0 output, 1 present_key, 2 present_value.
template <typename Kernel, typename T, bool Cuda>
struct AttentionOp : Ort::CustomOpBase<AttentionOp<Kernel, T, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "BatchInvariantAttention"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return 9; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i == 5 || i == 6) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ElementType<T>::value;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return (i == 1 || i == 2) ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                              : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
};

// ResidualRMSNorm(branch, residual?, branch_weight?, loop_weight?, out_weight?) -> sum, normed?
// Inputs 1..4 are optional (no residual: sum = the branch, which makes the op a plain RMSNorm
// that rounds exactly like the fused ones); output 1 exists iff out_weight does (checked per call).
template <typename Kernel, typename T, bool Cuda>
struct ResidualRMSNormOp : Ort::CustomOpBase<ResidualRMSNormOp<Kernel, T, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "ResidualRMSNorm"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ElementType<T>::value; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
};

// One ResidualRMSNorm call: rows of H elements and raw data pointers (host or device memory, as
// the provider placed them). Absent weights and an absent normed output are null.
struct ResidualNormIO {
  int64_t rows = 1, H = 0;
  const void* branch = nullptr;
  const void* residual = nullptr;  // null: no residual add
  const void* branch_weight = nullptr;
  const void* loop_weight = nullptr;
  const void* out_weight = nullptr;
  void* sum = nullptr;
  void* normed = nullptr;
};

// An omitted trailing input (a node with fewer inputs) and a "" input both read as absent.
inline Ort::ConstValue optional_input(Ort::KernelContext& ctx, size_t i) {
  return i < ctx.GetInputCount() ? ctx.GetInput(i) : Ort::ConstValue(nullptr);
}

// Checks the shapes and the optional-output rule, allocates the outputs and returns the pointers.
inline ResidualNormIO residual_norm_io(Ort::KernelContext& ctx) {
  const std::string op = "ResidualRMSNorm: ";
  Ort::ConstValue branch = ctx.GetInput(0), residual = optional_input(ctx, 1);
  const auto shape = branch.GetTensorTypeAndShapeInfo().GetShape();
  if (shape.empty()) fail(op + "branch must be [..., H], got a scalar");
  ResidualNormIO io;
  if (residual) {
    const auto res_shape = residual.GetTensorTypeAndShapeInfo().GetShape();
    if (res_shape != shape)
      fail(op + "branch " + shape_str(shape) + " and residual " + shape_str(res_shape) + " must have the same shape");
    io.residual = residual.GetTensorRawData();
  }
  io.H = shape.back();
  io.branch = branch.GetTensorRawData();
  for (size_t i = 0; i + 1 < shape.size(); ++i) io.rows *= shape[i];
  const char* names[3] = {"branch_weight", "loop_weight", "out_weight"};
  const void** weights[3] = {&io.branch_weight, &io.loop_weight, &io.out_weight};
  for (size_t k = 0; k < 3; ++k) {
    Ort::ConstValue w = optional_input(ctx, 2 + k);
    if (!w) continue;
    const auto ws = w.GetTensorTypeAndShapeInfo().GetShape();
    if (ws.size() != 1 || ws[0] != io.H)
      fail(op + names[k] + " must be [H] = [" + std::to_string(io.H) + "] for branch " + shape_str(shape) +
           ", got " + shape_str(ws));
    *weights[k] = w.GetTensorRawData();
  }
  // Output 1 is absent when the node lists one output or names it "" (GetOutput gives null).
  Ort::UnownedValue normed = ctx.GetOutputCount() > 1 ? ctx.GetOutput(1, shape) : Ort::UnownedValue(nullptr);
  if (io.out_weight != nullptr && !normed)
    fail(op + "input 4 (out_weight) is given but output 1 (normed) is absent: declare the output or drop the weight");
  if (io.out_weight == nullptr && normed)
    fail(op + "output 1 (normed) is requested but input 4 (out_weight) is absent");
  io.sum = ctx.GetOutput(0, shape).GetTensorMutableRawData();
  if (normed) io.normed = normed.GetTensorMutableRawData();
  return io;
}

// SwiGLU(gate_up[..., 2I]) -> out[..., I]: gate = columns 0..I-1, up = columns I..2I-1.
template <typename Kernel, typename T, bool Cuda>
struct SwiGLUOp : Ort::CustomOpBase<SwiGLUOp<Kernel, T, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "SwiGLU"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ElementType<T>::value; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
};

struct SwiGLUDims {
  int64_t rows = 1, inter = 0;  // inter = I, half the input's last dim
  std::vector<int64_t> out_shape;
};

inline SwiGLUDims swiglu_dims(const std::vector<int64_t>& x) {
  if (x.empty() || x.back() % 2 != 0)
    fail("SwiGLU: gate_up must be [..., 2*I] (gate | up) with an even last dim, got " + shape_str(x));
  SwiGLUDims d;
  d.inter = x.back() / 2;
  for (size_t i = 0; i + 1 < x.size(); ++i) d.rows *= x[i];
  d.out_shape = x;
  d.out_shape.back() = d.inter;
  return d;
}

}  // namespace loopcast
