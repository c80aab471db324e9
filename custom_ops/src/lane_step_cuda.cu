// LaneStep on the device: one thread runs lane_step.h's rule, so the schedule between two cycles
// of a captured cycle run costs one tiny launch instead of a host round trip.
#include <cuda_runtime.h>

#include "cuda_launch.h"
#include "lane_step.h"

namespace {

__global__ void lane_step_kernel(const int32_t* state, const int64_t* ids, int R, int32_t* out, int32_t* positions,
                                 int32_t* entering, int32_t* record) {
  loopcast::lane_step(state, ids, R, out, positions, entering, record);
}

}  // namespace

LOOPCAST_CUDA_API int loopcast_cuda_lane_step(const int32_t* state, const int64_t* ids, int R, int32_t* state_out,
                                              int32_t* positions, int32_t* entering, int32_t* record, void* stream) {
  if (R < 2 || R > loopcast::kLaneStepMaxRows)
    return static_cast<int>(cudaErrorInvalidValue);
  lane_step_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(state, ids, R, state_out, positions, entering,
                                                                      record);
  return static_cast<int>(cudaGetLastError());
}
