# SPDX-License-Identifier: Apache-2.0
"""Quality on a real model: calibration from a model's attention inputs and evaluation of every
policy against dense (perplexity, KL, top-1 agreement, passkey retrieval, density, operator-level
error). Entry points:
  python -m sparseprefill.quality.calibrate   model + calibration text -> calibration file
  python -m sparseprefill.quality.evaluate    model + held-out text + calibration -> results JSON
  python -m sparseprefill.quality.mc_analysis model + held-out text -> mean correction taken apart (JSON)
  python -m sparseprefill.quality.report      results JSON(s) -> docs/quality.md and plots
docs/quality.md says how the model and the text are fetched (scripts/model/)."""
