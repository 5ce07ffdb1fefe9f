// SPDX-License-Identifier: Apache-2.0
// The conformance suite's targets (targets.h). Device placement comes from tests/common/device
// in builds with the CUDA backend (SP_TEST_WITH_CUDA); without it the CUDA targets are
// unavailable and skip before placing anything.
#include "conformance/targets.h"

#include "common/poison.h"
#include "common/tolerance.h"

#if SP_TEST_WITH_CUDA
#include "common/device/device.h"
#endif

namespace sparseprefill::test {
namespace {

// A host target reads the TestProblem's own tensors.
class HostPlaced final : public Placed {
 public:
  HostPlaced(TestProblem* tp, const Policy& policy) : problem_(tp->problem()), output_(tp->output()), policy_(policy) {
    poison(&tp->o);
    poison(&tp->lse);
  }
  const AttentionProblem& problem() const override { return problem_; }
  const AttentionOutput& output() const override { return output_; }
  const Policy& policy() const override { return policy_; }
  void read_back(TestProblem*) const override {}

 private:
  AttentionProblem problem_;
  AttentionOutput output_;
  Policy policy_;
};

#if SP_TEST_WITH_CUDA
class DevicePlaced final : public Placed {
 public:
  DevicePlaced(TestProblem* tp, const Policy& policy) : dev_(to_device(tp, policy)) {}
  const AttentionProblem& problem() const override { return dev_->problem; }
  const AttentionOutput& output() const override { return dev_->output; }
  const Policy& policy() const override { return dev_->policy->policy; }
  void read_back(TestProblem* tp) const override {
    expect_device_synchronized();
    dev_->read_back(tp);
  }

 private:
  std::unique_ptr<DeviceProblem> dev_;
};
#endif

// The call's output read back into the oracle's layout.
ref::Result read_back(const Placed& placed, TestProblem* tp) {
  placed.read_back(tp);
  ProblemShape shape;
  const Status st = validate_problem(tp->problem(), nullptr, &shape);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return read_output(tp->output(), shape);
}

}  // namespace

const char* target_path(Target t) {
  switch (t) {
    case Target::kReference: return "reference";
    case Target::kCpu: return "cpu";
    case Target::kCudaPortable: return "cuda-portable";
    case Target::kCudaHopper: return "cuda-hopper";
  }
  return "?";
}

std::string target_param_name(const ::testing::TestParamInfo<Target>& info) {
  std::string name = target_path(info.param);
  for (char& c : name) c = c == '-' ? '_' : c;
  return name;
}

bool is_cuda(Target t) { return t == Target::kCudaPortable || t == Target::kCudaHopper; }

std::string target_unavailable(Target t) {
  if (!is_cuda(t)) return {};
#if SP_TEST_WITH_CUDA
  const std::string why = cuda_unavailable();
  if (!why.empty()) return why;
  if (t == Target::kCudaHopper && !hopper_device()) return "the CUDA device is not compute capability 9.0 (no Hopper kernels)";
  return {};
#else
  return "this build has no CUDA backend (configure with SP_ENABLE_CUDA=ON)";
#endif
}

RunOptions target_options(Target t) {
  RunOptions o;
  switch (t) {
    case Target::kReference: o.backend = Backend::kReference; break;
    case Target::kCpu:
      o.backend = Backend::kCPU;
      o.num_threads = 2;
      break;
    case Target::kCudaPortable:
    case Target::kCudaHopper:
      o.backend = Backend::kCUDA;
      o.overrides.cuda_path = t == Target::kCudaHopper ? ExecutionOverrides::CudaPath::kHopper
                                                       : ExecutionOverrides::CudaPath::kPortable;
      o.overrides.kv_staging = ExecutionOverrides::Choice::kNever;
      break;
  }
  return o;
}

std::unique_ptr<Placed> place(Target t, TestProblem* tp, const Policy& policy) {
  if (!is_cuda(t)) return std::make_unique<HostPlaced>(tp, policy);
#if SP_TEST_WITH_CUDA
  return std::make_unique<DevicePlaced>(tp, policy);
#else
  ADD_FAILURE() << "the CUDA targets skip in a build without the CUDA backend (target_unavailable)";
  return std::make_unique<HostPlaced>(tp, policy);
#endif
}

TargetRun run_on(Target t, TestProblem* tp, const Policy& policy) {
  const auto placed = place(t, tp, policy);
  TargetRun r;
  r.status = run(placed->problem(), placed->policy(), placed->output(), target_options(t), &r.stats, &r.decisions);
  if (r.status.ok()) r.out = read_back(*placed, tp);
  return r;
}

TargetRun run_plan_on(Target t, const Plan& plan, TestProblem* tp) {
  const auto placed = place(t, tp, DenseParams{});  // the problem alone: the plan holds the policy
  TargetRun r;
  r.status = run(plan, placed->problem(), placed->output(), target_options(t), &r.stats, &r.decisions);
  if (r.status.ok()) r.out = read_back(*placed, tp);
  return r;
}

Status select_on(Target t, TestProblem* tp, const Policy& policy, Decisions* decisions, RunStats* stats) {
  const auto placed = place(t, tp, policy);
  const Status st = select(placed->problem(), placed->policy(), target_options(t), decisions, stats);
  if (st.ok()) placed->read_back(tp);
  return st;
}

}  // namespace sparseprefill::test
