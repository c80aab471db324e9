// Registration hook of the CUDA kernels (cuda_ops.cc); only in builds with LOOPCAST_WITH_CUDA.
#pragma once

#include "ort_api.h"

namespace loopcast {
void add_cuda_ops(Ort::CustomOpDomain& domain);
}  // namespace loopcast
