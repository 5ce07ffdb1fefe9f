// SPDX-License-Identifier: Apache-2.0
// permute_stop on CUDA: ranking (query means, prefix scores), two segmented sorts and the
// attention over the ranked chunks (the Hopper kernel's where the plan says so), enqueued on
// the call's stream without a synchronisation; decisions copied back only when requested.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/launch.h"

namespace sparseprefill::cuda {

Status run_permute_stop(const Call& call, const ProblemShape& shape, const PermuteStopParams& pol, const FwdParams& fwd,
                        Decisions* decisions, ExecutionInfo* ran) {
  const PermuteVariant* variant = call.plan.permute;
  const Permute90Variant* hopper = call.plan.permute90;
  Scratch& scratch = call.scratch;
  const cudaStream_t stream = call.stream;
  PermuteLayout layout;
  SP_RETURN_IF_ERROR(permute_layout(shape, pol, &layout));
  PermuteParams pp{};
  pp.fwd = fwd;
  pp.segment = pol.segment;
  pp.tau = static_cast<float>(pol.tau);
  pp.block_k = pol.block_k;
  pp.max_segments = layout.max_segments;
  pp.tiles_per_segment = layout.tiles_per_segment;
  pp.max_s_q = layout.max_s_q;
  pp.max_prefix = layout.max_prefix;
  pp.rank_items = layout.rank_offsets.back();
  pp.rank_segments = static_cast<int>(layout.rank_offsets.size()) - 1;
  pp.query_items = layout.query_offsets.back();
  pp.query_segments = static_cast<int>(layout.query_offsets.size()) - 1;
  SP_RETURN_IF_ERROR(scratch.upload(layout.rank_offsets, &pp.rank_offsets));
  SP_RETURN_IF_ERROR(scratch.upload(layout.query_offsets, &pp.query_offsets));
  const auto rank_items = static_cast<std::size_t>(pp.rank_items);
  const auto query_items = static_cast<std::size_t>(pp.query_items);
  SP_RETURN_IF_ERROR(scratch.alloc(static_cast<std::size_t>(pp.rank_segments) * static_cast<std::size_t>(shape.d), &pp.q_mean));
  for (int i = 0; i < 2; ++i) {
    SP_RETURN_IF_ERROR(scratch.alloc(rank_items, &pp.rank_keys[i]));
    SP_RETURN_IF_ERROR(scratch.alloc(rank_items, &pp.rank_index[i]));
    SP_RETURN_IF_ERROR(scratch.alloc(query_items, &pp.query_keys[i]));
    SP_RETURN_IF_ERROR(scratch.alloc(query_items, &pp.query_rows[i]));
  }
  // One temporary buffer for both sorts: the larger of their sizes (host-side queries).
  std::size_t temp = 0;
  for (const bool rank : {true, false}) {
    const SortPairs sizes{{nullptr, nullptr}, {nullptr, nullptr}, rank ? pp.rank_items : pp.query_items,
                          rank ? pp.rank_segments : pp.query_segments, nullptr, nullptr, 0};
    std::size_t bytes = 0;
    int current = 0;
    SP_RETURN_IF_ERROR(cuda_status(static_cast<cudaError_t>(permute_sort_pairs(sizes, &bytes, &current, stream)),
                                   "permute_stop sort (temporary storage size)"));
    temp = temp > bytes ? temp : bytes;
  }
  std::uint8_t* sort_temp = nullptr;
  SP_RETURN_IF_ERROR(scratch.alloc(temp, &sort_temp));
  pp.sort_temp = sort_temp;
  pp.sort_temp_bytes = temp;
  const std::size_t tiles = static_cast<std::size_t>(pp.rank_segments) * static_cast<std::size_t>(pp.tiles_per_segment);
  if (decisions != nullptr) SP_RETURN_IF_ERROR(scratch.zeros(tiles, &pp.visited));
  // The ranking: slot order, q̄ per item, prefix scores, the ranking sort, the guide keys and
  // the query sort; each sort's result lands in one buffer of its pair (CUB double buffers).
  const auto stage = [&](PermuteStage s) { return launch_status(variant->launch(s, pp, stream), variant->name); };
  pp.ranked = pp.rank_index[0];
  pp.query_order = pp.query_rows[0];
  if (shape.batch > 0 && pp.max_s_q > 0) {
    SP_RETURN_IF_ERROR(stage(PermuteStage::kOrderInit));
    if (pp.max_segments > 0) {
      SP_RETURN_IF_ERROR(stage(PermuteStage::kQueryMeans));
      SP_RETURN_IF_ERROR(stage(PermuteStage::kPrefixScores));
      std::size_t bytes = 0;
      int current = 0;
      if (pp.rank_items > 0) {
        const SortPairs rank{{pp.rank_keys[0], pp.rank_keys[1]}, {pp.rank_index[0], pp.rank_index[1]}, pp.rank_items,
                             pp.rank_segments, pp.rank_offsets, pp.sort_temp, pp.sort_temp_bytes};
        SP_RETURN_IF_ERROR(cuda_status(static_cast<cudaError_t>(permute_sort_pairs(rank, &bytes, &current, stream)),
                                       "permute_stop ranking sort"));
      }
      pp.ranked = pp.rank_index[current];
      SP_RETURN_IF_ERROR(stage(PermuteStage::kGuide));
      const SortPairs query{{pp.query_keys[0], pp.query_keys[1]}, {pp.query_rows[0], pp.query_rows[1]}, pp.query_items,
                            pp.query_segments, pp.query_offsets, pp.sort_temp, pp.sort_temp_bytes};
      SP_RETURN_IF_ERROR(cuda_status(static_cast<cudaError_t>(permute_sort_pairs(query, &bytes, &current, stream)),
                                     "permute_stop query sort"));
      pp.query_order = pp.query_rows[current];
      // The attention: the Hopper kernel where the plan says so (it declines, enqueueing
      // nothing, for calls it cannot serve), else the portable one.
      const int attended = hopper != nullptr ? hopper->attend(pp, stream) : static_cast<int>(cudaErrorNotSupported);
      if (attended != static_cast<int>(cudaErrorNotSupported)) {
        SP_RETURN_IF_ERROR(launch_status(attended, hopper->name));
      } else {
        SP_RETURN_IF_ERROR(stage(PermuteStage::kAttend));
        if (ran != nullptr) {
          ran->path = "cuda-portable";
          ran->instance = variant->name;
        }
      }
    }
  }
  if (decisions == nullptr) return {};
  std::vector<std::int32_t> visited;
  SP_RETURN_IF_ERROR(scratch.download(pp.visited, tiles, &visited));
  SP_RETURN_IF_ERROR(scratch.download(pp.query_order, query_items, &decisions->query_order));
  SP_CUDA_TRY(cudaStreamSynchronize(stream), "cudaStreamSynchronize (decisions)");
  decisions->tiles = permute_tiles(shape, pol, layout, visited);
  return {};
}

}  // namespace sparseprefill::cuda
