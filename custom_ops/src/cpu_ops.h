// Registration hooks of the CPU kernels (matmul_cpu.cc, attention_cpu.cc, row_attention_cpu.cc, residual_norm_cpu.cc,
// swiglu_cpu.cc, lane_step_cpu.cc,
// matmul_nbits_cpu.cc).
#pragma once

#include "ort_api.h"

namespace loopcast {
void add_cpu_matmul(Ort::CustomOpDomain& domain);
void add_cpu_attention(Ort::CustomOpDomain& domain);
void add_cpu_row_attention(Ort::CustomOpDomain& domain);
void add_cpu_residual_norm(Ort::CustomOpDomain& domain);
void add_cpu_swiglu(Ort::CustomOpDomain& domain);
void add_cpu_lane_step(Ort::CustomOpDomain& domain);
void add_cpu_matmul_nbits(Ort::CustomOpDomain& domain);
}  // namespace loopcast
