#!/usr/bin/env bash
# Demo-model training runs side by side on the lent H200 (docs/demo-model.md), then the
# held-out evaluation of each. Usage, on the device, with .corpus and .ortgpu/wheels carried:
#   bash tools/gpu_machine/h200_train.sh BUDGET_S NAME1 "TRAIN FLAGS 1" [NAME2 "TRAIN FLAGS 2" ...]
# Results: $OUT/train-results.tgz (stdout, log.jsonl, eval.json per run) and the fp16 weights of
# every run that finished, in parts under 16 MiB ($OUT/NAME.safetensors.partN; `cat` rejoins).
# Flags are split on blanks (no value may contain one). Reusing a NAME on the same (warm)
# machine resumes that run from /root/run-NAME, as the trainer does for any existing run dir.
set -uo pipefail
shopt -s nullglob
[ $# -ge 3 ] && [ $(( ($# - 1) % 2 )) -eq 0 ] || { echo "usage: $0 BUDGET_S NAME \"FLAGS\" [NAME \"FLAGS\" ...]" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "tools/gpu_machine/h200_train.sh runs on the lent GPU machine (\$OUT unset)" >&2; exit 2; }
# A device call ends at 600 s: training, export (~10 s) and one evaluation per run (~25 s on the
# H200) must fit, or the results of the runs evaluated last are lost.
need=$(( $1 + 20 + 30 * ($# - 1) / 2 ))
[ "$need" -le 590 ] || { echo "budget $1 s + $(( ($# - 1) / 2 )) evaluations need ~$need s; one call has 600" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for d in exporter graphs ort_runtime custom_ops; do [ -e loopcast/$d ] || ln -s ../$d loopcast/$d; done
for w in .ortgpu/wheels/*.whl; do  # the pure-Python / abi3 wheels the machine lacks
  mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$w"
done
budget=$1; shift
RES=/root/train; mkdir -p "$RES"; names=()
while [ $# -ge 2 ]; do
  name=$1; read -r -a flags <<< "$2"; shift 2; names+=("$name")
  rm -rf "${RES:?}/$name" "/root/out-$name"   # nothing from an earlier call is reported as this one's
  mkdir -p "$RES/$name"
  python3 -m tools.demo_model.train_demo_model --data .corpus --run-dir "/root/run-$name" --out "/root/out-$name" \
    --time-budget-s "$budget" "${flags[@]}" > "$RES/$name/stdout.txt" 2>&1 &
done
wait
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$RES/device.txt"
python3 -c "import torch; print(torch.__version__)" >> "$RES/device.txt"
for name in "${names[@]}"; do
  cp "/root/run-$name/log.jsonl" "$RES/$name/" 2>/dev/null
  if [ -f "/root/out-$name/model.safetensors" ]; then
    python3 -m tools.demo_model.eval_demo_model --checkpoint "/root/out-$name" --data .corpus \
      --out "$RES/$name/eval.json" > "$RES/$name/eval-stdout.txt" 2>&1
    split -b 15000000 -d -a 1 "/root/out-$name/model.safetensors" "$OUT/$name.safetensors.part"
    cp "/root/out-$name/config.json" "$RES/$name/"
  fi
  # after every run, so that a call cut short by the device limit still returns what finished
  tar czf "$OUT/train-results.tgz" -C "$RES" .
done
for name in "${names[@]}"; do echo "== $name"; tail -n 3 "$RES/$name/stdout.txt"; \
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k != 'samples'})" \
  "$RES/$name/eval.json" 2>/dev/null; done
