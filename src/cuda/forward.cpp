// SPDX-License-Identifier: Apache-2.0
// The forward call of a planned CUDA run: kernel parameters, the call's metadata on the device,
// the policy's decisions ahead of the attention where the plan has them (estimate_select's
// selector, exact_gate's decision kernel), the Hopper or portable forward launch, and the
// decisions copied back on request.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/geometry.h"
#include "cuda/launch.h"

namespace sparseprefill::cuda {

namespace {

bool same_bytes(const std::vector<SeqInfo>& a, const std::vector<SeqInfo>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(SeqInfo)) == 0);
}

// Shared by the gates: a zeroed kept bitmap the kernel fills, read back after the launch.
struct KeptBits {
  std::uint32_t* dev = nullptr;
  std::size_t words = 0;
};

}  // namespace

Status upload_metadata(const AttentionProblem& problem, const ProblemShape& shape, const std::vector<SeqInfo>& seqs,
                       const SeqInfo* planned, Scratch* scratch, FwdParams* p, std::vector<std::int32_t>* table) {
  if (planned != nullptr) {
    p->seqs = planned;
  } else {
    SP_RETURN_IF_ERROR(scratch->upload(seqs, &p->seqs));
  }
  table->clear();
  if (shape.kv_layout == KvLayout::kPaged) {
    *table = compact_block_table(problem, shape);
    SP_RETURN_IF_ERROR(scratch->upload(*table, &p->paged.block_table));
  }
  return {};
}

Status cache_hopper_maps(const AttentionProblem& problem, const ProblemShape& shape, const ExecutionPlan& plan,
                         const std::vector<SeqInfo>& seqs, cudaStream_t stream) {
  // Calls whose maps travel as kernel parameters have nothing to cache (the launch would run).
  const bool paged = shape.kv_layout == KvLayout::kPaged;
  if (plan.path != FwdPath::kHopper || plan.fwd90 == nullptr || plan.staging.stage ||
      shape.batch + (paged ? 1 : 0) <= kFwd90ParamSeqMaps) {
    return {};
  }
  // The instance encodes the maps exactly as a run does and hands them to this uploader, which
  // caches them and declines the launch (kUploadRefused: nothing is enqueued). Batches whose
  // maps travel as kernel parameters never call it.
  struct CacheOnly {
    int device;
    cudaStream_t stream;
    Status status;
    static int call(void* context, const void* host, std::size_t bytes, const void** device) {
      auto* self = static_cast<CacheOnly*>(context);
      Status st = metadata_cache().find_or_add(self->device, host, bytes, false, self->stream, device);
      std::swap(self->status, st);  // (nvcc flags an assignment of a [[nodiscard]] type as discarded)
      return kUploadRefused;
    }
  } cache_only{shape.device.index, stream, {}};
  // The maps depend on q, k, v, the sequence table and (paged K/V) the block table only: any
  // output layout and the dense mode serve (mean-correction maps are kernel parameters).
  FwdParams p = make_fwd_params(problem, shape, AttentionOutput{problem.q, TensorView{}}, hopper_block_k());
  p.q_pack = plan.q_pack;
  p.grid = static_cast<int>(plan.grid);
  const std::vector<std::int32_t> table = paged ? compact_block_table(problem, shape) : std::vector<std::int32_t>{};
  const int err = plan.fwd90->launch(p, seqs.data(), paged ? table.data() : nullptr, {&cache_only, &CacheOnly::call},
                                     stream);
  SP_RETURN_IF_ERROR(cache_only.status);
  // cudaErrorNotSupported: the driver cannot describe these tensors (the runs fall back or
  // fail as the plan says). 0: an empty grid, or maps passed as kernel parameters.
  if (err == kUploadRefused || err == cudaErrorNotSupported || err == 0) return {};
  return launch_status(err, "the Hopper tensor maps of a plan");
}

Status run_forward(const Call& call, const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                   const AttentionOutput& output, bool cache_maps, Decisions* decisions, ExecutionInfo* ran) {
  const ExecutionPlan& plan = call.plan;
  Scratch& scratch = call.scratch;
  const cudaStream_t stream = call.stream;
  const PlanState* state = call.state;

  FwdParams p = make_fwd_params(problem, shape, output, plan.block_k);
  const std::vector<SeqInfo> seqs = make_seq_infos(problem, shape, output);
  std::vector<std::int32_t> table;  // paged K/V: the compact block table (host copy)
  SP_RETURN_IF_ERROR(upload_metadata(problem, shape, seqs,
                                     state != nullptr && same_bytes(seqs, state->seqs_host) ? state->seqs : nullptr,
                                     &scratch, &p, &table));
  p.kv_major = plan.kv_major;
  p.grid = static_cast<int>(plan.grid);
  const bool want = decisions != nullptr;
  Decisions local;
  local.policy = policy_name(policy);
  if (const auto* ps = std::get_if<PermuteStopParams>(&policy)) {
    SP_RETURN_IF_ERROR(run_permute_stop(call, shape, *ps, p, want ? &local : nullptr, ran));
    if (want) *decisions = std::move(local);
    return {};
  }
  KeptBits kept;
  const int kept_k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), plan.block_k));
  Selection sel;  // estimate_select's device-side selection, read back for decisions

  Status st = std::visit(
      [&](const auto& pol) -> Status {
        using P = std::decay_t<decltype(pol)>;
        if constexpr (std::is_same_v<P, DenseParams>) {
          p.mode = PolicyMode::kDense;
        } else if constexpr (std::is_same_v<P, BlockSparseParams>) {
          if (pol.in_place()) {
            return launch_mask_check(call, shape, pol.device_mask, &p, want ? &kept.dev : nullptr, &kept.words);
          }
          const BlockMask& m = pol.mask;
          p.mode = PolicyMode::kBlockMask;
          if (state != nullptr && state->has_mask) {
            p.full_count = state->full_count;
            p.partial_count = state->partial_count;
            p.full_start = state->full_start;
            p.partial_start = state->partial_start;
            p.full_index = state->full_index;
            p.partial_index = state->partial_index;
          } else {
            const CompactMask c = compact_mask(m);
            SP_RETURN_IF_ERROR(scratch.upload(c.full_count, &p.full_count));
            SP_RETURN_IF_ERROR(scratch.upload(c.partial_count, &p.partial_count));
            SP_RETURN_IF_ERROR(scratch.upload(c.full_start, &p.full_start));
            SP_RETURN_IF_ERROR(scratch.upload(c.partial_start, &p.partial_start));
            SP_RETURN_IF_ERROR(scratch.upload(c.full_index, &p.full_index));
            SP_RETURN_IF_ERROR(scratch.upload(c.partial_index, &p.partial_index));
          }
          p.mask_heads = m.heads;
          p.mask_per_kv_head = m.per_kv_head;
          p.mask_q_blocks = m.num_q_blocks;
          p.mask_k_blocks = m.num_k_blocks;
          if (want) local.kept = m;
        } else if constexpr (std::is_same_v<P, ExactGateParams> || std::is_same_v<P, SoftmaxSkipParams>) {
          if constexpr (std::is_same_v<P, ExactGateParams>) {
            p.mode = PolicyMode::kExactGate;
            p.thresholds = static_cast<const float*>(pol.thresholds.data);
            p.thr_head_stride = pol.thresholds.stride[0];
            p.thr_pos_stride = pol.thresholds.stride[1];
            p.thr_positions = static_cast<int>(pol.thresholds.shape[1]);
          } else {
            p.mode = PolicyMode::kSoftmaxSkip;
            p.skip_a = static_cast<float>(pol.a);
          }
          if (want) {
            p.kept_words = bitmap_words(kept_k_blocks);
            kept.words = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_q) *
                         static_cast<std::size_t>(p.num_q_blocks) * static_cast<std::size_t>(p.kept_words);
            SP_RETURN_IF_ERROR(scratch.zeros(kept.words, &kept.dev));
            p.kept_bits = kept.dev;
          }
        } else if constexpr (std::is_same_v<P, EstimateSelectParams>) {
          SP_RETURN_IF_ERROR(launch_selection(call, shape, p, pol, &sel, nullptr));
          const SelectParams& sp = sel.sp;
          const int units = pol.pack_gqa ? shape.h_kv : shape.h_q;
          p.mode = PolicyMode::kBlockMask;
          p.full_count = sp.full_count;
          p.full_index = sp.full_index;
          p.partial_count = sp.partial_count;
          p.partial_index = sp.partial_index;
          p.mask_heads = units;
          p.mask_per_kv_head = pol.pack_gqa;
          p.mask_q_blocks = sp.num_q_blocks;
          p.mask_k_blocks = sp.num_k_blocks;
          if (pol.mean_correction) {
            p.k_mean = sp.k_mean;
            p.v_mean = sp.v_mean;
            p.corrected_bits = sp.corrected_bits;
            p.mean_blocks = sp.num_k_blocks;
            p.mean_block = pol.block;
            p.corrected_words = sp.corrected_words;
          }
        }
        return {};
      },
      policy);
  SP_RETURN_IF_ERROR(st);
  if (plan.passes == 2) SP_RETURN_IF_ERROR(launch_gate_decisions(call, shape, &p));

  bool launched = false;
  if (plan.path == FwdPath::kHopper) {
    const bool fp8 = shape.dtype == DType::kFP8E4M3;
    if (fp8) {
      // V transposed for the e4m3 P·V ([batch, h_kv, d, vt_stride] bytes), written by the launch.
      p.vt_stride = geom::ceil_div(geom::max64(shape.max_seq_k(), 1), hopper_block_k()) * hopper_block_k();
      SP_RETURN_IF_ERROR(scratch.alloc(static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_kv) *
                                           static_cast<std::size_t>(shape.d_v) * static_cast<std::size_t>(p.vt_stride),
                                       &p.v_t));
      if (p.k_mean != nullptr) {
        // The means requantized to e4m3 for the mean tiles (FwdParams::k_mean8, v_mean_t).
        const auto planes = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_kv);
        p.mean_stride = geom::ceil_div(geom::max64(p.mean_blocks, 1), hopper_block_k()) * hopper_block_k();
        SP_RETURN_IF_ERROR(scratch.alloc(planes * static_cast<std::size_t>(p.mean_blocks) * static_cast<std::size_t>(shape.d),
                                         &p.k_mean8));
        SP_RETURN_IF_ERROR(scratch.alloc(planes * static_cast<std::size_t>(shape.d_v) * static_cast<std::size_t>(p.mean_stride),
                                         &p.v_mean_t));
      }
    }
    p.q_pack = plan.q_pack;
    UploadContext upload_context{&scratch, cache_maps, {}};
    const HostUpload upload{&upload_context, &UploadContext::call};
    const bool paged = shape.kv_layout == KvLayout::kPaged;
    const int err = plan.fwd90->launch(p, seqs.data(), paged ? table.data() : nullptr, upload, stream);
    if (err == kUploadRefused) return upload_context.status;
    // cudaErrorNotSupported: the driver cannot encode the tensor maps; nothing was enqueued.
    if (err != cudaErrorNotSupported) {
      SP_RETURN_IF_ERROR(launch_status(err, plan.fwd90->name));
      launched = true;
    } else if (plan.hopper_forced || plan.fwd == nullptr) {
      return unsupported(std::string("q, k, v: the driver cannot describe these tensors for the Hopper kernel's TMA") +
                         (plan.fwd == nullptr ? " (fp8_e4m3 has no portable kernel)" : " (cuda_path = hopper)"));
    }
  }
  if (!launched) {
    // The portable kernel: the plan's path, or the Hopper launch's fallback (tiles unpacked).
    p.q_pack = 1;
    p.grid = static_cast<int>(portable_grid(shape));
    SP_RETURN_IF_ERROR(launch_status(plan.fwd->launch(p, stream), plan.fwd->name));
    if (ran != nullptr && plan.path == FwdPath::kHopper) {
      ran->path = "cuda-portable";
      ran->instance = plan.fwd->name;
      ran->q_pack = 1;
      ran->grid = p.grid;
    }
  }
  if (!want) return {};

  // Decisions: copy the device-side selections back and convert them to BlockMasks.
  if (kept.dev != nullptr) {
    std::vector<std::uint32_t> bits;
    SP_RETURN_IF_ERROR(scratch.download(kept.dev, kept.words, &bits));
    SP_CUDA_TRY(cudaStreamSynchronize(stream), "cudaStreamSynchronize (decisions)");
    const auto* in_place = std::get_if<BlockSparseParams>(&policy);
    SP_RETURN_IF_ERROR(mask_from_bits(shape, kBlockQ, plan.block_k, in_place != nullptr && in_place->per_kv_head(), bits,
                                      &local.kept));
  } else if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    SP_RETURN_IF_ERROR(read_selection(call, shape, *es, sel, &local));
  }
  *decisions = std::move(local);
  return {};
}

}  // namespace sparseprefill::cuda
