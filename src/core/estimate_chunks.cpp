// SPDX-License-Identifier: Apache-2.0
// Validation and host reading of estimate_select's chunked-prefill inputs.
#include "core/estimate_chunks.h"

#include <string>

namespace sparseprefill::detail {

DType block_mean_dtype(DType input) { return input == DType::kFP8E4M3 ? DType::kBF16 : input; }

namespace {

// A host int32 [batch] index tensor, read into `out`.
Status read_counts(const char* name, const TensorView& t, int batch, std::vector<std::int64_t>* out) {
  const std::string expected = "host int32 [batch = " + std::to_string(batch) + "]";
  if (t.rank != 1 || t.dtype != DType::kInt32 || t.device.kind != DeviceKind::kCPU || t.shape[0] != batch ||
      (t.data == nullptr && batch > 0)) {
    return invalid_argument(std::string(name) + ": expected " + expected + ", got " + describe(t));
  }
  out->assign(static_cast<std::size_t>(batch), 0);
  for (int b = 0; b < batch; ++b) {
    (*out)[static_cast<std::size_t>(b)] = static_cast<const std::int32_t*>(t.data)[b * t.stride[0]];
  }
  return {};
}

Status check_cache(const char* name, const TensorView& t, const ProblemShape& s, std::int64_t min_blocks) {
  const DType dtype = block_mean_dtype(s.dtype);
  const std::string expected = std::string("[batch = ") + std::to_string(s.batch) + ", h_kv = " + std::to_string(s.h_kv) +
                               ", max_blocks >= " + std::to_string(min_blocks) + ", d = " + std::to_string(s.d) +
                               "] " + dtype_name(dtype) + " on q's device, last dimension contiguous";
  bool ok = t.rank == 4 && t.dtype == dtype && t.device == s.device && t.shape[0] == s.batch &&
            t.shape[1] == s.h_kv && t.shape[2] >= min_blocks && t.shape[3] == s.d &&
            (t.shape[3] <= 1 || t.stride[3] == 1) && (t.data != nullptr || t.numel() == 0);
  for (int i = 0; ok && i < 4; ++i) ok = t.stride[i] >= 0;
  if (!ok) return invalid_argument(std::string(name) + ": expected " + expected + ", got " + describe(t));
  return {};
}

}  // namespace

Status read_estimate_chunks(const EstimateSelectParams& p, const ProblemShape& s, EstimateChunks* out) {
  *out = EstimateChunks{};
  const auto batch = static_cast<std::size_t>(s.batch);
  out->prompt_len.assign(batch, 0);
  out->valid.assign(batch, 0);
  out->complete.assign(batch, 0);
  std::int64_t max_complete = 0;
  for (std::size_t b = 0; b < batch; ++b) {
    out->complete[b] = s.seq_k[b] / p.block;
    max_complete = out->complete[b] > max_complete ? out->complete[b] : max_complete;
  }
  if (p.prompt_len.defined()) {
    SP_RETURN_IF_ERROR(read_counts("prompt_len", p.prompt_len, s.batch, &out->prompt_len));
    for (std::size_t b = 0; b < batch; ++b) {
      if (out->prompt_len[b] < s.seq_k[b] || out->prompt_len[b] < 1) {
        return invalid_argument("prompt_len[" + std::to_string(b) + "]: expected >= the sequence's " +
                                std::to_string(s.seq_k[b]) + " keys (and >= 1), got " +
                                std::to_string(out->prompt_len[b]));
      }
    }
  }
  // validate_policy has checked that the three come together; an undefined cache tensor
  // beside a count fails check_cache.
  if (!p.k_block_means.defined() && !p.v_block_means.defined() && !p.block_means_valid.defined()) return {};
  SP_RETURN_IF_ERROR(check_cache("k_block_means", p.k_block_means, s, max_complete));
  SP_RETURN_IF_ERROR(check_cache("v_block_means", p.v_block_means, s, max_complete));
  SP_RETURN_IF_ERROR(read_counts("block_means_valid", p.block_means_valid, s.batch, &out->valid));
  for (std::size_t b = 0; b < batch; ++b) {
    if (out->valid[b] < 0 || out->valid[b] > out->complete[b]) {
      return invalid_argument("block_means_valid[" + std::to_string(b) + "]: expected 0 .. " +
                              std::to_string(out->complete[b]) + " (the complete blocks of the sequence's " +
                              std::to_string(s.seq_k[b]) + " keys at block " + std::to_string(p.block) + "), got " +
                              std::to_string(out->valid[b]));
    }
  }
  out->cached = true;
  return {};
}

}  // namespace sparseprefill::detail
