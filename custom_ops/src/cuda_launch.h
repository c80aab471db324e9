// C entry points of the CUDA kernels (matmul_cuda.cu, matmul_nbits_cuda.cu, attention_cuda.cu, residual_norm_cuda.cu,
// swiglu_cuda.cu, kv_move_cuda.cu, lane_step_cuda.cu). They take raw device pointers and the
// caller's stream, and only enqueue work: no allocation, no host sync, no host<->device copy, so
// they can run inside a captured CUDA graph. Kept free of CUDA and ORT types so both the ORT glue
// (cuda_ops.cc) and ctypes-based tests can call them.
// Return value: 0, or a cudaError_t code (loopcast_cuda_error_string names it).
#pragma once

#include <stdint.h>

#if defined(_WIN32)
#define LOOPCAST_CUDA_API extern "C" __declspec(dllexport)
#else
#define LOOPCAST_CUDA_API extern "C" __attribute__((visibility("default")))
#endif

// dtype: 0 fp32, 1 fp16, 2 bf16 (loopcast::DType).
// Y[M, N] = A[M, K] · B (B is [K, N], or [N, K] with trans_b = 1); fp32 accumulation.
LOOPCAST_CUDA_API int loopcast_cuda_matmul(int dtype, const void* A, const void* B, void* Y, int64_t M, int64_t K,
                                           int64_t N, int trans_b, void* stream);
// The same with A[M, 2K] = [gate | up]: Y = SwiGLU(A) · B, the activation applied as A is loaded
// (the values of loopcast_cuda_swiglu, never written to memory).
LOOPCAST_CUDA_API int loopcast_cuda_swiglu_matmul(int dtype, const void* A, const void* B, void* Y, int64_t M,
                                                  int64_t K, int64_t N, int trans_b, void* stream);

// The norm prologue (norm_prologue.cuh): A [M, K] is ResidualRMSNorm's branch and the product
// reads its normed output h = norm(n_loop(residual + n_b(A)), norm_weight) in A's place, bit for
// bit loopcast_cuda_residual_rms_norm's; sum_out (null: not written) gets its sum
// n_loop(residual + n_b(A)). residual, branch_weight and loop_weight may be null, norm_weight not;
// sum_out must not overlap A or residual (other blocks still read them).
LOOPCAST_CUDA_API int loopcast_cuda_norm_matmul(int dtype, const void* A, const void* residual,
                                                const void* branch_weight, const void* loop_weight,
                                                const void* norm_weight, float epsilon, void* sum_out, const void* B,
                                                void* Y, int64_t M, int64_t K, int64_t N, int trans_b, void* stream);

// Y[M, N] = A[M, K] · Wᵀ for W [N, K] block-quantized in MatMulNBits' layout (matmul_nbits_op.h):
// B uint8 [N, ceil(K/block_size), block_size·bits/8], scales fp32 [N·n_blocks], zero_points uint8
// or null (symmetric); bits 4 or 8; swiglu = 1: A is [M, 2K] = [gate | up] and Y = SwiGLU(A) · Wᵀ.
LOOPCAST_CUDA_API int loopcast_cuda_matmul_nbits(int dtype, const void* A, const void* B, const float* scales,
                                                 const uint8_t* zero_points, void* Y, int64_t M, int64_t K, int64_t N,
                                                 int bits, int block_size, int swiglu, void* stream);
// The same with the norm prologue (as loopcast_cuda_norm_matmul).
LOOPCAST_CUDA_API int loopcast_cuda_norm_matmul_nbits(int dtype, const void* A, const void* residual,
                                                      const void* branch_weight, const void* loop_weight,
                                                      const void* norm_weight, float epsilon, void* sum_out,
                                                      const void* B, const float* scales, const uint8_t* zero_points,
                                                      void* Y, int64_t M, int64_t K, int64_t N, int bits,
                                                      int block_size, void* stream);

// Packed-QKV GQA with rotate-half rotary; see attention_cuda.cu. present_* may equal past_*.
LOOPCAST_CUDA_API int loopcast_cuda_attention(int dtype, const void* qkv, const void* past_k, const void* past_v,
                                              void* present_k, void* present_v, const int32_t* seqlens_k,
                                              const void* cos_cache, const void* sin_cache, void* out, int B, int S,
                                              int num_heads, int kv_num_heads, int head_dim, int capacity,
                                              int rotary_len, float scale, int do_rotary, void* stream);

// One row per batch entry (S = 1) with a masked key range [lo, hi) per entry (masked_keys
// [B, 2], device): RowAttention's tree-verify rows. The row runs at its logical position
// seqlens_k[b] - (hi - lo) (when hi <= seqlens_k[b]) with the keys past lo read hi - lo
// positions further on, and writes its K/V at seqlens_k[b]: the decode row of the logical
// position, bit for bit. Split kernel only: cudaErrorNotSupported (801) where the one-row call
// takes the other kernel.
LOOPCAST_CUDA_API int loopcast_cuda_masked_attention(int dtype, const void* qkv, const void* past_k,
                                                     const void* past_v, void* present_k, void* present_v,
                                                     const int32_t* seqlens_k, const int32_t* masked_keys,
                                                     const void* cos_cache, const void* sin_cache, void* out, int B,
                                                     int num_heads, int kv_num_heads, int head_dim, int capacity,
                                                     int rotary_len, float scale, int do_rotary, void* stream);

// RowAttention's rows in one launch: row i (S = 1) at positions[i] on the pair keys[i] / values[i]
// ([1, kv_num_heads, capacity, head_dim] each, written in place), masked_keys [rows, 2] or null
// (as loopcast_cuda_masked_attention). Rows must use distinct pairs (a row reads the cache that
// another block of the same launch may be writing). Returns cudaErrorNotSupported (801) when the
// one-row decode call would not take the split kernel or rows > 32: the caller then runs the
// rows one launch each. sequences (device, [rows]) or null: row i's cache is batch entry
// sequences[i] of its pair's [entries, kv_num_heads, capacity, head_dim] buffers (the pairs may then
// repeat as long as no two valid rows address one (pair, entry)); an index outside 0..entries-1
// makes the row write nothing and output zeros. With null, entries is ignored (one entry).
LOOPCAST_CUDA_API int loopcast_cuda_row_attention(int dtype, const void* qkv, void* const* keys, void* const* values,
                                                  const int32_t* positions, const int32_t* masked_keys,
                                                  const int32_t* sequences, int entries, const void* cos_cache,
                                                  const void* sin_cache, void* out, int rows, int num_heads,
                                                  int kv_num_heads, int head_dim, int capacity, int rotary_len,
                                                  float scale, int do_rotary, void* stream);

// A KV buffer of `planes` rows of `capacity` positions (`position_bytes` each, [1, H_kv, T, D]):
// positions src..src+count-1 copied to dst.. in every plane (disjoint ranges). The alternate
// suffix's commit: a winning branch's K/V from its scratch positions into place. stream null:
// the legacy stream, synchronised before returning (between two ORT runs).
// The pipeline's lane schedule between two cycles (lane_step.h), on one device thread.
LOOPCAST_CUDA_API int loopcast_cuda_lane_step(const int32_t* state, const int64_t* ids, int R, int32_t* state_out,
                                              int32_t* positions, int32_t* entering, int32_t* record, void* stream);
LOOPCAST_CUDA_API int loopcast_cuda_move_positions(void* buffer, int64_t planes, int64_t capacity,
                                                   int64_t position_bytes, int64_t src, int64_t dst, int64_t count,
                                                   void* stream);
// Positions position..position+count-1 of every plane of src_buffer copied into the same
// positions of dst_buffer (two distinct buffers of one shape): the last-exited KV policy's fill of
// the deeper loops' slots. stream null: synchronised before returning.
LOOPCAST_CUDA_API int loopcast_cuda_copy_positions(void* dst_buffer, const void* src_buffer, int64_t planes,
                                                   int64_t capacity, int64_t position_bytes, int64_t position,
                                                   int64_t count, void* stream);

// Per row of `hidden` elements (see residual_norm_cuda.cu):
//   b = branch_weight ? norm(branch, branch_weight) : branch;  s = residual ? residual + b : b
//   sum = loop_weight ? norm(s, loop_weight) : s;  normed = norm(sum, out_weight)
// residual and the weights are [rows, hidden] / [hidden] or null; normed_out is null exactly when
// out_weight is. sum_out may be
// residual or branch (each thread rewrites only what it read).
LOOPCAST_CUDA_API int loopcast_cuda_residual_rms_norm(int dtype, const void* branch, const void* residual,
                                                      const void* branch_weight, const void* loop_weight,
                                                      const void* out_weight, void* sum_out, void* normed_out,
                                                      int64_t rows, int64_t hidden, float epsilon, void* stream);

// out[rows, inter] = silu(gate) * up over gate_up[rows, 2*inter] = [gate | up].
LOOPCAST_CUDA_API int loopcast_cuda_swiglu(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                                           void* stream);

LOOPCAST_CUDA_API const char* loopcast_cuda_error_string(int code);

// Largest cache capacity (positions) the attention kernel takes: its scores live in shared memory.
constexpr int kLoopcastMaxCudaCapacity = 49152;
// Largest row ResidualRMSNorm takes: its kernel keeps the row in registers, at most 16 16-byte
// granules per thread (16384 fp32 elements).
constexpr int64_t kLoopcastMaxNormHidden = 16384;
