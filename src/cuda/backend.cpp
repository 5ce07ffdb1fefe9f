// SPDX-License-Identifier: Apache-2.0
// The CUDA backend behind the backend interface (core/backend.h): plan() is plan_execution over
// the device's capabilities and the overrides, plus (for a Plan) the device state its runs
// share; run() executes that plan: paged K/V staged where it says so, then the forward call.
#include "cuda/backend.h"

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>

#include "cuda/host_staging.h"
#include "cuda/launch.h"

#ifndef SP_CUDA_ARCHS
#define SP_CUDA_ARCHS "unknown"
#endif

namespace sparseprefill::cuda {
namespace {

Status require_cuda(const ProblemShape& s) {
  if (s.device.kind != DeviceKind::kCUDA) return invalid_argument("backend cuda: expected CUDA tensors, got host tensors");
  return {};
}

Status prefixed(const char* who, Status st) {
  if (st.ok()) return st;
  return Status(st.code(), std::string(who) + ": " + st.message());
}

// The call's overrides over the environment's.
Status call_overrides(const RunOptions& options, ExecutionOverrides* out) {
  ExecutionOverrides env;
  SP_RETURN_IF_ERROR(environment_overrides(&env));
  *out = merge_overrides(env, options.overrides);
  return {};
}

// The execution plan of calls shaped like `problem` on its device.
Status plan_call(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                 const RunOptions& options, ExecutionPlan* out) {
  ExecutionOverrides overrides;
  SP_RETURN_IF_ERROR(call_overrides(options, &overrides));
  DeviceCaps caps;
  SP_RETURN_IF_ERROR(device_caps(shape.device.index, &caps));
  std::size_t free_bytes = 0;
  if (shape.kv_layout == KvLayout::kPaged) {
    DeviceGuard guard;
    SP_RETURN_IF_ERROR(guard.enter(shape.device.index));
    std::size_t total_bytes = 0;
    SP_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  }
  return plan_execution(shape, policy, tma_facts(problem), caps, overrides, free_bytes, out);
}

struct CudaPrepared final : detail::PreparedRun {
  ExecutionPlan plan;
  // Staging plans only: the same call reading its pages in the kernels, for runs under CUDA
  // graph capture (a captured graph would own the staged rows' memory).
  ExecutionPlan unstaged;
  std::shared_ptr<const PlanState> state;  // a Plan's device state; null for a transient plan
};

class CudaBackend final : public detail::BackendImpl {
 public:
  Backend kind() const override { return Backend::kCUDA; }

  // Host tensors too: run() stages them to the device (run_host).
  Status can_run(const ProblemShape& shape, const Policy& policy) const override {
    int block_k = 0;
    return check_support(shape, policy, &block_k);
  }

  Status plan(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
              const RunOptions& options, bool persistent, std::unique_ptr<detail::PreparedRun>* out) const override {
    SP_RETURN_IF_ERROR(require_cuda(shape));
    auto prepared = std::make_unique<CudaPrepared>();
    SP_RETURN_IF_ERROR(plan_call(problem, shape, policy, options, &prepared->plan));
    if (prepared->plan.staging.stage) {
      RunOptions unstaged = options;
      unstaged.overrides.kv_staging = ExecutionOverrides::Choice::kNever;
      SP_RETURN_IF_ERROR(plan_call(problem, shape, policy, unstaged, &prepared->unstaged));
    }
    if (persistent) {
      // The state serves the runs that need metadata cached ahead: captured ones, which never
      // stage (the unstaged plan).
      const ExecutionPlan& captured = prepared->plan.staging.stage ? prepared->unstaged : prepared->plan;
      SP_RETURN_IF_ERROR(make_plan_state(problem, shape, policy, captured,
                                         static_cast<cudaStream_t>(options.cuda_stream), &prepared->state));
    }
    prepared->info = execution_info(prepared->plan, 0);
    *out = std::move(prepared);
    return {};
  }

  Status run(const detail::PreparedRun& prepared, const AttentionProblem& problem, const ProblemShape& shape,
             const Policy& policy, const AttentionOutput& output, const RunOptions& options,
             Decisions* decisions, ExecutionInfo* ran_out) const override {
    const auto& cuda = static_cast<const CudaPrepared&>(prepared);
    SP_RETURN_IF_ERROR(check_layout(problem, output));
    DeviceCall device;
    SP_RETURN_IF_ERROR(device.enter(shape.device.index, options.cuda_stream));
    // Under CUDA graph capture every device operation becomes a graph node; metadata comes from
    // the cache (Scratch::upload_bytes), and nothing may be read back to the host.
    if (device.capturing && decisions != nullptr) {
      return unsupported("cuda_stream: is capturing a CUDA graph, so decisions and statistics cannot be read back; "
                         "request none under capture");
    }
    const ExecutionPlan& plan = device.capturing && cuda.plan.staging.stage ? cuda.unstaged : cuda.plan;
    if (plan.path == FwdPath::kHopper && !plan.staging.stage) {
      const TmaFacts tma = tma_facts(problem);
      if (!tma.q || !tma.kv) {
        return invalid_argument("q, k, v: strides TMA cannot describe, unlike those the plan was made for (the "
                                "Hopper path); make a plan for these tensors");
      }
    }
    ExecutionInfo ran = execution_info(plan, 0);
    Scratch scratch(device.stream, device.pool, shape.device.index, device.capturing);
    const Call call{plan, scratch, device.stream, cuda.state.get()};
    if (!plan.staging.stage) {
      SP_RETURN_IF_ERROR(run_forward(call, problem, shape, policy, output, true, decisions, &ran));
    } else {
      cudaMemPool_t staging_pool = nullptr;
      SP_RETURN_IF_ERROR(pool_for(shape.device.index, PoolKind::kStaging, &staging_pool));
      Scratch buffers(device.stream, staging_pool, shape.device.index, device.capturing);  // freed after the kernels
      AttentionProblem staged;
      SP_RETURN_IF_ERROR(stage_kv_rows(problem, shape, plan.staging, output, &buffers, device.stream, &staged));
      SP_RETURN_IF_ERROR(run_forward(call, staged, staged_shape(shape, plan.staging), policy, output, false, decisions,
                                     &ran));
    }
    ran.scratch_bytes = scratch.bytes();
    // Decisions synchronised the stream: a device mask's offence is this call's error.
    if (decisions != nullptr) SP_RETURN_IF_ERROR(report_mask_faults(shape.device.index));
    *ran_out = std::move(ran);
    return {};
  }

  Status run_host(const AttentionProblem& problem, const Policy& policy, const AttentionOutput& output,
                  const RunOptions& options, Decisions* decisions, ExecutionInfo* ran) const override {
    return run_host_staged(*this, problem, policy, output, options, decisions, ran);
  }

  Status select(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                const RunOptions& options, Decisions* decisions) const override {
    SP_RETURN_IF_ERROR(require_cuda(shape));
    const auto* es = std::get_if<EstimateSelectParams>(&policy);
    if (es == nullptr) return {StatusCode::kInternal, "cuda select: only estimate_select has a selector"};
    ExecutionPlan plan;
    SP_RETURN_IF_ERROR(plan_call(problem, shape, policy, options, &plan));
    return select_cuda(problem, shape, *es, plan, options.cuda_stream, decisions);
  }

  Status select_into(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                     const RunOptions& options, const DeviceBlockMask& out) const override {
    SP_RETURN_IF_ERROR(require_cuda(shape));
    ExecutionPlan plan;
    SP_RETURN_IF_ERROR(plan_call(problem, shape, policy, options, &plan));
    return select_into_cuda(problem, shape, std::get<EstimateSelectParams>(policy), plan, options.cuda_stream, out);
  }

  Status block_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape, int block_q,
                          int block_k, bool want_max, bool want_g, void* cuda_stream,
                          std::vector<BlockStatistics>* out) const override {
    return prefixed(who, block_statistics_cuda(sample, shape, block_q, block_k, want_max, want_g, cuda_stream, out));
  }

  Status select_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape,
                           const EstimateSelectParams& base, void* cuda_stream,
                           std::vector<SelectStatistics>* out) const override {
    ExecutionOverrides overrides;
    SP_RETURN_IF_ERROR(prefixed(who, call_overrides(RunOptions{}, &overrides)));
    DeviceCaps caps;
    SP_RETURN_IF_ERROR(prefixed(who, device_caps(shape.device.index, &caps)));
    // Supported first (block 128, a compiled selector), then the selector's shared memory.
    SP_RETURN_IF_ERROR(prefixed(who, check_select_statistics_support(shape, base)));
    const SelectVariant* select = choose_selector(shape, caps, overrides);
    SP_RETURN_IF_ERROR(prefixed(who, check_selector_smem(*select, shape, base.block, caps)));
    return prefixed(who, select_statistics_cuda(sample, shape, base, select, cuda_stream, out));
  }

  Status check_errors(int device) const override { return report_mask_faults(device); }

  std::string build_info() const override {
    return std::string("backend cuda: compiled\ncuda architectures (portable path): ") + SP_CUDA_ARCHS +
           "; Hopper path: 90a-real\ncuda kernels: " + support_summary() + "\n" + compiled_instances();
  }
};

}  // namespace

const detail::BackendImpl& cuda_backend() {
  static const CudaBackend backend;
  return backend;
}

int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

PlanState::~PlanState() {
  DeviceGuard guard;
  if (!guard.enter(device).ok()) return;
  for (void* ptr : owned) cudaFree(ptr);  // synchronises with work that may still read it
}

Status PlanState::copy_bytes(const void* host, std::size_t bytes, cudaStream_t stream, const void** out) {
  *out = nullptr;
  if (bytes == 0) return {};
  void* ptr = nullptr;
  SP_CUDA_TRY(cudaMalloc(&ptr, bytes), "cudaMalloc (plan)");
  owned.push_back(ptr);
  SP_CUDA_TRY(cudaMemcpyAsync(ptr, host, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync (plan)");
  *out = ptr;
  return {};
}

namespace {

// The output view of a plan's per-sequence table: O contiguous in q's shape, LSE contiguous
// ([b, h_q, s_q] or [h_q, total_q]).
std::vector<SeqInfo> contiguous_output_seqs(const AttentionProblem& problem, const ProblemShape& shape) {
  AttentionOutput out;
  out.o = problem.q;
  out.o.data = nullptr;
  std::int64_t step = 1;
  for (int i = out.o.rank - 1; i >= 0; --i) {
    out.o.stride[i] = step;
    step *= out.o.shape[i];
  }
  out.lse.dtype = DType::kFP32;
  out.lse.device = shape.device;
  out.lse.rank = shape.varlen_q ? 2 : 3;
  if (shape.varlen_q) {
    out.lse.shape[0] = shape.h_q;
    out.lse.shape[1] = shape.total_q();
    out.lse.stride[0] = shape.total_q();
    out.lse.stride[1] = 1;
  } else {
    out.lse.shape[0] = shape.batch;
    out.lse.shape[1] = shape.h_q;
    out.lse.shape[2] = shape.max_seq_q();
    out.lse.stride[0] = shape.h_q * shape.max_seq_q();
    out.lse.stride[1] = shape.max_seq_q();
    out.lse.stride[2] = 1;
  }
  return make_seq_infos(problem, shape, out);
}

}  // namespace

Status make_plan_state(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                       const ExecutionPlan& plan, cudaStream_t stream, std::shared_ptr<const PlanState>* out) {
  DeviceGuard guard;
  SP_RETURN_IF_ERROR(guard.enter(shape.device.index));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SP_CUDA_TRY(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    return unsupported("cuda_stream: is capturing a CUDA graph; make the plan before capture (it allocates and "
                       "uploads device memory)");
  }
  // The device's memory pool is created on its first use, which a capturing stream forbids:
  // create it here, so that the plan's first run may be captured.
  cudaMemPool_t pool = nullptr;
  SP_RETURN_IF_ERROR(pool_for(shape.device.index, PoolKind::kScratch, &pool));
  auto state = std::make_shared<PlanState>();
  state->device = shape.device.index;
  state->seqs_host = contiguous_output_seqs(problem, shape);
  SP_RETURN_IF_ERROR(state->copy(state->seqs_host, stream, &state->seqs));
  if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    const CompactMask c = compact_mask(bs->mask);
    state->has_mask = true;
    SP_RETURN_IF_ERROR(state->copy(c.full_count, stream, &state->full_count));
    SP_RETURN_IF_ERROR(state->copy(c.partial_count, stream, &state->partial_count));
    SP_RETURN_IF_ERROR(state->copy(c.full_start, stream, &state->full_start));
    SP_RETURN_IF_ERROR(state->copy(c.partial_start, stream, &state->partial_start));
    SP_RETURN_IF_ERROR(state->copy(c.full_index, stream, &state->full_index));
    SP_RETURN_IF_ERROR(state->copy(c.partial_index, stream, &state->partial_index));
  }
  if (std::get_if<PermuteStopParams>(&policy) == nullptr) {
    SP_RETURN_IF_ERROR(cache_hopper_maps(problem, shape, plan, state->seqs_host, stream));
  }
  // exact_gate's decision pass uploads its sequences' gated-block sums with each call
  // (launch_gate_decisions): into the metadata cache here, so that the plan's first run may be
  // captured.
  if (plan.passes == 2) {
    const std::vector<std::int64_t> seq_gated = gate_seq_gated(shape, plan.block_k);
    const void* cached = nullptr;
    SP_RETURN_IF_ERROR(metadata_cache().find_or_add(state->device, seq_gated.data(),
                                                    seq_gated.size() * sizeof(std::int64_t), false, stream, &cached));
  }
  // The host vectors die with this call: the copies must be complete before it returns.
  SP_CUDA_TRY(cudaStreamSynchronize(stream), "cudaStreamSynchronize (plan)");
  *out = std::move(state);
  return {};
}

}  // namespace sparseprefill::cuda
