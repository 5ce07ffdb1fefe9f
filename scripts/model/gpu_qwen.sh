#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Issue 32 on the GPU machine, after scripts/model/assemble_qwen.sh final: calibrates
# Qwen2.5-Coder-1.5B-Instruct on the Debian Reference (once; 3 windows of 32K tokens, block 128,
# bf16), then runs python -m sparseprefill.quality.longctx on the Debian Policy Manual until this
# call's time is spent, resuming QWEN_HOME/run/results.json where an earlier call stopped. The
# results, the calibration and the logs go to OUTDIR (5 files); the results become
# bench/records/quality/ and docs/quality.md here (python -m sparseprefill.quality.report ...
# --long RESULTS.json).
# Usage: scripts/model/gpu_qwen.sh OUTDIR
# Env: SP_CALL_START (epoch seconds the call began, default now), SP_CALL_SECONDS (seconds of
#      work this call may take from SP_CALL_START, default 540), QWEN_HOME (default /root/qwen),
#      SP_CAL_ARGS, SP_LONG_ARGS (more calibrate / longctx arguments; later ones win). On a fresh
#      machine, carry .carry/qwen-results/ (an earlier call's results.json and cal.safetensors) to
#      go on with them; without its cal.safetensors (a record's results alone) the calibration is
#      made again with the date the results record, and longctx goes on only if it is the same file
#      (QWEN_CARRY: another folder than .carry/qwen-results). For scripts/model/qwen_dry_run.sh
#      on a CPU: SP_DEVICE=cpu, QWEN_MODEL (a model folder other than QWEN_HOME/qwen-bf16).
set -uo pipefail
out=${1:?usage: scripts/model/gpu_qwen.sh OUTDIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/model/qwen_env.sh
. "$root/scripts/model/qwen_env.sh"
home=${QWEN_HOME:-/root/qwen}
run=$home/run
py=${PYTHON:-python3}
start=${SP_CALL_START:-$(date +%s)}
budget=${SP_CALL_SECONDS:-540}
device=${SP_DEVICE:-cuda}
dtype=$(qwen_dtype "$device")
model=${QWEN_MODEL:-$home/qwen-bf16}
carry=${QWEN_CARRY:-.carry/qwen-results}
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
mkdir -p "$out" "$run"
note() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$out/summary.txt"; }
[ -d "$model" ] || { echo "gpu_qwen: $model missing: run the part calls first" >&2; exit 2; }
if [ -d "$carry" ] && [ ! -f "$run/results.json" ]; then
  cp "$carry/results.json" "$run/" || exit 2
  if [ -f "$carry/cal.safetensors" ]; then
    cp "$carry/cal.safetensors" "$run/" && note "carried results and calibration resumed"
  else
    # The calibration is made again below, dated as the results record it (SOURCE_DATE_EPOCH):
    # the same model, text and statistics then give the same file, which longctx checks
    # against the results' calibration_sha256 before it goes on.
    SOURCE_DATE_EPOCH=$(cd /tmp && "$py" -c 'import json, sys; from sparseprefill.quality.data import calibration_epoch
print(calibration_epoch(json.load(open(sys.argv[1]))))' "$run/results.json") || exit 2
    export SOURCE_DATE_EPOCH
    note "carried results resumed; their calibration is made again, dated $(date -u -d "@$SOURCE_DATE_EPOCH" +%F)"
  fi
fi
if [ "$device" != cpu ]; then
  (cd /tmp && "$py" -c "import sparseprefill, sys; sys.exit('backend cuda: not compiled' in sparseprefill.build_info())") || {
    echo "gpu_qwen: sparseprefill with CUDA is not installed (scripts/model/assemble_qwen.sh install)" >&2; exit 2; }
fi
if [ ! -f "$run/cal.safetensors" ]; then
  note "calibrate"
  QWEN_HOME=$home QWEN_MODEL=$model SP_DEVICE=$device PYTHON=$py \
    scripts/model/calibrate_qwen.sh "$run/cal.safetensors" >"$out/calibrate.log" 2>&1 ||
    { tail -30 "$out/calibrate.log"; note "calibrate FAILED"; exit 1; }
  tail -1 "$out/calibrate.log"
fi
left=$((budget - ($(date +%s) - start) - 20))
if [ "$left" -lt 30 ]; then
  note "no time left for longctx (${left} s)"
  cp "$run/cal.safetensors" "$out/"
  exit 0
fi
note "longctx, deadline ${left} s"
# shellcheck disable=SC2086
(cd /tmp && timeout $((left + 45)) "$py" -m sparseprefill.quality.longctx --model "$model" \
  --model-name "$QWEN_MODEL_NAME" --text "$home/policy.txt" --calibration "$run/cal.safetensors" \
  --output "$run/results.json" --device "$device" --dtype "$dtype" --deadline "$left" ${SP_LONG_ARGS:-}) \
  >"$out/longctx.log" 2>&1
rc=$?
tail -n 12 "$out/longctx.log" | tr '\r' '\n' | grep -v '^\s*$' | tail -n 12
cp "$run/results.json" "$out/qwen-long.json" 2>/dev/null
cp "$run/cal.safetensors" "$out/" 2>/dev/null
note "longctx rc=$rc"
exit $rc
