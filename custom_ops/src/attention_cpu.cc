// BatchInvariantAttention, CPU kernel: rotary, KV-cache write and causal GQA attention for the
// packed-QKV GroupQueryAttention form our graphs use.
//
// Row invariance: all new rows' K/V are rotated, rounded to T and stored first; then each row
// attends over positions 0..p reading only the stored cache and its own q (tasks of a few rows of
// one kv head on ORT's thread pool; a task's rows share key and value loads, never a partial sum). Every
// reduction has an order fixed by the row's keys alone (attention_row_math.h), so row i of an
// S-row call is bit-identical to the same row computed alone after rows < i were committed.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_row_math.h"
#include "attention_shapes.h"
#include "cpu_ops.h"
#include "op_schemas.h"

namespace loopcast {
namespace {

constexpr int64_t kTasks = 12;  // tasks to aim for per call (rows allowing): even on 2-4 threads

template <typename T>
struct AttentionCpuKernel {
  AttentionAttrs attrs;
  AttentionCpuKernel(const OrtApi&, const OrtKernelInfo* info) : attrs(info) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const AttentionShapes s = attention_shapes(ctx, attrs);
    const int64_t B = s.B, S = s.S, D = s.D, T_cap = s.T, Hq = attrs.num_heads, Hkv = attrs.kv_num_heads;
    const int64_t group = Hq / Hkv, width = (Hq + 2 * Hkv) * D;
    const T* qkv = ctx.GetInput(0).GetTensorData<T>();
    const T* past_k = ctx.GetInput(3).GetTensorData<T>();
    const T* past_v = ctx.GetInput(4).GetTensorData<T>();
    const int32_t* seqlens = ctx.GetInput(5).GetTensorData<int32_t>();
    const T* cos = attrs.do_rotary ? ctx.GetInput(7).GetTensorData<T>() : nullptr;
    const T* sin = attrs.do_rotary ? ctx.GetInput(8).GetTensorData<T>() : nullptr;
    const int64_t max_pos = attrs.do_rotary ? ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetShape()[0] : T_cap;
    T* out = ctx.GetOutput(0, {B, S, Hq * D}).GetTensorMutableData<T>();
    T* pk = ctx.GetOutput(1, s.past_shape).GetTensorMutableData<T>();
    T* pv = ctx.GetOutput(2, s.past_shape).GetTensorMutableData<T>();
    const size_t cache_bytes = static_cast<size_t>(B * Hkv * T_cap * D) * sizeof(T);
    // past and present are usually one buffer (IO binding); copy only when they differ.
    if (pk != past_k) std::memcpy(pk, past_k, cache_bytes);
    if (pv != past_v) std::memcpy(pv, past_v, cache_bytes);

    const int64_t half = D / 2;
    std::vector<float> buf(static_cast<size_t>(D));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = static_cast<int64_t>(seqlens[b]) + 1 - S;
      if (n < 0 || n + S > T_cap || (attrs.do_rotary && n + S > max_pos))
        fail("BatchInvariantAttention: seqlens_k[" + std::to_string(b) + "]=" + std::to_string(seqlens[b]) +
             " gives positions " + std::to_string(n) + ".." + std::to_string(n + S - 1) + " outside the cache (" +
             std::to_string(T_cap) + ") or rotary table (" + std::to_string(max_pos) + ")");
      const size_t cache_b = static_cast<size_t>(b * Hkv * T_cap * D);
      // 1. Commit the new rows' rotated K (rounded to T, as stored) and V.
      for (int64_t i = 0; i < S; ++i) {
        const int64_t p = n + i;
        const T* row = qkv + (b * S + i) * width;
        for (int64_t h = 0; h < Hkv; ++h) {
          rotate(row + (Hq + h) * D, cos ? cos + p * half : nullptr, sin ? sin + p * half : nullptr, D,
                 attrs.do_rotary, buf.data());
          T* kdst = pk + cache_b + static_cast<size_t>((h * T_cap + p) * D);
          T* vdst = pv + cache_b + static_cast<size_t>((h * T_cap + p) * D);
          const T* vsrc = row + (Hq + Hkv + h) * D;
          for (int64_t d = 0; d < D; ++d) kdst[d] = from_float<T>(buf[d]);
          for (int64_t d = 0; d < D; ++d) vdst[d] = vsrc[d];
        }
      }
    }
    // 2. The rows of each (batch, kv head) — its q heads at the new positions — attend over the
    // stored cache at positions 0..p, in tasks on ORT's intra-op pool of up to `chunk` rows each.
    // Tasks share nothing but the read-only cache, so how they are scheduled cannot change a
    // bit; the rows of a task share only the loads of each key and value, never a partial sum,
    // so neither can how the rows are cut into tasks. About kTasks of them: with one task per
    // kv head, 3 kv heads on 2 threads left one thread idle a third of the time.
    const int64_t rows = group * S, heads_b = B * Hkv;
    const int64_t pieces = std::min(rows, (kTasks + heads_b - 1) / heads_b);
    // an even count where it can: a task's rows go in pairs (attention_row_pairs.h)
    const int64_t chunk = std::min(rows, ((rows + pieces - 1) / pieces + 1) / 2 * 2);
    const int64_t per_head = (rows + chunk - 1) / chunk;
    Heads heads{this, s, qkv, cos, sin, pk, pv, out, seqlens, width, group, half, chunk, per_head};
    ctx.ParallelFor(&Heads::run, static_cast<size_t>(heads_b * per_head), 0, &heads);
  }

  struct Heads {
    const AttentionCpuKernel* self;
    AttentionShapes s;
    const T *qkv, *cos, *sin, *pk, *pv;
    T* out;
    const int32_t* seqlens;
    int64_t width, group, half, chunk, per_head;

    static void run(void* raw, size_t task_index) {
      const Heads& r = *static_cast<const Heads*>(raw);
      const AttentionAttrs& attrs = r.self->attrs;
      const int64_t S = r.s.S, D = r.s.D, T_cap = r.s.T, Hq = attrs.num_heads, Hkv = attrs.kv_num_heads;
      const int64_t task = static_cast<int64_t>(task_index);
      const int64_t head = task / r.per_head, piece = task % r.per_head;
      const int64_t kvh = head % Hkv, b = head / Hkv;
      const int64_t n = static_cast<int64_t>(r.seqlens[b]) + 1 - S;
      // this task's rows j = first..first+rows-1 of the kv head's row j = g·S + i: q head
      // kvh·group + g at position n + i
      const int64_t first = piece * r.chunk, rows = std::min(r.chunk, r.group * S - first);
      int64_t last = 0;  // the latest position among them: the keys they read are 0..last
      for (int64_t j = first; j < first + rows; ++j) last = std::max(last, n + j % S);
      thread_local std::vector<float> q, acc, scores, sums, out, keys32, values32;
      thread_local std::vector<int64_t> counts;
      q.resize(static_cast<size_t>(rows * D));
      acc.resize(static_cast<size_t>(rows * D));
      out.resize(static_cast<size_t>(rows * D));
      scores.resize(static_cast<size_t>(rows * (last + 1)));
      sums.resize(static_cast<size_t>(rows));
      counts.resize(static_cast<size_t>(rows));
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t g = (first + t) / S, i = (first + t) % S, p = n + i, h = kvh * r.group + g;
        rotate(r.qkv + (b * S + i) * r.width + h * D, r.cos ? r.cos + p * r.half : nullptr,
               r.sin ? r.sin + p * r.half : nullptr, D, attrs.do_rotary, q.data() + t * D);
        counts[static_cast<size_t>(t)] = p + 1;  // keys 0..p
      }
      const size_t cache = static_cast<size_t>((b * Hkv + kvh) * T_cap * D);
      const float* kc = rows_f32(r.pk + cache, last + 1, D, keys32);
      const float* vc = rows_f32(r.pv + cache, last + 1, D, values32);
      attend_causal_rows(q.data(), rows, counts.data(), kc, vc, D, r.s.scale, last + 1, scores.data(), acc.data(),
                         sums.data(), out.data());
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t g = (first + t) / S, i = (first + t) % S;
        T* o = r.out + (b * S + i) * Hq * D + (kvh * r.group + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(out[t * D + d]);
      }
    }
  };
};

AttentionOp<AttentionCpuKernel<float>, float, false> g_f32;
AttentionOp<AttentionCpuKernel<Ort::Float16_t>, Ort::Float16_t, false> g_f16;
AttentionOp<AttentionCpuKernel<Ort::BFloat16_t>, Ort::BFloat16_t, false> g_bf16;

}  // namespace

void add_cpu_attention(Ort::CustomOpDomain& domain) {
  domain.Add(&g_f32);
  domain.Add(&g_f16);
  domain.Add(&g_bf16);
}

}  // namespace loopcast
