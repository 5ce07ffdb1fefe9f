// SPDX-License-Identifier: Apache-2.0
// block_sparse with a mask read in place (DeviceBlockMask): its check kernel ahead of the
// forward call (kernel/mask_check.cuh) writes, per mask row, the accepted prefix of each list
// and its start in the caller's index tensor; the forward kernel reads those as a compact mask.
// No host copy, no synchronisation: capturable, and a new mask each call costs one small kernel.
#include <cstddef>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/launch.h"

namespace sparseprefill::cuda {
namespace {

// Flex's count [B, H, Q] and index [B, H, Q, K] as the check kernel reads them: a dimension of
// size 1 broadcasts (stride 0).
MaskListView list_view(const TensorView& count, const TensorView& index) {
  MaskListView v{};
  if (!count.defined()) return v;
  v.count = static_cast<const std::int32_t*>(count.data);
  v.index = static_cast<const std::int32_t*>(index.data);
  for (int i = 0; i < 3; ++i) {
    v.count_stride[i] = count.shape[i] == 1 ? 0 : count.stride[i];
    v.index_stride[i] = index.shape[i] == 1 ? 0 : index.stride[i];
  }
  v.capacity = static_cast<int>(index.shape[3]);
  return v;
}

}  // namespace

Status launch_mask_check(const Call& call, const ProblemShape& shape, const DeviceBlockMask& mask, FwdParams* p,
                         std::uint32_t** kept_bits, std::size_t* kept_words) {
  Scratch& scratch = call.scratch;
  const int heads = mask.per_kv_head ? shape.h_kv : shape.h_q;
  const int k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), mask.block_k));
  MaskCheckParams mp{};
  if (mask.is_csr()) {
    mp.csr_indptr = static_cast<const std::int32_t*>(mask.csr_indptr.data);
    mp.csr_nnz = mask.csr_indices.shape[0];
    mp.list[1].index = static_cast<const std::int32_t*>(mask.csr_indices.data);
  } else {
    mp.list[0] = list_view(mask.partial_count, mask.partial_index);
    mp.list[1] = list_view(mask.full_count, mask.full_index);
  }
  mp.seqs = p->seqs;
  mp.batch = shape.batch;
  mp.heads = heads;
  mp.num_q_blocks = p->num_q_blocks;
  mp.block_q = mask.block_q;
  mp.block_k = mask.block_k;
  mp.bitmap_words = bitmap_words(k_blocks);
  mp.causal = shape.causal;
  mp.window_left = shape.window_left;
  mp.window_right = shape.window_right;
  mp.attention_chunk = shape.attention_chunk;
  const std::size_t rows = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(heads) *
                           static_cast<std::size_t>(p->num_q_blocks);
  for (int i = 0; i < 2; ++i) {
    SP_RETURN_IF_ERROR(scratch.alloc(rows, &mp.count_out[i]));
    SP_RETURN_IF_ERROR(scratch.alloc(rows, &mp.start_out[i]));
  }
  if (kept_bits != nullptr) {
    *kept_words = rows * static_cast<std::size_t>(mp.bitmap_words);
    SP_RETURN_IF_ERROR(scratch.zeros(*kept_words, &mp.kept_bits));
    *kept_bits = mp.kept_bits;
  }
  SP_RETURN_IF_ERROR(mask_fault_record(scratch.device(), scratch.capturing(), &mp.fault));
  SP_RETURN_IF_ERROR(launch_status(check_device_mask(mp, call.stream), "mask_check_sm80"));
  p->mode = PolicyMode::kBlockMask;
  p->partial_count = mp.count_out[0];
  p->partial_start = mp.start_out[0];
  p->full_count = mp.count_out[1];
  p->full_start = mp.start_out[1];
  // A list the mask lacks has count 0 in every row: its index pointer is never read.
  p->partial_index = mp.list[0].index != nullptr ? mp.list[0].index : mp.list[1].index;
  p->full_index = mp.list[1].index != nullptr ? mp.list[1].index : mp.list[0].index;
  p->mask_heads = heads;
  p->mask_per_kv_head = mask.per_kv_head;
  p->mask_q_blocks = p->num_q_blocks;
  p->mask_k_blocks = k_blocks;
  return {};
}

}  // namespace sparseprefill::cuda
