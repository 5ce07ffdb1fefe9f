// SPDX-License-Identifier: Apache-2.0
// BlockMask: the sparsity contract between policies, backends and kernels (FlexAttention/FA4
// shape). Per (batch, head, query block) it lists the key blocks to compute, split into full
// blocks (every valid query of the block sees every valid key: no element mask) and partial
// blocks (the causal mask cuts them). Host-only.
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
  // Every causally visible block selected: running it equals dense attention.
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
  // block is causally visible, and each is listed as full or partial correctly.
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

}  // namespace sparseprefill
