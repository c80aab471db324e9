// BatchInvariantMatMulNBits: the signature and the checks shared by the CPU and CUDA registrations.
//
// Y[..., N] = A[..., K] · Wᵀ for a weight W [N, K] stored block-quantized in com.microsoft
// MatMulNBits' layout (exporter/quantize.py writes it; docs/architecture.md "Quantized weights"):
//
//   0 A            T      [..., K]  (swiglu=1: [..., 2K] = [gate | up], the product reads SwiGLU(A))
//   1 B            uint8  [N, n_blocks, block_size·bits/8]   4 bits: two values a byte, the lower k first
//   2 scales       float  [N · n_blocks] (or [N, n_blocks]); fp32 whatever T is
//   3 zero_points  uint8  [N · ceil(n_blocks·bits/8)], optional (absent: 2^(bits-1));
//                         4 bits: two blocks a byte, the lower block first;
//                  or float [N · n_blocks] (a GGUF Q4_1's −m/d; the CPU kernels only)
//   4..7 residual, branch_weight, loop_weight, norm_weight  T, optional: the norm prologue
//                         (norm_prologue_io.h); output 1 sum, optional
//   attributes K, N, bits (4 or 8), block_size (16..256, a power of two), swiglu (0/1),
//   epsilon (the norm prologue's), accuracy_level (0: fp32 activations; 4: int8 activations
//   per block on the CPU, matmul_nbits_q8_cpu.h; the CUDA kernels compute in T at every level)
//
// Every weight is (q - zero_point) · scale (level 0: dequantized in fp32, the numpy reference's
// expression) and every output element is reduced in an order fixed by (K, N, block_size) alone,
// so a row's result never depends on how many rows share the call.
#pragma once

#include <string>
#include <vector>

#include "norm_prologue_io.h"
#include "op_schemas.h"

namespace loopcast {

struct NBitsAttrs {
  int64_t K, N, bits, block_size, accuracy_level;
  bool swiglu;
  float epsilon;
  explicit NBitsAttrs(const OrtKernelInfo* info)
      : K(attr_int(info, "K", 0)),
        N(attr_int(info, "N", 0)),
        bits(attr_int(info, "bits", 4)),
        block_size(attr_int(info, "block_size", 32)),
        accuracy_level(attr_int(info, "accuracy_level", 0)),
        swiglu(attr_int(info, "swiglu", 0) != 0),
        epsilon(attr_float(info, "epsilon", 1e-6f)) {
    const std::string op = "BatchInvariantMatMulNBits: ";
    if (K <= 0 || N <= 0) fail(op + "attributes K and N must be positive, got K=" + std::to_string(K) + " N=" + std::to_string(N));
    if (bits != 4 && bits != 8) fail(op + "bits must be 4 or 8, got " + std::to_string(bits));
    if (block_size < 16 || block_size > 256 || (block_size & (block_size - 1)) != 0)
      fail(op + "block_size must be a power of two in 16..256, got " + std::to_string(block_size));
    if (accuracy_level != 0 && accuracy_level != 4)
      fail(op + "accuracy_level must be 0 (fp32 activations) or 4 (int8), got " + std::to_string(accuracy_level));
  }
  int64_t n_blocks() const { return (K + block_size - 1) / block_size; }
  int64_t blob() const { return block_size * bits / 8; }
  int64_t zp_per_row() const { return (n_blocks() * bits + 7) / 8; }
};

struct NBitsCall {
  int64_t rows = 1;
  std::vector<int64_t> y_shape;
  const void* A = nullptr;
  const uint8_t* B = nullptr;
  const float* scales = nullptr;
  const uint8_t* zero_points = nullptr;  // packed uint8; both null: symmetric
  const float* float_zero_points = nullptr;
  NormPrologueIO norm;                   // inputs 4..7, output 1
};

inline int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Checks the inputs against the attributes, allocates Y and returns the pointers of one call.
inline NBitsCall nbits_call(Ort::KernelContext& ctx, const NBitsAttrs& at, Ort::UnownedValue* y) {
  const std::string op = "BatchInvariantMatMulNBits: ";
  Ort::ConstValue a = ctx.GetInput(0), b = ctx.GetInput(1), s = ctx.GetInput(2);
  Ort::ConstValue z = ctx.GetInputCount() > 3 ? ctx.GetInput(3) : Ort::ConstValue(nullptr);
  const auto as = a.GetTensorTypeAndShapeInfo().GetShape();
  const int64_t k_in = at.swiglu ? 2 * at.K : at.K;
  if (as.empty() || as.back() != k_in)
    fail(op + (at.swiglu ? "expects A[..., 2K] (swiglu=1: gate | up) with K=" : "expects A[..., K] with K=") +
         std::to_string(at.K) + ", got A" + shape_str(as));
  const std::vector<int64_t> b_want = {at.N, at.n_blocks(), at.blob()};
  const auto bs = b.GetTensorTypeAndShapeInfo().GetShape();
  if (bs != b_want)
    fail(op + "B must be uint8 " + shape_str(b_want) + " for K=" + std::to_string(at.K) + ", N=" +
         std::to_string(at.N) + ", bits=" + std::to_string(at.bits) + ", block_size=" + std::to_string(at.block_size) +
         ", got " + shape_str(bs));
  const auto ss = s.GetTensorTypeAndShapeInfo().GetShape();
  if (numel(ss) != at.N * at.n_blocks())
    fail(op + "scales must hold N·n_blocks = " + std::to_string(at.N * at.n_blocks()) + " values, got " + shape_str(ss));
  NBitsCall c;
  if (z) {
    const auto zi = z.GetTensorTypeAndShapeInfo();
    const auto zs = zi.GetShape();
    if (zi.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      if (numel(zs) != at.N * at.n_blocks())
        fail(op + "float zero_points must hold N·n_blocks = " + std::to_string(at.N * at.n_blocks()) +
             " values, got " + shape_str(zs));
      c.float_zero_points = z.GetTensorData<float>();
    } else if (zi.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
      if (numel(zs) != at.N * at.zp_per_row())
        fail(op + "zero_points must hold N·ceil(n_blocks·bits/8) = " + std::to_string(at.N * at.zp_per_row()) +
             " bytes, got " + shape_str(zs));
      c.zero_points = z.GetTensorData<uint8_t>();
    } else {
      fail(op + "zero_points must be uint8 (packed) or float");
    }
  }
  for (size_t i = 0; i + 1 < as.size(); ++i) c.rows *= as[i];
  c.y_shape.assign(as.begin(), as.end() - 1);
  c.y_shape.push_back(at.N);
  c.norm = norm_prologue_io(ctx, 4, as, at.K, at.swiglu, "BatchInvariantMatMulNBits");
  *y = ctx.GetOutput(0, c.y_shape);
  c.A = a.GetTensorRawData();
  c.B = b.GetTensorData<uint8_t>();
  c.scales = s.GetTensorData<float>();
  return c;
}

template <typename Kernel, typename T, bool Cuda>
struct MatMulNBitsOp : Ort::CustomOpBase<MatMulNBitsOp<Kernel, T, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "BatchInvariantMatMulNBits"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return 4 + kNormPrologueInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 0 || i >= 4) return ElementType<T>::value;
    if (i == 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // uint8 or float, checked per call
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
};

}  // namespace loopcast
