// SPDX-License-Identifier: Apache-2.0
// Block masks read in place on the GPU (DeviceBlockMask): FlexAttention's tensors and CSR in
// device memory run bit for bit as the host BlockMask they describe, on both paths; a bad entry
// cuts its row and is reported by check_device_errors() (once) naming the row and entry; a
// captured graph reads the mask's current contents on each replay; select_into writes
// estimate_select's selection in Flex's form, which then runs as the policy itself does.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/inputs.h"
#include "gpu_harness.cuh"
#include "sparseprefill/plan.h"

namespace sparseprefill::test {
namespace {

#define SP_REQUIRE_CUDA_DEVICE()                                          \
  do {                                                                    \
    int n_ = 0;                                                           \
    if (cudaGetDeviceCount(&n_) != cudaSuccess || n_ == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

const std::vector<SeqLen> kLengths = {{300, 700}, {300, 500}};

ProblemShape shape_of(const AttentionProblem& p) {
  ProblemShape s;
  EXPECT_TRUE(validate_problem(p, nullptr, &s).ok());
  return s;
}

BlockMask half_mask(const ProblemShape& s, bool per_kv_head, std::uint64_t seed) {
  BlockMask m = BlockMask::empty(s, 128, 128, per_kv_head);
  const BlockMask all = BlockMask::all_visible(s, 128, 128, per_kv_head);
  Random r(seed);
  for (int b = 0; b < m.batch; ++b) {
    for (int h = 0; h < m.heads; ++h) {
      for (int qb = 0; qb < m.num_q_blocks; ++qb) {
        for (int kb = 0; kb < m.num_k_blocks; ++kb) {
          if (all.contains(b, h, qb, kb) && r.below(2) == 1) EXPECT_TRUE(m.add(s, b, h, qb, kb).ok());
        }
      }
    }
  }
  return m;
}

// FlexAttention's four tensors of `m` on the device (entries past a count poisoned with -7).
struct DeviceFlex {
  HostTensor count[2], index[2];
  DeviceBuffer buf[4];
  DeviceBlockMask mask;

  explicit DeviceFlex(const BlockMask& m) {
    const std::int64_t b = m.batch, h = m.heads, q = m.num_q_blocks, k = m.num_k_blocks;
    TensorView* views[4] = {&mask.partial_count, &mask.partial_index, &mask.full_count, &mask.full_index};
    for (int l = 0; l < 2; ++l) {
      count[l] = HostTensor(DType::kInt32, {b, h, q});
      index[l] = HostTensor(DType::kInt32, {b, h, q, k});
      const auto& counts = l == 0 ? m.partial_count : m.full_count;
      const auto& indices = l == 0 ? m.partial_index : m.full_index;
      for (std::int64_t r = 0; r < b * h * q; ++r) {
        count[l].as<std::int32_t>()[r] = counts[static_cast<std::size_t>(r)];
        for (std::int64_t i = 0; i < k; ++i) {
          index[l].as<std::int32_t>()[r * k + i] =
              i < counts[static_cast<std::size_t>(r)] ? indices[static_cast<std::size_t>(r * k + i)] : -7;
        }
      }
      *views[2 * l] = to_device(count[l], &buf[2 * l]);
      *views[2 * l + 1] = to_device(index[l], &buf[2 * l + 1]);
    }
    mask.block_q = m.block_q;
    mask.block_k = m.block_k;
    mask.per_kv_head = m.per_kv_head;
  }
  // The host tensors copied to the device again (after editing them).
  void upload() {
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(cudaMemcpy(buf[2 * l].ptr, count[l].data(), count[l].nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(buf[2 * l + 1].ptr, index[l].data(), index[l].nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
};

// The problem's tensors on the device, and its output read back.
struct DeviceProblem {
  TestProblem tp;
  DeviceBuffer q, k, v, o, lse;
  AttentionProblem problem;
  AttentionOutput output;

  explicit DeviceProblem(TestProblem host) : tp(std::move(host)) {
    problem = tp.problem();
    problem.q = to_device(tp.q, &q);
    problem.k = to_device(tp.k, &k);
    problem.v = to_device(tp.v, &v);
    output.o = to_device(tp.o, &o);
    output.lse = to_device(tp.lse, &lse);
  }
  // O's bytes after a call (poisoned before it).
  std::vector<std::uint8_t> run_bytes(const Policy& policy, const RunOptions& options, Status* st,
                                      Decisions* decisions = nullptr) {
    EXPECT_EQ(cudaMemset(o.ptr, 0xff, o.bytes), cudaSuccess);
    static_cast<void>(*st = run(problem, policy, output, options, nullptr, decisions));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<std::uint8_t> bytes(o.bytes);
    EXPECT_EQ(cudaMemcpy(bytes.data(), o.ptr, o.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return bytes;
  }
};

RunOptions on(ExecutionOverrides::CudaPath path) {
  RunOptions o;
  o.backend = Backend::kCUDA;
  o.overrides.cuda_path = path;
  return o;
}

TEST(CudaDeviceMask, FlexTensorsRunAsTheHostMaskOnBothPaths) {
  SP_REQUIRE_CUDA_DEVICE();
  for (const bool per_kv : {false, true}) {
    SCOPED_TRACE(per_kv ? "per kv head" : "per query head");
    DeviceProblem dp(build_problem(random_inputs(kLengths, 4, 2, 128, DType::kBF16, 21)));
    const ProblemShape s = shape_of(dp.tp.problem());
    const BlockMask m = half_mask(s, per_kv, 5);
    DeviceFlex flex(m);
    BlockSparseParams host, dev;
    host.mask = m;
    dev.device_mask = flex.mask;
    for (const auto path : {ExecutionOverrides::CudaPath::kPortable, ExecutionOverrides::CudaPath::kAuto}) {
      Status a, b;
      const auto want = dp.run_bytes(host, on(path), &a);
      Decisions d;
      const auto got = dp.run_bytes(dev, on(path), &b, &d);
      ASSERT_TRUE(a.ok()) << a.to_string();
      ASSERT_TRUE(b.ok()) << b.to_string();
      EXPECT_EQ(got, want);
      EXPECT_EQ(d.kept.to_dense(), m.to_dense());
      EXPECT_TRUE(check_device_errors(0).ok());
    }
  }
}

TEST(CudaDeviceMask, CsrOnTheDeviceRunsAsTheHostMask) {
  SP_REQUIRE_CUDA_DEVICE();
  DeviceProblem dp(build_problem(random_inputs(kLengths, 4, 2, 128, DType::kFP16, 22)));
  const ProblemShape s = shape_of(dp.tp.problem());
  const BlockMask m = half_mask(s, false, 6);
  std::vector<std::int32_t> indptr, indices;
  m.to_csr(&indptr, &indices);
  HostTensor p(DType::kInt32, {static_cast<std::int64_t>(indptr.size())});
  HostTensor ix(DType::kInt32, {static_cast<std::int64_t>(indices.size())});
  std::memcpy(p.data(), indptr.data(), p.nbytes());
  std::memcpy(ix.data(), indices.data(), ix.nbytes());
  DeviceBuffer pb, ib;
  BlockSparseParams host, dev;
  host.mask = m;
  dev.device_mask.csr_indptr = to_device(p, &pb);
  dev.device_mask.csr_indices = to_device(ix, &ib);
  Status a, b;
  const auto want = dp.run_bytes(host, on(ExecutionOverrides::CudaPath::kAuto), &a);
  const auto got = dp.run_bytes(dev, on(ExecutionOverrides::CudaPath::kAuto), &b);
  ASSERT_TRUE(a.ok() && b.ok()) << a.to_string() << b.to_string();
  EXPECT_EQ(got, want);
}

TEST(CudaDeviceMask, ABadEntryCutsItsRowAndIsReportedOnce) {
  SP_REQUIRE_CUDA_DEVICE();
  DeviceProblem dp(build_problem(random_inputs(kLengths, 4, 2, 128, DType::kBF16, 23)));
  const ProblemShape s = shape_of(dp.tp.problem());
  const BlockMask all = BlockMask::all_visible(s, 128, 128, false);
  DeviceFlex flex(all);
  // Row (b 0, h 3, q block 2): rows 256 .. 299 at positions 656 .. 699 of 700 keys see key
  // blocks 0 .. 5 (full 0 .. 4, partial 5). Its full list's entry 3 becomes 9 (past s_k).
  const std::int64_t row = all.row(0, 3, 2);
  flex.index[1].as<std::int32_t>()[row * all.num_k_blocks + 3] = 9;
  flex.upload();
  BlockMask cut = all;
  cut.full_count[static_cast<std::size_t>(row)] = 3;  // entries 0 .. 2 stay
  BlockSparseParams host, dev;
  host.mask = cut;
  dev.device_mask = flex.mask;
  ASSERT_TRUE(check_device_errors(0).ok());
  Status a, b;
  const auto want = dp.run_bytes(host, on(ExecutionOverrides::CudaPath::kAuto), &a);
  const auto got = dp.run_bytes(dev, on(ExecutionOverrides::CudaPath::kAuto), &b);
  ASSERT_TRUE(a.ok()) << a.to_string();
  ASSERT_TRUE(b.ok()) << b.to_string();  // the call itself does not synchronise: no error yet
  EXPECT_EQ(got, want);
  const Status reported = check_device_errors(0);
  EXPECT_EQ(reported.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(reported.message().find("full_kv_indices: row (b 0, h 3, q block 2) entry 3 is key block 9"),
            std::string::npos)
      << reported.message();
  EXPECT_TRUE(check_device_errors(0).ok());  // reported once
  // With decisions the call synchronises, so the offence is its own error.
  Decisions d;
  const auto again = dp.run_bytes(dev, on(ExecutionOverrides::CudaPath::kAuto), &b, &d);
  EXPECT_EQ(b.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.message().find("entry 3 is key block 9"), std::string::npos) << b.message();
}

// Under a local window the check takes the window's visible blocks (the host conversion's
// rule): a mask over them runs as the host mask on both paths, and an entry that is visible
// without the window, not with it, cuts its row and is reported as out of range.
TEST(CudaDeviceMask, UnderALocalWindowTheCheckTakesTheWindowsBlocks) {
  SP_REQUIRE_CUDA_DEVICE();
  LayoutOptions opt;
  opt.window_left = 200;  // causal: row r sees keys a - 200 .. a
  DeviceProblem dp(build_problem(random_inputs(kLengths, 4, 2, 128, DType::kBF16, 26), opt));
  const ProblemShape s = shape_of(dp.tp.problem());
  {
    const BlockMask m = half_mask(s, true, 9);
    DeviceFlex flex(m);
    BlockSparseParams host, dev;
    host.mask = m;
    dev.device_mask = flex.mask;
    for (const auto path : {ExecutionOverrides::CudaPath::kPortable, ExecutionOverrides::CudaPath::kAuto}) {
      Status a, b;
      const auto want = dp.run_bytes(host, on(path), &a);
      Decisions d;
      const auto got = dp.run_bytes(dev, on(path), &b, &d);
      ASSERT_TRUE(a.ok()) << a.to_string();
      ASSERT_TRUE(b.ok()) << b.to_string();
      EXPECT_EQ(got, want);
      EXPECT_EQ(d.kept.to_dense(), m.to_dense());
      EXPECT_TRUE(check_device_errors(0).ok());
    }
  }
  // Row (b 0, h 1, q block 2): rows 256 .. 299 at positions 656 .. 699 of 700 keys see keys
  // 456 .. 699, key blocks 3 .. 5 (partial 3 and 5, full 4). Its partial list's entry 0 (block 3)
  // becomes block 2, which causal attention alone would show it.
  const BlockMask all = BlockMask::all_visible(s, 128, 128, false);
  const std::int64_t row = all.row(0, 1, 2);
  ASSERT_EQ(all.partial_count[static_cast<std::size_t>(row)], 2);
  ASSERT_EQ(all.partial_index[static_cast<std::size_t>(row * all.num_k_blocks)], 3);
  DeviceFlex flex(all);
  flex.index[0].as<std::int32_t>()[row * all.num_k_blocks] = 2;
  flex.upload();
  BlockMask cut = all;
  cut.partial_count[static_cast<std::size_t>(row)] = 0;  // the list is cut before its first entry
  BlockSparseParams host, dev;
  host.mask = cut;
  dev.device_mask = flex.mask;
  ASSERT_TRUE(check_device_errors(0).ok());
  Status a, b;
  const auto want = dp.run_bytes(host, on(ExecutionOverrides::CudaPath::kAuto), &a);
  const auto got = dp.run_bytes(dev, on(ExecutionOverrides::CudaPath::kAuto), &b);
  ASSERT_TRUE(a.ok()) << a.to_string();
  ASSERT_TRUE(b.ok()) << b.to_string();
  EXPECT_EQ(got, want);
  const Status reported = check_device_errors(0);
  EXPECT_EQ(reported.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(reported.message().find("mask.kv_indices: row (b 0, h 1, q block 2) entry 0 is key block 2, not visible"),
            std::string::npos)
      << reported.message();
}

TEST(CudaDeviceMask, ACapturedGraphReadsTheMasksCurrentContents) {
  SP_REQUIRE_CUDA_DEVICE();
  DeviceProblem dp(build_problem(random_inputs(kLengths, 4, 2, 128, DType::kBF16, 24)));
  const ProblemShape s = shape_of(dp.tp.problem());
  const BlockMask first = half_mask(s, false, 7), second = half_mask(s, false, 8);
  DeviceFlex flex(first);
  BlockSparseParams dev;
  dev.device_mask = flex.mask;
  cudaStream_t stream;
  SP_CUDA_CHECK(cudaStreamCreate(&stream));
  RunOptions opt = on(ExecutionOverrides::CudaPath::kAuto);
  opt.cuda_stream = stream;
  ASSERT_TRUE(run(dp.problem, dev, dp.output, opt).ok());  // warm-up: the metadata cache
  SP_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  SP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status captured = run(dp.problem, dev, dp.output, opt);
  SP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << captured.to_string();
  cudaGraphExec_t exec;
  SP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // The second mask's contents in the same tensors, then a replay.
  const DeviceFlex replacement(second);
  for (int l = 0; l < 2; ++l) {
    flex.count[l] = replacement.count[l];
    flex.index[l] = replacement.index[l];
  }
  flex.upload();
  SP_CUDA_CHECK(cudaMemset(dp.o.ptr, 0xff, dp.o.bytes));
  SP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  SP_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<std::uint8_t> replayed(dp.o.bytes);
  SP_CUDA_CHECK(cudaMemcpy(replayed.data(), dp.o.ptr, dp.o.bytes, cudaMemcpyDeviceToHost));
  BlockSparseParams host;
  host.mask = second;
  Status st;
  EXPECT_EQ(replayed, dp.run_bytes(host, on(ExecutionOverrides::CudaPath::kAuto), &st));
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(check_device_errors(0).ok());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaDeviceMask, SelectIntoWritesFlexTensorsThatRunAsThePolicy) {
  SP_REQUIRE_CUDA_DEVICE();
  for (const bool pack : {false, true}) {
    SCOPED_TRACE(pack ? "pack_gqa" : "per query head");
    DeviceProblem dp(build_problem(random_inputs({{700, 700}, {500, 500}}, 4, 2, 128, DType::kBF16, 25)));
    const ProblemShape s = shape_of(dp.tp.problem());
    EstimateSelectParams es;
    es.alpha = 0.3;
    es.sink = 1;
    es.window = 1;
    es.tail = 1;
    es.pack_gqa = pack;
    const BlockMask empty = BlockMask::empty(s, 128, 128, pack);
    DeviceFlex out(empty);
    RunOptions opt = on(ExecutionOverrides::CudaPath::kAuto);
    const Status st = select_into(dp.problem, es, opt, out.mask);
    ASSERT_TRUE(st.ok()) << st.to_string();
    Decisions want;
    ASSERT_TRUE(select(dp.problem, es, opt, &want).ok());
    BlockSparseParams dev;
    dev.device_mask = out.mask;
    Decisions got;
    Status a, b;
    const auto policy_bytes = dp.run_bytes(es, opt, &a);
    const auto mask_bytes = dp.run_bytes(dev, opt, &b, &got);
    ASSERT_TRUE(a.ok() && b.ok()) << a.to_string() << b.to_string();
    EXPECT_EQ(got.kept.to_dense(), want.kept.to_dense());
    EXPECT_EQ(mask_bytes, policy_bytes);
    EXPECT_TRUE(check_device_errors(0).ok());
  }
}

}  // namespace
}  // namespace sparseprefill::test
