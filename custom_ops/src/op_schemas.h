// The two op signatures, shared by the CPU and CUDA registrations so both providers expose
// exactly the same inputs, outputs and types. Kernel is the per-provider implementation.
#pragma once

#include "ops_common.h"

namespace loopcast {

struct MatMulDims {
  int64_t rows = 1, K = 0, N = 0;
  std::vector<int64_t> y_shape;
};

// A[..., K] with B[K, N] (or B[N, K] when trans_b) -> Y[..., N]; rows = product of A's leading dims.
inline MatMulDims matmul_dims(const std::vector<int64_t>& a, const std::vector<int64_t>& b, bool trans_b) {
  MatMulDims d;
  d.K = b.size() == 2 ? b[trans_b ? 1 : 0] : -1;
  d.N = b.size() == 2 ? b[trans_b ? 0 : 1] : -1;
  if (a.empty() || b.size() != 2 || a.back() != d.K)
    fail(std::string("BatchInvariantMatMul: expects A[..., K] and ") + (trans_b ? "B[N, K] (trans_b=1)" : "B[K, N]") +
         ", got A" + shape_str(a) + " and B" + shape_str(b));
  for (size_t i = 0; i + 1 < a.size(); ++i) d.rows *= a[i];
  d.y_shape.assign(a.begin(), a.end() - 1);
  d.y_shape.push_back(d.N);
  return d;
}

inline const char* provider_name(bool cuda) { return cuda ? "CUDAExecutionProvider" : "CPUExecutionProvider"; }

// BatchInvariantMatMul(A[..., K], B[K, N] or B[N, K] with trans_b=1) -> Y[..., N]
template <typename Kernel, typename T, bool Cuda>
struct MatMulOp : Ort::CustomOpBase<MatMulOp<Kernel, T, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "BatchInvariantMatMul"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ElementType<T>::value; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
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

}  // namespace loopcast
