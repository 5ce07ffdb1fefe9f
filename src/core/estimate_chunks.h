// SPDX-License-Identifier: Apache-2.0
// estimate_select's chunked-prefill inputs (EstimateSelectParams::prompt_len and the cache of
// block means), validated against the problem and read on the host once per call, for every
// backend: the oracle and the CPU backend read and write the cache through
// detail::load/store_block_mean, the CUDA backend uploads these counts for its kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "sparseprefill/policy.h"
#include "sparseprefill/problem.h"

namespace sparseprefill::detail {

struct EstimateChunks {
  std::vector<std::int64_t> prompt_len;  // [b]; 0: the call is the prompt (prompt_len undefined)
  bool cached = false;                   // k/v_block_means given
  std::vector<std::int64_t> valid;       // [b] leading blocks read from the cache (0 without one)
  std::vector<std::int64_t> complete;    // [b] s_k / block: blocks complete after the call; the
                                         // cache receives valid .. complete - 1
};

// The dtype estimate_select's block means are stored in (docs/semantics.md §3.5): the input
// dtype, bf16 for fp8_e4m3 inputs (the means are of their dequantized values, which E4M3's range
// and 3 mantissa bits would not hold).
DType block_mean_dtype(DType input);

// Validates prompt_len (host int32 [b], each >= s_k), the cache tensors ([b, h_kv, max_blocks, d]
// in block_mean_dtype on q's device, last dimension contiguous, max_blocks >= every s_k / block)
// and block_means_valid (host int32 [b], 0 <= valid <= s_k / block), and reads them. Errors
// name the argument.
Status read_estimate_chunks(const EstimateSelectParams& p, const ProblemShape& s, EstimateChunks* out);

}  // namespace sparseprefill::detail
