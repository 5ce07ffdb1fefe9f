// SPDX-License-Identifier: Apache-2.0
// exact_gate in two passes (docs/cuda.md, "exact_gate in two passes"): the path's decision
// kernel computes every gated block's exact maximum and writes the kept blocks as block-mask
// rows; the forward kernel then runs them as a mask. Same decisions and visit order as the
// in-loop gate.
#include <cstddef>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/launch.h"

namespace sparseprefill::cuda {

Status launch_gate_decisions(const Call& call, const ProblemShape& shape, FwdParams* p) {
  const GateVariant& gate = *call.plan.gate;
  Scratch& scratch = call.scratch;
  const int k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), p->block_k));
  GateParams gp{};
  gp.fwd = *p;
  gp.fwd.mask_k_blocks = k_blocks;
  gp.heads_per_cta = call.plan.gate_heads_per_cta;
  gp.words = bitmap_words(k_blocks);
  const std::size_t rows = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_q) *
                           static_cast<std::size_t>(p->num_q_blocks);
  const GateListEntries entries = gate_list_entries(shape, p->block_k, p->num_q_blocks);
  SP_RETURN_IF_ERROR(scratch.alloc(rows, &gp.full_start));
  SP_RETURN_IF_ERROR(scratch.alloc(rows, &gp.partial_start));
  SP_RETURN_IF_ERROR(scratch.alloc(rows, &gp.full_count));
  SP_RETURN_IF_ERROR(scratch.alloc(rows, &gp.partial_count));
  // At least one entry each: a call whose rows hold no block still passes valid pointers.
  SP_RETURN_IF_ERROR(scratch.alloc(static_cast<std::size_t>(entries.full > 0 ? entries.full : 1), &gp.full_index));
  SP_RETURN_IF_ERROR(scratch.alloc(static_cast<std::size_t>(entries.partial > 0 ? entries.partial : 1), &gp.partial_index));
  SP_RETURN_IF_ERROR(scratch.upload(gate_seq_gated(shape, p->block_k), &gp.seq_gated));
  SP_RETURN_IF_ERROR(launch_status(gate.launch(gp, call.stream), gate.name));
  p->mode = PolicyMode::kBlockMask;
  p->full_count = gp.full_count;
  p->full_index = gp.full_index;
  p->partial_count = gp.partial_count;
  p->partial_index = gp.partial_index;
  p->full_start = gp.full_start;
  p->partial_start = gp.partial_start;
  p->mask_heads = shape.h_q;
  p->mask_per_kv_head = false;
  p->mask_q_blocks = p->num_q_blocks;
  p->mask_k_blocks = k_blocks;
  p->kept_bits = nullptr;  // written by the decision kernel
  return {};
}

}  // namespace sparseprefill::cuda
