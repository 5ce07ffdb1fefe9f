// SPDX-License-Identifier: Apache-2.0
// Block masks read in place (DeviceBlockMask, block_mask.h), as the host backends take host
// tensors: FlexAttention's form and CSR give the BlockMask they describe (results bit for bit
// those of the BlockMask), B = 1 and H = 1 broadcast, rows past a sequence's end are ignored,
// the full/partial split is bookkeeping (the geometry classifies), and every offence of the
// entry rule (core/rules/block_sparse.h) is refused naming the tensor, the row and the entry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/inputs.h"
#include "core/rules/block_sparse.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {
namespace {

const std::vector<SeqLen> kLengths = {{40, 70}, {40, 50}};  // chunked (s_q < s_k), unequal keys

ProblemShape shape_of(const TestProblem& tp) {
  ProblemShape s;
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &s).ok());
  return s;
}

// FlexAttention's four tensors of a BlockMask (full and partial lists as the mask has them),
// on the host, capacity K = the mask's key blocks; entries past a count are poison (-7).
struct Flex {
  HostTensor count[2], index[2];  // 0 partial (kv_*), 1 full (full_kv_*)

  explicit Flex(const BlockMask& m) {
    const std::int64_t b = m.batch, h = m.heads, q = m.num_q_blocks, k = m.num_k_blocks;
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
    }
  }
  DeviceBlockMask view(const BlockMask& m) const {
    DeviceBlockMask d;
    d.partial_count = count[0].view();
    d.partial_index = index[0].view();
    d.full_count = count[1].view();
    d.full_index = index[1].view();
    d.block_q = m.block_q;
    d.block_k = m.block_k;
    d.per_kv_head = m.per_kv_head;
    return d;
  }
};

// About half of the visible 16 x 16 blocks, seeded.
BlockMask half_mask(const ProblemShape& s, bool per_kv_head, std::uint64_t seed) {
  BlockMask m = BlockMask::empty(s, 16, 16, per_kv_head);
  const BlockMask all = BlockMask::all_visible(s, 16, 16, per_kv_head);
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

RunOptions cpu() {
  RunOptions o;
  o.backend = Backend::kCPU;
  o.num_threads = 1;
  return o;
}

void expect_same_run(TestProblem* tp, const BlockMask& mask, const DeviceBlockMask& in_place) {
  BlockSparseParams host;
  host.mask = mask;
  BlockSparseParams dev;
  dev.device_mask = in_place;
  RunStats a_stats, b_stats;
  ASSERT_TRUE(run(tp->problem(), host, tp->output(), cpu(), &a_stats).ok());
  const auto* ao = static_cast<const std::uint8_t*>(tp->o.data());
  const std::vector<std::uint8_t> a(ao, ao + tp->o.nbytes());
  const Status st = run(tp->problem(), dev, tp->output(), cpu(), &b_stats);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto* bo = static_cast<const std::uint8_t*>(tp->o.data());
  const std::vector<std::uint8_t> b(bo, bo + tp->o.nbytes());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a_stats.density(), b_stats.density());
}

TEST(DeviceMask, FlexFormRunsAsTheBlockMaskItDescribes) {
  for (const bool per_kv : {false, true}) {
    SCOPED_TRACE(per_kv ? "per kv head" : "per query head");
    TestProblem tp = build_problem(random_inputs(kLengths, 4, 2, 16, DType::kBF16, 11));
    const ProblemShape s = shape_of(tp);
    const BlockMask m = half_mask(s, per_kv, 3);
    const Flex flex(m);
    BlockMask back;
    ASSERT_TRUE(flex.view(m).to_block_mask(s, &back).ok());
    EXPECT_EQ(back.to_dense(), m.to_dense());
    expect_same_run(&tp, m, flex.view(m));
  }
}

TEST(DeviceMask, TheSplitIsBookkeepingTheGeometryClassifies) {
  TestProblem tp = build_problem(random_inputs(kLengths, 2, 1, 16, DType::kBF16, 12));
  const ProblemShape s = shape_of(tp);
  const BlockMask m = half_mask(s, false, 4);
  // Every block in the partial list (a Flex mask without full blocks) describes the same set.
  BlockMask merged = m;
  for (std::size_t r = 0; r < m.full_count.size(); ++r) {
    std::vector<std::int32_t> all;
    const std::size_t base = r * static_cast<std::size_t>(m.num_k_blocks);
    for (int i = 0; i < m.full_count[r]; ++i) all.push_back(m.full_index[base + static_cast<std::size_t>(i)]);
    for (int i = 0; i < m.partial_count[r]; ++i) all.push_back(m.partial_index[base + static_cast<std::size_t>(i)]);
    std::sort(all.begin(), all.end());
    merged.full_count[r] = 0;
    merged.partial_count[r] = static_cast<std::int32_t>(all.size());
    for (std::size_t i = 0; i < all.size(); ++i) merged.partial_index[base + i] = all[i];
  }
  const Flex flex(merged);
  DeviceBlockMask d = flex.view(merged);
  d.full_count = TensorView{};
  d.full_index = TensorView{};
  BlockMask back;
  ASSERT_TRUE(d.to_block_mask(s, &back).ok());
  EXPECT_EQ(back.to_dense(), m.to_dense());
  ASSERT_TRUE(back.validate_for(s).ok());  // reclassified: full blocks in the full list
  expect_same_run(&tp, m, d);
}

TEST(DeviceMask, CsrRunsAsTheBlockMaskItDescribes) {
  TestProblem tp = build_problem(random_inputs(kLengths, 4, 2, 16, DType::kFP16, 13));
  const ProblemShape s = shape_of(tp);
  const BlockMask m = half_mask(s, false, 5);
  std::vector<std::int32_t> indptr, indices;
  m.to_csr(&indptr, &indices);
  HostTensor p(DType::kInt32, {static_cast<std::int64_t>(indptr.size())});
  HostTensor ix(DType::kInt32, {static_cast<std::int64_t>(indices.size())});
  std::copy(indptr.begin(), indptr.end(), p.as<std::int32_t>());
  std::copy(indices.begin(), indices.end(), ix.as<std::int32_t>());
  DeviceBlockMask d;
  d.csr_indptr = p.view();
  d.csr_indices = ix.view();
  d.block_q = d.block_k = 16;
  expect_same_run(&tp, m, d);
}

TEST(DeviceMask, SizeOneBatchAndHeadsBroadcast) {
  TestProblem tp = build_problem(random_inputs({{48, 48}, {48, 48}}, 4, 2, 16, DType::kBF16, 14));
  const ProblemShape s = shape_of(tp);
  // One row set for every (b, h): the first sequence's first head of a random mask.
  const BlockMask one = half_mask(s, false, 6);
  BlockMask every = BlockMask::empty(s, 16, 16, false);
  HostTensor count(DType::kInt32, {1, 1, one.num_q_blocks});
  HostTensor index(DType::kInt32, {1, 1, one.num_q_blocks, one.num_k_blocks});
  for (int qb = 0; qb < one.num_q_blocks; ++qb) {
    int n = 0;
    for (int kb = 0; kb < one.num_k_blocks; ++kb) {
      if (!one.contains(0, 0, qb, kb)) continue;
      index.as<std::int32_t>()[qb * one.num_k_blocks + n++] = kb;
      for (int b = 0; b < s.batch; ++b) {
        for (int h = 0; h < s.h_q; ++h) ASSERT_TRUE(every.add(s, b, h, qb, kb).ok());
      }
    }
    count.as<std::int32_t>()[qb] = n;
  }
  DeviceBlockMask d;
  d.partial_count = count.view();
  d.partial_index = index.view();
  d.block_q = d.block_k = 16;
  expect_same_run(&tp, every, d);
}

TEST(DeviceMask, EveryOffenceIsRefusedNamingTheEntry) {
  TestProblem tp = build_problem(random_inputs(kLengths, 2, 1, 16, DType::kBF16, 15));
  const ProblemShape s = shape_of(tp);
  const BlockMask m = BlockMask::all_visible(s, 16, 16, false);
  struct Case {
    const char* what;
    int list;           // 0 partial, 1 full
    std::int32_t count;  // -1: leave
    int entry;
    std::int32_t value;
    const char* says;
  };
  // Row (b 0, h 1, q block 1), rows 16 .. 31 of 40 queries over 70 keys (positions 46 .. 61):
  // visible blocks 0 .. 3, full 0 .. 1, partial 2 .. 3.
  const Case cases[] = {
      {"negative count", 1, -1 - 1, 0, 0, "count -2"},
      {"count past capacity", 0, 99, 0, 0, "count 99"},
      {"a key block past the causal limit", 0, -1, 1, 6, "not visible"},
      {"a negative key block", 1, -1, 0, -3, "not visible"},
      {"a repeated entry", 1, -1, 1, 0, "not above the entry before it"},
      {"a block in both lists", 1, -1, 2, 3, "other list"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Flex flex(m);
    const std::int64_t row = m.row(0, 1, 1);
    if (c.count != -1) {
      flex.count[c.list].as<std::int32_t>()[row] = c.count;
    } else {
      flex.index[c.list].as<std::int32_t>()[row * m.num_k_blocks + c.entry] = c.value;
    }
    if (std::string(c.what) == "a block in both lists") flex.count[1].as<std::int32_t>()[row] = 3;
    BlockSparseParams dev;
    dev.device_mask = flex.view(m);
    const Status st = run(tp.problem(), dev, tp.output(), cpu());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(c.list == 0 ? "kv_indices" : "full_kv_indices"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("b 0, h 1, q block 1"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(c.says), std::string::npos) << st.message();
  }
}

TEST(DeviceMask, ShapesDtypesAndDevicesAreCheckedBeforeAnyRead) {
  TestProblem tp = build_problem(random_inputs(kLengths, 2, 1, 16, DType::kBF16, 16));
  const ProblemShape s = shape_of(tp);
  const BlockMask m = half_mask(s, false, 7);
  const Flex flex(m);
  const auto refused = [&](DeviceBlockMask d, const char* names) {
    BlockSparseParams p;
    p.device_mask = d;
    const Status st = run(tp.problem(), p, tp.output(), cpu());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << names;
    EXPECT_NE(st.message().find(names), std::string::npos) << st.message();
  };
  DeviceBlockMask d = flex.view(m);
  HostTensor wide(DType::kFP32, {m.batch, m.heads, m.num_q_blocks});
  d.partial_count = wide.view();
  refused(d, "kv_num_blocks: expected int32");
  d = flex.view(m);
  HostTensor few(DType::kInt32, {m.batch, m.heads, m.num_q_blocks - 1});
  d.partial_count = few.view();
  refused(d, "Q >= 3");
  d = flex.view(m);
  d.full_index = TensorView{};
  refused(d, "go together");
  d = flex.view(m);
  HostTensor indptr(DType::kInt32, {5});
  d.csr_indptr = indptr.view();
  refused(d, "not both");
  BlockSparseParams both;
  both.mask = m;
  both.device_mask = flex.view(m);
  const Status st = run(tp.problem(), both, tp.output(), cpu());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not both"), std::string::npos) << st.message();
}

TEST(DeviceMask, EntryRuleOnHandCases) {
  EXPECT_EQ(rules::mask_entry_fault(0, -1, 3), rules::kMaskOk);
  EXPECT_EQ(rules::mask_entry_fault(2, 1, 3), rules::kMaskOk);
  EXPECT_EQ(rules::mask_entry_fault(3, 1, 3), rules::kMaskRange);
  EXPECT_EQ(rules::mask_entry_fault(-1, -1, 3), rules::kMaskRange);
  EXPECT_EQ(rules::mask_entry_fault(1, 1, 3), rules::kMaskOrder);
  EXPECT_EQ(rules::mask_entry_fault(0, 2, 3), rules::kMaskOrder);
  EXPECT_EQ(rules::mask_entry_fault(0, -1, 0), rules::kMaskRange);  // a query block that sees nothing
}

}  // namespace
}  // namespace sparseprefill::test
