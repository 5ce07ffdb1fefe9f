#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU machine's driver for the vLLM backend (issue 31), after scripts/vllm/assemble.sh part2
# on the same warm machine: runs the named stages in order, each within its time limit, keeps
# their results under SP_VLLM_HOME/results (so later calls add to them), and writes to OUTDIR
# vllm-results.md (scripts/vllm/report.py: record-ready markdown of every result so far),
# summary.txt and results.tar.gz (the JSON results and logs).
# Usage: scripts/vllm/gpu_vllm.sh OUTDIR STAGE...
# Stages (about 9 minutes of work fit one device call; docs/vllm.md, "Figures", has the plan):
#   tests     pytest tests/python/test_vllm_*.py against vLLM on the GPU            (~2 min)
#   smoke     the whole engine on a tiny dummy model: graphs, chunked prefill, mixed steps (~1 min)
#   greedy    50 prompts x 32 greedy tokens, ours dense vs FLASH_ATTN (SP_VLLM_MODEL)   (~3 min)
#   ttft8b    Llama-3.1-8B shape, dummy weights, one-shot 32K/64K/128K: FLASH_ATTN; ours dense and
#             synthetic densities 20/10/5%                                              (~5 min)
#   chunked   the same at 32K and 128K with vLLM's default batched-token budget          (~4 min)
#   qwen      real weights (SP_VLLM_MODEL) at 16K/32K: FLASH_ATTN and every policy, with density (~3 min)
#   serve-fa, serve-ours   vllm serve + vllm bench serve at SP_VLLM_RATES (~4 min each)
#   soak      5 minutes at SP_VLLM_SOAK_RATE with ours: failures and device memory      (~6 min)
# Env: SP_VLLM_MODEL (a checkpoint folder with its tokenizer; default $QWEN_HOME/qwen-bf16, as
#      scripts/model/assemble_qwen.sh writes it), SP_VLLM_QWEN_SETTINGS (JSON list of {name,
#      sparseprefill}), SP_VLLM_CALIBRATION + SP_VLLM_GATE_BUDGET (exact_gate in the qwen stage),
#      SP_VLLM_SERVE_CONFIG (ours when serving; default estimate_select alpha 0.1),
#      SP_VLLM_RATES (default 1,2,4,8), SP_VLLM_SOAK_RATE (default 4), SP_VLLM_SLO_S (report),
#      SP_COMMIT (recorded), SP_CALL_SECONDS (work this call may take, default 560).
set -uo pipefail
out=${1:?usage: scripts/vllm/gpu_vllm.sh OUTDIR STAGE...}
shift
out=$(mkdir -p "$out" && cd "$out" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/vllm/env.sh
source "$root/scripts/vllm/env.sh"
py=${PYTHON:-python3}
res=$SP_VLLM_HOME/results
mkdir -p "$res"
start=$(date +%s)
budget=${SP_CALL_SECONDS:-560}
model=${SP_VLLM_MODEL:-${QWEN_HOME:-/root/qwen}/qwen-bf16}
export SP_VLLM_MODEL=$model
note() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$res/summary.txt"; }
left() { echo $((budget - ($(date +%s) - start))); }
scripts=$root/scripts/vllm

# What ran (vLLM logs to stdout on import, so the JSON goes straight to its file).
"$py" - "$res/env.json" <<PY
import json, shutil, subprocess, sys, sparseprefill, vllm, torch
smi = shutil.which("nvidia-smi")
gpu = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip() if smi else None
with open(sys.argv[1], "w") as f:
    json.dump({"commit": "${SP_COMMIT:-unknown}", "gpu": gpu, "vllm": vllm.__version__, "torch": torch.__version__,
               "sparseprefill": sparseprefill.build_info().splitlines()[0]}, f)
PY

# stage NAME SECONDS COMMAND...: runs COMMAND with a time limit when at least SECONDS are left.
stage() {
  local name=$1 need=$2
  shift 2
  if [ "$(left)" -lt "$need" ]; then
    note "$name: skipped, $(left) s left of this call (needs ~$need s): run it in the next call"
    return
  fi
  note "$name: start"
  timeout --kill-after=20 "$(left)" "$@" >"$res/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc $(grep -E '^(ttft|smoke|greedy|serve|[0-9]+ (passed|failed))' "$res/$name.log" | tail -n 3 | tr '\n' ' ')"
}

# has_model STAGE: whether SP_VLLM_MODEL is there (else the stage is skipped, saying why).
has_model() {
  [ -d "$model" ] && return 0
  note "$1: skipped: no checkpoint folder $model (set SP_VLLM_MODEL; scripts/vllm/README.md)"
  return 1
}

qwen_settings=${SP_VLLM_QWEN_SETTINGS:-'[{"name": "dense", "sparseprefill": {"policy": "dense"}},
  {"name": "estimate_select a0.1", "sparseprefill": {"policy": "estimate_select", "alpha": 0.1}},
  {"name": "estimate_select a0.1 mc", "sparseprefill": {"policy": "estimate_select", "alpha": 0.1, "mean_correction": true}},
  {"name": "softmax_skip a10", "sparseprefill": {"policy": "softmax_skip", "a": 10}},
  {"name": "permute_stop t0.005", "sparseprefill": {"policy": "permute_stop", "tau": 0.005}}]'}
if [ -n "${SP_VLLM_CALIBRATION:-}" ]; then
  qwen_settings=$("$py" -c "import json, sys; s = json.loads(sys.argv[1]); s.append({'name': 'exact_gate b${SP_VLLM_GATE_BUDGET:-16}', 'sparseprefill': {'policy': 'exact_gate', 'calibration': sys.argv[2], 'budget': ${SP_VLLM_GATE_BUDGET:-16}}}); print(json.dumps(s))" "$qwen_settings" "$SP_VLLM_CALIBRATION")
fi
synthetic='[{"name": "dense", "sparseprefill": {"policy": "dense"}},
  {"name": "synthetic 20%", "sparseprefill": {"policy": "synthetic", "density": 0.2}},
  {"name": "synthetic 10%", "sparseprefill": {"policy": "synthetic", "density": 0.1}},
  {"name": "synthetic 5%", "sparseprefill": {"policy": "synthetic", "density": 0.05}}]'
serve_config=${SP_VLLM_SERVE_CONFIG:-'{"policy": "estimate_select", "alpha": 0.1}'}
label8b="Llama-3.1-8B shape, dummy weights"

for name in "$@"; do
  case $name in
    tests)
      stage tests 150 "$py" -m pytest -q -p no:cacheprovider --timeout=300 tests/python/test_vllm_backend.py \
        tests/python/test_vllm_config.py tests/python/test_vllm_batch.py
      grep -E "passed|failed|error" "$res/tests.log" | tail -n 1 >"$res/tests.txt" ;;
    smoke) stage smoke 90 "$py" "$scripts/smoke.py" --out "$res/smoke.json" ;;
    greedy)
      has_model greedy && stage greedy 200 "$py" "$scripts/greedy.py" --model "$model" --out "$res/greedy" ;;
    ttft8b)
      stage ttft8b-fa 120 "$py" "$scripts/ttft.py" --backend FLASH_ATTN --dummy --lengths 32768,65536,130048 \
        --label "$label8b" --out "$res/ttft8b-fa.json"
      stage ttft8b-ours 200 "$py" "$scripts/ttft.py" --backend CUSTOM --dummy --lengths 32768,65536,130048 \
        --settings "$synthetic" --label "$label8b" --out "$res/ttft8b-ours.json" ;;
    chunked)
      stage chunked-fa 100 "$py" "$scripts/ttft.py" --backend FLASH_ATTN --dummy --lengths 32768,130048 --chunk 0 \
        --label "$label8b" --out "$res/chunked-fa.json"
      stage chunked-ours 150 "$py" "$scripts/ttft.py" --backend CUSTOM --dummy --lengths 32768,130048 --chunk 0 \
        --settings "$synthetic" --label "$label8b" --out "$res/chunked-ours.json" ;;
    qwen)
      has_model qwen || continue
      stage qwen-fa 60 "$py" "$scripts/ttft.py" --backend FLASH_ATTN --model "$model" --lengths 16384,32000 \
        --label "$(basename "$model")" --out "$res/qwen-fa.json"
      stage qwen-ours 150 "$py" "$scripts/ttft.py" --backend CUSTOM --model "$model" --lengths 16384,32000 \
        --settings "$qwen_settings" --density --label "$(basename "$model")" --out "$res/qwen-ours.json" ;;
    serve-fa)
      has_model serve-fa && stage serve-fa 240 "$py" "$scripts/serve.py" --backend FLASH_ATTN --model "$model" \
        --rates "${SP_VLLM_RATES:-1,2,4,8}" --out "$res/serve-fa.json" ;;
    serve-ours)
      has_model serve-ours && stage serve-ours 240 "$py" "$scripts/serve.py" --backend CUSTOM --model "$model" --config "$serve_config" \
        --rates "${SP_VLLM_RATES:-1,2,4,8}" --out "$res/serve-ours.json" ;;
    soak)
      has_model soak && stage soak 360 "$py" "$scripts/serve.py" --backend CUSTOM --model "$model" --config "$serve_config" \
        --soak 300 --soak-rate "${SP_VLLM_SOAK_RATE:-4}" --out "$res/soak.json" ;;
    *) note "unknown stage $name (tests smoke greedy ttft8b chunked qwen serve-fa serve-ours soak)" ;;
  esac
done

(cd "$scripts" && "$py" report.py "$res") >"$out/vllm-results.md" 2>"$out/report.err" || cat "$out/report.err"
[ -s "$out/report.err" ] || rm -f "$out/report.err"
note "done: $out/vllm-results.md"
cp "$res/summary.txt" "$out/summary.txt"
tar -czf "$out/results.tar.gz" -C "$res" .
