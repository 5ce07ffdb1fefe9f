// SPDX-License-Identifier: Apache-2.0
// estimate_select on CUDA: the block means, then the selector (energies and the keep rule into a
// device BlockMask), ahead of the forward kernel that runs the mask; and select(), the
// selector alone with its mask copied back.
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/estimate_chunks.h"
#include "core/geometry.h"
#include "cuda/launch.h"

namespace sparseprefill::cuda {

Status alloc_block_means(const ProblemShape& shape, Scratch* scratch, SelectParams* sp) {
  // k̄ [batch, h_kv, num_k_blocks, d], v̄ [.., d_v].
  const std::size_t blocks = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_kv) *
                             static_cast<std::size_t>(sp->num_k_blocks);
  std::uint16_t* k_mean = nullptr;
  std::uint16_t* v_mean = nullptr;
  SP_RETURN_IF_ERROR(scratch->alloc(blocks * static_cast<std::size_t>(shape.d), &k_mean));
  SP_RETURN_IF_ERROR(scratch->alloc(blocks * static_cast<std::size_t>(shape.d_v), &v_mean));
  sp->k_mean = k_mean;
  sp->v_mean = v_mean;
  return {};
}

Status launch_selection(const Call& call, const ProblemShape& shape, const FwdParams& p,
                        const EstimateSelectParams& pol, Selection* sel, const DeviceBlockMask* into) {
  SelectParams& sp = sel->sp;
  sp.q = p.q;
  sp.k = p.k;
  sp.v = p.v;
  sp.q_row_stride = p.q_row_stride;
  sp.q_head_stride = p.q_head_stride;
  sp.k_row_stride = p.k_row_stride;
  sp.k_head_stride = p.k_head_stride;
  sp.v_row_stride = p.v_row_stride;
  sp.v_head_stride = p.v_head_stride;
  sp.seqs = p.seqs;
  sp.paged = p.paged;
  for (int i = 0; i < 3; ++i) {  // e4m3 inputs: the forward's descales (nullptr: 1)
    sp.descale[i] = p.descale[i];
    sp.descale_stride[i][0] = p.descale_stride[i][0];
    sp.descale_stride[i][1] = p.descale_stride[i][1];
  }
  sp.batch = shape.batch;
  sp.h_q = shape.h_q;
  sp.h_kv = shape.h_kv;
  sp.group = shape.group();
  sp.scale = p.scale;
  sp.block = pol.block;
  sp.num_q_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_q(), pol.block));
  sp.num_k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), pol.block));
  sp.alpha = static_cast<float>(pol.alpha);
  sp.sink = pol.sink;
  sp.window = pol.window;
  sp.tail = pol.tail;
  sp.pack_gqa = pol.pack_gqa;
  sp.mean_correction = pol.mean_correction;
  Scratch& scratch = call.scratch;
  // Chunked prefill: validated and read on the host (run() has checked them already).
  detail::EstimateChunks chunks;
  SP_RETURN_IF_ERROR(detail::read_estimate_chunks(pol, shape, &chunks));
  const std::vector<SelectSeq> select_seqs = make_select_seqs(pol, chunks);
  if (!select_seqs.empty()) SP_RETURN_IF_ERROR(scratch.upload(select_seqs, &sp.select_seqs));
  sp.cache_k = mean_cache(pol.k_block_means);
  sp.cache_v = mean_cache(pol.v_block_means);
  const int units = pol.pack_gqa ? shape.h_kv : shape.h_q;
  sel->rows = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(units) *
              static_cast<std::size_t>(sp.num_q_blocks);
  SP_RETURN_IF_ERROR(alloc_block_means(shape, &scratch, &sp));
  const std::size_t cap = sel->rows * static_cast<std::size_t>(sp.num_k_blocks);
  if (into != nullptr) {
    // The caller's tensors (select_into): FlexAttention's kv_* are the partial lists.
    sp.full_count = static_cast<std::int32_t*>(into->full_count.data);
    sp.full_index = static_cast<std::int32_t*>(into->full_index.data);
    sp.partial_count = static_cast<std::int32_t*>(into->partial_count.data);
    sp.partial_index = static_cast<std::int32_t*>(into->partial_index.data);
    SP_CUDA_TRY(cudaMemsetAsync(sp.full_count, 0, sel->rows * sizeof(std::int32_t), call.stream), "cudaMemsetAsync");
    SP_CUDA_TRY(cudaMemsetAsync(sp.partial_count, 0, sel->rows * sizeof(std::int32_t), call.stream), "cudaMemsetAsync");
  } else {
    SP_RETURN_IF_ERROR(scratch.zeros(sel->rows, &sp.full_count));
    SP_RETURN_IF_ERROR(scratch.zeros(sel->rows, &sp.partial_count));
    SP_RETURN_IF_ERROR(scratch.alloc(cap, &sp.full_index));
    SP_RETURN_IF_ERROR(scratch.alloc(cap, &sp.partial_index));
  }
  if (pol.mean_correction) {
    sp.corrected_words = bitmap_words(sp.num_k_blocks);
    SP_RETURN_IF_ERROR(scratch.zeros(sel->rows * static_cast<std::size_t>(sp.corrected_words), &sp.corrected_bits));
  }
  const SelectVariant* select = call.plan.select;
  SP_RETURN_IF_ERROR(launch_status(select->launch(SelectStage::kMeans, sp, call.stream), select->name));
  return launch_status(select->launch(SelectStage::kSelect, sp, call.stream), select->name);
}

Status read_selection(const Call& call, const ProblemShape& shape, const EstimateSelectParams& es, const Selection& sel,
                      Decisions* out) {
  const SelectParams& sp = sel.sp;
  Scratch& scratch = call.scratch;
  const std::size_t cap = sel.rows * static_cast<std::size_t>(sp.num_k_blocks);
  std::vector<std::int32_t> full_count, full_index, partial_count, partial_index;
  std::vector<std::uint32_t> corrected;
  SP_RETURN_IF_ERROR(scratch.download(sp.full_count, sel.rows, &full_count));
  SP_RETURN_IF_ERROR(scratch.download(sp.full_index, cap, &full_index));
  SP_RETURN_IF_ERROR(scratch.download(sp.partial_count, sel.rows, &partial_count));
  SP_RETURN_IF_ERROR(scratch.download(sp.partial_index, cap, &partial_index));
  if (es.mean_correction) {
    SP_RETURN_IF_ERROR(scratch.download(sp.corrected_bits, sel.rows * static_cast<std::size_t>(sp.corrected_words), &corrected));
  }
  SP_CUDA_TRY(cudaStreamSynchronize(call.stream), "cudaStreamSynchronize (decisions)");
  SP_RETURN_IF_ERROR(mask_from_arrays(shape, es.block, es.pack_gqa, std::move(full_count), std::move(full_index),
                                      std::move(partial_count), std::move(partial_index), &out->kept));
  if (es.mean_correction) {
    SP_RETURN_IF_ERROR(mask_from_bits(shape, es.block, es.block, es.pack_gqa, corrected, &out->corrected));
  }
  return {};
}

namespace {

// select_into's tensors: int32, contiguous, on q's device, counts [batch, units, nqb] and
// indices [batch, units, nqb, nkb] exactly.
Status check_into(const ProblemShape& shape, const EstimateSelectParams& params, const DeviceBlockMask& out) {
  const std::int64_t units = params.pack_gqa ? shape.h_kv : shape.h_q;
  const std::int64_t nqb = geom::ceil_div(shape.max_seq_q(), params.block);
  const std::int64_t nkb = geom::ceil_div(shape.max_seq_k(), params.block);
  const struct {
    const char* name;
    const TensorView* t;
    bool index;
  } tensors[] = {{"kv_num_blocks", &out.partial_count, false}, {"kv_indices", &out.partial_index, true},
                 {"full_kv_num_blocks", &out.full_count, false}, {"full_kv_indices", &out.full_index, true}};
  for (const auto& x : tensors) {
    const TensorView& t = *x.t;
    const std::int64_t want[4] = {shape.batch, units, nqb, nkb};
    const int rank = x.index ? 4 : 3;
    bool ok = t.defined() && t.dtype == DType::kInt32 && t.rank == rank && t.device == shape.device && t.data != nullptr;
    std::int64_t step = 1;
    for (int i = rank - 1; ok && i >= 0; --i) {
      ok = t.shape[i] == want[i] && (t.shape[i] == 1 || t.stride[i] == step);
      step *= t.shape[i];
    }
    if (!ok) {
      return invalid_argument(std::string("out.") + x.name + ": expected contiguous int32 [" + std::to_string(shape.batch) +
                              ", " + std::to_string(units) + ", " + std::to_string(nqb) +
                              (x.index ? ", " + std::to_string(nkb) : std::string()) + "] on q's device, got " +
                              describe(t));
    }
  }
  return {};
}

}  // namespace

namespace {

// The selector's call on the device entered: q's layout stands in for O (the selector writes no
// output) so the shared builders apply, the metadata uploaded; then launch(call, params).
template <class Launch>
Status on_selection_call(const AttentionProblem& problem, const ProblemShape& shape, const ExecutionPlan& plan,
                         const DeviceCall& device, Launch&& launch) {
  const AttentionOutput no_output{problem.q, TensorView{}};
  SP_RETURN_IF_ERROR(check_layout(problem, no_output));
  Scratch scratch(device.stream, device.pool, shape.device.index, device.capturing);
  const Call call{plan, scratch, device.stream, nullptr};
  FwdParams p = make_fwd_params(problem, shape, no_output, plan.block_k);
  const std::vector<SeqInfo> seqs = make_seq_infos(problem, shape, no_output);
  std::vector<std::int32_t> table;
  SP_RETURN_IF_ERROR(upload_metadata(problem, shape, seqs, nullptr, &scratch, &p, &table));
  return launch(call, p);
}

}  // namespace

Status select_into_cuda(const AttentionProblem& problem, const ProblemShape& shape, const EstimateSelectParams& params,
                        const ExecutionPlan& plan, void* cuda_stream, const DeviceBlockMask& out) {
  SP_RETURN_IF_ERROR(check_into(shape, params, out));
  DeviceCall device;
  SP_RETURN_IF_ERROR(device.enter(shape.device.index, cuda_stream));
  return on_selection_call(problem, shape, plan, device, [&](const Call& call, const FwdParams& p) {
    Selection sel;
    return launch_selection(call, shape, p, params, &sel, &out);
  });
}

Status select_cuda(const AttentionProblem& problem, const ProblemShape& shape, const EstimateSelectParams& params,
                   const ExecutionPlan& plan, void* cuda_stream, Decisions* decisions) {
  DeviceCall device;
  SP_RETURN_IF_ERROR(device.enter(shape.device.index, cuda_stream));
  if (device.capturing) {
    return unsupported("cuda_stream: is capturing a CUDA graph, and select() reads its mask back to the host; "
                       "select outside capture");
  }
  return on_selection_call(problem, shape, plan, device, [&](const Call& call, const FwdParams& p) {
    Selection sel;
    SP_RETURN_IF_ERROR(launch_selection(call, shape, p, params, &sel, nullptr));
    *decisions = Decisions{};
    decisions->policy = "estimate_select";
    return read_selection(call, shape, params, sel, decisions);
  });
}

}  // namespace sparseprefill::cuda
