// SPDX-License-Identifier: Apache-2.0
// The C ABI (libsparseprefill_c) against the C++ API on host tensors: every policy and layout
// that crosses the ABI gives bit-identical O/LSE and identical statistics to run(), and every
// malformed argument comes back as a status code with a message naming it; a calibration run
// through the ABI writes the file CalibrationRun makes.
#include "sparseprefill/c_api.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "sparseprefill/sparseprefill.h"

namespace sp = sparseprefill;

namespace {

// splitmix64: a seeded, platform-independent stream (never zeros as test data).
std::uint64_t next_u64(std::uint64_t* state) {
  std::uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [lo, hi).
double next_uniform(std::uint64_t* state, double lo, double hi) {
  return lo + (hi - lo) * static_cast<double>(next_u64(state) >> 11) * 0x1.0p-53;
}

sp::HostTensor random_bf16(std::vector<std::int64_t> shape, std::uint64_t seed) {
  sp::HostTensor t(sp::DType::kBF16, std::move(shape));
  auto* p = t.as<std::uint16_t>();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    p[i] = sp::float_to_bf16(static_cast<float>(next_uniform(&seed, -1.0, 1.0)));
  }
  return t;
}

// FP8 e4m3 codes of values uniform in [lo, hi) (rounded to nearest even).
sp::HostTensor random_fp8(std::vector<std::int64_t> shape, std::uint64_t seed, double lo, double hi) {
  sp::HostTensor t(sp::DType::kFP8E4M3, std::move(shape));
  auto* p = t.as<std::uint8_t>();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    p[i] = sp::float_to_e4m3(static_cast<float>(next_uniform(&seed, lo, hi)));
  }
  return t;
}

void poison(sp::HostTensor* t) {
  if (t->dtype() == sp::DType::kFP32) {
    auto* p = t->as<float>();
    for (std::int64_t i = 0; i < t->numel(); ++i) p[i] = std::numeric_limits<float>::quiet_NaN();
  } else {
    auto* p = t->as<std::uint16_t>();
    for (std::int64_t i = 0; i < t->numel(); ++i) p[i] = 0x7FC1;  // bf16/fp16 NaN either way
  }
}

bool all_finite_or_neg_inf(const sp::HostTensor& t) {
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    float x = t.dtype() == sp::DType::kFP32 ? t.as<float>()[i]
                                            : sp::bf16_to_float(t.as<std::uint16_t>()[i]);
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) return false;
  }
  return true;
}

sp_tensor to_c(const sp::TensorView& v) {
  sp_tensor t{};
  if (!v.defined()) return t;
  t.data = v.data;
  switch (v.dtype) {
    case sp::DType::kBF16: t.dtype = SP_DTYPE_BF16; break;
    case sp::DType::kFP16: t.dtype = SP_DTYPE_FP16; break;
    case sp::DType::kFP32: t.dtype = SP_DTYPE_FP32; break;
    case sp::DType::kInt32: t.dtype = SP_DTYPE_INT32; break;
    case sp::DType::kFP8E4M3: t.dtype = SP_DTYPE_FP8_E4M3; break;
  }
  t.device_type = SP_DEVICE_CPU;
  t.rank = v.rank;
  for (int i = 0; i < v.rank; ++i) {
    t.shape[i] = v.shape[i];
    t.stride[i] = v.stride[i];
  }
  return t;
}

sp_problem to_c(const sp::AttentionProblem& p) {
  sp_problem c{};
  c.q = to_c(p.q);
  c.k = to_c(p.k);
  c.v = to_c(p.v);
  c.cu_seqlens_q = to_c(p.cu_seqlens_q);
  c.cu_seqlens_k = to_c(p.cu_seqlens_k);
  c.seqused_k = to_c(p.seqused_k);
  c.block_table = to_c(p.block_table);
  c.q_descale = to_c(p.q_descale);
  c.k_descale = to_c(p.k_descale);
  c.v_descale = to_c(p.v_descale);
  c.causal = p.causal ? 1 : 0;
  c.scale = p.scale;
  c.local = p.window_left != -1 || p.window_right != -1 ? 1 : 0;
  c.window_left = c.local ? p.window_left : 0;
  c.window_right = c.local ? p.window_right : 0;
  c.attention_chunk = p.attention_chunk;
  c.softcap = p.softcap;
  c.sinks = to_c(p.sinks);
  return c;
}

// A batched GQA problem with s_q != s_k (bottom-right causal): b 2, s_q 37, s_k 53, h_q 4,
// h_kv 2, d 16.
struct Batched {
  sp::HostTensor q = random_bf16({2, 37, 4, 16}, 11);
  sp::HostTensor k = random_bf16({2, 53, 2, 16}, 12);
  sp::HostTensor v = random_bf16({2, 53, 2, 16}, 13);
  sp::AttentionProblem problem() const {
    sp::AttentionProblem p;
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.causal = true;
    return p;
  }
  sp::HostTensor new_o() const { return sp::HostTensor(sp::DType::kBF16, {2, 37, 4, 16}); }
  sp::HostTensor new_lse() const { return sp::HostTensor(sp::DType::kFP32, {2, 4, 37}); }
};

struct PolicyHandle {
  sp_policy* handle = nullptr;
  PolicyHandle(const char* name, const std::vector<sp_setting>& settings) {
    int rc = sp_policy_create(name, settings.data(), static_cast<int32_t>(settings.size()),
                              &handle);
    EXPECT_EQ(rc, SP_OK) << sp_last_error();
  }
  ~PolicyHandle() { sp_policy_destroy(handle); }
  PolicyHandle(const PolicyHandle&) = delete;
  PolicyHandle& operator=(const PolicyHandle&) = delete;
};

sp::Policy parse(const char* name, const std::vector<sp_setting>& settings) {
  std::vector<std::pair<std::string, std::string>> kv;
  for (const auto& s : settings) kv.emplace_back(s.key, s.value);
  sp::Policy policy;
  sp::Status st = sp::parse_policy(name, kv, &policy);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return policy;
}

// Runs `policy` through run() and `handle` through sp_run on the same inputs (one CPU thread
// each, so both are deterministic) and expects identical bits and statistics.
void expect_same_as_run(const sp::AttentionProblem& problem, const sp::Policy& policy,
                        const sp_policy* handle, sp::HostTensor o_cpp, sp::HostTensor lse_cpp) {
  sp::HostTensor o_c = o_cpp;
  sp::HostTensor lse_c = lse_cpp;
  poison(&o_cpp);
  poison(&lse_cpp);
  poison(&o_c);
  poison(&lse_c);

  sp::RunOptions opts;
  opts.backend = sp::Backend::kCPU;
  opts.num_threads = 1;
  sp::RunStats rs;
  sp::Status st = sp::run(problem, policy, {o_cpp.view(), lse_cpp.view()}, opts, &rs);
  ASSERT_TRUE(st.ok()) << st.to_string();

  sp_problem cp = to_c(problem);
  sp_output out{to_c(o_c.view()), to_c(lse_c.view())};
  sp_options copts{SP_BACKEND_CPU, 1, nullptr};
  std::vector<sp_head_stats> heads(rs.heads.size());
  sp_stats stats{};
  stats.heads = heads.data();
  stats.heads_capacity = static_cast<int64_t>(heads.size());
  ASSERT_EQ(sp_run(&cp, handle, &out, &copts, &stats), SP_OK) << sp_last_error();
  EXPECT_STREQ(sp_last_error(), "");

  EXPECT_TRUE(all_finite_or_neg_inf(o_c)) << "O not fully written";
  EXPECT_TRUE(all_finite_or_neg_inf(lse_c)) << "LSE not fully written";
  EXPECT_EQ(std::memcmp(o_c.data(), o_cpp.data(), o_c.nbytes()), 0);
  EXPECT_EQ(std::memcmp(lse_c.data(), lse_cpp.data(), lse_c.nbytes()), 0);

  EXPECT_EQ(stats.batch, rs.batch);
  EXPECT_EQ(stats.h_q, rs.h_q);
  ASSERT_EQ(stats.num_heads, static_cast<int64_t>(rs.heads.size()));
  sp_head_stats sum{};
  for (std::size_t i = 0; i < rs.heads.size(); ++i) {
    const auto& h = rs.heads[i];
    EXPECT_EQ(heads[i].visible_blocks, h.visible_blocks) << "head " << i;
    EXPECT_EQ(heads[i].kept_blocks, h.kept_blocks) << "head " << i;
    EXPECT_EQ(heads[i].corrected_blocks, h.corrected_blocks) << "head " << i;
    EXPECT_EQ(heads[i].visible_pairs, h.visible_pairs) << "head " << i;
    EXPECT_EQ(heads[i].computed_pairs, h.computed_pairs) << "head " << i;
    sum.visible_blocks += h.visible_blocks;
    sum.kept_blocks += h.kept_blocks;
    sum.computed_pairs += h.computed_pairs;
  }
  EXPECT_EQ(stats.total.visible_blocks, sum.visible_blocks);
  EXPECT_EQ(stats.total.kept_blocks, sum.kept_blocks);
  EXPECT_EQ(stats.total.computed_pairs, sum.computed_pairs);
  EXPECT_DOUBLE_EQ(stats.density, rs.density());
  EXPECT_DOUBLE_EQ(stats.pair_density, rs.pair_density());
}

// Blocks kept by run() over the whole call.
std::int64_t kept_blocks(const Batched& in, const sp::Policy& policy) {
  sp::RunStats rs;
  sp::HostTensor o = in.new_o();
  sp::Status st = sp::run(in.problem(), policy, {o.view(), {}}, {}, &rs);
  EXPECT_TRUE(st.ok()) << st.to_string();
  std::int64_t kept = 0;
  for (const auto& h : rs.heads) kept += h.kept_blocks;
  return kept;
}

// A block_sparse mask over `problem`'s visible 8 x 8 blocks, every third one (by row plus block
// index) dropped, as CSR.
struct ThinnedMask {
  sp::ProblemShape shape;
  std::vector<std::int32_t> indptr = {0}, indices;
  std::int64_t visible = 0;  // visible blocks before dropping
  explicit ThinnedMask(const sp::AttentionProblem& problem) {
    EXPECT_TRUE(sp::validate_problem(problem, nullptr, &shape).ok());
    std::vector<std::int32_t> all_ptr, all_idx;
    sp::BlockMask::all_visible(shape, 8, 8, false).to_csr(&all_ptr, &all_idx);
    visible = static_cast<std::int64_t>(all_idx.size());
    for (std::size_t r = 0; r + 1 < all_ptr.size(); ++r) {
      for (std::int32_t i = all_ptr[r]; i < all_ptr[r + 1]; ++i) {
        if ((all_idx[i] + static_cast<std::int32_t>(r)) % 3 != 0) indices.push_back(all_idx[i]);
      }
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
    }
  }
  sp_block_mask_csr csr() const {
    return sp_block_mask_csr{8, 8, 0, static_cast<int64_t>(indptr.size() - 1), indptr.data(),
                             static_cast<int64_t>(indices.size()), indices.data()};
  }
  sp::BlockSparseParams params() const {
    sp::BlockSparseParams p;
    EXPECT_TRUE(sp::BlockMask::from_csr(shape, 8, 8, false, indptr, indices, &p.mask).ok());
    return p;
  }
};

TEST(CApi, DenseMatchesRun) {
  Batched in;
  PolicyHandle h("dense", {});
  expect_same_as_run(in.problem(), sp::DenseParams{}, h.handle, in.new_o(), in.new_lse());
}

TEST(CApi, SettingsReachThePolicy) {
  Batched in;
  std::vector<sp_setting> skip = {{"block_q", "8"}, {"block_k", "8"}, {"a", "3"}};
  PolicyHandle hs("softmax_skip", skip);
  expect_same_as_run(in.problem(), parse("softmax_skip", skip), hs.handle, in.new_o(),
                     in.new_lse());

  std::vector<sp_setting> est = {{"block", "8"}, {"alpha", "0.6"}, {"sink", "1"},
                                 {"window", "1"}, {"tail", "1"}};
  PolicyHandle he("estimate_select", est);
  std::string described = sp_policy_describe(he.handle);
  EXPECT_EQ(described, sp::describe(parse("estimate_select", est)));
  expect_same_as_run(in.problem(), parse("estimate_select", est), he.handle, in.new_o(),
                     in.new_lse());
}

TEST(CApi, ExactGateThresholdsAttach) {
  Batched in;
  // fp32 [h_q 4, positions 7]: thresholds near the block maxima (about 0.8 for these inputs)
  // so that some full blocks are kept and some skipped.
  sp::HostTensor table(sp::DType::kFP32, {4, 7});
  std::uint64_t seed = 21;
  for (std::int64_t i = 0; i < table.numel(); ++i) {
    table.as<float>()[i] = static_cast<float>(next_uniform(&seed, 0.4, 1.0));
  }
  std::vector<sp_setting> settings = {{"block_q", "8"}, {"block_k", "8"}};
  PolicyHandle h("exact_gate", settings);
  sp_tensor ct = to_c(table.view());
  ASSERT_EQ(sp_policy_set_thresholds(h.handle, &ct), SP_OK) << sp_last_error();

  sp::Policy policy = parse("exact_gate", settings);
  std::get<sp::ExactGateParams>(policy).thresholds = table.view();
  expect_same_as_run(in.problem(), policy, h.handle, in.new_o(), in.new_lse());

  // The table must actually gate: more blocks kept than with +inf thresholds (partial blocks
  // only), fewer than with -inf thresholds (every visible block).
  auto kept_with = [&](float fill) {
    sp::HostTensor uniform(sp::DType::kFP32, {4, 1});
    for (int i = 0; i < 4; ++i) uniform.as<float>()[i] = fill;
    sp::Policy p = parse("exact_gate", settings);
    std::get<sp::ExactGateParams>(p).thresholds = uniform.view();
    return kept_blocks(in, p);
  };
  std::int64_t kept = kept_blocks(in, policy);
  EXPECT_GT(kept, kept_with(std::numeric_limits<float>::infinity()));
  EXPECT_LT(kept, kept_with(-std::numeric_limits<float>::infinity()));
}

TEST(CApi, EstimateSelectChunkedPrefillAttach) {
  // A chunk (37 queries over 53 keys: 6 complete blocks of 8) with prompt lengths and a cache
  // of block means holding 2 and 4 blocks: the C handle runs exactly as the C++ policy, and
  // the cache keeps the means the first (C++) call wrote.
  Batched in;
  std::vector<sp_setting> est = {{"block", "8"}, {"alpha", "0.6"}, {"sink", "1"}, {"window", "1"}, {"tail", "2"},
                                 {"mean_correction", "true"}};
  sp::HostTensor km(sp::DType::kBF16, {2, 2, 7, 16}), vm(sp::DType::kBF16, {2, 2, 7, 16});
  sp::HostTensor valid(sp::DType::kInt32, {2}), prompt_len(sp::DType::kInt32, {2});
  prompt_len.as<std::int32_t>()[0] = 60;
  prompt_len.as<std::int32_t>()[1] = 53;
  valid.as<std::int32_t>()[0] = valid.as<std::int32_t>()[1] = 0;
  sp::Policy policy = parse("estimate_select", est);
  auto& es = std::get<sp::EstimateSelectParams>(policy);
  es.prompt_len = prompt_len.view();
  es.k_block_means = km.view();
  es.v_block_means = vm.view();
  es.block_means_valid = valid.view();
  sp::HostTensor o = in.new_o(), lse = in.new_lse();
  sp::RunOptions opts;
  opts.backend = sp::Backend::kCPU;
  const sp::Status st = sp::run(in.problem(), policy, {o.view(), lse.view()}, opts);
  ASSERT_TRUE(st.ok()) << st.to_string();
  valid.as<std::int32_t>()[0] = 2;
  valid.as<std::int32_t>()[1] = 4;
  const sp::HostTensor filled_k = km, filled_v = vm;

  PolicyHandle h("estimate_select", est);
  const sp_tensor c_len = to_c(prompt_len.view()), c_k = to_c(km.view()), c_v = to_c(vm.view()),
                  c_valid = to_c(valid.view());
  ASSERT_EQ(sp_policy_set_prompt_len(h.handle, &c_len), SP_OK) << sp_last_error();
  ASSERT_EQ(sp_policy_set_block_means(h.handle, &c_k, &c_v, &c_valid), SP_OK) << sp_last_error();
  expect_same_as_run(in.problem(), policy, h.handle, in.new_o(), in.new_lse());
  EXPECT_EQ(std::memcmp(km.data(), filled_k.data(), km.nbytes()), 0);
  EXPECT_EQ(std::memcmp(vm.data(), filled_v.data(), vm.nbytes()), 0);

  // Malformed attachments name what is wrong; NULL clears.
  EXPECT_EQ(sp_policy_set_block_means(h.handle, &c_k, nullptr, &c_valid), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("all three or none"), std::string::npos) << sp_last_error();
  PolicyHandle dense("dense", {});
  EXPECT_EQ(sp_policy_set_prompt_len(dense.handle, &c_len), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("only estimate_select"), std::string::npos) << sp_last_error();
  ASSERT_EQ(sp_policy_set_block_means(h.handle, nullptr, nullptr, nullptr), SP_OK) << sp_last_error();
  ASSERT_EQ(sp_policy_set_prompt_len(h.handle, nullptr), SP_OK) << sp_last_error();
  expect_same_as_run(in.problem(), parse("estimate_select", est), h.handle, in.new_o(), in.new_lse());
}

TEST(CApi, BlockMaskFromCsr) {
  Batched in;
  sp::AttentionProblem problem = in.problem();
  sp::ProblemShape shape;
  ASSERT_TRUE(sp::validate_problem(problem, nullptr, &shape).ok());
  sp::BlockMask all = sp::BlockMask::all_visible(shape, 8, 8, false);
  std::vector<std::int32_t> indptr, indices;
  all.to_csr(&indptr, &indices);
  // Drop about half of each row's blocks, at random.
  std::vector<std::int32_t> kept_ptr = {0}, kept_idx;
  std::uint64_t seed = 31;
  for (std::size_t r = 0; r + 1 < indptr.size(); ++r) {
    for (std::int32_t i = indptr[r]; i < indptr[r + 1]; ++i) {
      if (next_u64(&seed) & 1) kept_idx.push_back(indices[i]);
    }
    kept_ptr.push_back(static_cast<std::int32_t>(kept_idx.size()));
  }
  ASSERT_GT(kept_idx.size(), 0u);
  ASSERT_LT(kept_idx.size(), indices.size());

  PolicyHandle h("block_sparse", {});
  sp_problem cp = to_c(problem);
  sp_block_mask_csr csr{8, 8, 0, static_cast<int64_t>(kept_ptr.size() - 1), kept_ptr.data(),
                        static_cast<int64_t>(kept_idx.size()), kept_idx.data()};
  ASSERT_EQ(sp_policy_set_block_mask(h.handle, &cp, &csr), SP_OK) << sp_last_error();

  sp::BlockSparseParams params;
  sp::Status st = sp::BlockMask::from_csr(shape, 8, 8, false, kept_ptr, kept_idx, &params.mask);
  ASSERT_TRUE(st.ok()) << st.to_string();
  expect_same_as_run(problem, params, h.handle, in.new_o(), in.new_lse());

  // A row count that does not fit the geometry is refused.
  sp_block_mask_csr short_csr = csr;
  short_csr.num_rows -= 1;
  EXPECT_EQ(sp_policy_set_block_mask(h.handle, &cp, &short_csr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_STRNE(sp_last_error(), "");
}

TEST(CApi, VarlenAndStridesPassThrough) {
  // Varlen: two sequences (s_q 5 and 30, s_k 19 and 30) packed along seq.
  sp::HostTensor q = random_bf16({35, 4, 16}, 41);
  sp::HostTensor k = random_bf16({49, 1, 16}, 42);
  sp::HostTensor v = random_bf16({49, 1, 16}, 43);
  sp::HostTensor cu_q(sp::DType::kInt32, {3});
  sp::HostTensor cu_k(sp::DType::kInt32, {3});
  const std::int32_t cq[3] = {0, 5, 35}, ck[3] = {0, 19, 49};
  std::memcpy(cu_q.data(), cq, sizeof cq);
  std::memcpy(cu_k.data(), ck, sizeof ck);
  sp::AttentionProblem p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.cu_seqlens_q = cu_q.view();
  p.cu_seqlens_k = cu_k.view();
  PolicyHandle h("dense", {});
  expect_same_as_run(p, sp::DenseParams{}, h.handle, sp::HostTensor(sp::DType::kBF16, {35, 4, 16}),
                     sp::HostTensor(sp::DType::kFP32, {4, 35}));

  // Strided: q stored [b, h, s, d] and viewed as [b, s, h, d]; non-causal, explicit scale.
  sp::HostTensor q_bhsd = random_bf16({1, 4, 21, 16}, 44);
  sp::HostTensor k2 = random_bf16({1, 21, 4, 16}, 45);
  sp::HostTensor v2 = random_bf16({1, 21, 4, 16}, 46);
  sp::AttentionProblem s;
  s.q = sp::TensorView::contiguous(q_bhsd.data(), sp::DType::kBF16, {1, 21, 4, 16});
  s.q.stride[1] = 16;
  s.q.stride[2] = 21 * 16;
  s.k = k2.view();
  s.v = v2.view();
  s.causal = false;
  s.scale = 0.3;
  expect_same_as_run(s, sp::DenseParams{}, h.handle, sp::HostTensor(sp::DType::kBF16, {1, 21, 4, 16}),
                     sp::HostTensor(sp::DType::kFP32, {1, 4, 21}));
}

// The Batched geometry with v of head dim 8 (d 16), and one sink logit per query head.
struct Features {
  Batched in;
  sp::HostTensor v8 = random_bf16({2, 53, 2, 8}, 14);
  sp::HostTensor sinks = sp::HostTensor(sp::DType::kFP32, {4});
  Features() {
    for (int h = 0; h < 4; ++h) sinks.as<float>()[h] = 0.25f * static_cast<float>(h) - 0.5f;
  }
  sp::AttentionProblem plain() const {
    sp::AttentionProblem p = in.problem();
    p.v = v8.view();
    return p;
  }
  sp::HostTensor new_o() const { return sp::HostTensor(sp::DType::kBF16, {2, 37, 4, 8}); }
};

// O of run() on the CPU backend.
sp::HostTensor run_o(const sp::AttentionProblem& p, const sp::Policy& policy, sp::HostTensor o) {
  sp::RunOptions opts;
  opts.backend = sp::Backend::kCPU;
  const sp::Status st = sp::run(p, policy, {o.view(), {}}, opts);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return o;
}

TEST(CApi, WindowChunksSoftcapSinksAndValueHeadDimMatchRun) {
  // Each feature alone and all together, dense and softmax_skip, bit for bit run()'s; each one
  // changes O, so a field the ABI dropped would show.
  Features f;
  const std::vector<sp_setting> skip = {{"block_q", "8"}, {"block_k", "8"}, {"a", "3"}};
  PolicyHandle dense("dense", {}), skipping("softmax_skip", skip);
  const sp::HostTensor plain = run_o(f.plain(), sp::DenseParams{}, f.new_o());
  struct Case {
    const char* name;
    std::function<void(sp::AttentionProblem*)> set;
  };
  const sp::TensorView sinks = f.sinks.view();
  for (const Case& c : {Case{"window", [](sp::AttentionProblem* p) { p->window_left = 9; }},
                        Case{"non-causal window", [](sp::AttentionProblem* p) {
                               p->causal = false;
                               p->window_left = 3;
                               p->window_right = 5;
                             }},
                        Case{"chunks", [](sp::AttentionProblem* p) { p->attention_chunk = 7; }},
                        Case{"chunks and window", [](sp::AttentionProblem* p) {
                               p->attention_chunk = 12;
                               p->window_left = 4;
                             }},
                        Case{"softcap", [](sp::AttentionProblem* p) { p->softcap = 0.5; }},
                        Case{"sinks", [&](sp::AttentionProblem* p) { p->sinks = sinks; }},
                        Case{"all", [&](sp::AttentionProblem* p) {
                               p->window_left = 9;
                               p->softcap = 0.5;
                               p->sinks = sinks;
                             }}}) {
    SCOPED_TRACE(c.name);
    sp::AttentionProblem p = f.plain();
    c.set(&p);
    expect_same_as_run(p, sp::DenseParams{}, dense.handle, f.new_o(), f.in.new_lse());
    expect_same_as_run(p, parse("softmax_skip", skip), skipping.handle, f.new_o(), f.in.new_lse());
    const sp::HostTensor o = run_o(p, sp::DenseParams{}, f.new_o());
    EXPECT_NE(std::memcmp(o.data(), plain.data(), o.nbytes()), 0) << "the feature changes nothing here";
  }
}

TEST(CApi, MalformedFeaturesNameThemselves) {
  Features f;
  PolicyHandle dense("dense", {});
  sp::HostTensor o = f.new_o();
  const sp_output out{to_c(o.view()), {}};
  const sp_options opts{SP_BACKEND_CPU, 1, nullptr};
  const auto expect_error = [&](const sp_problem& p, const char* needle) {
    EXPECT_EQ(sp_run(&p, dense.handle, &out, &opts, nullptr), SP_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(sp_last_error()).find(needle), std::string::npos) << sp_last_error();
  };
  const sp_problem good = to_c(f.plain());
  ASSERT_EQ(sp_run(&good, dense.handle, &out, &opts, nullptr), SP_OK) << sp_last_error();
  sp_problem bad = good;
  bad.window_left = 5;  // local = 0: a window given by mistake is refused, not ignored
  expect_error(bad, "window_left/window_right: set while local = 0");
  bad = good;
  bad.local = 1;
  bad.window_left = -2;
  bad.window_right = -1;
  expect_error(bad, "window_left: expected -1 (no bound) or a number of keys >= 0, got -2");
  bad = good;
  bad.attention_chunk = -3;
  expect_error(bad, "attention_chunk: expected 0 (none) or a chunk of positions > 0, got -3");
  for (const double cap : {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    bad = good;
    bad.softcap = cap;
    expect_error(bad, "softcap: expected 0 (none) or a finite positive number");
  }
  sp::HostTensor three(sp::DType::kFP32, {3});
  bad = good;
  bad.sinks = to_c(three.view());
  expect_error(bad, "sinks: expected fp32 [h_q] = [4]");
  bad = good;
  bad.sinks = to_c(f.sinks.view());
  bad.sinks.dtype = SP_DTYPE_BF16;
  expect_error(bad, "sinks: expected fp32 [h_q] = [4]");
}

// The Batched geometry with fp8_e4m3 inputs and fp32 descales [2, 2] that are not powers of
// two; k_descale is stored [h_kv, b] and viewed as [b, h_kv], so descale strides cross too.
struct Fp8Batched {
  sp::HostTensor q = random_fp8({2, 37, 4, 16}, 51, -3.0, 3.0);
  sp::HostTensor k = random_fp8({2, 53, 2, 16}, 52, -3.0, 3.0);
  sp::HostTensor v = random_fp8({2, 53, 2, 16}, 53, -3.0, 3.0);
  sp::HostTensor q_descale = descale(54), k_descale_t = descale(55), v_descale = descale(56);
  static sp::HostTensor descale(std::uint64_t seed) {
    sp::HostTensor t(sp::DType::kFP32, {2, 2});
    for (std::int64_t i = 0; i < 4; ++i) t.as<float>()[i] = static_cast<float>(next_uniform(&seed, 0.3, 1.7));
    return t;
  }
  sp::AttentionProblem problem() const {
    sp::AttentionProblem p;
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.q_descale = q_descale.view();
    p.k_descale = k_descale_t.view();
    std::swap(p.k_descale.stride[0], p.k_descale.stride[1]);
    p.v_descale = v_descale.view();
    p.causal = true;
    return p;
  }
  sp::HostTensor new_o() const { return sp::HostTensor(sp::DType::kBF16, {2, 37, 4, 16}); }
  sp::HostTensor new_lse() const { return sp::HostTensor(sp::DType::kFP32, {2, 4, 37}); }
};

TEST(CApi, Fp8WithDescalesMatchesRun) {
  Fp8Batched in;
  PolicyHandle dense("dense", {});
  expect_same_as_run(in.problem(), sp::DenseParams{}, dense.handle, in.new_o(), in.new_lse());
  sp::AttentionProblem unscaled = in.problem();  // absent descales are 1
  unscaled.q_descale = unscaled.k_descale = unscaled.v_descale = sp::TensorView{};
  expect_same_as_run(unscaled, sp::DenseParams{}, dense.handle, in.new_o(), in.new_lse());

  const ThinnedMask mask(in.problem());
  PolicyHandle sparse("block_sparse", {});
  const sp_problem cp = to_c(in.problem());
  const sp_block_mask_csr csr = mask.csr();
  ASSERT_EQ(sp_policy_set_block_mask(sparse.handle, &cp, &csr), SP_OK) << sp_last_error();
  expect_same_as_run(in.problem(), mask.params(), sparse.handle, in.new_o(), in.new_lse());
}

// Each descale element reaches exactly its (batch, kv head): with GQA 4:2, kv head 1 of batch
// b serves query heads 2 and 3 of that batch only.
TEST(CApi, Fp8DescaleElementsReachTheirHeads) {
  Fp8Batched in;
  PolicyHandle dense("dense", {});
  sp_options copts{SP_BACKEND_CPU, 1, nullptr};
  auto run_c = [&](const sp::AttentionProblem& p) {
    sp::HostTensor o = in.new_o();
    poison(&o);
    const sp_problem cp = to_c(p);
    sp_output out{to_c(o.view()), {}};
    EXPECT_EQ(sp_run(&cp, dense.handle, &out, &copts, nullptr), SP_OK) << sp_last_error();
    return o;
  };
  // O[b, :, h, :] of two runs: bit-identical, or (for the changed heads) different.
  auto expect_changed_heads = [](const sp::HostTensor& a, const sp::HostTensor& b, int batch, int kv_head) {
    for (int bb = 0; bb < 2; ++bb) {
      for (int h = 0; h < 4; ++h) {
        bool same = true;
        for (int r = 0; r < 37; ++r) {
          const std::int64_t at = ((bb * 37 + r) * 4 + h) * 16;
          same = same && std::memcmp(a.as<std::uint16_t>() + at, b.as<std::uint16_t>() + at, 16 * 2) == 0;
        }
        EXPECT_EQ(same, !(bb == batch && h / 2 == kv_head)) << "batch " << bb << ", head " << h;
      }
    }
  };
  const sp::HostTensor base = run_c(in.problem());
  // v_descale[1, 1] doubled: exactly doubles O of batch 1, heads 2 and 3 (v · descale is formed
  // exactly and O is linear in v; doubling is exact in bf16).
  in.v_descale.as<float>()[1 * 2 + 1] *= 2.0f;
  const sp::HostTensor v_doubled = run_c(in.problem());
  expect_changed_heads(base, v_doubled, 1, 1);
  for (int r = 0; r < 37; ++r) {
    for (int h = 2; h < 4; ++h) {
      for (int i = 0; i < 16; ++i) {
        const std::int64_t at = ((37 + r) * 4 + h) * 16 + i;
        ASSERT_EQ(sp::bf16_to_float(v_doubled.as<std::uint16_t>()[at]),
                  2.0f * sp::bf16_to_float(base.as<std::uint16_t>()[at]))
            << "row " << r << ", head " << h;
      }
    }
  }
  in.v_descale.as<float>()[1 * 2 + 1] /= 2.0f;
  // k_descale[0, 1], stored transposed at [1, 0]: changes the scores of batch 0, heads 2 and 3.
  in.k_descale_t.as<float>()[1 * 2 + 0] *= 1.5f;
  expect_changed_heads(base, run_c(in.problem()), 0, 1);
  in.k_descale_t.as<float>()[1 * 2 + 0] /= 1.5f;
  // q_descale[1, 0]: batch 1, query heads 0 and 1.
  in.q_descale.as<float>()[1 * 2 + 0] *= 1.5f;
  expect_changed_heads(base, run_c(in.problem()), 1, 0);
}

TEST(CApi, Fp8MalformedDescalesNameThemselves) {
  Fp8Batched in;
  PolicyHandle dense("dense", {});
  sp::HostTensor o = in.new_o();
  sp_output out{to_c(o.view()), {}};
  auto expect_error = [&](const sp_problem& p, const sp_policy* policy, const sp_output* output, int code,
                          const char* needle) {
    EXPECT_EQ(sp_run(&p, policy, output, nullptr, nullptr), code) << needle;
    EXPECT_NE(std::string(sp_last_error()).find(needle), std::string::npos) << "message: " << sp_last_error();
  };
  const sp_problem good = to_c(in.problem());
  sp_problem bad = good;
  bad.q_descale.shape[1] = 4;
  expect_error(bad, dense.handle, &out, SP_ERR_INVALID_ARGUMENT, "q_descale: expected fp32 [b, h_kv] = [2, 2]");
  bad = good;
  bad.v_descale.dtype = SP_DTYPE_BF16;
  expect_error(bad, dense.handle, &out, SP_ERR_INVALID_ARGUMENT, "v_descale: expected fp32 [b, h_kv]");
  bad = good;
  bad.k_descale.dtype = 7;
  expect_error(bad, dense.handle, &out, SP_ERR_INVALID_ARGUMENT, "k_descale: expected an sp_dtype code 0..4, got 7");
  bad = good;
  bad.k_descale.device_type = SP_DEVICE_CUDA;
  expect_error(bad, dense.handle, &out, SP_ERR_INVALID_ARGUMENT, "k_descale: expected q's device");
  bad = good;
  bad.q_descale.rank = 0;  // absent, but data given
  expect_error(bad, dense.handle, &out, SP_ERR_INVALID_ARGUMENT, "q_descale: rank 0 (absent) but data is not NULL");
  in.v_descale.as<float>()[2] = std::numeric_limits<float>::infinity();
  expect_error(good, dense.handle, &out, SP_ERR_INVALID_ARGUMENT, "v_descale[1, 0]: expected a finite number");
  in.v_descale.as<float>()[2] = 1.0f;

  // Descales belong to fp8 inputs; fp8 inputs give a bf16 O and run every policy on the CPU.
  Batched bf16;
  sp_problem scaled_bf16 = to_c(bf16.problem());
  scaled_bf16.k_descale = good.k_descale;
  expect_error(scaled_bf16, dense.handle, &out, SP_ERR_INVALID_ARGUMENT,
               "k_descale: only with fp8_e4m3 inputs, got bf16 inputs");
  sp::HostTensor o8(sp::DType::kFP8E4M3, {2, 37, 4, 16});
  sp_output out8{to_c(o8.view()), {}};
  expect_error(good, dense.handle, &out8, SP_ERR_INVALID_ARGUMENT,
               "o: expected dtype bf16 (fp8_e4m3 inputs give a bf16 output)");
  PolicyHandle skip("softmax_skip", {});
  EXPECT_EQ(sp_can_run(&good, skip.handle, SP_BACKEND_CPU), SP_OK) << sp_last_error();
  EXPECT_EQ(sp_can_run(&good, dense.handle, SP_BACKEND_CPU), SP_OK) << sp_last_error();
  EXPECT_EQ(sp_can_run(&good, dense.handle, SP_BACKEND_REFERENCE), SP_OK) << sp_last_error();
}

TEST(CApi, StatsWithoutHeadBuffer) {
  Batched in;
  PolicyHandle h("dense", {});
  sp_problem cp = to_c(in.problem());
  sp::HostTensor o = in.new_o();
  sp_output out{to_c(o.view()), {}};
  sp_head_stats sentinel{-7, -7, -7, -7, -7};
  sp_stats stats{};
  stats.heads = &sentinel;
  stats.heads_capacity = 1;  // too small for [2, 4]: left untouched
  ASSERT_EQ(sp_run(&cp, h.handle, &out, nullptr, &stats), SP_OK) << sp_last_error();
  EXPECT_EQ(stats.num_heads, 8);
  EXPECT_EQ(sentinel.kept_blocks, -7);
  EXPECT_EQ(stats.total.kept_blocks, stats.total.visible_blocks);
  EXPECT_EQ(stats.total.computed_pairs, stats.total.visible_pairs);
  EXPECT_DOUBLE_EQ(stats.density, 1.0);
}

TEST(CApi, MalformedArgumentsNameThemselves) {
  Batched in;
  PolicyHandle dense("dense", {});
  sp::HostTensor o = in.new_o();
  sp_output out{to_c(o.view()), {}};
  auto expect_error = [&](sp_problem p, const sp_policy* policy, const sp_output* output,
                          const sp_options* options, int code, const char* needle) {
    EXPECT_EQ(sp_run(&p, policy, output, options, nullptr), code) << needle;
    EXPECT_NE(std::string(sp_last_error()).find(needle), std::string::npos)
        << "message: " << sp_last_error();
  };
  sp_problem good = to_c(in.problem());

  sp_problem bad = good;
  bad.q.dtype = 9;
  expect_error(bad, dense.handle, &out, nullptr, SP_ERR_INVALID_ARGUMENT, "q:");
  bad = good;
  bad.k.rank = 5;
  expect_error(bad, dense.handle, &out, nullptr, SP_ERR_INVALID_ARGUMENT, "k:");
  bad = good;
  bad.v.device_type = 4;
  expect_error(bad, dense.handle, &out, nullptr, SP_ERR_INVALID_ARGUMENT, "v:");
  bad = good;
  bad.seqused_k.data = o.data();  // rank 0 but data given
  expect_error(bad, dense.handle, &out, nullptr, SP_ERR_INVALID_ARGUMENT, "seqused_k:");
  expect_error(good, nullptr, &out, nullptr, SP_ERR_INVALID_ARGUMENT, "policy");
  expect_error(good, dense.handle, nullptr, nullptr, SP_ERR_INVALID_ARGUMENT, "output");
  sp_options bad_backend{17, 0, nullptr};
  expect_error(good, dense.handle, &out, &bad_backend, SP_ERR_INVALID_ARGUMENT, "backend");
  sp_options bad_threads{SP_BACKEND_CPU, -1, nullptr};
  expect_error(good, dense.handle, &out, &bad_threads, SP_ERR_INVALID_ARGUMENT, "num_threads");
  EXPECT_EQ(sp_run(nullptr, dense.handle, &out, nullptr, nullptr), SP_ERR_INVALID_ARGUMENT);

  // A shape the library rejects: the code and message come from validate_problem.
  bad = good;
  bad.k.shape[3] = 8;
  bad.k.stride[0] = 53 * 2 * 8;
  bad.k.stride[1] = 2 * 8;
  bad.k.stride[2] = 8;
  EXPECT_EQ(sp_run(&bad, dense.handle, &out, nullptr, nullptr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_STRNE(sp_last_error(), "");

  // Attachments that do not belong to the policy.
  sp::HostTensor table(sp::DType::kFP32, {4, 1});
  sp_tensor ct = to_c(table.view());
  EXPECT_EQ(sp_policy_set_thresholds(dense.handle, &ct), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("thresholds"), std::string::npos);
  const std::int32_t indptr[1] = {0};
  sp_block_mask_csr csr{8, 8, 0, 0, indptr, 0, nullptr};
  EXPECT_EQ(sp_policy_set_block_mask(dense.handle, &good, &csr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("mask"), std::string::npos);

  // Policy construction.
  sp_policy* handle = reinterpret_cast<sp_policy*>(&table);  // must be reset to NULL
  EXPECT_EQ(sp_policy_create("no_such_policy", nullptr, 0, &handle), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(handle, nullptr);
  EXPECT_STRNE(sp_last_error(), "");
  sp_setting unknown_key{"no_such_key", "1"};
  EXPECT_EQ(sp_policy_create("dense", &unknown_key, 1, &handle), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(handle, nullptr);
  sp_setting null_value{"alpha", nullptr};
  EXPECT_EQ(sp_policy_create("estimate_select", &null_value, 1, &handle),
            SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("settings[0]"), std::string::npos);
  EXPECT_EQ(sp_policy_create(nullptr, nullptr, 0, &handle), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sp_policy_create("dense", nullptr, 0, nullptr), SP_ERR_INVALID_ARGUMENT);
  sp_policy_destroy(nullptr);

  // A success clears the message.
  ASSERT_EQ(sp_run(&good, dense.handle, &out, nullptr, nullptr), SP_OK) << sp_last_error();
  EXPECT_STREQ(sp_last_error(), "");
}

TEST(CApi, LastErrorIsPerThread) {
  PolicyHandle dense("dense", {});
  sp_policy* handle = nullptr;
  ASSERT_EQ(sp_policy_create("no_such_policy", nullptr, 0, &handle), SP_ERR_INVALID_ARGUMENT);
  std::string mine = sp_last_error();
  ASSERT_NE(mine, "");
  std::string theirs = "unset";
  std::thread other([&] {
    theirs = sp_last_error();  // a fresh thread has seen no failure
    sp_policy* h = nullptr;
    EXPECT_EQ(sp_policy_create(nullptr, nullptr, 0, &h), SP_ERR_INVALID_ARGUMENT);
  });
  other.join();
  EXPECT_EQ(theirs, "");
  EXPECT_EQ(std::string(sp_last_error()), mine);
}

TEST(CApi, CanRunAndInfo) {
  Batched in;
  PolicyHandle dense("dense", {});
  sp_problem cp = to_c(in.problem());
  EXPECT_EQ(sp_can_run(&cp, dense.handle, SP_BACKEND_CPU), SP_OK) << sp_last_error();
  EXPECT_EQ(sp_can_run(&cp, dense.handle, SP_BACKEND_REFERENCE), SP_OK) << sp_last_error();
  // Host tensors are never the CUDA backend's.
  EXPECT_NE(sp_can_run(&cp, dense.handle, SP_BACKEND_CUDA), SP_OK);
  EXPECT_STRNE(sp_last_error(), "");
  EXPECT_EQ(sp_can_run(&cp, dense.handle, 42), SP_ERR_INVALID_ARGUMENT);

  EXPECT_EQ(sp_abi_version(), SP_ABI_VERSION);
  EXPECT_NE(std::string(sp_build_info()).find(SPARSEPREFILL_VERSION_STRING), std::string::npos)
      << sp_build_info();
  for (int code = SP_OK; code <= SP_ERR_INTERNAL; ++code) {
    EXPECT_STREQ(sp_status_name(code), sp::status_code_name(static_cast<sp::StatusCode>(code)));
  }
  EXPECT_STREQ(sp_status_name(-1), "unknown");
  EXPECT_STREQ(sp_status_name(99), "unknown");
}

// An sp_decisions handle released at scope exit.
struct DecisionsHandle {
  sp_decisions* handle = nullptr;
  DecisionsHandle() { EXPECT_EQ(sp_decisions_create(&handle), SP_OK) << sp_last_error(); }
  ~DecisionsHandle() { sp_decisions_destroy(handle); }
  DecisionsHandle(const DecisionsHandle&) = delete;
  DecisionsHandle& operator=(const DecisionsHandle&) = delete;
};

// The view of mask `which` equals `expected` (geometry and CSR), or is absent when `expected`
// has no rows.
void expect_mask(const sp_decisions* d, int32_t which, const sp::BlockMask& expected) {
  sp_block_mask_view view{};
  ASSERT_EQ(sp_decisions_mask(d, which, &view), SP_OK) << sp_last_error();
  if (expected.full_count.empty()) {
    EXPECT_EQ(view.num_rows, 0);
    EXPECT_EQ(view.indptr, nullptr);
    return;
  }
  std::vector<std::int32_t> indptr, indices;
  expected.to_csr(&indptr, &indices);
  EXPECT_EQ(view.batch, expected.batch);
  EXPECT_EQ(view.heads, expected.heads);
  EXPECT_EQ(view.num_q_blocks, expected.num_q_blocks);
  EXPECT_EQ(view.num_k_blocks, expected.num_k_blocks);
  EXPECT_EQ(view.block_q, expected.block_q);
  EXPECT_EQ(view.block_k, expected.block_k);
  EXPECT_EQ(view.per_kv_head, expected.per_kv_head ? 1 : 0);
  ASSERT_EQ(view.num_rows + 1, static_cast<int64_t>(indptr.size()));
  ASSERT_EQ(view.num_indices, static_cast<int64_t>(indices.size()));
  EXPECT_EQ(std::vector<std::int32_t>(view.indptr, view.indptr + indptr.size()), indptr);
  if (!indices.empty()) {
    EXPECT_EQ(std::vector<std::int32_t>(view.indices, view.indices + indices.size()), indices);
  }
}

TEST(CApi, SelectReturnsTheSelection) {
  Batched in;
  std::vector<sp_setting> est = {{"block", "8"},  {"alpha", "0.95"}, {"sink", "1"},
                                 {"window", "1"}, {"tail", "1"},     {"mean_correction", "true"}};
  PolicyHandle h("estimate_select", est);
  sp_problem cp = to_c(in.problem());
  sp_options copts{SP_BACKEND_CPU, 1, nullptr};
  DecisionsHandle d;
  std::vector<sp_head_stats> heads(8);
  sp_stats stats{};
  stats.heads = heads.data();
  stats.heads_capacity = 8;
  ASSERT_EQ(sp_select(&cp, h.handle, &copts, d.handle, &stats), SP_OK) << sp_last_error();
  EXPECT_STREQ(sp_decisions_policy(d.handle), "estimate_select");

  sp::Decisions expected;
  sp::RunStats rs;
  sp::RunOptions opts;
  opts.backend = sp::Backend::kCPU;
  ASSERT_TRUE(sp::select(in.problem(), parse("estimate_select", est), opts, &expected, &rs).ok());
  ASSERT_GT(expected.corrected.selected_blocks(), 0) << "mean correction must have something to add";
  expect_mask(d.handle, SP_MASK_KEPT, expected.kept);
  expect_mask(d.handle, SP_MASK_CORRECTED, expected.corrected);
  EXPECT_DOUBLE_EQ(stats.density, rs.density());
  EXPECT_LT(stats.density, 1.0);
  ASSERT_EQ(stats.num_heads, 8);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(heads[i].kept_blocks, rs.heads[i].kept_blocks) << "head " << i;

  // Gates and permute_stop decide during attention: unsupported, with the reason.
  PolicyHandle skip("softmax_skip", {});
  EXPECT_EQ(sp_select(&cp, skip.handle, &copts, d.handle, nullptr), SP_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(sp_last_error()).find("softmax_skip"), std::string::npos) << sp_last_error();
  // The failed call left the previous fill in place.
  expect_mask(d.handle, SP_MASK_KEPT, expected.kept);
  EXPECT_EQ(sp_select(&cp, h.handle, &copts, nullptr, nullptr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("decisions"), std::string::npos);
  sp_block_mask_view view{};
  EXPECT_EQ(sp_decisions_mask(d.handle, 2, &view), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sp_decisions_mask(nullptr, SP_MASK_KEPT, &view), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sp_decisions_create(nullptr), SP_ERR_INVALID_ARGUMENT);
  sp_decisions_destroy(nullptr);
}

TEST(CApi, RunDecisionsMirrorRun) {
  Batched in;
  sp_problem cp = to_c(in.problem());
  sp_options copts{SP_BACKEND_CPU, 1, nullptr};
  sp::RunOptions opts;
  opts.backend = sp::Backend::kCPU;
  opts.num_threads = 1;

  std::vector<sp_setting> skip = {{"block_q", "8"}, {"block_k", "8"}, {"a", "3"}};
  PolicyHandle hs("softmax_skip", skip);
  std::vector<sp_setting> stop = {{"segment", "16"}, {"block_q", "8"}, {"block_k", "8"}, {"tau", "0.05"}};
  PolicyHandle hp("permute_stop", stop);
  for (const auto& [name, settings, handle] :
       {std::tuple{"softmax_skip", skip, hs.handle}, std::tuple{"permute_stop", stop, hp.handle}}) {
    SCOPED_TRACE(name);
    sp::HostTensor o = in.new_o();
    sp::Decisions expected;
    ASSERT_TRUE(sp::run(in.problem(), parse(name, settings), {o.view(), {}}, opts, nullptr, &expected).ok());
    sp_output out{to_c(o.view()), {}};
    DecisionsHandle d;
    ASSERT_EQ(sp_run_decisions(&cp, handle, &out, &copts, nullptr, d.handle), SP_OK) << sp_last_error();
    EXPECT_STREQ(sp_decisions_policy(d.handle), name);
    expect_mask(d.handle, SP_MASK_KEPT, expected.kept);
    expect_mask(d.handle, SP_MASK_CORRECTED, expected.corrected);
    const sp_permute_tile* tiles = nullptr;
    int64_t count = -1;
    ASSERT_EQ(sp_decisions_tiles(d.handle, &tiles, &count), SP_OK);
    ASSERT_EQ(count, static_cast<int64_t>(expected.tiles.size()));
    for (int64_t i = 0; i < count; ++i) {
      const sp::PermuteTile& t = expected.tiles[static_cast<std::size_t>(i)];
      EXPECT_EQ(tiles[i].batch, t.batch);
      EXPECT_EQ(tiles[i].head, t.head);
      EXPECT_EQ(tiles[i].segment, t.segment);
      EXPECT_EQ(tiles[i].tile, t.tile);
      EXPECT_EQ(tiles[i].chunks_visited, t.chunks_visited);
      EXPECT_EQ(tiles[i].chunks_total, t.chunks_total);
    }
    const int32_t* order = nullptr;
    ASSERT_EQ(sp_decisions_query_order(d.handle, &order, &count), SP_OK);
    ASSERT_EQ(count, static_cast<int64_t>(expected.query_order.size()));
    if (count > 0) EXPECT_EQ(std::vector<int32_t>(order, order + count), expected.query_order);
  }
}

TEST(CApi, PlanRunsLikeRun) {
  Batched in;
  sp::AttentionProblem problem = in.problem();
  const ThinnedMask mask(problem);
  const std::vector<std::int32_t>& kept_idx = mask.indices;
  sp_problem cp = to_c(problem);
  const sp_block_mask_csr csr = mask.csr();
  sp_options copts{SP_BACKEND_CPU, 1, nullptr};
  sp_plan* plan = nullptr;
  sp::HostTensor o_run = in.new_o(), lse_run = in.new_lse();
  {
    PolicyHandle h("block_sparse", {});
    ASSERT_EQ(sp_policy_set_block_mask(h.handle, &cp, &csr), SP_OK) << sp_last_error();
    ASSERT_EQ(sp_plan_create(&cp, h.handle, &copts, &plan), SP_OK) << sp_last_error();
    EXPECT_STREQ(sp_plan_describe(plan), sp_policy_describe(h.handle));
    sp_output out{to_c(o_run.view()), to_c(lse_run.view())};
    ASSERT_EQ(sp_run(&cp, h.handle, &out, &copts, nullptr), SP_OK) << sp_last_error();
  }  // the plan holds its own copy of the policy
  for (int repeat = 0; repeat < 2; ++repeat) {
    sp::HostTensor o = in.new_o(), lse = in.new_lse();
    poison(&o);
    poison(&lse);
    sp_output out{to_c(o.view()), to_c(lse.view())};
    sp_stats stats{};
    DecisionsHandle d;
    ASSERT_EQ(sp_plan_run(plan, &cp, &out, &copts, &stats, d.handle), SP_OK) << sp_last_error();
    EXPECT_EQ(std::memcmp(o.data(), o_run.data(), o.nbytes()), 0);
    EXPECT_EQ(std::memcmp(lse.data(), lse_run.data(), lse.nbytes()), 0);
    EXPECT_DOUBLE_EQ(stats.density, static_cast<double>(kept_idx.size()) / static_cast<double>(mask.visible));
    sp_block_mask_view view{};
    ASSERT_EQ(sp_decisions_mask(d.handle, SP_MASK_KEPT, &view), SP_OK);
    ASSERT_EQ(view.num_indices, static_cast<int64_t>(kept_idx.size()));
    EXPECT_EQ(std::vector<int32_t>(view.indices, view.indices + view.num_indices), kept_idx);
  }
  // A problem of another shape is refused, naming the difference.
  sp::HostTensor q2 = random_bf16({2, 36, 4, 16}, 11);
  sp::AttentionProblem other = problem;
  other.q = q2.view();
  sp_problem cp2 = to_c(other);
  sp::HostTensor o2(sp::DType::kBF16, {2, 36, 4, 16});
  sp_output out2{to_c(o2.view()), {}};
  EXPECT_EQ(sp_plan_run(plan, &cp2, &out2, &copts, nullptr, nullptr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("does not match the plan: query lengths"), std::string::npos)
      << sp_last_error();
  sp_options reference{SP_BACKEND_REFERENCE, 0, nullptr};
  sp::HostTensor o = in.new_o();
  sp_output out{to_c(o.view()), {}};
  EXPECT_EQ(sp_plan_run(plan, &cp, &out, &reference, nullptr, nullptr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("backend"), std::string::npos);
  EXPECT_EQ(sp_plan_run(nullptr, &cp, &out, nullptr, nullptr, nullptr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sp_plan_run(plan, &cp, nullptr, nullptr, nullptr, nullptr), SP_ERR_INVALID_ARGUMENT);
  sp_plan_destroy(plan);
  sp_plan_destroy(nullptr);

  // Creation validates once: a mask for another geometry never makes a plan.
  PolicyHandle wrong("block_sparse", {});
  ASSERT_EQ(sp_policy_set_block_mask(wrong.handle, &cp, &csr), SP_OK);
  sp::HostTensor q3 = random_bf16({2, 20, 4, 16}, 11);
  sp::AttentionProblem shorter = problem;
  shorter.q = q3.view();
  sp_problem cp3 = to_c(shorter);
  plan = reinterpret_cast<sp_plan*>(&o);  // must be reset to NULL
  EXPECT_EQ(sp_plan_create(&cp3, wrong.handle, &copts, &plan), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(plan, nullptr);
  EXPECT_NE(std::string(sp_last_error()).find("mask"), std::string::npos) << sp_last_error();
}

TEST(CApi, CalibratorWritesWhatCalibrationRunMakes) {
  // Two layers, GQA 4:2, one 300-token sample each; host tensors (the CPU statistics route).
  std::vector<sp::HostTensor> q, k;
  for (int l = 0; l < 2; ++l) {
    q.push_back(random_bf16({1, 300, 4, 64}, 100 + l));
    k.push_back(random_bf16({1, 300, 2, 64}, 200 + l));
  }
  const std::vector<std::int32_t> budgets = {1, 2};
  const std::vector<double> skip = {0.2, 0.5}, density = {0.5, 0.8};
  sp_calibration_targets t{};
  t.layers = 2;
  t.heads = 4;
  t.block_q = t.block_k = 64;
  t.select_block = 64;
  t.budgets = budgets.data();
  t.num_budgets = 2;
  t.skip_targets = skip.data();
  t.num_skip_targets = 2;
  t.density_targets = density.data();
  t.num_density_targets = 2;
  sp_calibrator* cal = nullptr;
  ASSERT_EQ(sp_calibrator_create(&t, &cal), SP_OK) << sp_last_error();

  sp::CalibrationTargets ct;
  ct.layers = 2;
  ct.heads = 4;
  ct.block_q = ct.block_k = 64;
  ct.estimate.block = 64;
  ct.budgets = {1, 2};
  ct.skip_targets = skip;
  ct.density_targets = density;
  std::unique_ptr<sp::CalibrationRun> run;
  ASSERT_TRUE(sp::CalibrationRun::create(ct, &run).ok());
  for (int l = 0; l < 2; ++l) {
    sp::AttentionProblem p;
    p.q = q[static_cast<std::size_t>(l)].view();
    p.k = k[static_cast<std::size_t>(l)].view();
    p.v = p.k;
    const sp_problem cp = to_c(p);
    ASSERT_EQ(sp_calibrator_add(cal, l, &cp, nullptr), SP_OK) << sp_last_error();
    ASSERT_TRUE(run->add(l, p).ok());
  }
  const std::string path = ::testing::TempDir() + "sp_c_api_calibration.safetensors";
  const sp_setting meta[] = {{"model", "c-api-test"}};
  ASSERT_EQ(sp_calibrator_save(cal, path.c_str(), meta, 1), SP_OK) << sp_last_error();
  sp::Calibration loaded, expected;
  ASSERT_TRUE(sp::load_calibration(path, &loaded).ok());
  ASSERT_TRUE(run->finish(&expected).ok());
  EXPECT_EQ(loaded.metadata.at("model"), "c-api-test");
  EXPECT_EQ(loaded.exact_gate.values, expected.exact_gate.values);
  EXPECT_EQ(loaded.skip_a, expected.skip_a);
  EXPECT_EQ(loaded.alpha, expected.alpha);
  EXPECT_EQ(loaded.layers, 2);

  // Malformed arguments name themselves; the handle stays usable.
  sp::AttentionProblem p;
  p.q = q[0].view();
  p.k = k[0].view();
  p.v = p.k;
  const sp_problem cp = to_c(p);
  EXPECT_EQ(sp_calibrator_add(cal, 2, &cp, nullptr), SP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(sp_last_error(), "CalibrationRun: layer: expected 0 .. 1, got 2");
  EXPECT_EQ(sp_calibrator_add(nullptr, 0, &cp, nullptr), SP_ERR_INVALID_ARGUMENT);
  const sp_setting reserved[] = {{"format", "x"}};
  EXPECT_EQ(sp_calibrator_save(cal, path.c_str(), reserved, 1), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("reserved"), std::string::npos) << sp_last_error();
  sp_calibrator_destroy(cal);

  t.num_budgets = t.num_skip_targets = t.num_density_targets = 0;
  EXPECT_EQ(sp_calibrator_create(&t, &cal), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(cal, nullptr);
  t.num_budgets = 1;
  t.budgets = nullptr;
  EXPECT_EQ(sp_calibrator_create(&t, &cal), SP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(sp_last_error(), "targets.budgets: expected a length >= 0 and a non-NULL array when it is positive");
}

TEST(CApi, GenerateEqualsTheGeneratorBitForBit) {
  sp::GeneratorConfig c;
  c.seq_q = 200;
  c.seq_k = 333;
  c.h_q = 4;
  c.h_kv = 2;
  c.d = 64;
  c.seed = 0x1234567890ull;
  c.peakedness = 1.5;
  sp::HostTensor q, k, v;
  ASSERT_TRUE(sp::generate(c, &q, &k, &v).ok());
  sp::HostTensor q2(sp::DType::kBF16, {1, 200, 4, 64}), k2(sp::DType::kBF16, {1, 333, 2, 64}),
      v2(sp::DType::kBF16, {1, 333, 2, 64});
  poison(&q2);
  poison(&k2);
  poison(&v2);
  const sp_generator_config cc{1, 200, 333, 4, 2, 64, 0x1234567890ull, 1.5};
  const sp_tensor cq = to_c(q2.view()), ck = to_c(k2.view()), cv = to_c(v2.view());
  ASSERT_EQ(sp_generate(&cc, &cq, &ck, &cv), SP_OK) << sp_last_error();
  EXPECT_EQ(std::memcmp(q.data(), q2.data(), q.nbytes()), 0);
  EXPECT_EQ(std::memcmp(k.data(), k2.data(), k.nbytes()), 0);
  EXPECT_EQ(std::memcmp(v.data(), v2.data(), v.nbytes()), 0);

  // A shape, dtype or layout unlike the generator's is refused, naming the tensor.
  sp::HostTensor wrong(sp::DType::kBF16, {1, 333, 4, 64});
  const sp_tensor cw = to_c(wrong.view());
  EXPECT_EQ(sp_generate(&cc, &cq, &cw, &cv), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("sp_generate: k: expected [1, 333, 2, 64] bf16"), std::string::npos)
      << sp_last_error();
  sp::HostTensor k_fp16(sp::DType::kFP16, {1, 333, 2, 64});
  const sp_tensor ck16 = to_c(k_fp16.view());
  EXPECT_EQ(sp_generate(&cc, &cq, &ck16, &cv), SP_ERR_INVALID_ARGUMENT);
  sp_tensor strided = ck;
  strided.stride[1] = 2 * 64 + 8;
  EXPECT_EQ(sp_generate(&cc, &cq, &strided, &cv), SP_ERR_INVALID_ARGUMENT);
  // FP8 is an input dtype the generator does not make.
  sp::HostTensor q8(sp::DType::kFP8E4M3, {1, 200, 4, 64}), k8(sp::DType::kFP8E4M3, {1, 333, 2, 64});
  const sp_tensor cq8 = to_c(q8.view()), ck8 = to_c(k8.view());
  EXPECT_EQ(sp_generate(&cc, &cq8, &ck8, &ck8), SP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sp_last_error()).find("dtype: expected bf16, fp16 or fp32, got fp8_e4m3"), std::string::npos)
      << sp_last_error();
  const sp_generator_config bad{1, 400, 333, 4, 2, 64, 1, 1.0};  // seq_q > seq_k
  EXPECT_EQ(sp_generate(&bad, &cq, &ck, &cv), SP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sp_generate(nullptr, &cq, &ck, &cv), SP_ERR_INVALID_ARGUMENT);
}

}  // namespace
