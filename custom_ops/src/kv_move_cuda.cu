// KV position copies on the device, one cudaMemcpy2D per buffer: `planes` (= kv heads) rows of
// `capacity` positions each.
// - move (within a buffer): the alternate suffix's commit (docs/architecture.md §5, "Alternate
//   suffix invariant"). A winning branch's rows were written at scratch positions past the
//   primary chain, already rotated at their logical positions; copying them into place is exact.
// - copy (between two buffers of one shape, the same positions): the last-exited KV policy, a
//   token's exit-loop K/V written into the deeper loops' slots (docs/adaptive-depth.md).
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda_launch.h"

LOOPCAST_CUDA_API int loopcast_cuda_move_positions(void* buffer, int64_t planes, int64_t capacity,
                                                   int64_t position_bytes, int64_t src, int64_t dst, int64_t count,
                                                   void* stream) {
  if (count <= 0) return 0;
  if (planes <= 0 || position_bytes <= 0 || src < 0 || dst < 0 || src + count > capacity || dst + count > capacity ||
      (src < dst + count && dst < src + count))
    return static_cast<int>(cudaErrorInvalidValue);
  char* base = static_cast<char*>(buffer);
  const size_t pitch = static_cast<size_t>(capacity * position_bytes);
  cudaError_t err = cudaMemcpy2DAsync(base + dst * position_bytes, pitch, base + src * position_bytes, pitch,
                                      static_cast<size_t>(count * position_bytes), static_cast<size_t>(planes),
                                      cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return static_cast<int>(err);
  return stream == nullptr ? static_cast<int>(cudaStreamSynchronize(nullptr)) : 0;
}

LOOPCAST_CUDA_API int loopcast_cuda_copy_positions(void* dst_buffer, const void* src_buffer, int64_t planes,
                                                   int64_t capacity, int64_t position_bytes, int64_t position,
                                                   int64_t count, void* stream) {
  if (count <= 0) return 0;
  if (planes <= 0 || position_bytes <= 0 || position < 0 || position + count > capacity || dst_buffer == src_buffer)
    return static_cast<int>(cudaErrorInvalidValue);
  const size_t pitch = static_cast<size_t>(capacity * position_bytes), offset = static_cast<size_t>(position * position_bytes);
  cudaError_t err = cudaMemcpy2DAsync(static_cast<char*>(dst_buffer) + offset, pitch,
                                      static_cast<const char*>(src_buffer) + offset, pitch,
                                      static_cast<size_t>(count * position_bytes), static_cast<size_t>(planes),
                                      cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return static_cast<int>(err);
  return stream == nullptr ? static_cast<int>(cudaStreamSynchronize(nullptr)) : 0;
}
