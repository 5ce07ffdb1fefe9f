// SPDX-License-Identifier: Apache-2.0
// One parameter struct per policy of DESIGN.md §3, the Policy variant, and the key=value
// parser shared by the CLI and the Python layer. docs/semantics.md is the exact definition.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "sparseprefill/block_mask.h"
#include "sparseprefill/types.h"

namespace sparseprefill {

// Dense attention: nothing skipped.
struct DenseParams {};

// Runs a caller-given block mask: full blocks unmasked, partial blocks masked, nothing else.
// Either a BlockMask (host; validated and, on CUDA, compacted and uploaded by the call or once
// by a plan) or a DeviceBlockMask (read in place on its device, checked there as the call runs).
struct BlockSparseParams {
  BlockMask mask;
  DeviceBlockMask device_mask;

  bool in_place() const { return device_mask.defined(); }
  int block_q() const { return in_place() ? device_mask.block_q : mask.block_q; }
  int block_k() const { return in_place() ? device_mask.block_k : mask.block_k; }
  bool per_kv_head() const { return in_place() ? device_mask.per_kv_head : mask.per_kv_head; }
};

// BSFA. Full blocks whose exact max of scale·QKᵀ (over the valid rows of the query block) is
// below T[h_q][p] are skipped; partial blocks are always computed. p is the absolute query
// block floor((first query position + s_k - s_q) / block_q), clamped to the table's last row.
// Non-causal: every block is gated except each sequence's last key block.
struct ExactGateParams {
  int block_q = 128;
  int block_k = 128;
  TensorView thresholds;  // fp32 [h_q, positions], on q's device; -inf keeps everything
};

// BLASST. Visit partial blocks, then full blocks, each group in descending index; per row
// skip iff tile_rowmax - m_run < ln(a / s_k) (strict); a block is skipped iff every row that
// matters skips. The first visited block is never skipped; off when s_k < a.
struct SoftmaxSkipParams {
  int block_q = 128;
  int block_k = 128;
  double a = 10.0;  // λ = a / s_k; calibrate for a target skip fraction
};

// FlashPrefill V2. Key blocks scored from mean-pooled keys by every query row of the tile;
// keep E_j >= alpha · max E plus sink / window / tail blocks; optional zero-order mean
// correction adds each pruned, fully visible block back as one pseudo-token. Causal only.
struct EstimateSelectParams {
  int block = 128;        // query tile, key block and pooling size
  double alpha = 0.1;     // keep threshold relative to the tile's peak energy
  int sink = 2;           // key blocks j < sink are always kept
  int window = 4;         // key blocks fqb - window + 1 .. lqb are always kept
  int tail = 2;           // the last `tail` query tiles (of the call, or of prompt_len) keep every visible block
  bool mean_correction = false;
  bool pack_gqa = false;  // score the rows of a KV group's heads together; one selection

  // Chunked prefill (docs/semantics.md §1 and §3.5). Optional; index tensors are host int32 [b].
  // prompt_len: each sequence's whole prompt length (>= its s_k). Then `tail` counts the last
  // query tiles of the prompt (tiles whose last row lies in its last `tail` blocks), so a
  // prompt prefilled in chunks forces the one-shot tail once. Undefined: the call is the prompt.
  TensorView prompt_len;
  // Block means kept beside the K/V cache (caller-owned, all three or none): k/v_block_means
  // [b, h_kv, max_blocks, d] in the input dtype on q's device, last dimension contiguous;
  // block_means_valid: per sequence how many leading key blocks hold their means (complete
  // blocks of `block` keys, at most s_k / block). A call reads the means of blocks
  // j < valid from the cache, computes the rest from K/V, and writes the means of the blocks
  // valid <= j < s_k / block back (they are complete now; max_blocks must hold them); the
  // caller then sets valid = s_k / block for its next chunk. Means are per logical block,
  // whatever the page size of paged K/V.
  TensorView k_block_means;
  TensorView v_block_means;
  TensorView block_means_valid;
};

// S2O, as defined in docs/semantics.md (the paper leaves details open). Queries permuted
// inside segments of `segment` absolute positions; pass 1 dense causal inside the segment;
// pass 2 walks the prefix keys ranked by the segment's mean query, in chunks of block_k, and
// stops after the first chunk whose max row gain Δl/l' is below tau. Causal only.
struct PermuteStopParams {
  int segment = 2048;
  double tau = 0.005;
  int block_q = 128;
  int block_k = 128;
};

using Policy = std::variant<DenseParams, BlockSparseParams, ExactGateParams, SoftmaxSkipParams,
                            EstimateSelectParams, PermuteStopParams>;

// "dense", "block_sparse", "exact_gate", "softmax_skip", "estimate_select", "permute_stop".
const char* policy_name(const Policy& policy);
std::vector<std::string> policy_names();
// One line: the name and every parameter, e.g. "estimate_select block=128 alpha=0.1 ...".
std::string describe(const Policy& policy);

// Builds a policy from its name and key=value settings (the CLI's --set, Python's kwargs).
// Unknown names or keys, unparsable or non-finite numbers and out-of-range values are
// errors that name the key. ExactGate thresholds and BlockSparse masks are tensors and are
// attached by the caller afterwards.
Status parse_policy(std::string_view name,
                    const std::vector<std::pair<std::string, std::string>>& settings,
                    Policy* out);

// Checks a policy's parameters on their own (block sizes positive, finite numbers in range,
// thresholds fp32 rank 2, ...). Backends add their own limits through can_run (the CUDA
// kernels need block sizes that are multiples of their tile).
Status validate_policy(const Policy& policy);

}  // namespace sparseprefill
