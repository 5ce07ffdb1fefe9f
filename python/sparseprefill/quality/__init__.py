# SPDX-License-Identifier: Apache-2.0
"""Quality on a real model: calibration from a model's attention inputs and evaluation of every
policy against dense (perplexity, KL, top-1 agreement, passkey retrieval, RULER-style tasks,
density, operator-level error, prefill time). Entry points:
  python -m sparseprefill.quality.calibrate   model + calibration text -> calibration file
  python -m sparseprefill.quality.evaluate    model + held-out text + calibration -> results JSON
  python -m sparseprefill.quality.mc_analysis model + held-out text -> mean correction taken apart (JSON)
  python -m sparseprefill.quality.longctx     long-context model + texts + calibration -> results JSON
                                              (issue 32: every policy, perplexity/KL, prefill time and the
                                              RULER-style suite of sparseprefill.quality.ruler; resumable)
  python -m sparseprefill.quality.convert     GGUF -> bf16 transformers folder (or a tiny random Qwen2)
  python -m sparseprefill.quality.report      results JSON(s) -> docs/quality.md and plots (report_long
                                              writes the long-context section)
docs/quality.md says how the models and the texts are fetched (scripts/model/)."""
