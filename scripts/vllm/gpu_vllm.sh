#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU machine's driver for the vLLM backend (issue 31), after scripts/vllm/assemble.sh part2
# on the same warm machine: waits for the package build if assemble.sh install started one,
# checks the plugin once per machine, runs the named stages in order, each within the rest of
# this call's time, keeps their results under SP_VLLM_HOME/results (so later calls of the
# session add to them), and writes to OUTDIR vllm-results.md (scripts/vllm/report.py:
# record-ready markdown of every result so far), summary.txt and results.tar.gz (the JSON
# results and logs). python3 scripts/vllm/calls.py prints the calls of both sessions.
# Usage: scripts/vllm/gpu_vllm.sh OUTDIR STAGE...
# Stages (each one's expected seconds: scripts/vllm/calls.py, which this reads to skip a stage
# that would not fit the rest of the call):
#   tests     pytest tests/python/test_vllm_*.py against vLLM on the GPU
#   smoke     the whole engine on a tiny dummy model: graphs, chunked prefill, mixed steps
#   ttft8b    Llama-3.1-8B shape, dummy weights, one-shot 32K/64K/128K: FLASH_ATTN; ours dense and
#             synthetic densities 20/10/5%
#   chunked   the same at 32K and 128K with vLLM's default batched-token budget
#   tp        tensor parallelism (issue 34; a machine of SP_VLLM_TP GPUs, default 2): the 8B shape at
#             32K and 128K with --tp SP_VLLM_TP, FLASH_ATTN and ours dense and synthetic 5%
#   greedy    50 prompts x 32 greedy tokens, ours dense vs FLASH_ATTN (SP_VLLM_MODEL), and the
#             controls (SP_VLLM_GREEDY_CONTROLS, default TRITON_ATTN) vs FLASH_ATTN
#   qwen      real weights (SP_VLLM_MODEL) at 16K/32K: FLASH_ATTN and every policy, with density
#   serve-fa, serve-ours   vllm serve + vllm bench serve at serve.py's rates (or SP_VLLM_RATES)
#   soak      5 minutes with ours at SP_VLLM_SOAK_RATE, by default the saturating rate of this
#             session's serve-ours, or of the record SP_VLLM_SOAK_OF on a machine that did not
#             serve (serve.py --soak-rate-of: common.soak_rate): failures and device memory
# Env: SP_VLLM_MODEL (a checkpoint folder with its tokenizer; default $QWEN_HOME/qwen-bf16, as
#      scripts/model/assemble_qwen.sh writes it), SP_VLLM_QWEN_SETTINGS (JSON list of {name,
#      sparseprefill}), SP_VLLM_CALIBRATION (the model's calibration file; unset, the qwen stage
#      makes it first: scripts/model/calibrate_qwen.sh, stage qwen-cal), SP_VLLM_GATE_BUDGET,
#      SP_VLLM_DENSITY_TARGET, SP_VLLM_SKIP_TARGET (the calibrated settings the qwen stage adds:
#      exact_gate at budget 16, and what docs/quality.md recommends at 32K, estimate_select at
#      density target 0.2 and softmax_skip at skip target 0.8),
#      SP_VLLM_SERVE_CONFIG (ours when serving; default estimate_select alpha 0.1),
#      SP_VLLM_RATES, SP_VLLM_SOAK_RATE, SP_VLLM_SLO_S (report.py), SP_COMMIT (recorded),
#      SP_CALL_START (epoch seconds the call began, default now: set it when something ran
#      before in the same call), SP_CALL_SECONDS (seconds of work from SP_CALL_START, default
#      560), SP_VLLM_PROFILE=1 (the TTFT stages also run one request per setting and length
#      under torch.profiler: ttft.py --profile, tables in results/<stage>-profile.txt; the
#      stages' expected seconds do not count it).
set -uo pipefail
out=${1:?usage: scripts/vllm/gpu_vllm.sh OUTDIR STAGE...}
shift
out=$(mkdir -p "$out" && cd "$out" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
# shellcheck source=scripts/vllm/env.sh
source "$root/scripts/vllm/env.sh"
py=${PYTHON:-python3}
res=$SP_VLLM_HOME/results
mkdir -p "$res"
start=${SP_CALL_START:-$(date +%s)}
budget=${SP_CALL_SECONDS:-560}
model=${SP_VLLM_MODEL:-${QWEN_HOME:-/root/qwen}/qwen-bf16}
export SP_VLLM_MODEL=$model
note() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$res/summary.txt"; }
left() { echo $((budget - ($(date +%s) - start))); }
scripts=$root/scripts/vllm

if [ -d "$SP_VLLM_HOME/install" ]; then
  "$root/scripts/python_install_background.sh" wait "$SP_VLLM_HOME/install" "$(left)" ||
    { note "the package build failed or did not finish (scripts/vllm/assemble.sh install)"; exit 1; }
fi
# Once per machine: the plugin as vLLM finds it, and what ran (vLLM logs to stdout on import, so
# the JSON goes straight to its file).
if [ ! -f "$res/env.json" ]; then
  (cd /tmp && "$py" - "$res/env.json" <<PY
import json, shutil, subprocess, sys
from importlib.metadata import entry_points
import sparseprefill, sparseprefill.vllm.backend, torch, vllm, vllm.vllm_flash_attn
info = sparseprefill.build_info()
if "backend cuda: not compiled" in info:
    sys.exit("gpu_vllm: sparseprefill is installed without CUDA")
found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "sparseprefill"]
if found != ["sparseprefill.vllm:register"]:
    sys.exit(f"gpu_vllm: vllm.general_plugins entry point sparseprefill: {found}")
smi = shutil.which("nvidia-smi")
gpu = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip() if smi else None
with open(sys.argv[1], "w") as f:
    json.dump({"commit": "${SP_COMMIT:-unknown}", "gpu": gpu, "vllm": vllm.__version__, "torch": torch.__version__,
               "sparseprefill": info.splitlines()[0]}, f)
PY
  ) || { note "the plugin check failed"; exit 1; }
  note "plugin registered: $(cat "$res/env.json")"
fi

# stage NAME COMMAND...: runs COMMAND within the rest of the call when at least NAME's expected
# seconds (calls.py) are left.
stage() {
  local name=$1 need
  shift
  need=$("$py" "$scripts/calls.py" --need "$name")
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
# calibrated_settings CAL: qwen_settings plus the settings that read the calibration file CAL.
calibrated_settings() {
  "$py" - "$qwen_settings" "$1" "${SP_VLLM_GATE_BUDGET:-16}" "${SP_VLLM_DENSITY_TARGET:-0.2}" \
    "${SP_VLLM_SKIP_TARGET:-0.8}" <<'PY'
import json, sys
settings, cal = json.loads(sys.argv[1]), sys.argv[2]
budget, density, skip = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
for name, body in ((f"exact_gate b{budget}", {"policy": "exact_gate", "budget": budget}),
                   (f"estimate_select dt{density:g}", {"policy": "estimate_select", "density_target": density}),
                   (f"softmax_skip st{skip:g}", {"policy": "softmax_skip", "skip_target": skip})):
    settings.append({"name": name, "sparseprefill": dict(body, calibration=cal)})
print(json.dumps(settings))
PY
}
synthetic='[{"name": "dense", "sparseprefill": {"policy": "dense"}},
  {"name": "synthetic 20%", "sparseprefill": {"policy": "synthetic", "density": 0.2}},
  {"name": "synthetic 10%", "sparseprefill": {"policy": "synthetic", "density": 0.1}},
  {"name": "synthetic 5%", "sparseprefill": {"policy": "synthetic", "density": 0.05}}]'
serve_config=${SP_VLLM_SERVE_CONFIG:-'{"policy": "estimate_select", "alpha": 0.1}'}
label8b="Llama-3.1-8B shape, dummy weights"
tp_settings='[{"name": "dense", "sparseprefill": {"policy": "dense"}},
  {"name": "synthetic 5%", "sparseprefill": {"policy": "synthetic", "density": 0.05}}]'
tp=${SP_VLLM_TP:-2}
# profile NAME: ttft.py's --profile for stage NAME when SP_VLLM_PROFILE is set.
profile() { [ -n "${SP_VLLM_PROFILE:-}" ] && echo "--profile=$res/$1-profile.txt"; }

for name in "$@"; do
  case $name in
    tests)
      stage tests "$py" -m pytest -q -p no:cacheprovider --timeout=300 tests/python/test_vllm_*.py
      [ -f "$res/tests.log" ] && grep -E "passed|failed|error" "$res/tests.log" | tail -n 1 >"$res/tests.txt" ;;
    smoke) stage smoke "$py" "$scripts/smoke.py" --out "$res/smoke.json" ;;
    greedy)
      has_model greedy && stage greedy "$py" "$scripts/greedy.py" --model "$model" \
        --controls "${SP_VLLM_GREEDY_CONTROLS-TRITON_ATTN}" --out "$res/greedy" ;;
    ttft8b)
      stage ttft8b-fa "$py" "$scripts/ttft.py" --backend FLASH_ATTN --dummy --lengths 32768,65536,130048 \
        --label "$label8b" $(profile ttft8b-fa) --out "$res/ttft8b-fa.json"
      stage ttft8b-ours "$py" "$scripts/ttft.py" --backend CUSTOM --dummy --lengths 32768,65536,130048 \
        --settings "$synthetic" --label "$label8b" $(profile ttft8b-ours) --out "$res/ttft8b-ours.json" ;;
    chunked)
      stage chunked-fa "$py" "$scripts/ttft.py" --backend FLASH_ATTN --dummy --lengths 32768,130048 --chunk 0 \
        --label "$label8b" $(profile chunked-fa) --out "$res/chunked-fa.json"
      stage chunked-ours "$py" "$scripts/ttft.py" --backend CUSTOM --dummy --lengths 32768,130048 --chunk 0 \
        --settings "$synthetic" --label "$label8b" $(profile chunked-ours) --out "$res/chunked-ours.json" ;;
    tp)
      stage tp-fa "$py" "$scripts/ttft.py" --backend FLASH_ATTN --dummy --tp "$tp" --lengths 32768,130048 \
        --label "$label8b, TP=$tp" --out "$res/tp$tp-fa.json"
      stage tp-ours "$py" "$scripts/ttft.py" --backend CUSTOM --dummy --tp "$tp" --lengths 32768,130048 \
        --settings "$tp_settings" --label "$label8b, TP=$tp" --out "$res/tp$tp-ours.json" ;;
    qwen)
      has_model qwen || continue
      cal=${SP_VLLM_CALIBRATION:-$res/qwen-cal.safetensors}
      if [ -z "${SP_VLLM_CALIBRATION:-}" ]; then
        stage qwen-cal env QWEN_MODEL="$model" PYTHON="$py" "$root/scripts/model/calibrate_qwen.sh" "$cal"
      fi
      settings=$qwen_settings
      if [ -f "$cal" ]; then settings=$(calibrated_settings "$cal"); else note "qwen: no calibration $cal"; fi
      stage qwen-fa "$py" "$scripts/ttft.py" --backend FLASH_ATTN --model "$model" --lengths 16384,32000 \
        --label "$(basename "$model")" $(profile qwen-fa) --out "$res/qwen-fa.json"
      stage qwen-ours "$py" "$scripts/ttft.py" --backend CUSTOM --model "$model" --lengths 16384,32000 \
        --settings "$settings" --density --label "$(basename "$model")" $(profile qwen-ours) \
        --out "$res/qwen-ours.json" ;;
    serve-fa)
      has_model serve-fa && stage serve-fa "$py" "$scripts/serve.py" --backend FLASH_ATTN --model "$model" \
        ${SP_VLLM_RATES:+--rates "$SP_VLLM_RATES"} --out "$res/serve-fa.json" ;;
    serve-ours)
      has_model serve-ours && stage serve-ours "$py" "$scripts/serve.py" --backend CUSTOM --model "$model" \
        --config "$serve_config" ${SP_VLLM_RATES:+--rates "$SP_VLLM_RATES"} --out "$res/serve-ours.json" ;;
    soak)
      soak_rate=(--soak-rate-of "$res/serve-ours.json")
      [ -f "$res/serve-ours.json" ] || soak_rate=(--soak-rate-of "${SP_VLLM_SOAK_OF:-$res/serve-ours.json}")
      [ -n "${SP_VLLM_SOAK_RATE:-}" ] && soak_rate=(--soak-rate "$SP_VLLM_SOAK_RATE")
      has_model soak && stage soak "$py" "$scripts/serve.py" --backend CUSTOM --model "$model" --config "$serve_config" \
        --soak 300 "${soak_rate[@]}" --out "$res/soak.json" ;;
    *) note "unknown stage $name (tests smoke greedy ttft8b chunked tp qwen serve-fa serve-ours soak)" ;;
  esac
done

(cd "$scripts" && "$py" report.py "$res") >"$out/vllm-results.md" 2>"$out/report.err" || cat "$out/report.err"
[ -s "$out/report.err" ] || rm -f "$out/report.err"
note "done: $out/vllm-results.md"
cp "$res/summary.txt" "$out/summary.txt"
tar -czf "$out/results.tar.gz" -C "$res" .
