// Shared by the CPU kernels and the op registrations: element types, fp32 conversions and
// attribute reading. No CUDA here, so the CPU-only build needs only the ORT headers.
#pragma once

#include "ort_api.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace loopcast {

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

// Dtype codes shared with the CUDA launchers (which cannot see the ORT types).
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kF32; };
template <> struct DTypeOf<Ort::Float16_t> { static constexpr DType value = DType::kF16; };
template <> struct DTypeOf<Ort::BFloat16_t> { static constexpr DType value = DType::kBF16; };

// Optional attributes: the C++ getter throws when an attribute is absent, so go through the C
// API and fall back to the schema default.
inline int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t v = 0;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return fallback;
  }
  return v;
}

inline float attr_float(const OrtKernelInfo* info, const char* name, float fallback) {
  float v = 0.0f;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return fallback;
  }
  return v;
}

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

[[noreturn]] inline void fail(std::string message) {
  throw Ort::Exception(std::move(message), ORT_INVALID_ARGUMENT);
}

}  // namespace loopcast
