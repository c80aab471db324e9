// Attribute and shape validation for BatchInvariantAttention, shared by the CPU and CUDA
// kernels so both reject the same inputs with the same messages.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "ops_common.h"

namespace loopcast {

struct AttentionAttrs {
  int64_t num_heads = 0, kv_num_heads = 0;
  float scale = 0.0f;  // 0: 1/sqrt(head_dim), resolved once the head size is known
  bool do_rotary = true;

  explicit AttentionAttrs(const OrtKernelInfo* info) {
    num_heads = attr_int(info, "num_heads", 0);
    kv_num_heads = attr_int(info, "kv_num_heads", 0);
    scale = attr_float(info, "scale", 0.0f);
    do_rotary = attr_int(info, "do_rotary", 0) != 0;
    if (attr_int(info, "rotary_interleaved", 0) != 0)
      fail("BatchInvariantAttention: rotary_interleaved=1 is not supported (only rotate-half)");
    if (num_heads <= 0 || kv_num_heads <= 0 || num_heads % kv_num_heads != 0)
      fail("BatchInvariantAttention: num_heads=" + std::to_string(num_heads) + " must be a positive multiple of "
           "kv_num_heads=" + std::to_string(kv_num_heads));
  }
};

struct AttentionShapes {
  int64_t B = 0, S = 0, D = 0, T = 0;  // batch, new rows, head size, cache capacity
  std::vector<int64_t> past_shape;
  float scale = 0.0f;
};

// Reads and checks every shape; the device-side values (seqlens_k) are checked by the kernels.
inline AttentionShapes attention_shapes(Ort::KernelContext& ctx, const AttentionAttrs& a) {
  const char* op = "BatchInvariantAttention: ";
  if (ctx.GetInput(1) || ctx.GetInput(2))
    fail(std::string(op) + "key/value inputs must be absent (only packed q|k|v in query is supported)");
  auto q = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape();
  auto pk = ctx.GetInput(3).GetTensorTypeAndShapeInfo().GetShape();
  auto pv = ctx.GetInput(4).GetTensorTypeAndShapeInfo().GetShape();
  auto sl = ctx.GetInput(5).GetTensorTypeAndShapeInfo().GetShape();
  auto tl = ctx.GetInput(6).GetTensorTypeAndShapeInfo().GetShape();
  auto cs = ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetShape();
  auto sn = ctx.GetInput(8).GetTensorTypeAndShapeInfo().GetShape();
  if (q.size() != 3) fail(std::string(op) + "query must be [B, S, (num_heads + 2*kv_num_heads)*head_dim], got " + shape_str(q));
  AttentionShapes s;
  s.B = q[0];
  s.S = q[1];
  const int64_t width = a.num_heads + 2 * a.kv_num_heads;
  if (q[2] % width != 0)
    fail(std::string(op) + "query width " + std::to_string(q[2]) + " is not a multiple of num_heads + 2*kv_num_heads = " +
         std::to_string(width));
  s.D = q[2] / width;
  if (pk.size() != 4 || pk[0] != s.B || pk[1] != a.kv_num_heads || pk[3] != s.D)
    fail(std::string(op) + "past_key must be [B, kv_num_heads, T, head_dim] = [" + std::to_string(s.B) + ", " +
         std::to_string(a.kv_num_heads) + ", T, " + std::to_string(s.D) + "], got " + shape_str(pk) +
         " (head_dim mismatch?)");
  if (pv != pk) fail(std::string(op) + "past_value " + shape_str(pv) + " differs from past_key " + shape_str(pk));
  s.T = pk[2];
  s.past_shape = pk;
  if (!(sl.size() == 1 && sl[0] == s.B))
    fail(std::string(op) + "seqlens_k must be int32 [B], got " + shape_str(sl));
  if (!(tl.empty() || (tl.size() == 1 && tl[0] == 1)))
    fail(std::string(op) + "total_sequence_length must be an int32 scalar, got " + shape_str(tl));
  if (a.do_rotary) {
    if (s.D % 2 != 0) fail(std::string(op) + "rotary needs an even head_dim, got " + std::to_string(s.D));
    if (cs.size() != 2 || cs[1] != s.D / 2 || sn != cs)
      fail(std::string(op) + "cos_cache/sin_cache must be [max_len, head_dim/2 = " + std::to_string(s.D / 2) +
           "], got " + shape_str(cs) + " and " + shape_str(sn));
  }
  s.scale = a.scale != 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(s.D));
  return s;
}

}  // namespace loopcast
