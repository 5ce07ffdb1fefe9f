#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine, after the package is installed with CUDA (scripts/python_install_cuda.sh):
# FlashAttention-3's forward tests (hopper/test_flash_attn.py of Dao-AILab/flash-attention,
# fetched into .carry/fa3/ with test_util.py and padding.py, never committed) in dense mode
# against our FlashAttention-compatible functions through tests/python/fa3_shim.
# Usage: scripts/fa3_check.sh OUTDIR   (logs: fa3.log, fa3_env.txt, fa3_summary.txt)
# Env: PYTHON, SP_FA3_SECONDS (default 120), SP_FA3_WORKERS (default 4: with 8, the suite's
#      float32 references of its long cases (up to 50 GB cached per process) ran the H200 out of
#      memory beside the other checks).
set -uo pipefail
out=${1:?usage: scripts/fa3_check.sh OUTDIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ ! -f .carry/fa3/test_flash_attn.py ]; then
  echo "fa3_check: .carry/fa3/test_flash_attn.py not found (nothing run)" | tee "$out/fa3_summary.txt"
  exit 0
fi
# Switch off what the suite cannot ask of a dense forward-only library: backward, FP8,
# splits, pack_gqa, appending KV; head dims whose cases use a V head dim unlike Q's (64: dv
# 256/512; 192: dv 128), and what the CUDA backend lacks (local windows, which also turn on the
# suite's attention_chunk values, and softcap where it does not run them).
(cd /tmp && "$py" - <<'PY') >"$out/fa3_env.txt"
import torch, sparseprefill as sp
env = {k: "TRUE" for k in ("BACKWARD", "FP8", "SPLIT", "PACKGQA", "APPENDKV", "HDIM64", "HDIM192")}
def runs(d, dtype=torch.bfloat16, paged=False, **features):
  q = torch.zeros(1, 128, 4, d, dtype=dtype, device="cuda")
  k = torch.zeros(2, 64, 2, d, dtype=dtype, device="cuda") if paged else q[:, :, :2]
  kw = dict(block_table=torch.zeros(1, 2, dtype=torch.int32), seqused_k=torch.tensor([128], dtype=torch.int32)) if paged else {}
  return sp.can_run(q, k, k, causal=True, **kw, **features)[0]
for d in (96, 128, 256):
  if not runs(d):
      env[f"HDIM{d}"] = "TRUE"
if not runs(128, window_size=(31, 0)) or not runs(128, attention_chunk=64):
  env["LOCAL"] = "TRUE"
if not runs(128, softcap=15.0):
  env["SOFTCAP"] = "TRUE"
if not runs(128, torch.float16):
  env["FP16"] = "TRUE"
if not runs(128, paged=True):
  env["PAGEDKV"] = "TRUE"
for k, v in sorted(env.items()):
  print(f"FLASH_ATTENTION_DISABLE_{k}={v}")
PY
set -a
. "$out/fa3_env.txt"
set +a
cat "$out/fa3_env.txt"
# Bounded in time (SP_FA3_SECONDS): the counts come from pytest's per-test lines (-v), so a
# run cut short still reports what completed.
workers=${SP_FA3_WORKERS:-4}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PYTHONPATH="$root/tests/python/fa3_shim:$root/.carry/fa3" timeout "${SP_FA3_SECONDS:-120}" "$py" -m pytest -v \
  --tb=line -p no:cacheprovider -n "$workers" --timeout=120 \
  -k "test_flash_attn_output or test_flash_attn_varlen_output or test_flash_attn_kvcache" \
  .carry/fa3/test_flash_attn.py >"$out/fa3.log" 2>&1
fa3_rc=$?
"$py" - "$out/fa3.log" "$fa3_rc" <<'PY' | tee "$out/fa3_summary.txt"
import re, sys
counts, failed = {}, []
for line in open(sys.argv[1], errors="replace"):
  if not line.startswith("[gw"):  # xdist's per-test lines, not the closing summary
      continue
  m = re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR)\s+(\S*::\S+)", line)
  if m:
      counts[m.group(1)] = counts.get(m.group(1), 0) + 1
      if m.group(1) in ("FAILED", "ERROR"):
          failed.append(m.group(2))
state = "cut off by SP_FA3_SECONDS" if sys.argv[2] == "124" else f"pytest exit {sys.argv[2]}"
print(f"FlashAttention-3 forward suite (dense): {counts.get('PASSED', 0)} passed, {counts.get('FAILED', 0)} failed, "
    f"{counts.get('SKIPPED', 0)} skipped, {counts.get('ERROR', 0)} errors ({state})")
for name in failed[:30]:
  print("  failed:", name)
PY
