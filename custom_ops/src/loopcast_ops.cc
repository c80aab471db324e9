// loopcast custom-op library (op domain "loopcast"), CPU kernels.
//
// BatchInvariantMatMul(A[..., K], B[K, N]) -> Y[..., N] for fp32, fp16 and bf16 with fp32
// accumulation. Every output element is reduced over k = 0..K-1 in the same order whatever
// the number of rows, so a row's result does not depend on how many rows share the call
// (stock GEMMs pick different kernels and blockings for M = 1 and M = W).
//
// Loaded by Python (SessionOptions.register_custom_ops_library) and C programs
// (RegisterCustomOpsLibrary_V2) through RegisterCustomOps below.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <mutex>
#include <vector>

namespace {

template <typename T> inline float to_float(T v) { return static_cast<float>(v); }
template <> inline float to_float(Ort::Float16_t v) { return v.ToFloat(); }
template <> inline float to_float(Ort::BFloat16_t v) { return v.ToFloat(); }
template <typename T> inline T from_float(float v) { return static_cast<T>(v); }
template <> inline Ort::Float16_t from_float(float v) { return Ort::Float16_t(v); }
template <> inline Ort::BFloat16_t from_float(float v) { return Ort::BFloat16_t(v); }

template <typename T> struct ElementType;
template <> struct ElementType<float> { static constexpr auto value = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
template <> struct ElementType<Ort::Float16_t> { static constexpr auto value = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16; };
template <> struct ElementType<Ort::BFloat16_t> { static constexpr auto value = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16; };

template <typename T>
struct BatchInvariantMatMulKernel {
  BatchInvariantMatMulKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue a = ctx.GetInput(0), b = ctx.GetInput(1);
    std::vector<int64_t> a_shape = a.GetTensorTypeAndShapeInfo().GetShape();
    std::vector<int64_t> b_shape = b.GetTensorTypeAndShapeInfo().GetShape();
    if (a_shape.empty() || b_shape.size() != 2 || a_shape.back() != b_shape[0])
      ORT_CXX_API_THROW("BatchInvariantMatMul: expects A[..., K] and B[K, N]", ORT_INVALID_ARGUMENT);
    const int64_t K = b_shape[0], N = b_shape[1];
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < a_shape.size(); ++i) rows *= a_shape[i];
    std::vector<int64_t> y_shape(a_shape.begin(), a_shape.end() - 1);
    y_shape.push_back(N);
    Ort::UnownedValue y = ctx.GetOutput(0, y_shape);
    const T* A = a.GetTensorData<T>();
    const T* B = b.GetTensorData<T>();
    T* Y = y.GetTensorMutableData<T>();
    std::vector<float> acc(static_cast<size_t>(N));
    for (int64_t r = 0; r < rows; ++r) {
      // acc[n] += A[r,k] * B[k,n] for k ascending: one fixed order per element, and B is
      // read row by row (contiguous), which vectorises over n without reassociating k.
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float a_rk = to_float(A[r * K + k]);
        const T* b_row = B + k * N;
        for (int64_t n = 0; n < N; ++n) acc[n] += a_rk * to_float(b_row[n]);
      }
      for (int64_t n = 0; n < N; ++n) Y[r * N + n] = from_float<T>(acc[n]);
    }
  }
};

template <typename T>
struct BatchInvariantMatMulOp : Ort::CustomOpBase<BatchInvariantMatMulOp<T>, BatchInvariantMatMulKernel<T>> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    return new BatchInvariantMatMulKernel<T>(api, info);
  }
  const char* GetName() const { return "BatchInvariantMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ElementType<T>::value; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
};

BatchInvariantMatMulOp<float> g_matmul_f32;
BatchInvariantMatMulOp<Ort::Float16_t> g_matmul_f16;
BatchInvariantMatMulOp<Ort::BFloat16_t> g_matmul_bf16;
std::once_flag g_once;
Ort::CustomOpDomain* g_domain = nullptr;  // lives as long as the library: sessions reference it

}  // namespace

extern "C" ORT_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                 const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    std::call_once(g_once, [] {
      g_domain = new Ort::CustomOpDomain("loopcast");
      g_domain->Add(&g_matmul_f32);
      g_domain->Add(&g_matmul_f16);
      g_domain->Add(&g_matmul_bf16);
    });
    Ort::UnownedSessionOptions(options).Add(*g_domain);
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
