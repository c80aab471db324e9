// loopcast custom-op library (op domain "loopcast"): the registry.
//
//   BatchInvariantMatMul     matmul_cpu.cc, matmul_cuda.cu                rows independent of M;
//                                                                         swiglu=1 reads [gate | up]
//   BatchInvariantAttention  attention_cpu.cc, attention_cuda.cu          rows independent of S
//   RowAttention             row_attention_cpu.cc, cuda_ops.cc            per-row (buffer, sequence, position)
//   ResidualRMSNorm          residual_norm_cpu.cc, residual_norm_cuda.cu  residual add + RMSNorms, per row
//   SwiGLU                   swiglu_cpu.cc, swiglu_cuda.cu                silu(gate) * up, elementwise
//   LaneStep                 lane_step_cpu.cc, lane_step_cuda.cu          the pipeline's lane schedule
//   BatchInvariantMatMulNBits matmul_nbits_cpu.cc, matmul_nbits_cuda.cu   int4/int8 weights (MatMulNBits
//                                                                         layout), rows independent of M
//
// CPU kernels are always built; CUDA kernels only with LOOPCAST_WITH_CUDA (custom_ops/build.py
// defines it when nvcc is found). cudart is linked statically and nothing calls CUDA before a
// CUDA kernel runs, so a CUDA build still loads in a CPU-only ONNX Runtime on a machine without
// a GPU. Loaded by Python (SessionOptions.register_custom_ops_library) and C programs
// (RegisterCustomOpsLibrary_V2) through RegisterCustomOps below.
#include "ort_api.h"

#include <mutex>

#include "cpu_ops.h"
#ifdef LOOPCAST_WITH_CUDA
#include "cuda_ops.h"
#endif

namespace {
std::once_flag g_once;
Ort::CustomOpDomain* g_domain = nullptr;  // lives as long as the library: sessions reference it
}  // namespace

// 1 when this build carries CUDA kernels (read with ctypes by custom_ops/build.py).
extern "C" ORT_EXPORT int loopcast_ops_has_cuda() {
#ifdef LOOPCAST_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

extern "C" ORT_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                 const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  try {
    std::call_once(g_once, [] {
      g_domain = new Ort::CustomOpDomain("loopcast");
      loopcast::add_cpu_matmul(*g_domain);
      loopcast::add_cpu_attention(*g_domain);
      loopcast::add_cpu_row_attention(*g_domain);
      loopcast::add_cpu_residual_norm(*g_domain);
      loopcast::add_cpu_swiglu(*g_domain);
      loopcast::add_cpu_lane_step(*g_domain);
      loopcast::add_cpu_matmul_nbits(*g_domain);
#ifdef LOOPCAST_WITH_CUDA
      loopcast::add_cuda_ops(*g_domain);
#endif
    });
    Ort::UnownedSessionOptions(options).Add(*g_domain);
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
