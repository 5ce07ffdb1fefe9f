// SPDX-License-Identifier: Apache-2.0
// run() with backend kCUDA on host tensors (the CLI on a GPU machine): the inputs are staged
// to the device and the outputs back; the result matches the CPU backend's within the
// calibrated tolerance with the same decisions, estimate_select's cache of block means is
// written back, and the device time is reported.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/decisions.h"
#include "common/inputs.h"
#include "common/tolerance.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {
namespace {

TEST(CudaHostStaging, HostTensorsRunOnTheDeviceAsTheCpuBackendDecides) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  TestProblem tp = build_problem(random_inputs({{300, 700}, {300, 500}}, 4, 2, 128, DType::kBF16, 41));
  HostTensor thresholds(DType::kFP32, {4, 8});
  for (std::int64_t i = 0; i < thresholds.numel(); ++i) thresholds.as<float>()[i] = 0.2f;
  ExactGateParams gate;
  gate.thresholds = thresholds.view();
  EstimateSelectParams select;
  select.alpha = 0.3;
  select.sink = select.window = select.tail = 1;
  for (const Policy& policy : {Policy{DenseParams{}}, Policy{gate}, Policy{select}}) {
    SCOPED_TRACE(policy_name(policy));
    RunOptions cpu, cuda;
    cpu.backend = Backend::kCPU;
    cuda.backend = Backend::kCUDA;
    RunStats cpu_stats, cuda_stats;
    Decisions cpu_decisions, cuda_decisions;
    ASSERT_TRUE(run(tp.problem(), policy, tp.output(), cpu, &cpu_stats, &cpu_decisions).ok());
    const Status st = run(tp.problem(), policy, tp.output(), cuda, &cuda_stats, &cuda_decisions);
    ASSERT_TRUE(st.ok()) << st.to_string();
    // The staged run's O and LSE against the oracle (calibrated), and its decisions the CPU's.
    EXPECT_TRUE(matches_reference(tp.problem(), policy, tp.output()));
    EXPECT_TRUE(same_decisions(cpu_decisions, cuda_decisions));
    EXPECT_EQ(cuda_stats.execution.backend, Backend::kCUDA);
    EXPECT_GT(cuda_stats.execution.device_ms, 0.0);
    EXPECT_EQ(cuda_stats.density(), cpu_stats.density());
  }
}

}  // namespace
}  // namespace sparseprefill::test
