// One (dtype, bits) of BatchInvariantMatMulNBits' kernels (matmul_nbits_kernel.cuh), in a file of
// its own so that the build compiles the specializations in parallel.
#include "matmul_nbits_kernel.cuh"

template int loopcast_cuda::nbits_run<float, 8>(const loopcast_cuda::NBitsArgs&, bool, bool, cudaStream_t);
