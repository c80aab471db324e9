// RowAttention's signature and checks, shared by the CPU and CUDA registrations.
//
// Inputs   0 query [1, S, (num_heads + 2*kv_num_heads)*head_dim]  packed q|k|v of S rows
//          1 positions [S] int32          row i's position; -1: inactive row (writes nothing, outputs 0)
//          2 sequences [S] int32          optional: batch entry of the KV buffers (absent: 0)
//          3 masked_keys [S, 2] int32     optional: keys [lo, hi) that row i does not see (tree verify);
//                                         they leave its sequence, so its rotary position is
//                                         positions[i] - (hi - lo) when hi <= positions[i]
//          4 cos_cache, 5 sin_cache       [max_len, head_dim/2]
//          6.. key_0, value_0, key_1, value_1, ...   KV buffer pairs [Bseq, kv_num_heads, T, head_dim]
// Outputs  0 output [1, S, num_heads*head_dim]; 1.. present key_0, value_0, ... (bound to the inputs)
// Attributes as BatchInvariantAttention, plus row_buffers (ints, at least one per row): the pair row i uses,
// and kv_in_place (0/1): 1 writes K/V into the input buffers themselves and leaves the present
// outputs empty ([0]). The unrolled cycle run (graphs/kinds.py::build_cycle_run) takes one bound
// cache in every cycle that way: chaining presents would copy the cache between cycles.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "op_schemas.h"

namespace loopcast {

constexpr size_t kRowAttentionFirstKV = 6;

struct RowAttentionAttrs {
  int64_t num_heads = 0, kv_num_heads = 0;
  float scale = 0.0f;
  bool do_rotary = true, kv_in_place = false;
  std::vector<int64_t> row_buffers;

  explicit RowAttentionAttrs(const OrtKernelInfo* info) {
    num_heads = attr_int(info, "num_heads", 0);
    kv_num_heads = attr_int(info, "kv_num_heads", 0);
    scale = attr_float(info, "scale", 0.0f);
    do_rotary = attr_int(info, "do_rotary", 0) != 0;
    kv_in_place = attr_int(info, "kv_in_place", 0) != 0;
    if (attr_int(info, "rotary_interleaved", 0) != 0)
      fail("RowAttention: rotary_interleaved=1 is not supported (only rotate-half)");
    if (num_heads <= 0 || kv_num_heads <= 0 || num_heads % kv_num_heads != 0)
      fail("RowAttention: num_heads=" + std::to_string(num_heads) + " must be a positive multiple of kv_num_heads=" +
           std::to_string(kv_num_heads));
    row_buffers = Ort::ConstKernelInfo(info).GetAttributes<int64_t>("row_buffers");
  }
};

struct RowAttentionShapes {
  int64_t S = 0, D = 0, T = 0, Bseq = 0, pairs = 0, rotary_len = 0;
  bool has_sequences = false, has_masked = false;
  std::vector<int64_t> past_shape;
  float scale = 0.0f;
};

inline RowAttentionShapes row_attention_shapes(Ort::KernelContext& ctx, const RowAttentionAttrs& a) {
  const std::string op = "RowAttention: ";
  RowAttentionShapes s;
  auto q = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape();
  const int64_t width = a.num_heads + 2 * a.kv_num_heads;
  if (q.size() != 3 || q[0] != 1 || q[2] % width != 0)
    fail(op + "query must be [1, S, (num_heads + 2*kv_num_heads)*head_dim], got " + shape_str(q));
  s.S = q[1];
  s.D = q[2] / width;
  // A call may run fewer rows than the attribute names (the batched cycle over the occupied
  // slots): row i < S uses row_buffers[i]; the rest of the list is not read.
  if (static_cast<int64_t>(a.row_buffers.size()) < s.S)
    fail(op + "row_buffers has " + std::to_string(a.row_buffers.size()) + " entries for " + std::to_string(s.S) +
         " rows");
  auto pos = ctx.GetInput(1).GetTensorTypeAndShapeInfo().GetShape();
  if (pos != std::vector<int64_t>{s.S}) fail(op + "positions must be int32 [S=" + std::to_string(s.S) + "], got " + shape_str(pos));
  Ort::ConstValue seq = optional_input(ctx, 2), masked = optional_input(ctx, 3);
  if (seq) {
    auto sh = seq.GetTensorTypeAndShapeInfo().GetShape();
    if (sh != std::vector<int64_t>{s.S}) fail(op + "sequences must be int32 [S], got " + shape_str(sh));
    s.has_sequences = true;
  }
  if (masked) {
    auto sh = masked.GetTensorTypeAndShapeInfo().GetShape();
    if (sh != std::vector<int64_t>{s.S, 2}) fail(op + "masked_keys must be int32 [S, 2], got " + shape_str(sh));
    s.has_masked = true;
  }
  const size_t n_in = ctx.GetInputCount();
  if (n_in < kRowAttentionFirstKV + 2 || (n_in - kRowAttentionFirstKV) % 2 != 0)
    fail(op + "expects KV buffer pairs (key, value) after input 5, got " + std::to_string(n_in - kRowAttentionFirstKV) +
         " tensors");
  s.pairs = static_cast<int64_t>((n_in - kRowAttentionFirstKV) / 2);
  for (int64_t i = 0; i < s.S; ++i)
    if (a.row_buffers[i] < 0 || a.row_buffers[i] >= s.pairs)
      fail(op + "row_buffers[" + std::to_string(i) + "]=" + std::to_string(a.row_buffers[i]) + " names no KV pair (" +
           std::to_string(s.pairs) + " given)");
  std::vector<bool> named(static_cast<size_t>(s.pairs), false);
  for (int64_t b : a.row_buffers) named[static_cast<size_t>(b)] = true;
  for (int64_t k = 0; k < s.pairs; ++k)
    if (!named[static_cast<size_t>(k)])
      fail(op + "KV pair " + std::to_string(k) + " is named by no row (row_buffers): give only the pairs the rows use");
  s.past_shape = ctx.GetInput(kRowAttentionFirstKV).GetTensorTypeAndShapeInfo().GetShape();
  if (s.past_shape.size() != 4 || s.past_shape[1] != a.kv_num_heads || s.past_shape[3] != s.D)
    fail(op + "KV buffers must be [Bseq, kv_num_heads=" + std::to_string(a.kv_num_heads) + ", T, head_dim=" +
         std::to_string(s.D) + "], got " + shape_str(s.past_shape));
  for (size_t i = kRowAttentionFirstKV; i < n_in; ++i)
    if (ctx.GetInput(i).GetTensorTypeAndShapeInfo().GetShape() != s.past_shape)
      fail(op + "KV buffer " + std::to_string(i - kRowAttentionFirstKV) + " has shape " +
           shape_str(ctx.GetInput(i).GetTensorTypeAndShapeInfo().GetShape()) + ", buffer 0 " + shape_str(s.past_shape));
  s.Bseq = s.past_shape[0];
  s.T = s.past_shape[2];
  s.rotary_len = s.T;
  if (a.do_rotary) {
    auto cs = ctx.GetInput(4).GetTensorTypeAndShapeInfo().GetShape();
    auto sn = ctx.GetInput(5).GetTensorTypeAndShapeInfo().GetShape();
    if (s.D % 2 != 0 || cs.size() != 2 || cs[1] != s.D / 2 || sn != cs)
      fail(op + "cos_cache/sin_cache must be [max_len, head_dim/2 = " + std::to_string(s.D / 2) + "], got " +
           shape_str(cs) + " and " + shape_str(sn));
    s.rotary_len = cs[0];
  }
  s.scale = a.scale != 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(s.D));
  return s;
}

// Where KV pair k's present output lives: the output buffer, or with kv_in_place the input
// buffer (the output is then an empty placeholder).
inline void* row_attention_present(Ort::KernelContext& ctx, const RowAttentionAttrs& a, const RowAttentionShapes& s,
                                   size_t output) {
  if (!a.kv_in_place) return ctx.GetOutput(output, s.past_shape).GetTensorMutableRawData();
  ctx.GetOutput(output, {0});
  return const_cast<void*>(ctx.GetInput(kRowAttentionFirstKV + output - 1).GetTensorRawData());
}

template <typename Kernel, typename T, bool Cuda>
struct RowAttentionOp : Ort::CustomOpBase<RowAttentionOp<Kernel, T, Cuda>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return "RowAttention"; }
  const char* GetExecutionProviderType() const { return provider_name(Cuda); }
  size_t GetInputTypeCount() const { return kRowAttentionFirstKV + 1; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i >= 1 && i <= 3) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ElementType<T>::value;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    if (i == kRowAttentionFirstKV) return OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_VARIADIC;
    return (i == 2 || i == 3) ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                              : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  int GetVariadicInputMinArity() const { return 2; }
  bool GetVariadicInputHomogeneity() const { return true; }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType<T>::value; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_VARIADIC
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  int GetVariadicOutputMinArity() const { return 2; }
  bool GetVariadicOutputHomogeneity() const { return true; }
};

}  // namespace loopcast
