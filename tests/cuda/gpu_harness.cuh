// SPDX-License-Identifier: Apache-2.0
// GPU test harness: device copies of test problems (common/device/device.h), the CUDA backend's
// path expectations (common/cuda_paths.h), and the checks a GPU test makes of its own CUDA
// calls. A call's path and kernels are chosen through RunOptions::overrides and read back from
// RunStats::execution, as any caller would.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

#include "common/cuda_paths.h"
#include "common/device/device.h"
#include "common/inputs.h"

namespace sparseprefill::test {

#define SP_CUDA_CHECK(expr)                                                              \
  do {                                                                                   \
    const cudaError_t sp_err_ = (expr);                                                  \
    ASSERT_EQ(sp_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(sp_err_);     \
  } while (0)

#define SP_REQUIRE_GPU()                                  \
  do {                                                    \
    const std::string sp_why_ = cuda_unavailable();       \
    if (!sp_why_.empty()) GTEST_SKIP() << sp_why_;        \
  } while (0)

// `base` with the CUDA path forced onto the portable kernels, or left to the plan (on a 9.0
// device the Hopper kernels where they serve the call).
inline ExecutionOverrides on_path(bool portable, ExecutionOverrides base = {}) {
  base.cuda_path = portable ? ExecutionOverrides::CudaPath::kPortable : ExecutionOverrides::CudaPath::kAuto;
  return base;
}

// The path a call takes: the portable kernels when forced, else the Hopper kernels on a 9.0
// device where they serve it (reads_pages: K/V read through the block table, not staged; the
// head dims with a Hopper instance: hopper_compiles).
inline std::string expected_path(const Policy& policy, bool portable, bool reads_pages, int head_dim = 128,
                                 int head_dim_v = 0) {
  const bool hopper_dim = hopper_compiles(head_dim, head_dim_v > 0 ? head_dim_v : head_dim, reads_pages);
  return !portable && hopper_device() && hopper_dim && hopper_serves(policy, reads_pages, head_dim) ? "cuda-hopper"
                                                                                          : "cuda-portable";
}

// The run took `path`, with an attention kernel of its family; on the Hopper path a call
// reading pages runs the paged instance and any other a contiguous one.
inline void expect_ran(const GpuRun& r, const Policy& policy, const std::string& path, bool reads_pages) {
  const ExecutionInfo& e = r.stats.execution;
  EXPECT_EQ(e.path, path);
  const std::string family = instance_family(path, policy);
  EXPECT_EQ(e.instance.rfind(family, 0), 0u) << "ran " << e.instance << ", expected " << family << "*";
  if (path == "cuda-hopper" && !std::holds_alternative<PermuteStopParams>(policy)) {
    EXPECT_EQ(e.instance.rfind("fwd_sm90_paged_", 0) == 0, reads_pages) << "ran " << e.instance;
  }
}

}  // namespace sparseprefill::test
