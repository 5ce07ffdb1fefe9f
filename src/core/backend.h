// SPDX-License-Identifier: Apache-2.0
// The interface every backend (src/reference, src/cpu, src/cuda) implements and the dispatch
// layer (src/dispatch) calls. A call is planned, then run: plan() decides everything that does
// not depend on the tensors' contents (the ExecutionInfo and the backend's prepared state);
// run() executes that plan and re-decides nothing. An unplanned run() of the public API is a
// transient plan and one run of it, so planned and unplanned calls share one code path.
// Inputs reach a backend validated: `shape` is validate_problem's result and the policy agrees
// with it (dispatch checks both once).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sparseprefill/attention.h"
#include "sparseprefill/calibration.h"

namespace sparseprefill::detail {

// A backend's plan of one problem shape and policy. Backends derive their own state from it.
struct PreparedRun {
  virtual ~PreparedRun() = default;
  ExecutionInfo info;
};

class BackendImpl {
 public:
  virtual ~BackendImpl() = default;
  virtual Backend kind() const = 0;

  // Whether this backend serves (shape, policy): the device of the tensors, what is compiled.
  virtual Status can_run(const ProblemShape& shape, const Policy& policy) const = 0;

  // Plans calls shaped like `problem` (its data is not read). `persistent`: the plan outlives
  // the call (make_plan), so the backend may prepare state worth keeping (device copies of a
  // mask, metadata a captured run needs); otherwise it is used by one run and dropped.
  virtual Status plan(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                      const RunOptions& options, bool persistent, std::unique_ptr<PreparedRun>* out) const = 0;

  // Runs `prepared` on `problem` (whose shape matches the plan's). `decisions` is null when the
  // caller wants none (a GPU backend then reads nothing back). *ran receives what executed:
  // the plan's info, or what the run fell back to (a GPU driver refusing the plan's tensor maps).
  virtual Status run(const PreparedRun& prepared, const AttentionProblem& problem, const ProblemShape& shape,
                     const Policy& policy, const AttentionOutput& output, const RunOptions& options,
                     Decisions* decisions, ExecutionInfo* ran) const = 0;

  // run() on host tensors by a device backend (the CLI on a GPU machine): the inputs copied to
  // the device and the outputs back, synchronously; *ran also gets the device time. The host
  // backends, which read host tensors anyway, have no such path.
  virtual Status run_host(const AttentionProblem& problem, const Policy& policy, const AttentionOutput& output,
                          const RunOptions& options, Decisions* decisions, ExecutionInfo* ran) const;

  // The policy's selection alone (select(), plan.h): dense, block_sparse and estimate_select.
  virtual Status select(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                        const RunOptions& options, Decisions* decisions) const = 0;

  // estimate_select's selection into the caller's device tensors (select_into, plan.h),
  // without a synchronisation. Only a GPU backend has it.
  virtual Status select_into(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                             const RunOptions& options, const DeviceBlockMask& out) const;

  // Calibration statistics of a sample (calibration.h), one record per sequence; messages
  // start with `who` (the calibrator or function asked). A backend without them says so.
  virtual Status block_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape,
                                  int block_q, int block_k, bool want_max, bool want_g, void* cuda_stream,
                                  std::vector<BlockStatistics>* out) const;
  virtual Status select_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape,
                                   const EstimateSelectParams& base, void* cuda_stream,
                                   std::vector<SelectStatistics>* out) const;

  // The offences its device checks recorded on `device` since the last report
  // (check_device_errors(), block_mask.h); clears them. The host backends have none.
  virtual Status check_errors(int device) const;

  // What this backend computes with, one item per line (build_info()).
  virtual std::string build_info() const = 0;
};

}  // namespace sparseprefill::detail
