// SPDX-License-Identifier: Apache-2.0
// The backend-conformance suite's targets: the oracle behind the public API (reference), the
// CPU backend (cpu), and the CUDA backend forced onto its portable kernels (cuda-portable) or
// its Hopper kernels (cuda-hopper). A call is placed where the target reads its tensors (the
// host TestProblem itself, or device copies), run through the public API with the target's
// options, and read back into the oracle's layout, so that one scenario checks every backend
// alike.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/inputs.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"
#include "sparseprefill/plan.h"

namespace sparseprefill::test {

enum class Target { kReference, kCpu, kCudaPortable, kCudaHopper };

// RunStats::execution.path of a call on the target.
const char* target_path(Target t);
// The test parameter's name: reference, cpu, cuda_portable, cuda_hopper.
std::string target_param_name(const ::testing::TestParamInfo<Target>& info);
bool is_cuda(Target t);
// Why the target cannot run here ("" when it can): a build without the CUDA backend, no CUDA
// device, or (cuda-hopper) a device that is not compute capability 9.0.
std::string target_unavailable(Target t);

// The options of every call on the target: its backend (two CPU threads for cpu); for the CUDA
// targets the forced path, and paged K/V read through the block table in the kernels (staged
// rows are the contiguous layout's, which tests/cuda's paged tests compare bit for bit).
RunOptions target_options(Target t);

// The tensors of one call where the target reads them; O and LSE poisoned with NaN.
class Placed {
 public:
  virtual ~Placed() = default;
  virtual const AttentionProblem& problem() const = 0;
  virtual const AttentionOutput& output() const = 0;
  // The policy with its tensors (thresholds, a cache of block means) beside the problem's.
  virtual const Policy& policy() const = 0;
  // Copies what a call wrote (O, LSE, a cache of block means) into tp's host tensors.
  virtual void read_back(TestProblem* tp) const = 0;
};
std::unique_ptr<Placed> place(Target t, TestProblem* tp, const Policy& policy);

struct TargetRun {
  Status status;
  ref::Result out;  // O and LSE in the oracle's layout (when status is ok)
  Decisions decisions;
  RunStats stats;
};
// run() of `policy` on tp; tp's host O and LSE (and a cache of block means) hold the result.
TargetRun run_on(Target t, TestProblem* tp, const Policy& policy);
// run(plan, ...) on tp (the plan holds the policy and its tensors).
TargetRun run_plan_on(Target t, const Plan& plan, TestProblem* tp);
// select() of `policy` on tp (a cache of block means written back into tp's policy tensors).
Status select_on(Target t, TestProblem* tp, const Policy& policy, Decisions* decisions, RunStats* stats);

}  // namespace sparseprefill::test
