#!/usr/bin/env bash
# One call on the lent H200 (docs/perf.md): `tools/gpu_machine/h200_run.sh PHASE...` with PHASE in
# setup | kernels | tests | parity | bench-demo | bench-1p4b | gate-1p4b | sampling | fresh-install | export-mem
# | serve | host-loop | weight-mem | export-profile | export-speed | alternate | gate-overhead | nbits
# | quant-llama | quant-ouro | depth-demo | prep-1p4b | depth-1p4b | huginn | gpu-tests | quick-tests
# | serve-pipeline | serve-equal | serve-chunk | nbits-kernels | huginn-long
# (kernels needs no setup). Results go to /root/res and are packed into
# $OUT/results.tgz after every phase (the device returns only a few files per call).
# setup expects the onnxruntime-gpu wheel staged in parts under /root/og (see docs/perf.md)
# and the pure-Python wheels the machine lacks under .ortgpu/wheels.
set -uo pipefail
[ -n "${OUT:-}" ] || { echo "tools/gpu_machine/h200_run.sh runs on the lent GPU machine (\$OUT unset)" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD
# The repository maps exporter/, graphs/, ... into loopcast.*; plain PYTHONPATH imports need
# the same view (links inside this throwaway copy of the work tree).
for d in exporter graphs ort_runtime custom_ops cli serve bench; do [ -e loopcast/$d ] || ln -s ../$d loopcast/$d; done
export LOOPCAST_CACHE=${LOOPCAST_CACHE:-$PWD/.lccache}   # carries the custom-op library built on the dev machine
# Bytecode cached between runs, as an installed package has it (without this, every timed
# export round recompiled the package: 2 s of a 6 s export on this host)
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pycache
RES=/root/res; mkdir -p "$RES"
phase_setup() {
  cat /root/og/p? > /root/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/onnxruntime_gpu-*.whl
  for w in .ortgpu/wheels/*.whl; do
    [ -f "$w" ] || continue
    mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z'); mod=${mod/onnx_ir/onnx_ir}
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$w"
  done
  # The prebuilt op library, when staged (.ortgpu/opswheel): no build on this machine.
  for w in .ortgpu/opswheel/loopcast_ops-*.whl; do
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$w"
  done
  # ORT-GenAI (the export comparison) when its wheel was staged by a call of its own into
  # /root/og/genai; the host's Python has the torch and transformers its model builder needs
  for w in /root/og/genai/onnxruntime_genai*.whl; do
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$w"
  done
  python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())" | tee "$RES/setup.txt"
  # A library built on the dev machine (LOOPCAST_CUDA=1, sm_90) and carried in .lccache/ops-*/
  # goes where this machine's build would (the cache key holds the nvcc path, which differs),
  # only if its source stamp is these sources' digest: saves the ~100 s build per fresh machine
  local key digest lib
  key=$(python3 -c "from loopcast.custom_ops.library import _build_dir; print(_build_dir()[0])")
  digest=$(python3 -c "from loopcast.custom_ops import build; print(build.source_digest())")
  for lib in .lccache/ops-*/libloopcast_ops.so; do
    [ -f "$lib" ] && [ ! -f "$key/libloopcast_ops.so" ] || continue
    [ "$(cat "$(dirname "$lib")/source_digest.txt" 2>/dev/null)" = "$digest" ] || continue
    mkdir -p "$key" && cp "$lib" "$key/" && echo "carried $lib" >> "$RES/setup.txt"
  done
  # the op library now (~100 s unless carried), so that no later phase's timeout pays for it
  python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())" >> "$RES/setup.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$RES/setup.txt"
}
phase_tests() {
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  LOOPCAST_OPS_LIB=$LIB timeout 240 python3 -m pytest -q -p no:cacheprovider tests/ort_runtime/test_cuda.py \
    2>&1 | tail -30 > "$RES/gpu-tests.txt"   # the kernel tests run in the kernels phase
  # RowAttention's per-row launches (the fallback of its one-launch path) must give the same bits
  LOOPCAST_ROW_ATTENTION=per-row LOOPCAST_OPS_LIB=$LIB timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/ort_runtime/test_cuda.py -k "pipeline or batch_invariant" 2>&1 | tail -8 >> "$RES/gpu-tests.txt"
}
phase_kernels() {  # ctypes microbenchmarks; needs no onnxruntime-gpu. baseline = a build of an earlier commit
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  local libs=(--lib "new=$LIB")
  [ -f .lccache/baseline/libloopcast_ops.so ] && libs+=(--lib "baseline=$PWD/.lccache/baseline/libloopcast_ops.so")
  timeout 150 python3 -m tools.bench.bench_matmul_cuda "${libs[@]}" --ms 1,5,16 --variant nopdl:LOOPCAST_PDL=0 \
    --variant nostage:LOOPCAST_SWIGLU_STAGE=0 --calls 96 --out "$RES" > "$RES/bench-matmul.txt" 2>&1
  LOOPCAST_OPS_LIB=$LIB timeout 60 python3 -m pytest -q -p no:cacheprovider tests/custom_ops/test_cuda_kernels.py tests/custom_ops/test_cuda_kv_rows.py tests/custom_ops/test_cuda_norm_kernels.py \
    2>&1 | tail -30 > "$RES/gpu-kernel-tests.txt"
}
phase_parity() {
  timeout 150 python3 -m tools.probes.gpu_parity --new-tokens 48 --checkpoint demo --out "$RES/parity.json" > "$RES/parity.txt" 2>&1
}
phase_bench_demo() {
  timeout 420 python3 -m loopcast.cli bench demo --device cuda --dtype fp16 --dtype bf16 --iters 20 --new-tokens 64 \
    --past 1000 --widths 2,5,8 --passes 3 --work-dir /root/bw --out "$RES/bench-demo.json" > "$RES/bench-demo.txt" 2>&1
}
phase_gate_overhead() {  # where a stood-down default gate's time goes on the demo (tools/bench/gate_overhead.py)
  for dt in fp16 bf16; do
    timeout 200 python3 -m tools.bench.gate_overhead demo --device cuda --dtype $dt --passes 4 \
      --json "$RES/gate-overhead-$dt.json" > "$RES/gate-overhead-$dt.txt" 2>&1
  done
}
phase_gate_1p4b() {  # the speculation gate table on random Ouro-1.4B weights (end to end, loopcast ops)
  timeout 420 python3 -m loopcast.cli bench preset:ouro-1.4b --device cuda --dtype fp16 --dtype bf16 \
    --variant batch-invariant --iters 10 --past 400 --widths 5 --new-tokens 64 --alternate-tokens 0 --no-profile \
    --no-torch --work-dir /root/bw14 --out "$RES/gate-1p4b.json" > "$RES/gate-1p4b.txt" 2>&1
}
phase_bench_1p4b() {
  timeout 360 python3 -m loopcast.cli bench preset:ouro-1.4b --device cuda --dtype fp16 --dtype bf16 --iters 20 \
    --past 1024 --widths 5 --no-end-to-end --alternate-tokens 0 --work-dir /root/bw14 \
    --out "$RES/bench-1p4b.json" > "$RES/bench-1p4b.txt" 2>&1
}
phase_serve() {  # batched vs one-at-a-time serving (tools/bench/loadgen.py, in-process engines; docs/serving.md)
  # Random Ouro-1.4B and 1.43B-Llama (Ouro's shape, R=1) checkpoints, fp16, --target cuda ops, 64 slots;
  # the batched graphs eager and captured per width (--cuda-graphs).
  local common=(--device cuda --dtype fp16 --max-batch 64 --max-length 512 --concurrency 1,4,16,64 --prompt-len 64
                --max-tokens 64 --time-limit 20 --work-dir /root/lg)
  timeout 280 python3 -m tools.bench.loadgen preset:ouro-1.4b "${common[@]}" --out "$RES/serve-ouro-1.4b.json" \
    > "$RES/serve-ouro-1.4b.txt" 2>&1
  timeout 200 python3 -m tools.bench.loadgen preset:ouro-1.4b "${common[@]}" --modes batched --cuda-graphs \
    --out "$RES/serve-ouro-1.4b-graphs.json" > "$RES/serve-ouro-1.4b-graphs.txt" 2>&1
  timeout 240 python3 -m tools.bench.loadgen preset:llama-1.43b "${common[@]}" --cuda-graphs \
    --out "$RES/serve-llama-1.43b.json" > "$RES/serve-llama-1.43b.txt" 2>&1
  phase_serve_chunk "${common[@]}"
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  LOOPCAST_OPS_LIB=$LIB timeout 180 python3 -m pytest -q -p no:cacheprovider tests/ort_runtime/test_batch_cuda.py \
    tests/ort_runtime/test_prefix_cache_cuda.py 2>&1 | tail -20 > "$RES/serve-gpu-tests.txt"
}
phase_serve_chunk() {  # chunked prefill (one chunk between two steps) and the multi-turn prefix cache,
  # captured batched kinds; chunks as uncaptured prefill calls, then as captured ones (--prefill-rows)
  local common=("$@")
  [ ${#common[@]} -gt 0 ] || common=(--device cuda --dtype fp16 --max-batch 64 --max-length 512 --prompt-len 64
                                     --max-tokens 64 --time-limit ${CHUNK_LEVEL_S:-20} --work-dir /root/lg
                                     --requests ${CHUNK_REQUESTS:-160})
  # CHUNK_VARIANTS: "chunk:rows" at concurrency 16 (rows 0: uncaptured exact-length chunks)
  local v chunk rows
  for v in ${CHUNK_VARIANTS:-16:16 32:32}; do
    IFS=: read -r chunk rows <<< "$v"
    local extra=(); [ "$rows" = 0 ] || extra=(--prefill-rows "$rows")
    timeout 150 python3 -m tools.bench.loadgen preset:ouro-1.4b "${common[@]}" --modes batched --concurrency 16 \
      --cuda-graphs --prefill-chunk "$chunk" "${extra[@]}" --out "$RES/serve-ouro-1.4b-chunk$chunk-rows$rows.json" \
      > "$RES/serve-ouro-1.4b-chunk$chunk-rows$rows.txt" 2>&1
  done
  [ "${CHUNK_MULTITURN:-1}" = 1 ] || return 0
  timeout 200 python3 -m tools.bench.loadgen preset:ouro-1.4b "${common[@]}" --modes batched --concurrency 1,4 \
    --cuda-graphs --prefill-chunk 32 --prefill-rows 32 --multi-turn --shared-prefix 256 \
    --out "$RES/serve-ouro-1.4b-multiturn.json" > "$RES/serve-ouro-1.4b-multiturn.txt" 2>&1
}
phase_sampling() {  # seeded sampling reproducible run to run, on the GPU (fp16) and the CPU (fp32)
  { python3 -m loopcast.cli export loopcast/demo_model -o /root/art-demo-fp16 --dtype fp16 --target cuda --overwrite
    python3 -m loopcast.cli export loopcast/demo_model -o /root/art-demo-fp32 --overwrite; } > "$RES/sampling-export.txt" 2>&1
  timeout 200 python3 -m tools.probes.sampling_repro /root/art-demo-fp16 --device cuda --out "$RES/sampling-cuda.json" > "$RES/sampling.txt" 2>&1
  timeout 200 python3 -m tools.probes.sampling_repro /root/art-demo-fp32 --device cpu --out "$RES/sampling-cpu.json" >> "$RES/sampling.txt" 2>&1
}
phase_fresh_install() {  # a fresh install (loopcast + the prebuilt loopcast-ops wheel) exports --target cuda without nvcc
  local log="$RES/fresh-install.txt" wheel
  wheel=$(ls .ortgpu/opswheel/loopcast_ops-*.whl | head -1)
  rm -rf /tmp/fresh /tmp/fresh-cache /tmp/fresh-art; mkdir -p /tmp/fresh-home
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fresh . "$wheel" > "$log" 2>&1
  du -sh /tmp/fresh "$wheel" >> "$log"
  ( cd /tmp && export HOME=/tmp/fresh-home LOOPCAST_CACHE=/tmp/fresh-cache PYTHONPATH=/tmp/fresh:/tmp/site
    export PATH=$(echo "$PATH" | tr ':' '\n' | grep -v -i cuda | paste -sd: -)
    echo "nvcc on PATH: $(command -v nvcc || echo none)"
    t0=$(date +%s.%N)
    timeout 120 python3 -m loopcast.cli export /tmp/fresh/loopcast/demo_model -o /tmp/fresh-art --dtype fp16 --target cuda
    echo "export --target cuda wall: $(python3 -c "import time; print(round(time.time() - $t0, 2))") s"
    ls /tmp/fresh-cache 2>/dev/null | sed 's/^/cache entry: /'
    timeout 120 python3 -m loopcast.cli generate /tmp/fresh-art --device cuda --prompt "def add(a, b):" \
      --max-new-tokens 32 --speculative pipeline --json | head -c 600 ) >> "$log" 2>&1
}
phase_export_mem() {  # a 1.43B fp16 Llama export against cp (and ORT-GenAI's builder when this
  # Python has onnxruntime-genai), 3 interleaved rounds; then device memory of the loaded artifact per number
  # of graph kinds opened (each CUDA session holds its own device copy of its initializers).
  local genai=(); python3 -c "import onnxruntime_genai" 2>/dev/null && genai=(--genai-python python3 --genai-ep cuda)
  timeout 420 python3 -m tools.bench.bench_export --preset llama-1.4b --dtype fp16 --repeats 3 --work /root/bx \
    --json "$RES/export-1p4b.json" "${genai[@]}" -- --dtype fp16 > "$RES/export-1p4b.txt" 2>&1
  nproc >> "$RES/export-1p4b.txt"; df -h /root | tail -1 >> "$RES/export-1p4b.txt"
  timeout 240 python3 -m tools.bench.bench_weight_sharing /root/bx/artifact --device cuda --repeats 1 \
    --json "$RES/weight-memory-cuda.json" > "$RES/weight-memory-cuda.txt" 2>&1
}
phase_weight_mem() {  # one device copy of the weights for every session (ort_runtime/loading/shared_weights.py)
  # 1.43B Llama (stock fp16 and --target cuda) and Ouro-1.4B (--target cuda: six kinds), random weights
  { python3 -m loopcast.cli random-checkpoint /root/llama --preset llama-1.4b --dtype fp16
    python3 -m loopcast.cli random-checkpoint /root/ouro --preset ouro-1.4b --dtype fp16
    python3 -m loopcast.cli export /root/llama -o /root/wm-llama-stock --dtype fp16 --max-length 2048 --overwrite
    python3 -m loopcast.cli export /root/llama -o /root/wm-llama-ops --dtype fp16 --target cuda --max-length 2048 --overwrite
    python3 -m loopcast.cli export /root/ouro -o /root/wm-ouro-ops --dtype fp16 --target cuda --max-length 2048 \
      --overwrite; } > "$RES/weight-mem-export.txt" 2>&1
  timeout 560 python3 -m tools.bench.bench_weight_sharing /root/wm-llama-stock /root/wm-llama-ops /root/wm-ouro-ops \
    --device cuda --repeats 2 --json "$RES/weight-mem-cuda.json" > "$RES/weight-mem-cuda.txt" 2>&1
}
phase_export_profile() {  # where a 1.43B fp16 export spends its time on this host (after weight-mem)
  local log="$RES/export-profile.txt"
  python3 -c "
import hashlib, os, time
b = os.urandom(256 << 20)
for algo in ('sha256', 'sha1', 'blake2b'):
    t = time.perf_counter(); hashlib.new(algo, b).digest(); print(algo, round(256 / (time.perf_counter() - t)), 'MiB/s')
" > "$log" 2>&1
  grep -o -m1 -w sha_ni /proc/cpuinfo >> "$log"; grep -m1 "model name" /proc/cpuinfo >> "$log"
  { /usr/bin/time -f "cp %e s" cp /root/llama/model.safetensors /root/cp-test.safetensors; rm -f /root/cp-test.safetensors
    python3 -m cProfile -o /root/export.prof -m loopcast.cli export /root/llama -o /root/prof-art --dtype fp16 \
      --overwrite 2>&1 | tail -1
    python3 -c "import pstats; p = pstats.Stats('/root/export.prof'); p.sort_stats('cumulative').print_stats(30); p.sort_stats('tottime').print_stats(15)"
  } >> "$log" 2>&1
}
phase_export_speed() {  # a 1.43B fp16 export against cp (and ORT-GenAI's builder when staged),
  # 3 interleaved rounds (no memory table)
  local genai=(); python3 -c "import onnxruntime_genai" 2>/dev/null && genai=(--genai-python python3 --genai-ep cuda)
  timeout 400 python3 -m tools.bench.bench_export --preset llama-1.4b --dtype fp16 --repeats 3 --work /root/bx \
    --json "$RES/export-speed.json" "${genai[@]}" -- --dtype fp16 > "$RES/export-speed.txt" 2>&1
  nproc >> "$RES/export-speed.txt"
}
phase_host_loop() {  # plain decode end to end: a 1.43B Llama (Ouro-1.4B layer shapes, R=1), 1000-token prompt
  { python3 -m loopcast.cli random-checkpoint /root/llama --preset llama-1.4b --dtype fp16
    python3 -m loopcast.cli export /root/llama -o /root/llama-art --dtype fp16 --target cuda --max-length 1536 \
      --overwrite; } > "$RES/host-loop.txt" 2>&1
  timeout 240 python3 -m tools.bench.host_loop /root/llama-art --device cuda --prompt-len 1000 --new-tokens 256 \
    --out "$RES/host-loop.json" >> "$RES/host-loop.txt" 2>&1
}
phase_alternate() {  # tree verify on CUDA (masked kernel rows, engine exactness), then the table
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  { LOOPCAST_OPS_LIB=$LIB timeout 100 python3 -m pytest -q -p no:cacheprovider tests/custom_ops/test_cuda_kernels.py tests/custom_ops/test_cuda_kv_rows.py tests/custom_ops/test_cuda_norm_kernels.py \
      -k "masked or move_positions" 2>&1 | tail -8
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ort_runtime/test_cuda.py -k alternate 2>&1 | tail -8
  } > "$RES/alternate-tests.txt"
  for dt in fp16 bf16; do
    timeout 200 python3 -m tools.bench.bench_alternate --device cuda --dtype $dt --json "$RES/alternate-$dt.json" \
      > "$RES/alternate-$dt.txt" 2>&1
  done
}
phase_quant_llama() {  # int4 end to end: the 1.43B Llama (Ouro-1.4B layer shapes, R=1), ours (--target cuda,
  # the loopcast NBits op) beside ORT-GenAI's int4 (its builder's -p int4 -e cuda) with its CUDA graph, same
  # random checkpoint, 1000-token prompt, 2 interleaved rounds (docs/quantization.md)
  local log="$RES/quant-llama.txt"
  { python3 -m loopcast.cli random-checkpoint /root/llama --preset llama-1.4b --dtype fp16
    cp loopcast/demo_model/tokenizer.json loopcast/demo_model/tokenizer_config.json /root/llama/  # the builder saves one
    /usr/bin/time -f "export int4 %e s" python3 -m loopcast.cli export /root/llama -o /root/llama-int4 --dtype fp16 \
      --target cuda --quantize int4 --max-length 1536 --overwrite
    /usr/bin/time -f "export fp16 %e s" python3 -m loopcast.cli export /root/llama -o /root/llama-fp16 --dtype fp16 \
      --target cuda --max-length 1536 --overwrite
    python3 -m loopcast.cli inspect /root/llama-int4 | head -30
    /usr/bin/time -f "builder int4 %e s" timeout 300 python3 -m onnxruntime_genai.models.builder -i /root/llama \
      -o /root/genai-int4 -p int4 -e cuda -c /root/genai-cache 2>&1 | tail -5
    du -sh /root/llama-int4 /root/llama-fp16 /root/genai-int4
  } > "$log" 2>&1
  for round in 1 2; do
    timeout 120 python3 -m tools.bench.host_loop /root/llama-int4 --device cuda --prompt-len 1000 --new-tokens 256 \
      --out "$RES/quant-llama-ours-int4-$round.json" >> "$log" 2>&1
    [ -d /root/genai-int4 ] && timeout 120 python3 -m tools.bench.genai_decode /root/genai-int4 --device cuda \
      --cuda-graph --prompt-len 1000 --new-tokens 256 --out "$RES/quant-llama-genai-int4-$round.json" >> "$log" 2>&1
    timeout 120 python3 -m tools.bench.host_loop /root/llama-fp16 --device cuda --prompt-len 1000 --new-tokens 256 \
      --out "$RES/quant-llama-ours-fp16-$round.json" >> "$log" 2>&1
  done
}
phase_quant_ouro() {  # Ouro-1.4B shapes, fp16 activations: float weights beside int4 in one bench run
  timeout 560 python3 -m loopcast.cli bench preset:ouro-1.4b --device cuda --dtype fp16 --variant batch-invariant \
    --quantize none --quantize int4 --iters 10 --past 400 --widths 5 --new-tokens 48 --alternate-tokens 0 \
    --no-torch --work-dir /root/bw14 --out "$RES/quant-ouro.json" > "$RES/quant-ouro.txt" 2>&1
}
phase_nbits() {  # int4/int8 BatchInvariantMatMulNBits: ctypes kernel tests, the ORT-level tests, the microbenchmark
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  { LOOPCAST_OPS_LIB=$LIB timeout 200 python3 -m pytest -q -p no:cacheprovider tests/custom_ops/test_cuda_nbits_kernels.py \
      2>&1 | tail -12
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ort_runtime/test_cuda_quantized.py 2>&1 | tail -12
  } > "$RES/nbits-tests.txt"
  { timeout 120 python3 -m tools.bench.bench_matmul_nbits_cuda --lib "$LIB" --ms 1,5,16 --out "$RES"
    timeout 100 python3 -m tools.bench.bench_matmul_nbits_cuda --lib "$LIB" --bits 8 --ms 1,5,16 --out "$RES"
  } > "$RES/bench-matmul-nbits.txt" 2>&1
}
phase_nbits_kernels() {  # the int4/int8 kernels alone (ctypes; no onnxruntime-gpu): tests, microbenchmark, layer chain
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  LOOPCAST_OPS_LIB=$LIB timeout ${NK_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rfE --tb=line \
    tests/custom_ops/test_cuda_nbits_kernels.py tests/custom_ops/test_cuda_norm_prologue.py 2>&1 | tail -20 \
    > "$OUT/nbits-kernel-tests.txt"
  { timeout 120 python3 -m tools.bench.bench_matmul_nbits_cuda --lib "$LIB" --ms 1,4,5,16 --out "$RES"
    timeout 120 python3 -m tools.bench.bench_matmul_nbits_cuda --lib "$LIB" --block 128 --asymmetric --ms 1,5 --out "$RES"
    timeout 120 python3 -m tools.bench.bench_matmul_nbits_cuda --lib "$LIB" --bits 8 --ms 1,5 --out "$RES"
    timeout 120 python3 -m tools.bench.bench_matmul_nbits_cuda --lib "$LIB" --dtype bfloat16 --ms 1,5 --out "$RES"
  } > "$OUT/bench-matmul-nbits.txt" 2>&1
  timeout 150 python3 -m tools.bench.bench_layer_chain_cuda --lib "$LIB" --ms 1,4,5 --dtypes float16 --past 400 \
    --out "$RES" > "$OUT/layer-chain.txt" 2>&1
}
phase_prep_1p4b() {  # depth-1p4b's checkpoint and export alone (run beside other phases, then depth-1p4b)
  { [ -f /root/ouro14/config.json ] || python3 -m loopcast.cli random-checkpoint /root/ouro14 --preset ouro-1.4b --dtype fp16
    [ -f /root/ouro14-fp16/manifest.json ] || /usr/bin/time -f "export %e s" python3 -m loopcast.cli export /root/ouro14 \
      -o /root/ouro14-fp16 --dtype fp16 --target cuda --max-length 512 --overwrite
  } > "$RES/prep-1p4b.txt" 2>&1
}
phase_depth_1p4b() {  # adaptive depth on random Ouro-1.4B weights (fp16, loopcast ops): static depths, the gate
  # under both KV policies and forced exits, ms/token beside full depth (tools/bench/bench_depth.py, docs/adaptive-depth.md)
  local log="$RES/depth-1p4b.txt"
  { [ -f /root/ouro14/config.json ] || python3 -m loopcast.cli random-checkpoint /root/ouro14 --preset ouro-1.4b --dtype fp16
    [ -f /root/ouro14-fp16/manifest.json ] || /usr/bin/time -f "export %e s" python3 -m loopcast.cli export /root/ouro14 \
      -o /root/ouro14-fp16 --dtype fp16 --target cuda --max-length 512 --overwrite
    timeout ${DEPTH_TIMEOUT:-400} python3 -m tools.bench.bench_depth --artifact /root/ouro14-fp16 --device cuda --passes ${DEPTH_PASSES:-3} --prompts 3 \
      --new-tokens 32 --json "$RES/depth-1p4b.json"
  } > "$log" 2>&1
}
phase_depth_demo() {  # adaptive depth on the demo (fp16, loopcast ops): the speed table of static depths and the
  # gate beside full depth, with the last-exited q within 1 % of full depth's bits/byte on the CPU (docs/adaptive-depth.md)
  local log="$RES/depth-demo.txt"
  { python3 -m loopcast.cli export demo -o /root/demo-fp16 --dtype fp16 --target cuda --overwrite
    timeout ${DEPTH_TIMEOUT:-300} python3 -m tools.bench.bench_depth --artifact /root/demo-fp16 --device cuda --passes ${DEPTH_PASSES:-6} --prompts 3 \
      --new-tokens 48 --q 0.29 --json "$RES/depth-demo.json"
    # gated full through the pipeline against the full-depth pipeline (tools/bench/bench_exit_lanes.py)
    [ "${LANES_PASSES:-12}" = 0 ] || timeout ${LANES_TIMEOUT:-200} python3 -m tools.bench.bench_exit_lanes --artifact /root/demo-fp16 --device cuda \
      --passes ${LANES_PASSES:-12} --q 0.1 --q 0.2 --json "$RES/exit-lanes-demo.json"
  } > "$log" 2>&1
}
phase_huginn() {  # on CUDA (worst case ~11 min; 16 GPU tests took over 150 s on 2026-12-04): the tiny GPU tests, then huginn-3.5b at r = 32
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  # tiny-huginn fp16/bf16: the fp32 reference, and with --ops loopcast verify and cycle rows
  # bit-identical to decode rows, every speculative mode = plain
  LOOPCAST_OPS_LIB=$LIB timeout ${HUGINN_TEST_TIMEOUT:-300} python3 -m pytest -q -rfE -p no:cacheprovider tests/ort_runtime/test_recurrent_cuda.py \
    2>&1 | tail -20 > "$RES/huginn-gpu-tests.txt"
  # the must-show: plain vs the pipeline on oracle drafts (100 %, 90 %), rows against decode rows.
  # Its heads of 96 are stored padded to 128 for the loopcast attention kernels (docs/checkpoints.md,
  # "Head padding"). A lane leaves after r = 32 cycles, so 32 new tokens are half fill (2026-12-03:
  # 1.94 cycles a token); 128 measure nearer the steady state.
  timeout ${HUGINN_TIMEOUT:-360} python3 -m loopcast.cli bench preset:huginn-3.5b --device cuda --dtype fp16 --dtype bf16 \
    --variant batch-invariant --loops 32 --oracle-reject 0,0.1 --iters 10 --new-tokens ${HUGINN_TOKENS:-128} --no-torch \
    --no-profile --alternate-tokens 0 --work-dir /root/hug --out "$RES/huginn-3.5b.json" > "$RES/huginn-bench.txt" 2>&1
  # plain decoding at r = 32 with the stock ops (which take head_dim 96; tools/bench/bench_huginn.py)
  timeout 120 python3 -m tools.bench.bench_huginn --preset huginn-3.5b --dtype bf16 --device cuda --loops 32 \
    --tokens 32 --work /root/hug-plain --json "$RES/huginn-plain-bf16.json" > "$RES/huginn-plain-bf16.txt" 2>&1
}
phase_huginn_long() {  # (~8-10 min) the batched recurrent kinds on CUDA, the pipeline over
  # longer generations (a lane leaves after r cycles: the fill is amortised over more tokens), and
  # where a recurrent_cycle's GPU time goes (tools/bench/profile_recurrent.py)
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  LOOPCAST_OPS_LIB=$LIB timeout ${HL_TEST_TIMEOUT:-300} python3 -m pytest -q -x --tb=short -p no:cacheprovider -rfE \
    tests/ort_runtime/test_recurrent_cuda.py -k "${HL_TESTS:-batched}" > "$RES/huginn-batch-tests.txt" 2>&1
  timeout ${HUGINN_TIMEOUT:-360} python3 -m loopcast.cli bench preset:huginn-3.5b --device cuda --dtype fp16 --dtype bf16 \
    --variant batch-invariant --loops 32 --oracle-reject 0,0.1 --iters 10 --new-tokens ${HUGINN_TOKENS:-256} --no-torch \
    --no-profile --alternate-tokens 0 --work-dir /root/hug --out "$RES/huginn-long.json" > "$RES/huginn-long.txt" 2>&1
  local art; art=$(ls -d /root/hug/art-*-fp16-batch-invariant 2>/dev/null | head -1)
  [ -n "$art" ] && timeout ${PROFILE_TIMEOUT:-120} python3 -m tools.bench.profile_recurrent --artifact "$art" \
    --dtype fp16 --loops 32 --past 1024 --json "$RES/huginn-profile.json" > "$RES/huginn-profile.txt" 2>&1
}
phase_gpu_tests() {  # every GPU test file (ctypes kernels and ORT sessions) in one pytest run, one line per failure
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  LOOPCAST_OPS_LIB=$LIB timeout ${GPU_TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rfE \
    $(ls tests/custom_ops/test_cuda_*.py tests/ort_runtime/test_*cuda*.py) 2>&1 | tail -40 > "$RES/gpu-all-tests.txt"
}
phase_quick_tests() {  # the kernel tests, then the ORT-level GPU tests named in $QUICK_TESTS (default: all), verbose
  LIB=$(python3 -c "from loopcast.exporter.export import custom_op_library as c; print(c())")
  [ "${QUICK_KERNELS:-1}" = 0 ] || LOOPCAST_OPS_LIB=$LIB timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE \
    --tb=line tests/custom_ops/test_cuda_*.py 2>&1 | tail -15 > "$RES/quick-kernel-tests.txt"
  LOOPCAST_OPS_LIB=$LIB timeout ${QUICK_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -v -rfE --tb=short \
    ${QUICK_TESTS:-$(ls tests/ort_runtime/test_*cuda*.py)} > "$RES/quick-tests.txt" 2>&1
}
phase_serve_pipeline() {  # the batched pipeline beside batched plain, oracle drafts 92 % right, Ouro-1.4B shapes
  # (every width captured at the engine's start, prompts prefilled by captured 32-token chunks;
  # SP_PER_CLIENT requests a client, the same work in both modes; SP_LEVEL_S a guard)
  # the log goes straight to $OUT: a call cut short keeps the levels that ran
  timeout ${SP_TIMEOUT:-300} python3 -m tools.bench.loadgen preset:ouro-1.4b --device cuda --dtype ${SP_DTYPE:-fp16} \
    --max-batch 32 --max-length 512 --prompt-len 32 --max-tokens ${SP_MAX_TOKENS:-128} \
    --requests-per-client ${SP_PER_CLIENT:-6} --time-limit ${SP_LEVEL_S:-60} \
    --work-dir /root/lg --modes ${SP_MODES:-batched} --cuda-graphs --prefill-rows ${SP_PREFILL_ROWS:-32} --oracle-reject 0.08 \
    --speculative ${SP_SPEC:-none,pipeline} \
    --concurrency ${SP_LEVELS:-1,4,8,32} --out "$RES/serve-pipeline${SP_TAG:-}.json" > "$OUT/serve-pipeline${SP_TAG:-}.txt" 2>&1
}
phase_serve_equal() {  # every mode at C=32 beside one request at a time (sequential = `loopcast generate` alone)
  local dt
  for dt in ${SE_DTYPES:-fp16 bf16}; do
    SP_DTYPE=$dt SP_TAG=-equal-$dt SP_MODES=sequential,batched SP_SPEC=none,prompt-lookup,self,pipeline \
      SP_LEVELS=32 SP_PER_CLIENT=1 SP_MAX_TOKENS=${SE_MAX_TOKENS:-64} SP_TIMEOUT=${SE_TIMEOUT:-200} phase_serve_pipeline
  done
}
for p in "$@"; do
  echo "== $p $(date -u +%T)" >> "$RES/phases.txt"
  "phase_${p//-/_}"
  tar czf "$OUT/results.tgz" -C "$RES" .   # after every phase: a call cut short keeps what ran
done
echo "== done $(date -u +%T)" >> "$RES/phases.txt"
tar czf "$OUT/results.tgz" -C "$RES" .
tail -n 5 "$RES"/*.txt
