// SPDX-License-Identifier: Apache-2.0
// The backend interface's defaults.
#include "core/backend.h"

namespace sparseprefill::detail {

Status BackendImpl::block_statistics(const char* who, const AttentionProblem&, const ProblemShape&, int, int, bool,
                                     bool, void*, std::vector<BlockStatistics>*) const {
  return unsupported(std::string(who) + ": backend " + backend_name(kind()) + " computes no calibration statistics");
}

Status BackendImpl::select_statistics(const char* who, const AttentionProblem&, const ProblemShape&,
                                      const EstimateSelectParams&, void*, std::vector<SelectStatistics>*) const {
  return unsupported(std::string(who) + ": backend " + backend_name(kind()) + " computes no calibration statistics");
}

Status BackendImpl::check_errors(int) const { return {}; }

Status BackendImpl::run_host(const AttentionProblem&, const Policy&, const AttentionOutput&, const RunOptions&,
                             Decisions*, ExecutionInfo*) const {
  return {StatusCode::kInternal, std::string("backend ") + backend_name(kind()) + " takes host tensors directly"};
}

Status BackendImpl::select_into(const AttentionProblem&, const ProblemShape&, const Policy&, const RunOptions&,
                                const DeviceBlockMask&) const {
  return unsupported(std::string("select_into: backend ") + backend_name(kind()) +
                     " has no device selection; use select() (its selection on the host)");
}

}  // namespace sparseprefill::detail
