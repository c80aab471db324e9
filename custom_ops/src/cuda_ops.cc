// The CUDA execution provider's BatchInvariantMatMul (and its NBits form), BatchInvariantAttention, RowAttention,
// ResidualRMSNorm, SwiGLU and LaneStep: shape checks on the host, then one call into the CUDA launchers on ORT's compute stream.
// Inputs stay on the device (seqlens_k too: the kernels read it there), and Compute neither
// allocates nor syncs, so the ops can run inside captured CUDA graphs.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "attention_shapes.h"
#include "cuda_launch.h"
#include "cuda_ops.h"
#include "lane_step_op.h"
#include "matmul_nbits_op.h"
#include "norm_prologue_io.h"
#include "op_schemas.h"
#include "row_attention.h"

namespace loopcast {
namespace {

void check_launch(int code, const char* op) {
  if (code != 0)
    fail(std::string(op) + " (CUDA): kernel launch failed: " + loopcast_cuda_error_string(code));
}

template <typename T>
struct MatMulCudaKernel {
  MatMulAttrs attrs;
  MatMulCudaKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue a = ctx.GetInput(0), b = ctx.GetInput(1);
    const MatMulDims dims = attrs.dims(a, b);
    const NormPrologueIO norm = norm_prologue_io(ctx, 2, a.GetTensorTypeAndShapeInfo().GetShape(), dims.K,
                                                 attrs.swiglu, "BatchInvariantMatMul");
    Ort::UnownedValue y = ctx.GetOutput(0, dims.y_shape);
    if (dims.rows == 0 || dims.N == 0) return;
    if (norm.on) {
      check_launch(loopcast_cuda_norm_matmul(static_cast<int>(DTypeOf<T>::value), a.GetTensorRawData(), norm.residual,
                                             norm.weight[0], norm.weight[1], norm.weight[2], attrs.epsilon, norm.sum,
                                             b.GetTensorRawData(), y.GetTensorMutableRawData(), dims.rows, dims.K,
                                             dims.N, attrs.trans_b ? 1 : 0, ctx.GetGPUComputeStream()),
                   "BatchInvariantMatMul");
      return;
    }
    auto launch = attrs.swiglu ? loopcast_cuda_swiglu_matmul : loopcast_cuda_matmul;
    check_launch(launch(static_cast<int>(DTypeOf<T>::value), a.GetTensorRawData(), b.GetTensorRawData(),
                        y.GetTensorMutableRawData(), dims.rows, dims.K, dims.N, attrs.trans_b ? 1 : 0,
                        ctx.GetGPUComputeStream()),
                 "BatchInvariantMatMul");
  }
};

template <typename T>
struct NBitsCudaKernel {
  NBitsAttrs attrs;
  // accuracy_level 4 permits int8 activations (MatMulNBits' meaning: a minimum accuracy); these
  // kernels compute in the activation dtype at every level, as MatMulNBits' CUDA kernels do.
  NBitsCudaKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::UnownedValue y(nullptr);
    const NBitsCall call = nbits_call(ctx, attrs, &y);
    if (call.float_zero_points != nullptr)
      fail("BatchInvariantMatMulNBits: float zero_points run on the CPU only; CUDA takes packed uint8 ones");
    if (call.rows == 0) return;
    if (call.norm.on) {
      check_launch(loopcast_cuda_norm_matmul_nbits(
                       static_cast<int>(DTypeOf<T>::value), call.A, call.norm.residual, call.norm.weight[0],
                       call.norm.weight[1], call.norm.weight[2], attrs.epsilon, call.norm.sum, call.B, call.scales,
                       call.zero_points, y.GetTensorMutableRawData(), call.rows, attrs.K, attrs.N,
                       static_cast<int>(attrs.bits), static_cast<int>(attrs.block_size), ctx.GetGPUComputeStream()),
                   "BatchInvariantMatMulNBits");
      return;
    }
    check_launch(loopcast_cuda_matmul_nbits(static_cast<int>(DTypeOf<T>::value), call.A, call.B, call.scales,
                                            call.zero_points, y.GetTensorMutableRawData(), call.rows, attrs.K,
                                            attrs.N, static_cast<int>(attrs.bits), static_cast<int>(attrs.block_size),
                                            attrs.swiglu ? 1 : 0, ctx.GetGPUComputeStream()),
                 "BatchInvariantMatMulNBits");
  }
};

template <typename T>
struct AttentionCudaKernel {
  AttentionAttrs attrs;
  AttentionCudaKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const AttentionShapes s = attention_shapes(ctx, attrs);
    if (s.D != 16 && s.D != 32 && s.D != 64 && s.D != 128)
      fail("BatchInvariantAttention (CUDA): head_dim must be 16, 32, 64 or 128, got " + std::to_string(s.D));
    if (s.T > kLoopcastMaxCudaCapacity)
      fail("BatchInvariantAttention (CUDA): cache capacity " + std::to_string(s.T) + " exceeds " +
           std::to_string(kLoopcastMaxCudaCapacity));
    const void* cos = attrs.do_rotary ? ctx.GetInput(7).GetTensorRawData() : nullptr;
    const void* sin = attrs.do_rotary ? ctx.GetInput(8).GetTensorRawData() : nullptr;
    const int64_t rotary_len = attrs.do_rotary ? ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetShape()[0] : s.T;
    Ort::UnownedValue out = ctx.GetOutput(0, {s.B, s.S, attrs.num_heads * s.D});
    Ort::UnownedValue pk = ctx.GetOutput(1, s.past_shape);
    Ort::UnownedValue pv = ctx.GetOutput(2, s.past_shape);
    check_launch(loopcast_cuda_attention(
                     static_cast<int>(DTypeOf<T>::value), ctx.GetInput(0).GetTensorRawData(),
                     ctx.GetInput(3).GetTensorRawData(), ctx.GetInput(4).GetTensorRawData(),
                     pk.GetTensorMutableRawData(), pv.GetTensorMutableRawData(),
                     ctx.GetInput(5).GetTensorData<int32_t>(), cos, sin, out.GetTensorMutableRawData(),
                     static_cast<int>(s.B), static_cast<int>(s.S), static_cast<int>(attrs.num_heads),
                     static_cast<int>(attrs.kv_num_heads), static_cast<int>(s.D), static_cast<int>(s.T),
                     static_cast<int>(std::min<int64_t>(rotary_len, 1 << 30)), s.scale, attrs.do_rotary ? 1 : 0,
                     ctx.GetGPUComputeStream()),
                 "BatchInvariantAttention");
  }
};

constexpr int kCudaErrorNotSupported = 801;  // cudaErrorNotSupported, without CUDA headers here

bool per_row_forced() {
  static const bool forced = [] {
    const char* v = std::getenv("LOOPCAST_ROW_ATTENTION");
    return v != nullptr && std::string(v) == "per-row";
  }();
  return forced;
}

// RowAttention on CUDA: each active row is the one-row BatchInvariantAttention launch at its own
// position (positions + i is the launch's seqlens_k, read on the device) on its row_buffers pair,
// so a pipeline row runs the decode row's kernel and numerics exactly. When the pairs are bound
// in place and the decode call takes the split kernel, the rows go in one launch instead: the
// split kernel with row i as batch entry i on its own pair (loopcast_cuda_row_attention), whose
// arithmetic per (row, head) depends only on the position, not on the batch or the grid. A position of -1 makes the
// launch write nothing and output zeros. The single launch needs distinct pairs (a row reads the
// cache another block of the launch may be writing); rows sharing a pair (tree verify: every row
// on the layer's slot) run one launch each, in row order, so a row sees what earlier rows wrote.
// masked_keys (tree verify) take the split kernel either way (loopcast_cuda_masked_attention):
// a row runs at its logical position with the masked keys skipped, as on the CPU. sequences (the
// batched cycle, graphs/batched_cycle.py): row i reads and writes batch entry sequences[i] of its
// pair, read on the device; those rows always take the one launch (in chunks of the launch's row
// table), which needs the pairs bound in place and the split kernel for these shapes; valid rows
// sharing a pair address distinct sequences (the graph's contract), so no block of a launch reads
// a cache another writes.
constexpr int64_t kRowLaunchRows = 32;  // rows of one loopcast_cuda_row_attention launch (its row table)

template <typename T>
struct RowAttentionCudaKernel {
  RowAttentionAttrs attrs;
  RowAttentionCudaKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const RowAttentionShapes s = row_attention_shapes(ctx, attrs);
    const int32_t* masked = s.has_masked ? ctx.GetInput(3).GetTensorData<int32_t>() : nullptr;
    const int32_t* sequences = s.has_sequences ? ctx.GetInput(2).GetTensorData<int32_t>() : nullptr;
    if (sequences != nullptr && masked != nullptr)
      fail("RowAttention (CUDA): sequences with masked_keys are not supported");
    if (s.Bseq != 1 && sequences == nullptr)
      fail("RowAttention (CUDA): KV buffers must hold one sequence without the sequences input, got " +
           shape_str(s.past_shape));
    if (s.D != 16 && s.D != 32 && s.D != 64 && s.D != 128)
      fail("RowAttention (CUDA): head_dim must be 16, 32, 64 or 128, got " + std::to_string(s.D));
    if (s.T > kLoopcastMaxCudaCapacity)
      fail("RowAttention (CUDA): cache capacity " + std::to_string(s.T) + " exceeds " +
           std::to_string(kLoopcastMaxCudaCapacity));
    const void* cos = attrs.do_rotary ? ctx.GetInput(4).GetTensorRawData() : nullptr;
    const void* sin = attrs.do_rotary ? ctx.GetInput(5).GetTensorRawData() : nullptr;
    const int64_t Hq = attrs.num_heads, Hkv = attrs.kv_num_heads;
    const size_t elem = sizeof(T);
    const auto* qkv = static_cast<const char*>(ctx.GetInput(0).GetTensorRawData());
    const int32_t* positions = ctx.GetInput(1).GetTensorData<int32_t>();
    auto* out = static_cast<char*>(ctx.GetOutput(0, {1, s.S, Hq * s.D}).GetTensorMutableRawData());
    std::vector<const void*> past_k, past_v;
    std::vector<void*> pk, pv;
    for (int64_t k = 0; k < s.pairs; ++k) {
      past_k.push_back(ctx.GetInput(kRowAttentionFirstKV + 2 * k).GetTensorRawData());
      past_v.push_back(ctx.GetInput(kRowAttentionFirstKV + 2 * k + 1).GetTensorRawData());
      pk.push_back(row_attention_present(ctx, attrs, s, 1 + 2 * k));
      pv.push_back(row_attention_present(ctx, attrs, s, 2 + 2 * k));
    }
    // One launch for all rows when every pair is bound in place (past == present) and the
    // one-row decode call takes the split kernel; LOOPCAST_ROW_ATTENTION=per-row forces the
    // per-row launches (the bench compares them).
    bool in_place = true;
    for (int64_t k = 0; k < s.pairs; ++k) in_place = in_place && past_k[k] == pk[k] && past_v[k] == pv[k];
    // every pair is named by the attribute (checked): with one entry per row, one row each
    const bool distinct = s.pairs == s.S && static_cast<int64_t>(attrs.row_buffers.size()) == s.S;
    if (sequences != nullptr) {
      if (!in_place)
        fail("RowAttention (CUDA): the sequences input needs every KV pair bound as its own present output");
      std::vector<void*> keys, values;
      for (int64_t i = 0; i < s.S; ++i) {
        keys.push_back(pk[attrs.row_buffers[i]]);
        values.push_back(pv[attrs.row_buffers[i]]);
      }
      for (int64_t i0 = 0; i0 < s.S; i0 += kRowLaunchRows) {
        const int64_t rows = std::min<int64_t>(kRowLaunchRows, s.S - i0);
        const int code = loopcast_cuda_row_attention(
            static_cast<int>(DTypeOf<T>::value), qkv + i0 * (Hq + 2 * Hkv) * s.D * elem, keys.data() + i0,
            values.data() + i0, positions + i0, nullptr, sequences + i0, static_cast<int>(s.Bseq), cos, sin,
            out + i0 * Hq * s.D * elem, static_cast<int>(rows), static_cast<int>(Hq), static_cast<int>(Hkv),
            static_cast<int>(s.D), static_cast<int>(s.T), static_cast<int>(std::min<int64_t>(s.rotary_len, 1 << 30)),
            s.scale, attrs.do_rotary ? 1 : 0, ctx.GetGPUComputeStream());
        if (code == kCudaErrorNotSupported)
          fail("RowAttention (CUDA): the sequences input needs the split attention kernel, which does not serve "
               "these shapes (head_dim " + std::to_string(s.D) + ", capacity " + std::to_string(s.T) + ")");
        check_launch(code, "RowAttention");
      }
      return;
    }
    if (in_place && distinct && !per_row_forced()) {
      std::vector<void*> keys, values;
      for (int64_t i = 0; i < s.S; ++i) {
        keys.push_back(pk[attrs.row_buffers[i]]);
        values.push_back(pv[attrs.row_buffers[i]]);
      }
      const int code = loopcast_cuda_row_attention(
          static_cast<int>(DTypeOf<T>::value), qkv, keys.data(), values.data(), positions, masked, nullptr, 1, cos,
          sin, out,
          static_cast<int>(s.S), static_cast<int>(Hq), static_cast<int>(Hkv), static_cast<int>(s.D),
          static_cast<int>(s.T), static_cast<int>(std::min<int64_t>(s.rotary_len, 1 << 30)), s.scale,
          attrs.do_rotary ? 1 : 0, ctx.GetGPUComputeStream());
      if (code != kCudaErrorNotSupported) {
        check_launch(code, "RowAttention");
        return;
      }
    }
    for (int64_t i = 0; i < s.S; ++i) {
      const int64_t k = attrs.row_buffers[i];
      if (masked != nullptr) {
        const int code = loopcast_cuda_masked_attention(
            static_cast<int>(DTypeOf<T>::value), qkv + i * (Hq + 2 * Hkv) * s.D * elem, past_k[k], past_v[k], pk[k],
            pv[k], positions + i, masked + 2 * i, cos, sin, out + i * Hq * s.D * elem, 1, static_cast<int>(Hq),
            static_cast<int>(Hkv), static_cast<int>(s.D), static_cast<int>(s.T),
            static_cast<int>(std::min<int64_t>(s.rotary_len, 1 << 30)), s.scale, attrs.do_rotary ? 1 : 0,
            ctx.GetGPUComputeStream());
        if (code == kCudaErrorNotSupported)
          fail("RowAttention (CUDA): masked_keys need the split attention kernel, which does not serve these shapes "
               "(head_dim " + std::to_string(s.D) + ", capacity " + std::to_string(s.T) + ")");
        check_launch(code, "RowAttention");
        past_k[k] = pk[k];
        past_v[k] = pv[k];
        continue;
      }
      // The launch copies past to present when they differ: only for a pair's first row.
      check_launch(loopcast_cuda_attention(
                       static_cast<int>(DTypeOf<T>::value), qkv + i * (Hq + 2 * Hkv) * s.D * elem, past_k[k],
                       past_v[k], pk[k], pv[k], positions + i, cos, sin, out + i * Hq * s.D * elem, 1, 1,
                       static_cast<int>(Hq), static_cast<int>(Hkv), static_cast<int>(s.D), static_cast<int>(s.T),
                       static_cast<int>(std::min<int64_t>(s.rotary_len, 1 << 30)), s.scale, attrs.do_rotary ? 1 : 0,
                       ctx.GetGPUComputeStream()),
                   "RowAttention");
      past_k[k] = pk[k];
      past_v[k] = pv[k];
    }
  }
};

template <typename T>
struct ResidualNormCudaKernel {
  float epsilon;
  ResidualNormCudaKernel(const OrtApi&, const OrtKernelInfo* info) : epsilon(attr_float(info, "epsilon", 1e-6f)) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const ResidualNormIO io = residual_norm_io(ctx);
    if (io.H > kLoopcastMaxNormHidden)
      fail("ResidualRMSNorm (CUDA): hidden size " + std::to_string(io.H) + " exceeds " +
           std::to_string(kLoopcastMaxNormHidden));
    if (io.rows == 0 || io.H == 0) return;
    check_launch(loopcast_cuda_residual_rms_norm(static_cast<int>(DTypeOf<T>::value), io.branch, io.residual,
                                                 io.branch_weight, io.loop_weight, io.out_weight, io.sum, io.normed,
                                                 io.rows, io.H, epsilon, ctx.GetGPUComputeStream()),
                 "ResidualRMSNorm");
  }
};

template <typename T>
struct SwiGLUCudaKernel {
  SwiGLUCudaKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue x = ctx.GetInput(0);
    const SwiGLUDims d = swiglu_dims(x.GetTensorTypeAndShapeInfo().GetShape());
    Ort::UnownedValue y = ctx.GetOutput(0, d.out_shape);
    if (d.rows == 0 || d.inter == 0) return;
    check_launch(loopcast_cuda_swiglu(static_cast<int>(DTypeOf<T>::value), x.GetTensorRawData(),
                                      y.GetTensorMutableRawData(), d.rows, d.inter, ctx.GetGPUComputeStream()),
                 "SwiGLU");
  }
};

struct LaneStepCudaKernel {
  LaneStepCudaKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const LaneStepShapes s = lane_step_shapes(ctx);
    check_launch(loopcast_cuda_lane_step(ctx.GetInput(0).GetTensorData<int32_t>(),
                                         ctx.GetInput(1).GetTensorData<int64_t>(), s.R,
                                         ctx.GetOutput(0, s.state).GetTensorMutableData<int32_t>(),
                                         ctx.GetOutput(1, s.rows).GetTensorMutableData<int32_t>(),
                                         ctx.GetOutput(2, s.entering).GetTensorMutableData<int32_t>(),
                                         ctx.GetOutput(3, s.record).GetTensorMutableData<int32_t>(),
                                         ctx.GetGPUComputeStream()),
                 "LaneStep");
  }
};

MatMulOp<MatMulCudaKernel<float>, float, true> g_mm_f32;
MatMulOp<MatMulCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_mm_f16;
MatMulOp<MatMulCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_mm_bf16;
MatMulNBitsOp<NBitsCudaKernel<float>, float, true> g_nb_f32;
MatMulNBitsOp<NBitsCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_nb_f16;
MatMulNBitsOp<NBitsCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_nb_bf16;
AttentionOp<AttentionCudaKernel<float>, float, true> g_at_f32;
AttentionOp<AttentionCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_at_f16;
AttentionOp<AttentionCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_at_bf16;
RowAttentionOp<RowAttentionCudaKernel<float>, float, true> g_ra_f32;
RowAttentionOp<RowAttentionCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_ra_f16;
RowAttentionOp<RowAttentionCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_ra_bf16;
ResidualRMSNormOp<ResidualNormCudaKernel<float>, float, true> g_rn_f32;
ResidualRMSNormOp<ResidualNormCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_rn_f16;
ResidualRMSNormOp<ResidualNormCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_rn_bf16;
SwiGLUOp<SwiGLUCudaKernel<float>, float, true> g_sg_f32;
SwiGLUOp<SwiGLUCudaKernel<Ort::Float16_t>, Ort::Float16_t, true> g_sg_f16;
SwiGLUOp<SwiGLUCudaKernel<Ort::BFloat16_t>, Ort::BFloat16_t, true> g_sg_bf16;
LaneStepOp<LaneStepCudaKernel, true> g_lane_step;

}  // namespace

void add_cuda_ops(Ort::CustomOpDomain& domain) {
  for (OrtCustomOp* op : std::vector<OrtCustomOp*>{&g_mm_f32, &g_mm_f16, &g_mm_bf16, &g_at_f32, &g_at_f16, &g_at_bf16,
                                                   &g_ra_f32, &g_ra_f16, &g_ra_bf16,
                                                   &g_rn_f32, &g_rn_f16, &g_rn_bf16, &g_sg_f32, &g_sg_f16, &g_sg_bf16,
                                                   &g_lane_step, &g_nb_f32, &g_nb_f16, &g_nb_bf16})
    domain.Add(op);
}

}  // namespace loopcast
