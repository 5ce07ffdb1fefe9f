// SPDX-License-Identifier: Apache-2.0
// BlockMask: the sparsity contract between policies, backends and kernels (FlexAttention/FA4
// shape). Per (batch, head, query block) it lists the key blocks to compute, split into full
// blocks (every valid query of the block sees every valid key: no element mask) and partial
// blocks (the causal mask or the local window cuts them). Host-only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparseprefill/problem.h"
#include "sparseprefill/types.h"

namespace sparseprefill {

struct BlockMask {
  int batch = 0;
  int heads = 0;              // h_q, or h_kv when per_kv_head
  bool per_kv_head = false;   // one selection shared by the query heads of a KV group
  int block_q = 128;          // queries per query block (call-relative rows)
  int block_k = 128;          // keys per key block (absolute key positions)
  int num_q_blocks = 0;       // max over the batch; rows past a sequence's end have count 0
  int num_k_blocks = 0;       // max over the batch; the capacity of each index row

  // Counts: [batch, heads, num_q_blocks]. Indices: [batch, heads, num_q_blocks, num_k_blocks],
  // the first `count` entries ascending and unique; the rest are never read (the library
  // writes -1 there).
  std::vector<std::int32_t> full_count;
  std::vector<std::int32_t> full_index;
  std::vector<std::int32_t> partial_count;
  std::vector<std::int32_t> partial_index;

  // An empty mask (nothing selected) with the geometry of `shape`.
  static BlockMask empty(const ProblemShape& shape, int block_q, int block_k, bool per_kv_head);
  // Every visible block selected (causal mask and window): running it equals dense attention.
  static BlockMask all_visible(const ProblemShape& shape, int block_q, int block_k,
                               bool per_kv_head);

  std::int64_t row(int b, int h, int qb) const {
    return (static_cast<std::int64_t>(b) * heads + h) * num_q_blocks + qb;
  }
  // Adds key block kb to row (b, h, qb) as full or partial according to `shape`'s geometry.
  // Keeps the row sorted; adding a block twice is a no-op. Errors if kb is not visible.
  Status add(const ProblemShape& shape, int b, int h, int qb, int kb);
  bool contains(int b, int h, int qb, int kb) const;
  std::int64_t selected_blocks() const;  // full + partial over the whole mask

  // Structure only: sizes, counts <= num_k_blocks, indices ascending, unique, in range, full
  // and partial disjoint. O(rows + selected blocks), so run() can afford it on every call.
  Status validate() const;
  // Structure plus geometry: the mask fits `shape` (batch, heads, block counts), every listed
  // block is visible (causal mask and window), and each is listed as full or partial correctly.
  Status validate_for(const ProblemShape& shape) const;

  // Dense boolean block map [batch, heads, num_q_blocks, num_k_blocks] (1 = selected).
  std::vector<std::uint8_t> to_dense() const;
  static Status from_dense(const ProblemShape& shape, int block_q, int block_k, bool per_kv_head,
                           const std::vector<std::uint8_t>& map, BlockMask* out);
  // CSR over rows (b, h, qb) in row-major order: indptr [rows + 1], indices ascending per row
  // (full and partial merged; the geometry recovers the split).
  void to_csr(std::vector<std::int32_t>* indptr, std::vector<std::int32_t>* indices) const;
  static Status from_csr(const ProblemShape& shape, int block_q, int block_k, bool per_kv_head,
                         const std::vector<std::int32_t>& indptr,
                         const std::vector<std::int32_t>& indices, BlockMask* out);
};

// A block mask whose arrays stay where the caller made them (a GPU selector's output, a torch
// FlexAttention BlockMask): int32 tensors read by the kernels in place, with no host copy and
// no synchronisation, so a call with a new mask each step can be captured in a CUDA graph.
// Two forms:
//   FlexAttention's: per row (b, h, qb) the first count[b, h, qb] entries of index[b, h, qb, :]
//     are key blocks; `partial` is Flex's (kv_num_blocks, kv_indices), `full` its
//     (full_kv_num_blocks, full_kv_indices) and may be undefined. counts [B, H, Q], indices
//     [B, H, Q, K] with the last dimension contiguous; B = 1 and H = 1 broadcast over the batch
//     and the heads (h is the query head, or the KV head with per_kv_head); Q >= the call's
//     query blocks; any strides.
//   CSR: csr_indptr [rows + 1] and csr_indices over rows (b, h, qb) in row-major order, as
//     BlockMask::to_csr writes them (contiguous).
// A row is a set of key blocks: the split into full and partial lists is Flex's bookkeeping,
// and the call's geometry decides which blocks need the element mask (as BlockMask::add
// classifies them). Each list must be strictly ascending, every block visible (causal mask and
// window) to its query block, and no block in both lists. These are checked on the device as the call runs:
// a row is cut at its first bad entry (nothing out of bounds is ever read), and the first
// offence is recorded on the device; check_device_errors() — and every later call that
// synchronises its stream (decisions, select() to the host, plans) — reports it as
// kInvalidArgument naming the tensor, the row and the entry. Host tensors work too (the host
// backends read them as a BlockMask).
struct DeviceBlockMask {
  TensorView partial_count;  // Flex kv_num_blocks       int32 [B, H, Q]
  TensorView partial_index;  // Flex kv_indices          int32 [B, H, Q, K]
  TensorView full_count;     // Flex full_kv_num_blocks  int32 [B, H, Q], optional
  TensorView full_index;     // Flex full_kv_indices     int32 [B, H, Q, K], optional
  TensorView csr_indptr;     // or CSR: int32 [rows + 1]
  TensorView csr_indices;    //         int32 [nnz]
  int block_q = 128;
  int block_k = 128;
  bool per_kv_head = false;

  bool defined() const { return partial_count.defined() || csr_indptr.defined(); }
  bool is_csr() const { return csr_indptr.defined(); }
  // Shapes, dtypes, devices and block sizes against the call (no data read). Errors name the
  // tensor.
  Status validate_for(const ProblemShape& shape) const;
  // Host tensors only: the mask as a BlockMask (every check above, on the host).
  Status to_block_mask(const ProblemShape& shape, BlockMask* out) const;
};

// The first offence the device checks of block masks (DeviceBlockMask) recorded on `device`
// since the last report, as kInvalidArgument naming the tensor, row and entry; clears it.
// Synchronises the device. OK when there is none (or the build has no CUDA backend).
Status check_device_errors(int device = 0);

}  // namespace sparseprefill
