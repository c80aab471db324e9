// RowAttention, CPU kernel: attention where every row carries its own address (docs/architecture.md
// §3, "Row addressing"). Row i of an S-row call uses KV buffer pair row_buffers[i] (an attribute:
// which (loop, layer) slot a row reads is fixed by the graph), batch entry sequences[i] of that
// pair, and position positions[i]; it writes its rotated K and V there and attends to keys
// 0..positions[i] of the same (buffer, sequence), except keys in [masked[i][0], masked[i][1]).
// A row at position -1 is inactive: it writes nothing and its output is zeros.
//
// A masked range takes its keys out of the row's sequence, positions included: the row's rotary
// position is the number of keys it sees before itself, positions[i] - (hi - lo) when the range
// lies below it (rotary_position()). So a tree-verify branch row written at a scratch position
// past the other branch computes exactly the decode row at its logical position: the same
// rotation of q and of its stored K, and the same visible keys in the same ascending order.
//
// Row invariance: a row's arithmetic is BatchInvariantAttention's for a one-row call at the same
// position (attention_row_math.h: the same operations over the same visible keys in ascending
// order), so a pipeline row equals the decode row bit for bit, and
// what other rows share the call never changes it. All active rows are written before any row
// attends; two active rows may not write the same (buffer, sequence, position).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <vector>

#include "attention_row_math.h"
#include "cpu_ops.h"
#include "row_attention.h"

namespace loopcast {
namespace {

template <typename T>
struct RowAttentionCpuKernel {
  RowAttentionAttrs attrs;
  RowAttentionCpuKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  struct Call {
    const RowAttentionCpuKernel* self;
    RowAttentionShapes s;
    const T *qkv, *cos, *sin;
    std::vector<T*> keys, values;
    const int32_t *pos, *seq, *masked;
    T* out;
    int64_t width, group, half;
  };

  // Row i's position in its own sequence: its cache position less the masked keys below it.
  static int64_t rotary_position(const Call& c, int64_t i) {
    const int64_t p = c.pos[i];
    if (!c.masked) return p;
    const int64_t lo = c.masked[2 * i], hi = c.masked[2 * i + 1];
    return p >= hi ? p - (hi - lo) : p;
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const RowAttentionShapes s = row_attention_shapes(ctx, attrs);
    const int64_t S = s.S, D = s.D, T_cap = s.T, Hq = attrs.num_heads, Hkv = attrs.kv_num_heads;
    Call c{this, s, ctx.GetInput(0).GetTensorData<T>(), nullptr, nullptr, {}, {},
           ctx.GetInput(1).GetTensorData<int32_t>(), nullptr, nullptr, nullptr, (Hq + 2 * Hkv) * D, Hq / Hkv, D / 2};
    if (attrs.do_rotary) {
      c.cos = ctx.GetInput(4).GetTensorData<T>();
      c.sin = ctx.GetInput(5).GetTensorData<T>();
    }
    if (s.has_sequences) c.seq = ctx.GetInput(2).GetTensorData<int32_t>();
    if (s.has_masked) c.masked = ctx.GetInput(3).GetTensorData<int32_t>();
    c.out = ctx.GetOutput(0, {1, S, Hq * D}).GetTensorMutableData<T>();
    const size_t cache_bytes = static_cast<size_t>(s.Bseq * Hkv * T_cap * D) * sizeof(T);
    for (int64_t k = 0; k < s.pairs; ++k) {
      const T* past_k = ctx.GetInput(kRowAttentionFirstKV + 2 * k).GetTensorData<T>();
      const T* past_v = ctx.GetInput(kRowAttentionFirstKV + 2 * k + 1).GetTensorData<T>();
      T* pk = static_cast<T*>(row_attention_present(ctx, attrs, s, 1 + 2 * k));
      T* pv = static_cast<T*>(row_attention_present(ctx, attrs, s, 2 + 2 * k));
      // past and present are usually one buffer (IO binding); copy only when they differ.
      if (pk != past_k) std::memcpy(pk, past_k, cache_bytes);
      if (pv != past_v) std::memcpy(pv, past_v, cache_bytes);
      c.keys.push_back(pk);
      c.values.push_back(pv);
    }
    // Check every address before writing anything: a bad call changes no cache entry.
    std::set<std::tuple<int64_t, int64_t, int64_t>> written;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t p = c.pos[i];
      if (p == -1) continue;
      const int64_t sq = c.seq ? c.seq[i] : 0;
      if (p < 0 || p >= T_cap || (attrs.do_rotary && p >= s.rotary_len))
        fail("RowAttention: positions[" + std::to_string(i) + "]=" + std::to_string(p) + " is outside the cache (" +
             std::to_string(T_cap) + ") or rotary table (" + std::to_string(s.rotary_len) + "); -1 marks an inactive row");
      if (sq < 0 || sq >= s.Bseq)
        fail("RowAttention: sequences[" + std::to_string(i) + "]=" + std::to_string(sq) + " is outside the " +
             std::to_string(s.Bseq) + " sequences of the KV buffers");
      const int64_t lo = c.masked ? c.masked[2 * i] : 0, hi = c.masked ? c.masked[2 * i + 1] : 0;
      if (lo < 0 || hi < lo || (p >= lo && p < hi))
        fail("RowAttention: masked_keys[" + std::to_string(i) + "]=[" + std::to_string(lo) + ", " + std::to_string(hi) +
             ") must be an interval that leaves the row's own position " + std::to_string(p) + " visible");
      if (!written.insert({attrs.row_buffers[i], sq, p}).second)
        fail("RowAttention: rows share the KV address (buffer " + std::to_string(attrs.row_buffers[i]) +
             ", sequence " + std::to_string(sq) + ", position " + std::to_string(p) + "); each row needs its own");
    }
    // 1. Commit every active row's rotated K (rounded to T, as stored) and V.
    std::vector<float> buf(static_cast<size_t>(D));
    for (int64_t i = 0; i < S; ++i) {
      const int64_t p = c.pos[i];
      if (p < 0) continue;
      const int64_t k = attrs.row_buffers[i], sq = c.seq ? c.seq[i] : 0;
      const int64_t rp = rotary_position(c, i);
      const T* row = c.qkv + i * c.width;
      for (int64_t h = 0; h < Hkv; ++h) {
        rotate(row + (Hq + h) * D, c.cos ? c.cos + rp * c.half : nullptr, c.sin ? c.sin + rp * c.half : nullptr, D,
                   attrs.do_rotary, buf.data());
        const size_t at = static_cast<size_t>(((sq * Hkv + h) * T_cap + p) * D);
        const T* vsrc = row + (Hq + Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) c.keys[k][at + d] = from_float<T>(buf[d]);
        for (int64_t d = 0; d < D; ++d) c.values[k][at + d] = vsrc[d];
      }
    }
    // 2. One task per (row, head) on ORT's intra-op pool, reading only the stored cache.
    ctx.ParallelFor(&RowAttentionCpuKernel::attend, static_cast<size_t>(S * Hq), 0, &c);
  }

  static void attend(void* raw, size_t task) {
    const Call& c = *static_cast<const Call*>(raw);
    const RowAttentionAttrs& attrs = c.self->attrs;
    const int64_t D = c.s.D, T_cap = c.s.T, Hq = attrs.num_heads, Hkv = attrs.kv_num_heads;
    const int64_t i = static_cast<int64_t>(task) / Hq, h = static_cast<int64_t>(task) % Hq;
    T* o = c.out + i * Hq * D + h * D;
    const int64_t p = c.pos[i];
    if (p < 0) {
      for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(0.0f);
      return;
    }
    const int64_t k = attrs.row_buffers[i], sq = c.seq ? c.seq[i] : 0;
    const int64_t lo = c.masked ? c.masked[2 * i] : 0, hi = c.masked ? c.masked[2 * i + 1] : 0;
    thread_local std::vector<float> q, acc, scores, row, keys32, values32;
    q.resize(static_cast<size_t>(D));
    acc.resize(static_cast<size_t>(D));
    row.resize(static_cast<size_t>(D));
    scores.resize(static_cast<size_t>(p + 1));
    const int64_t rp = rotary_position(c, i);
    rotate(c.qkv + i * c.width + h * D, c.cos ? c.cos + rp * c.half : nullptr, c.sin ? c.sin + rp * c.half : nullptr,
               D, attrs.do_rotary, q.data());
    const size_t cache = static_cast<size_t>((sq * Hkv + h / c.group) * T_cap * D);
    // BatchInvariantAttention's row arithmetic over the visible keys (attention_row_math.h).
    const float* kc = rows_f32(c.keys[k] + cache, p + 1, D, keys32);
    const float* vc = rows_f32(c.values[k] + cache, p + 1, D, values32);
    attend_row(q.data(), p, lo, hi, kc, vc, D, c.s.scale, scores.data(), acc.data(), row.data());
    for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(row[d]);
  }
};

RowAttentionOp<RowAttentionCpuKernel<float>, float, false> g_f32;
RowAttentionOp<RowAttentionCpuKernel<Ort::Float16_t>, Ort::Float16_t, false> g_f16;
RowAttentionOp<RowAttentionCpuKernel<Ort::BFloat16_t>, Ort::BFloat16_t, false> g_bf16;

}  // namespace

void add_cpu_row_attention(Ort::CustomOpDomain& domain) {
  domain.Add(&g_f32);
  domain.Add(&g_f16);
  domain.Add(&g_bf16);
}

}  // namespace loopcast
