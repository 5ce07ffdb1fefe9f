#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU procedure of issue 32 rehearsed on a CPU, every script and code path the device calls
# run: the 22 parts copied and checked as the part calls do (QWEN_HOME under WORK), `final`'s
# join, checks and GGUF-to-bf16 conversion with its logits check (on the CPU: a few minutes;
# --no-convert skips it), then scripts/model/gpu_qwen.sh twice on a random two-layer Qwen2 with
# the model's tokenizer (calibration, perplexity/KL at 1K/2K, timing, RULER at 2K/4K with 2
# samples per task): the first call stopped by its deadline, the second resuming it, a third
# given the results alone (the calibration made again, the same file); last the report with
# --long into WORK (docs/ untouched). Needs scripts/model/fetch_qwen.sh and
# pack_qwen.sh first, and the package installed CPU-only (scripts/python_ci.sh's way) in the
# running python.
# Usage: scripts/model/qwen_dry_run.sh [--no-convert] [WORK]   (default WORK build/qwen-dry-run)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
convert=1
if [ "${1:-}" = --no-convert ]; then convert=; shift; fi
work=$(realpath -m "${1:-$root/build/qwen-dry-run}")
py=${PYTHON:-python3}
# QWEN_CARRY: no carried results until the third call (not the repository's .carry/qwen-results).
export QWEN_HOME=$work/home SP_DEVICE=cpu SP_SKIP_INSTALL=1 PYTHON=$py QWEN_CARRY=$work/carry
cd "$root"
[ -d .carry/qwen/22 ] || { echo "qwen_dry_run: run scripts/model/pack_qwen.sh first" >&2; exit 2; }
rm -rf "$work" && mkdir -p "$work"
for i in $(seq 1 22); do scripts/model/assemble_qwen.sh part "$(printf %02d "$i")" | tail -n 1; done
if [ -n "$convert" ]; then
  scripts/model/assemble_qwen.sh final
  tokenizer=$QWEN_HOME/qwen-bf16
else
  tokenizer=$root/build/models/qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
fi
"$py" -m sparseprefill.quality.convert --tiny "$tokenizer" "$work/tiny"
export QWEN_MODEL=$work/tiny
export SP_CAL_ARGS="--samples 1 --length 4096"
export SP_LONG_ARGS="--ppl-lengths 1024,2048 --budgets 8,16 --skip-targets 0.8 --density-targets 0.2 --alphas 0.1,0.2 \
--taus 0.01 --dense-layer-variants 1 --ruler-lengths 2048,4096 --frontier-lengths 4096 --ruler-samples 2 \
--timing-repeats 1 --batch-tokens 8192"
# 120 s: the whole run took 217 s on the CI machine's kind (2026-12-02), so the first call's
# deadline must fall well inside it for the resume to be rehearsed.
SP_CALL_SECONDS=${SP_DRY_FIRST:-120} scripts/model/gpu_qwen.sh "$work/out1"
"$py" - "$work/out1/qwen-long.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["calls"][-1]["stopped"] == "deadline", d["calls"][-1]
print("first call stopped by its deadline:", len(d["ppl"]), "settings of perplexity,",
      sum(len(t) for per in d["ruler"]["results"].values() for it in per.values() for t in it["tasks"].values()),
      "RULER answers")
PY
SP_CALL_SECONDS=${SP_DRY_SECOND:-3000} scripts/model/gpu_qwen.sh "$work/out2"
"$py" - "$work/out2/qwen-long.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["calls"][-1]["stopped"] == "done" and len(d["calls"]) == 2, d["calls"]
print("second call resumed and finished:", [c["stopped"] for c in d["calls"]])
PY
# A fresh machine given the results alone (as a record keeps them): the calibration is made
# again with their date, is the same file, and the run resumes with nothing left to do.
mv "$QWEN_HOME/run" "$work/run-before"
mkdir -p "$work/carry" && cp "$work/out2/qwen-long.json" "$work/carry/results.json"
QWEN_CARRY=$work/carry SP_CALL_SECONDS=600 scripts/model/gpu_qwen.sh "$work/out3"
cmp "$work/run-before/cal.safetensors" "$QWEN_HOME/run/cal.safetensors"
"$py" - "$work/out3/qwen-long.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert [c["stopped"] for c in d["calls"]] == ["deadline", "done", "done"], d["calls"]
print("third call: the calibration made again is the same file; resumed with nothing left")
PY
# A copy of the small model's record: the report writes a page beside each JSON it is given.
cp bench/records/quality/2026-11-29-h200-smollm2-b128-operator-timing.json "$work/smollm2.json"
"$py" -m sparseprefill.quality.report "$work/smollm2.json" \
  --mc-analysis bench/records/quality/2026-11-30-cpu-smollm2-b128-mc-analysis.json --long "$work/out2/qwen-long.json" \
  --output "$work/quality.md" --img-dir "$work/img"
echo "qwen_dry_run: $work/quality.md"
