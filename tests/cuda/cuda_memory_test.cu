// SPDX-License-Identifier: Apache-2.0
// Bounded memory: 10,000 calls over random shapes (batched, varlen and paged; every policy;
// new sequence tables, block tables and masks nearly every call) keep the device's memory in
// use within a fixed bound, and the metadata cache within its cap (set small here, so that it
// must evict).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "common/inputs.h"
#include "cuda/runtime.h"
#include "gpu_harness.cuh"

namespace sparseprefill::test {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 128;
constexpr std::int64_t kMaxRows = 4 * 2048;  // q rows and key rows of the largest call
constexpr std::size_t kCacheCap = std::size_t{1} << 20;

std::size_t used_bytes() {
  std::size_t free_b = 0, total_b = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  return total_b - free_b;
}

struct Pools {
  DeviceBuffer q, k, v, o, lse, thresholds;
  Pools() {
    const std::size_t q_bytes = static_cast<std::size_t>(kMaxRows) * kHq * kD * 2;
    const std::size_t kv_bytes = static_cast<std::size_t>(kMaxRows) * kHkv * kD * 2;
    std::vector<std::uint16_t> host(std::max(q_bytes, kv_bytes) / 2);
    Random r(3);
    for (auto& x : host) x = static_cast<std::uint16_t>(0x3c00 | (r.next() & 0x03ff));  // bf16 in [1, 2)
    for (DeviceBuffer* b : {&q, &o}) {
      b->bytes = q_bytes;
      EXPECT_EQ(cudaMalloc(&b->ptr, q_bytes), cudaSuccess);
    }
    for (DeviceBuffer* b : {&k, &v}) {
      b->bytes = kv_bytes;
      EXPECT_EQ(cudaMalloc(&b->ptr, kv_bytes), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(b->ptr, host.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    EXPECT_EQ(cudaMemcpy(q.ptr, host.data(), q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    lse.bytes = static_cast<std::size_t>(kMaxRows) * kHq * 4;
    EXPECT_EQ(cudaMalloc(&lse.ptr, lse.bytes), cudaSuccess);
    std::vector<float> thr(static_cast<std::size_t>(kHq) * 64, 0.5f);
    thresholds.bytes = thr.size() * 4;
    EXPECT_EQ(cudaMalloc(&thresholds.ptr, thresholds.bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(thresholds.ptr, thr.data(), thresholds.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
};

// One random call over the pools: its problem, output and policy, and the host index tensors
// its views point to.
struct Call {
  AttentionProblem problem;
  AttentionOutput output;
  Policy policy;
  HostTensor cu_q, cu_k, seqused, table;
};

// `layout` (0 batched, 1 varlen, 2 paged) and `policy` (0 .. 5) chosen by the caller, or at
// random when negative.
Call random_call(const Pools& pools, Random* r, int layout = -1, int policy = -1) {
  const Device dev{DeviceKind::kCUDA, 0};
  Call c;
  const int batch = 1 + static_cast<int>(r->below(4));
  if (layout < 0) layout = static_cast<int>(r->below(3));
  std::vector<std::int64_t> s_q(static_cast<std::size_t>(batch)), s_k(static_cast<std::size_t>(batch));
  std::int64_t total_q = 0, total_k = 0;
  for (int b = 0; b < batch; ++b) {
    s_k[static_cast<std::size_t>(b)] = 1 + static_cast<std::int64_t>(r->below(2048));
    s_q[static_cast<std::size_t>(b)] = layout == 0 ? 0 : 1 + static_cast<std::int64_t>(r->below(static_cast<std::uint64_t>(s_k[static_cast<std::size_t>(b)])));
    total_k += s_k[static_cast<std::size_t>(b)];
  }
  if (layout == 0) {  // batched: one s_q, each s_k at least it (seqused_k)
    const std::int64_t sq = 1 + static_cast<std::int64_t>(r->below(512));
    for (auto& x : s_q) x = sq;
    for (auto& x : s_k) x = std::max(x, sq);
  }
  for (auto x : s_q) total_q += x;
  auto dview = [&](void* p, std::vector<std::int64_t> shape) {
    return TensorView::contiguous(p, DType::kBF16, shape, dev);
  };
  const std::int64_t max_k = *std::max_element(s_k.begin(), s_k.end());
  if (layout == 0) {
    c.problem.q = dview(pools.q.ptr, {batch, s_q[0], kHq, kD});
    c.output.o = dview(pools.o.ptr, {batch, s_q[0], kHq, kD});
    c.output.lse = TensorView::contiguous(pools.lse.ptr, DType::kFP32, {batch, kHq, s_q[0]}, dev);
    c.problem.k = dview(pools.k.ptr, {batch, max_k, kHkv, kD});
    c.problem.v = dview(pools.v.ptr, {batch, max_k, kHkv, kD});
    c.seqused = HostTensor(DType::kInt32, {batch});
    for (int b = 0; b < batch; ++b) c.seqused.as<std::int32_t>()[b] = static_cast<std::int32_t>(s_k[static_cast<std::size_t>(b)]);
    c.problem.seqused_k = c.seqused.view();
  } else {
    c.problem.q = dview(pools.q.ptr, {total_q, kHq, kD});
    c.output.o = dview(pools.o.ptr, {total_q, kHq, kD});
    c.output.lse = TensorView::contiguous(pools.lse.ptr, DType::kFP32, {kHq, total_q}, dev);
    c.cu_q = HostTensor(DType::kInt32, {batch + 1});
    c.cu_q.as<std::int32_t>()[0] = 0;
    for (int b = 0; b < batch; ++b) {
      c.cu_q.as<std::int32_t>()[b + 1] = c.cu_q.as<std::int32_t>()[b] + static_cast<std::int32_t>(s_q[static_cast<std::size_t>(b)]);
    }
    c.problem.cu_seqlens_q = c.cu_q.view();
    if (layout == 1) {
      c.problem.k = dview(pools.k.ptr, {total_k, kHkv, kD});
      c.problem.v = dview(pools.v.ptr, {total_k, kHkv, kD});
      c.cu_k = HostTensor(DType::kInt32, {batch + 1});
      c.cu_k.as<std::int32_t>()[0] = 0;
      for (int b = 0; b < batch; ++b) {
        c.cu_k.as<std::int32_t>()[b + 1] = c.cu_k.as<std::int32_t>()[b] + static_cast<std::int32_t>(s_k[static_cast<std::size_t>(b)]);
      }
      c.problem.cu_seqlens_k = c.cu_k.view();
    } else {
      const int page = std::vector<int>{16, 64, 128}[r->below(3)];
      const std::int64_t pages = kMaxRows / page;
      c.problem.k = dview(pools.k.ptr, {pages, page, kHkv, kD});
      c.problem.v = dview(pools.v.ptr, {pages, page, kHkv, kD});
      const std::int64_t per_seq = (max_k + page - 1) / page;
      c.table = HostTensor(DType::kInt32, {batch, per_seq});
      for (std::int64_t i = 0; i < batch * per_seq; ++i) {
        c.table.as<std::int32_t>()[i] = static_cast<std::int32_t>(r->below(static_cast<std::uint64_t>(pages)));
      }
      c.problem.block_table = c.table.view();
      c.seqused = HostTensor(DType::kInt32, {batch});
      for (int b = 0; b < batch; ++b) c.seqused.as<std::int32_t>()[b] = static_cast<std::int32_t>(s_k[static_cast<std::size_t>(b)]);
      c.problem.seqused_k = c.seqused.view();
    }
  }
  c.problem.causal = true;
  if (policy < 0) policy = static_cast<int>(r->below(6));
  switch (policy) {
    case 5: {  // a host mask of about half the visible blocks: a new mask upload every call
      ProblemShape shape;
      EXPECT_TRUE(validate_problem(c.problem, nullptr, &shape).ok());
      BlockSparseParams bs;
      bs.mask = BlockMask::empty(shape, 128, 128, false);
      const BlockMask all = BlockMask::all_visible(shape, 128, 128, false);
      for (int b = 0; b < shape.batch; ++b) {
        for (int h = 0; h < shape.h_q; ++h) {
          for (int qb = 0; qb < all.num_q_blocks; ++qb) {
            for (int kb = 0; kb < all.num_k_blocks; ++kb) {
              if (all.contains(b, h, qb, kb) && r->below(2) == 1) EXPECT_TRUE(bs.mask.add(shape, b, h, qb, kb).ok());
            }
          }
        }
      }
      c.policy = bs;
      break;
    }
    case 0: c.policy = DenseParams{}; break;
    case 1: {
      ExactGateParams g;
      g.thresholds = TensorView::contiguous(pools.thresholds.ptr, DType::kFP32, {kHq, 64}, dev);
      c.policy = g;
      break;
    }
    case 2: c.policy = SoftmaxSkipParams{}; break;
    case 3: c.policy = EstimateSelectParams{}; break;
    default: {
      PermuteStopParams ps;
      ps.segment = 512;
      c.policy = ps;
      break;
    }
  }
  return c;
}

TEST(CudaMemory, TenThousandRandomCallsStayWithinAFixedBound) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  // The first call of this process reads the cap: small, so the cache must evict.
  ASSERT_EQ(setenv("SPARSEPREFILL_CUDA_CACHE_BYTES", "1048576", 1), 0);
  const Pools pools;
  Random r(11);
  RunOptions opt;
  opt.backend = Backend::kCUDA;
  auto call_once = [&](int layout, int policy) {
    Call c = random_call(pools, &r, layout, policy);
    const Status st = run(c.problem, c.policy, c.output, opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
  };
  // Warm-up: every (layout, policy) several times, so that each kernel's module is loaded (and
  // its local memory reserved) and the pools hold their working sets before the baseline.
  for (int round = 0; round < 20; ++round) {
    for (int layout = 0; layout < 3; ++layout) {
      for (int policy = 0; policy < 6; ++policy) call_once(layout, policy);
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::size_t baseline = used_bytes();
  cudaMemPool_t pool = nullptr;
  ASSERT_TRUE(cuda::pool_for(0, cuda::PoolKind::kScratch, &pool).ok());
  auto reserved = [&] {
    std::uint64_t bytes = 0;
    EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &bytes), cudaSuccess);
    return bytes;
  };
  const std::uint64_t baseline_reserved = reserved();
  std::size_t peak = baseline;
  for (int i = 0; i < 10000; ++i) {
    call_once(-1, -1);
    if (i % 500 == 499) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      peak = std::max(peak, used_bytes());
      EXPECT_LE(cuda::metadata_cache().bytes_on(0), kCacheCap) << "after " << i + 1 << " calls";
    }
  }
  // The bound: the cache's cap plus what the scratch pool keeps between calls, beyond the
  // baseline (which already holds the pools' first allocations).
  const std::size_t bound = kCacheCap + static_cast<std::size_t>(cuda::kScratchKeepBytes) + (std::size_t{32} << 20);
  EXPECT_LE(peak - baseline, bound) << "baseline " << baseline << " peak " << peak << "; scratch pool reserved "
                                    << baseline_reserved << " then " << reserved() << "; metadata cache "
                                    << cuda::metadata_cache().bytes_on(0);
  EXPECT_EQ(cuda::metadata_cache_cap(), kCacheCap);
}

}  // namespace
}  // namespace sparseprefill::test
