// SPDX-License-Identifier: Apache-2.0
// Calibration statistics (calibration.h) routed to the backend of the sample's device.
#include <string>
#include <vector>

#include "dispatch/dispatch.h"

namespace sparseprefill {
namespace detail {
namespace {

// The backend that computes statistics for a sample on `device`: the oracle for host tensors.
Status statistics_backend(const char* who, const ProblemShape& shape, const BackendImpl** out) {
  *out = backend_impl(shape.device.kind == DeviceKind::kCUDA ? Backend::kCUDA : Backend::kReference);
  if (*out == nullptr) return unsupported(std::string(who) + ": sample: CUDA tensors, but this build has no CUDA backend");
  return {};
}

}  // namespace

Status check_sample(const char* who, const AttentionProblem& sample, ProblemShape* shape) {
  Status st = validate_problem(sample, nullptr, shape);
  if (!st.ok()) return Status(st.code(), std::string(who) + ": sample: " + st.message());
  if (!shape->causal) {
    return invalid_argument(std::string(who) + ": sample.causal: calibration expects causal (prefill) samples");
  }
  if (shape->dtype == DType::kFP8E4M3) {
    return unsupported(std::string(who) + ": sample: calibration takes bf16, fp16 or fp32 samples, got fp8_e4m3; "
                       "calibrate on the model's 16-bit activations (FP8 inputs apply the thresholds to their "
                       "dequantized scores)");
  }
  // The statistics are those of the policies' rules on causal prefixes of plain scores; a local
  // window (or chunks) changes which blocks are visible and softcap every score, so neither is calibrated
  // (yet). Sinks enter no decision and v is not read: both are accepted (and ignored).
  if (shape->local()) {
    return unsupported(std::string(who) + (shape->attention_chunk > 0 ? ": sample.attention_chunk: chunked"
                                                                      : ": sample.window_left/window_right: local (sliding-window)") +
                       " attention is not calibrated; calibrate on causal samples without a window or chunks");
  }
  if (shape->softcap != 0.0) {
    return unsupported(std::string(who) + ": sample.softcap: softcapped scores are not calibrated; calibrate on "
                       "samples with softcap = 0");
  }
  return {};
}

Status block_statistics(const char* who, const AttentionProblem& sample, int block_q, int block_k, bool want_max,
                        bool want_g, void* cuda_stream, std::vector<BlockStatistics>* out) {
  if (block_q < 1 || block_k < 1) return invalid_argument(std::string(who) + ": block sizes must be >= 1");
  ProblemShape shape;
  SP_RETURN_IF_ERROR(check_sample(who, sample, &shape));
  const BackendImpl* backend = nullptr;
  SP_RETURN_IF_ERROR(statistics_backend(who, shape, &backend));
  return backend->block_statistics(who, sample, shape, block_q, block_k, want_max, want_g, cuda_stream, out);
}

Status select_statistics(const char* who, const AttentionProblem& sample, const EstimateSelectParams& base,
                         void* cuda_stream, std::vector<SelectStatistics>* out) {
  if (base.block < 1) return invalid_argument(std::string(who) + ": base.block must be >= 1");
  ProblemShape shape;
  SP_RETURN_IF_ERROR(check_sample(who, sample, &shape));
  const BackendImpl* backend = nullptr;
  SP_RETURN_IF_ERROR(statistics_backend(who, shape, &backend));
  return backend->select_statistics(who, sample, shape, base, cuda_stream, out);
}

}  // namespace detail

Status compute_block_statistics(const AttentionProblem& sample, int block_q, int block_k, bool block_max, bool skip_g,
                                std::vector<BlockStatistics>* out, void* cuda_stream) {
  return detail::block_statistics("compute_block_statistics", sample, block_q, block_k, block_max, skip_g, cuda_stream,
                                  out);
}

Status compute_select_statistics(const AttentionProblem& sample, const EstimateSelectParams& base,
                                 std::vector<SelectStatistics>* out, void* cuda_stream) {
  return detail::select_statistics("compute_select_statistics", sample, base, cuda_stream, out);
}

}  // namespace sparseprefill
