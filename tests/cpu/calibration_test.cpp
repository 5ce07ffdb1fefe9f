// SPDX-License-Identifier: Apache-2.0
// Calibration: threshold tables, the calibration file (round trips; every missing, extra or
// inconsistent field an error; truncation at every byte), a hand-computed exact_gate table,
// and the calibrators checked end to end against the fp64 oracle: thresholds keep exactly k
// full blocks, the factor a skips the target fraction of blocks, alpha keeps the target
// density.
#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "common/inputs.h"
#include "core/geometry.h"
#include "core/stats.h"
#include "reference/reference.h"
#include "sparseprefill/calibration.h"
#include "sparseprefill/safetensors.h"

namespace sp = sparseprefill;
namespace test = sparseprefill::test;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::string temp_path(const std::string& name) {
  std::string tmpl = ::testing::TempDir() + "sp_calibration_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* dir = ::mkdtemp(buf.data());
  EXPECT_NE(dir, nullptr);
  return std::string(dir ? dir : ".") + "/" + name;
}

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::string corpus(const std::string& name) {
  return std::string(SP_SOURCE_DIR) + "/tests/fuzz/corpus/" + name;
}

sp::Calibration full_calibration() {
  sp::Calibration c;
  c.metadata = {{"model", "test-model"}, {"score_dtype", "fp64"}, {"date", "2026-11-29"}};
  sp::ThresholdTable& t = c.exact_gate;
  t.layers = 2;
  t.heads = 3;
  t.positions = 5;
  t.block_q = 16;
  t.block_k = 8;
  t.budgets = {1, 4, 9};
  for (int i = 0; i < 2 * 3 * 3 * 5; ++i) t.values.push_back(i % 4 == 0 ? kNegInf : 0.37f * static_cast<float>(i) - 5.0f);
  c.layers = 2;
  c.skip_targets = {0.25f, 0.5f, 0.75f};
  c.skip_a = {1.5f, 3.0f, 9.0f, 2.0f, 4.0f, 11.0f};
  c.skip_block_q = 64;
  c.skip_block_k = 32;
  c.density_targets = {0.1f, 0.3f};
  c.alpha = {0.4f, 0.05f, 0.5f, 0.02f};
  c.estimate_base.block = 64;
  c.estimate_base.sink = 1;
  c.estimate_base.window = 3;
  c.estimate_base.tail = 0;
  c.estimate_base.mean_correction = true;
  c.estimate_base.pack_gqa = true;
  return c;
}

void expect_equal(const sp::Calibration& a, const sp::Calibration& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  EXPECT_EQ(a.exact_gate.layers, b.exact_gate.layers);
  EXPECT_EQ(a.exact_gate.heads, b.exact_gate.heads);
  EXPECT_EQ(a.exact_gate.positions, b.exact_gate.positions);
  EXPECT_EQ(a.exact_gate.block_q, b.exact_gate.block_q);
  EXPECT_EQ(a.exact_gate.block_k, b.exact_gate.block_k);
  EXPECT_EQ(a.exact_gate.budgets, b.exact_gate.budgets);
  EXPECT_EQ(a.exact_gate.values, b.exact_gate.values);
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.skip_targets, b.skip_targets);
  EXPECT_EQ(a.skip_a, b.skip_a);
  EXPECT_EQ(a.skip_block_q, b.skip_block_q);
  EXPECT_EQ(a.skip_block_k, b.skip_block_k);
  EXPECT_EQ(a.density_targets, b.density_targets);
  EXPECT_EQ(a.alpha, b.alpha);
  EXPECT_EQ(a.estimate_base.block, b.estimate_base.block);
  EXPECT_EQ(a.estimate_base.sink, b.estimate_base.sink);
  EXPECT_EQ(a.estimate_base.window, b.estimate_base.window);
  EXPECT_EQ(a.estimate_base.tail, b.estimate_base.tail);
  EXPECT_EQ(a.estimate_base.mean_correction, b.estimate_base.mean_correction);
  EXPECT_EQ(a.estimate_base.pack_gqa, b.estimate_base.pack_gqa);
}

// ---------------------------------------------------------------- tables and files

TEST(ThresholdTable, IndexesClampsAndSlices) {
  const sp::Calibration c = full_calibration();
  const sp::ThresholdTable& t = c.exact_gate;
  ASSERT_TRUE(t.validate().ok());
  // values is [layers, budgets, heads, positions].
  EXPECT_EQ(t.at(1, 2, 0, 3), t.values[((1 * 3 + 2) * 3 + 0) * 5 + 3]);
  EXPECT_EQ(t.at(0, 1, 2, 99), t.values[((0 * 3 + 1) * 3 + 2) * 5 + 4]);  // past the end: last row
  const sp::HostTensor s = t.slice(1, 1);
  ASSERT_EQ(s.shape(), (std::vector<std::int64_t>{3, 5}));
  ASSERT_EQ(s.dtype(), sp::DType::kFP32);
  for (int h = 0; h < 3; ++h) {
    for (int p = 0; p < 5; ++p) EXPECT_EQ(s.as<float>()[h * 5 + p], t.at(1, 1, h, p));
  }
}

TEST(ThresholdTable, ValidateRejectsBadValuesAndShapes) {
  struct Case {
    std::function<void(sp::ThresholdTable*)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](sp::ThresholdTable* t) { t->values[17] = std::nanf(""); },
       "exact_gate.thresholds: nan at [layer 0, budget 1, head 0, position 2] (finite or -inf expected)"},
      {[](sp::ThresholdTable* t) { t->values.back() = std::numeric_limits<float>::infinity(); },
       "exact_gate.thresholds: inf at [layer 1, budget 2, head 2, position 4] (finite or -inf expected)"},
      {[](sp::ThresholdTable* t) { t->budgets = {1, 9, 4}; },
       "exact_gate.budgets: must be strictly ascending, got 9 then 4"},
      {[](sp::ThresholdTable* t) { t->budgets = {0, 4, 9}; },
       "exact_gate.budgets[0]: expected a block count >= 1, got 0"},
      {[](sp::ThresholdTable* t) { t->values.pop_back(); },
       "exact_gate.thresholds: expected 90 values [layers, budgets, heads, positions] = [2, 3, 3, 5], got 89"},
      {[](sp::ThresholdTable* t) { t->heads = 0; }, "exact_gate.heads: expected 1 .. 1048576, got 0"},
      {[](sp::ThresholdTable* t) { t->block_k = -8; }, "exact_gate.block_k: expected 1 .. 1048576, got -8"},
      {[](sp::ThresholdTable* t) { t->budgets.clear(); },
       "exact_gate.budgets: expected at least one budget, got none"},
  };
  for (const Case& c : cases) {
    sp::ThresholdTable t = full_calibration().exact_gate;
    c.mutate(&t);
    const sp::Status st = t.validate();
    EXPECT_EQ(st.code(), sp::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(st.message(), c.message);
  }
  sp::ThresholdTable all_neg_inf = full_calibration().exact_gate;
  std::fill(all_neg_inf.values.begin(), all_neg_inf.values.end(), kNegInf);
  EXPECT_TRUE(all_neg_inf.validate().ok());
}

TEST(CalibrationFile, RoundTripsEverySection) {
  const std::string path = temp_path("cal.safetensors");
  const sp::Calibration c = full_calibration();
  ASSERT_TRUE(sp::save_calibration(path, c).ok());
  sp::Calibration back;
  const sp::Status st = sp::load_calibration(path, &back);
  ASSERT_TRUE(st.ok()) << st.to_string();
  expect_equal(c, back);

  // Each section alone; an absent section stays empty ("not calibrated").
  sp::Calibration gate_only;
  gate_only.exact_gate = c.exact_gate;
  sp::Calibration skip_only;
  skip_only.layers = 2;
  skip_only.skip_targets = c.skip_targets;
  skip_only.skip_a = c.skip_a;
  sp::Calibration select_only;
  select_only.layers = 2;
  select_only.density_targets = c.density_targets;
  select_only.alpha = c.alpha;
  select_only.estimate_base = c.estimate_base;
  for (const sp::Calibration* one : {&gate_only, &skip_only, &select_only}) {
    ASSERT_TRUE(sp::save_calibration(path, *one).ok());
    ASSERT_TRUE(sp::load_calibration(path, &back).ok());
    expect_equal(*one, back);
  }
  sp::SafetensorsFile raw;
  ASSERT_TRUE(sp::read_safetensors(path, &raw).ok());
  EXPECT_EQ(raw.tensors.size(), 2u);
  EXPECT_EQ(raw.metadata.at("format"), "sparseprefill.calibration");
  EXPECT_EQ(raw.metadata.at("format_version"), "1");
  EXPECT_EQ(raw.metadata.at("estimate_select.pack_gqa"), "true");
  EXPECT_EQ(raw.metadata.count("exact_gate.heads"), 0u);
}

TEST(CalibrationFile, SaveRejectsInvalidCalibrations) {
  const std::string path = temp_path("bad.safetensors");
  struct Case {
    std::function<void(sp::Calibration*)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](sp::Calibration* c) { c->metadata["format"] = "x"; },
       "calibration: metadata: key 'format' is reserved by the file format"},
      {[](sp::Calibration* c) { c->metadata["exact_gate.note"] = "x"; },
       "calibration: metadata: key 'exact_gate.note' is reserved by the file format"},
      {[](sp::Calibration* c) { c->exact_gate.values[0] = std::nanf(""); },
       "calibration: exact_gate.thresholds: nan at [layer 0, budget 0, head 0, position 0] (finite or -inf expected)"},
      {[](sp::Calibration* c) { c->skip_targets = {0.5f, 0.25f, 0.75f}; },
       "calibration: softmax_skip.targets: must be strictly ascending, got 0.5 then 0.25"},
      {[](sp::Calibration* c) { c->density_targets[1] = 1.5f; },
       "calibration: estimate_select.targets[1]: expected a fraction in [0, 1], got 1.5"},
      {[](sp::Calibration* c) { c->skip_a[4] = 0.0f; },
       "calibration: softmax_skip.a[layer 1, target 1]: a: expected a finite positive number, got 0.000000"},
      {[](sp::Calibration* c) { c->alpha[0] = std::nanf(""); },
       "calibration: estimate_select.alpha[layer 0, target 0]: alpha: expected a finite number >= 0, got nan"},
      {[](sp::Calibration* c) { c->alpha.pop_back(); },
       "calibration: estimate_select.alpha: expected [layers, targets] = [2, 2] values, got 3"},
      {[](sp::Calibration* c) { c->layers = 3; },
       "calibration: layers: 3 disagrees with exact_gate.layers 2"},
  };
  for (const Case& c : cases) {
    sp::Calibration cal = full_calibration();
    c.mutate(&cal);
    const sp::Status st = sp::save_calibration(path, cal);
    EXPECT_EQ(st.code(), sp::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(st.message(), c.message);
  }
  EXPECT_EQ(::access(path.c_str(), F_OK), -1) << "nothing written for an invalid calibration";
}

// A valid file, edited at the safetensors level, must fail to load with a precise message.
TEST(CalibrationFile, LoadRejectsMissingExtraAndInconsistentData) {
  const std::string good = temp_path("good.safetensors");
  ASSERT_TRUE(sp::save_calibration(good, full_calibration()).ok());
  sp::SafetensorsFile base;
  ASSERT_TRUE(sp::read_safetensors(good, &base).ok());

  struct Case {
    std::function<void(sp::SafetensorsFile*)> mutate;
    std::string message;
  };
  const auto set_f32 = [](sp::SafetensorsFile* f, const char* name, int i, float x) {
    f->tensors.at(name).as<float>()[i] = x;
  };
  const std::vector<Case> cases = {
      {[](sp::SafetensorsFile* f) { f->metadata.erase("format"); },
       "metadata 'format' is missing: not a sparseprefill calibration file"},
      {[](sp::SafetensorsFile* f) { f->metadata["format"] = "other"; },
       "metadata 'format' is 'other', expected 'sparseprefill.calibration'"},
      {[](sp::SafetensorsFile* f) { f->metadata["format_version"] = "2"; },
       "format_version '2' is not supported (this build reads 1)"},
      {[](sp::SafetensorsFile* f) { f->metadata.erase("format_version"); },
       "metadata 'format_version' is missing"},
      {[](sp::SafetensorsFile* f) { f->tensors.erase("exact_gate.budgets"); },
       "exact_gate: 'exact_gate.budgets' is missing ('exact_gate.thresholds' is present)"},
      {[](sp::SafetensorsFile* f) { f->metadata.erase("softmax_skip.block_k"); },
       "softmax_skip: 'softmax_skip.block_k' is missing ('softmax_skip.targets' is present)"},
      {[](sp::SafetensorsFile* f) { f->tensors.erase("estimate_select.alpha"); },
       "estimate_select: 'estimate_select.alpha' is missing ('estimate_select.targets' is present)"},
      {[](sp::SafetensorsFile* f) { f->tensors["extra"] = sp::HostTensor(sp::DType::kFP32, {1}); },
       "unexpected tensor 'extra'"},
      {[](sp::SafetensorsFile* f) { f->metadata["softmax_skip.lambda"] = "1"; },
       "unexpected metadata key 'softmax_skip.lambda'"},
      {[](sp::SafetensorsFile* f) { f->metadata["exact_gate.positions"] = "6"; },
       "exact_gate.thresholds: expected [2, 3, 3, 6] fp32 (from the metadata), got [2, 3, 3, 5] fp32"},
      {[](sp::SafetensorsFile* f) { f->metadata["layers"] = "1"; },
       "softmax_skip.a: expected [1, 3] fp32 (from the metadata), got [2, 3] fp32"},
      {[](sp::SafetensorsFile* f) { f->tensors["exact_gate.budgets"] = sp::HostTensor(sp::DType::kFP32, {3}); },
       "exact_gate.budgets: expected I32 [budgets] with at least one budget, got [3] fp32"},
      {[](sp::SafetensorsFile* f) { f->tensors["softmax_skip.targets"] = sp::HostTensor(sp::DType::kFP32, {0}); },
       "softmax_skip.targets: expected fp32 [targets] with at least one target, got [0] fp32"},
      {[](sp::SafetensorsFile* f) { f->tensors.at("exact_gate.budgets").as<std::int32_t>()[1] = 1; },
       "exact_gate.budgets: must be strictly ascending, got 1 then 1"},
      {[&](sp::SafetensorsFile* f) { set_f32(f, "exact_gate.thresholds", 31, std::nanf("")); },
       "exact_gate.thresholds: nan at [layer 0, budget 2, head 0, position 1] (finite or -inf expected)"},
      {[&](sp::SafetensorsFile* f) { set_f32(f, "exact_gate.thresholds", 2, std::numeric_limits<float>::infinity()); },
       "exact_gate.thresholds: inf at [layer 0, budget 0, head 0, position 2] (finite or -inf expected)"},
      {[&](sp::SafetensorsFile* f) { set_f32(f, "softmax_skip.targets", 2, 0.5f); },
       "softmax_skip.targets: must be strictly ascending, got 0.5 then 0.5"},
      {[&](sp::SafetensorsFile* f) { set_f32(f, "softmax_skip.a", 0, -1.0f); },
       "softmax_skip.a[layer 0, target 0]: a: expected a finite positive number, got -1.000000"},
      {[&](sp::SafetensorsFile* f) { set_f32(f, "estimate_select.targets", 0, -0.1f); },
       "estimate_select.targets[0]: expected a fraction in [0, 1], got -0.100000001"},
      {[](sp::SafetensorsFile* f) { f->metadata["exact_gate.block_q"] = "0"; },
       "metadata 'exact_gate.block_q': expected an integer in 1 .. 1048576, got '0'"},
      {[](sp::SafetensorsFile* f) { f->metadata["exact_gate.heads"] = "3x"; },
       "metadata 'exact_gate.heads': expected an integer in 1 .. 1048576, got '3x'"},
      {[](sp::SafetensorsFile* f) { f->metadata["layers"] = "-2"; },
       "metadata 'layers': expected an integer in 0 .. 1048576, got '-2'"},
      {[](sp::SafetensorsFile* f) { f->metadata["estimate_select.sink"] = "99999999999"; },
       "metadata 'estimate_select.sink': expected an integer in 0 .. 1048576, got '99999999999'"},
      {[](sp::SafetensorsFile* f) { f->metadata["estimate_select.pack_gqa"] = "1"; },
       "metadata 'estimate_select.pack_gqa': expected 'true' or 'false', got '1'"},
      // Found by the fuzzer: a long value once overflowed the digit accumulator (UB) before
      // the length check rejected it.
      {[](sp::SafetensorsFile* f) { f->metadata["layers"] = "2estimate_select.taildel"; },
       "metadata 'layers': expected an integer in 0 .. 1048576, got '2estimate_select.taildel'"},
      {[](sp::SafetensorsFile* f) { f->metadata["layers"] = "99999999999999999999999"; },
       "metadata 'layers': expected an integer in 0 .. 1048576, got '99999999999999999999999'"},
  };
  const std::string path = temp_path("edited.safetensors");
  for (const Case& c : cases) {
    sp::SafetensorsFile f = base;
    c.mutate(&f);
    ASSERT_TRUE(sp::write_safetensors(path, f).ok());
    sp::Calibration out = full_calibration();
    const sp::Status st = sp::load_calibration(path, &out);
    EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData) << c.message;
    EXPECT_EQ(st.message(), path + ": " + c.message);
    expect_equal(out, sp::Calibration());  // never a partial result

    const std::vector<std::uint8_t> bytes = read_bytes(path);
    EXPECT_EQ(sp::parse_calibration(bytes.data(), bytes.size(), &out).message(), c.message);
  }
}

TEST(CalibrationFile, TruncationAtEveryByteIsAnError) {
  sp::Calibration c;
  c.exact_gate.layers = 1;
  c.exact_gate.heads = 2;
  c.exact_gate.positions = 2;
  c.exact_gate.budgets = {2};
  c.exact_gate.values = {kNegInf, 1.5f, -0.5f, 2.0f};
  c.layers = 1;
  c.skip_targets = {0.5f};
  c.skip_a = {3.0f};
  const std::string path = temp_path("small.safetensors");
  ASSERT_TRUE(sp::save_calibration(path, c).ok());
  const std::vector<std::uint8_t> bytes = read_bytes(path);
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    const std::vector<std::uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    sp::Calibration out;
    ASSERT_EQ(sp::parse_calibration(prefix.data(), prefix.size(), &out).code(), sp::StatusCode::kCorruptData)
        << "prefix of " << n << " bytes";
  }
  sp::Calibration out;
  ASSERT_TRUE(sp::parse_calibration(bytes.data(), bytes.size(), &out).ok());
  expect_equal(c, out);
}

// The corpus files were written byte by byte from docs/file-formats.md by
// tests/fuzz/make_corpus.py, independently of the C++ writer.
TEST(CalibrationFile, ReadsFilesWrittenFromTheDocumentedFormat) {
  sp::Calibration c;
  sp::Status st = sp::load_calibration(corpus("calibration_full.safetensors"), &c);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(c.metadata, (std::map<std::string, std::string>{{"model", "corpus-model"}, {"score_dtype", "fp64"}}));
  EXPECT_EQ(c.layers, 2);
  EXPECT_EQ(c.exact_gate.budgets, (std::vector<int>{1, 2}));
  EXPECT_EQ(c.exact_gate.block_q, 128);
  EXPECT_EQ(c.exact_gate.block_k, 64);
  ASSERT_EQ(c.exact_gate.values.size(), 24u);
  for (int i = 0; i < 24; ++i) {
    EXPECT_EQ(c.exact_gate.values[static_cast<std::size_t>(i)], i % 7 == 0 ? kNegInf : 0.125f * static_cast<float>(i) - 3.0f);
  }
  EXPECT_EQ(c.skip_targets, (std::vector<float>{0.5f, 0.75f}));
  EXPECT_EQ(c.skip_a, (std::vector<float>{4.0f, 5.0f, 6.0f, 7.0f}));
  EXPECT_EQ(c.density_targets, (std::vector<float>{0.1f, 0.2f, 0.4f}));
  EXPECT_TRUE(c.estimate_base.pack_gqa);
  EXPECT_FALSE(c.estimate_base.mean_correction);

  st = sp::load_calibration(corpus("calibration_gate_only.safetensors"), &c);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(c.skip_targets.empty());
  EXPECT_TRUE(c.alpha.empty());
  EXPECT_EQ(c.exact_gate.budgets, (std::vector<int>{3}));

  const std::vector<std::pair<std::string, std::string>> broken = {
      {"broken_cal_nan_threshold.safetensors",
       "exact_gate.thresholds: nan at [layer 0, budget 0, head 1, position 2] (finite or -inf expected)"},
      {"broken_cal_version.safetensors", "format_version '2' is not supported (this build reads 1)"},
      {"broken_cal_shape.safetensors",
       "exact_gate.thresholds: expected [2, 2, 2, 4] fp32 (from the metadata), got [2, 2, 2, 3] fp32"},
      {"broken_cal_budgets_order.safetensors", "exact_gate.budgets: must be strictly ascending, got 4 then 2"},
      {"broken_cal_extra_tensor.safetensors", "unexpected tensor 'exact_gate.extra'"},
      {"broken_st_truncated.safetensors", "header length 968 exceeds file size 100"},
  };
  for (const auto& [name, message] : broken) {
    st = sp::load_calibration(corpus(name), &c);
    EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData) << name;
    EXPECT_EQ(st.message(), corpus(name) + ": " + message);
  }
}

// ---------------------------------------------------------------- exact_gate calibrator

// Sets every query row of head h to (x, 0) and key t to (y[t], 0): with scale 1 the score is
// x·y[t], so a full block's maximum is max(y) for x = 1 and -min(y) for x = -1.
void fill_hand(test::Inputs* in, int b, const std::vector<double>& y) {
  test::SequenceData& s = in->seqs[static_cast<std::size_t>(b)];
  for (std::int64_t r = 0; r < in->s_q(b); ++r) {
    test::set(&s.q, (r * 2 + 0) * 2, 1.0);
    test::set(&s.q, (r * 2 + 1) * 2, -1.0);
  }
  for (std::int64_t t = 0; t < in->s_k(b); ++t) test::set(&s.k, t * 2, y[static_cast<std::size_t>(t)]);
}

TEST(ExactGateCalibrator, HandComputedTable) {
  // Blocks of 4 tokens; h_q = 2 reading one KV head; budgets {1, 2}.
  // y1 block maxima (max / -min): block0 3 / -0.5, block1 1 / 1, block2 2 / 2, block3 5 / -5.
  const std::vector<double> y1 = {0.5, 3, 1, 2, 1, -1, 0.25, 0, 2, 1.5, -2, 0.5, 5, 5, 5, 5};
  const std::vector<double> y2 = {4, 0, 0, 0, 1, 1, 1, -3, 0, 0.5, 2.5, -1, 7, 7};
  test::LayoutOptions opt;
  opt.scale = 1.0;

  // Layer 0: one varlen call with two samples: (16 queries, 16 keys) and a chunk (6, 14).
  test::Inputs l0 = test::empty_inputs({{16, 16}, {6, 14}}, 2, 1, 2, sp::DType::kFP32);
  fill_hand(&l0, 0, y1);
  fill_hand(&l0, 1, y2);
  opt.layout = test::Layout::kVarlen;
  const test::TestProblem p0 = test::build_problem(l0, opt);
  // Layer 1: two calls: y1 again, then the last 5 queries over y1's 16 keys (offset 11).
  test::Inputs l1a = test::empty_inputs({{16, 16}}, 2, 1, 2, sp::DType::kFP32);
  fill_hand(&l1a, 0, y1);
  test::Inputs l1b = test::empty_inputs({{5, 16}}, 2, 1, 2, sp::DType::kFP32);
  fill_hand(&l1b, 0, y1);
  opt.layout = test::Layout::kBatched;
  const test::TestProblem p1a = test::build_problem(l1a, opt);
  opt.layout = test::Layout::kPaged;
  const test::TestProblem p1b = test::build_problem(l1b, opt);

  sp::ExactGateCalibrator cal(2, 2, {1, 2}, 4, 4);
  ASSERT_TRUE(cal.add(0, p0.problem()).ok());
  ASSERT_TRUE(cal.add(1, p1a.problem()).ok());
  const sp::Status st = cal.add(1, p1b.problem());
  ASSERT_TRUE(st.ok()) << st.to_string();
  const sp::ThresholdTable t = cal.finish();
  ASSERT_TRUE(t.validate().ok());
  EXPECT_EQ(t.positions, 4);
  EXPECT_EQ(t.layers, 2);
  EXPECT_EQ(t.heads, 2);
  EXPECT_EQ(t.budgets, (std::vector<int>{1, 2}));

  // Per sample, position p, head: full-block maxima sorted descending, then midpoints.
  //   y1 (offset 0):  p2: h0 {3,1} -> k1 2;      h1 {1,-0.5} -> k1 0.25
  //                   p3: h0 {3,2,1} -> 2.5/1.5; h1 {2,1,-0.5} -> 1.5/0.25
  //   y2 (offset 8):  p2: h0 {4,1} -> k1 2.5;    h1 {3,0} -> k1 1.5
  //                   p3: h0 {4,2.5,1} -> 3.25/1.75; h1 {3,1,0} -> 2/0.5
  //   y1 (offset 11): p2: h0 {3,2,1} -> 2.5/1.5; h1 {2,1,-0.5} -> 1.5/0.25
  //                   p3: h0 {5,3,2,1} -> 4/2.5; h1 {2,1,-0.5,-5} -> 1.5/0.25
  // p0 and p1 have at most one candidate: -inf. -inf values are left out of the means.
  const float n = kNegInf;
  const float expected[2][2][2][4] = {
      // layer 0: means of y1 and y2
      {{{n, n, 2.25f, 2.875f}, {n, n, 0.875f, 1.75f}},   // budget 1: head 0, head 1
       {{n, n, n, 1.625f}, {n, n, n, 0.375f}}},          // budget 2
      // layer 1: means of y1 (offset 0) and y1 (offset 11)
      {{{n, n, 2.25f, 3.25f}, {n, n, 0.875f, 1.5f}},
       {{n, n, 1.5f, 2.0f}, {n, n, 0.25f, 0.25f}}},
  };
  for (int l = 0; l < 2; ++l) {
    for (int b = 0; b < 2; ++b) {
      for (int h = 0; h < 2; ++h) {
        for (int p = 0; p < 4; ++p) {
          EXPECT_EQ(t.at(l, b, h, p), expected[l][b][h][p]) << "layer " << l << " budget " << b
                                                            << " head " << h << " position " << p;
        }
      }
    }
  }
}

// Counts, per (batch, head, query block), the kept full blocks of an oracle run.
int kept_full(const sp::Decisions& d, int b, int h, int qb) {
  return d.kept.full_count[static_cast<std::size_t>(d.kept.row(b, h, qb))];
}

TEST(ExactGateCalibrator, ThresholdsFromOneSampleKeepExactlyKFullBlocks) {
  // A chunk whose offset (37) is not a multiple of block_q, GQA 4:2, bf16.
  const test::Inputs in = test::random_inputs({{75, 112}}, 4, 2, 16, sp::DType::kBF16, 11, 1.0,
                                              test::Distribution::kNormal);
  const test::TestProblem tp = test::build_problem(in);
  const std::vector<int> budgets = {1, 3, 6};
  sp::ExactGateCalibrator cal(1, 4, budgets, 8, 8);
  ASSERT_TRUE(cal.add(0, tp.problem()).ok());
  const sp::ThresholdTable table = cal.finish();
  EXPECT_EQ(table.positions, (74 + 37) / 8 + 1);

  const sp::geom::BlockGeometry g{{75, 112, true}, 8, 8};
  for (std::size_t bi = 0; bi < budgets.size(); ++bi) {
    const sp::HostTensor slice = table.slice(0, static_cast<int>(bi));
    sp::ExactGateParams params;
    params.block_q = 8;
    params.block_k = 8;
    params.thresholds = slice.view();
    sp::ref::Result result;
    ASSERT_TRUE(sp::ref::run_reference(tp.problem(), params, &result).ok());
    int gated_rows = 0;
    for (int h = 0; h < 4; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        const int full = g.full_end(qb);
        const int k = budgets[bi];
        EXPECT_EQ(kept_full(result.decisions, 0, h, qb), std::min(full, k))
            << "budget " << k << " head " << h << " query block " << qb << " (" << full << " full)";
        gated_rows += full > k;
      }
    }
    EXPECT_GT(gated_rows, 8) << "the test must exercise finite thresholds";
  }
}

TEST(ExactGateCalibrator, RejectsBadSamplesAndConfigurations) {
  const test::Inputs in = test::random_inputs({{16, 16}}, 2, 1, 8, sp::DType::kFP32, 3);
  const test::TestProblem tp = test::build_problem(in);
  sp::ExactGateCalibrator cal(2, 2, {1, 2}, 4, 4);
  sp::Status st = cal.add(2, tp.problem());
  EXPECT_EQ(st.code(), sp::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "ExactGateCalibrator: layer: expected 0 .. 1, got 2");

  sp::ExactGateCalibrator three_heads(1, 3, {1}, 4, 4);
  st = three_heads.add(0, tp.problem());
  EXPECT_EQ(st.message(), "ExactGateCalibrator: sample.q: expected 3 query heads, got 2");

  sp::ExactGateCalibrator unsorted(1, 2, {2, 1}, 4, 4);
  st = unsorted.add(0, tp.problem());
  EXPECT_EQ(st.message(), "ExactGateCalibrator: budgets: expected strictly ascending values >= 1");

  test::LayoutOptions opt;
  opt.causal = false;
  const test::TestProblem non_causal = test::build_problem(in, opt);
  st = cal.add(0, non_causal.problem());
  EXPECT_EQ(st.message(), "ExactGateCalibrator: sample.causal: calibration expects causal (prefill) samples");

  sp::AttentionProblem broken = tp.problem();
  broken.k = sp::TensorView();
  st = cal.add(0, broken);
  EXPECT_EQ(st.code(), sp::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("ExactGateCalibrator: sample: k", 0), 0u) << st.message();

  test::Inputs nan_in = in;
  test::set(&nan_in.seqs[0].q, (5 * 2 + 1) * 8 + 3, std::nan(""));
  const test::TestProblem nan_problem = test::build_problem(nan_in);
  st = cal.add(0, nan_problem.problem());
  EXPECT_EQ(st.message(), "ExactGateCalibrator: sample.q: non-finite value in sequence 0, row 5, head 1");

  // A bad second sequence rejects the whole call before anything is accumulated.
  test::Inputs two = test::random_inputs({{16, 16}, {12, 20}}, 2, 1, 8, sp::DType::kFP32, 4);
  test::set(&two.seqs[1].k, 19 * 8, std::numeric_limits<double>::infinity());
  test::LayoutOptions varlen;
  varlen.layout = test::Layout::kVarlen;
  const test::TestProblem two_problem = test::build_problem(two, varlen);
  st = cal.add(0, two_problem.problem());
  EXPECT_EQ(st.message(), "ExactGateCalibrator: sample.k: non-finite value in sequence 1, row 19, head 0");

  // Nothing was added by the failed calls: the table has no positions.
  EXPECT_EQ(cal.finish().positions, 0);
  EXPECT_FALSE(cal.finish().validate().ok());
}

// ---------------------------------------------------------------- softmax_skip calibrator

struct Counts {
  std::int64_t visible = 0, kept = 0;
};

Counts counts(const sp::AttentionProblem& problem, const sp::Policy& policy, const sp::ref::Result& r) {
  sp::ProblemShape shape;
  EXPECT_TRUE(sp::validate_problem(problem, nullptr, &shape).ok());
  const sp::RunStats stats = sp::detail::stats_from_decisions(shape, policy, r.decisions);
  Counts c;
  for (const sp::HeadStats& h : stats.heads) {
    c.visible += h.visible_blocks;
    c.kept += h.kept_blocks;
  }
  return c;
}

// Random inputs with a strong diagonal (each key also carries the query at its position), so
// the partial blocks visited first set a high running max and the statistic spreads out.
test::Inputs diagonal_inputs(const std::vector<test::SeqLen>& lengths, sp::DType dtype, std::uint64_t seed) {
  test::Inputs in = test::random_inputs(lengths, 4, 2, 16, dtype, seed, 1.0, test::Distribution::kNormal);
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    const std::int64_t offset = lengths[b].s_k - lengths[b].s_q;
    for (std::int64_t r = 0; r < lengths[b].s_q; ++r) {
      for (int hk = 0; hk < 2; ++hk) {
        for (int i = 0; i < 16; ++i) {
          const std::int64_t k_index = ((r + offset) * 2 + hk) * 16 + i;
          const double q = test::get(in.seqs[b].q, (r * 4 + hk * 2) * 16 + i);
          test::set(&in.seqs[b].k, k_index, test::get(in.seqs[b].k, k_index) + q);
        }
      }
    }
  }
  return in;
}

TEST(SoftmaxSkipCalibrator, FactorReproducesTheTargetSkipFractionInTheOracle) {
  // Two sequences (one a chunk), GQA 4:2; then a second layer with other inputs.
  const test::Inputs in = diagonal_inputs({{96, 96}, {70, 121}}, sp::DType::kBF16, 5);
  test::LayoutOptions opt;
  opt.layout = test::Layout::kVarlen;
  const test::TestProblem tp = test::build_problem(in, opt);
  const test::Inputs in2 = diagonal_inputs({{80, 80}}, sp::DType::kFP16, 6);
  const test::TestProblem tp2 = test::build_problem(in2);

  sp::SoftmaxSkipCalibrator cal(2, 8, 8);
  ASSERT_TRUE(cal.add(0, tp.problem()).ok());
  ASSERT_TRUE(cal.add(1, tp2.problem()).ok());
  for (const double target : {0.0, 0.1, 0.2, 0.35}) {
    double a = 0;
    ASSERT_TRUE(cal.factor_for(target, 0, &a).ok());
    const sp::Policy policy = sp::SoftmaxSkipParams{8, 8, a};
    sp::ref::Result r;
    ASSERT_TRUE(sp::ref::run_reference(tp.problem(), policy, &r).ok());
    const Counts c = counts(tp.problem(), policy, r);
    const double skipped = static_cast<double>(c.visible - c.kept);
    EXPECT_LE(std::abs(skipped - target * static_cast<double>(c.visible)), 1.0)
        << "target " << target << " a " << a << ": skipped " << skipped << " of " << c.visible;
  }
  // Pooling both layers: the fraction holds over the union of the two samples.
  double a = 0;
  ASSERT_TRUE(cal.factor_for(0.3, -1, &a).ok());
  const sp::Policy policy = sp::SoftmaxSkipParams{8, 8, a};
  Counts total;
  for (const test::TestProblem* p : {&tp, &tp2}) {
    sp::ref::Result r;
    ASSERT_TRUE(sp::ref::run_reference(p->problem(), policy, &r).ok());
    const Counts c = counts(p->problem(), policy, r);
    total.visible += c.visible;
    total.kept += c.kept;
  }
  EXPECT_LE(std::abs(static_cast<double>(total.visible - total.kept) - 0.3 * static_cast<double>(total.visible)), 1.0);
}

TEST(SoftmaxSkipCalibrator, UnreachableTargetsStopAtTheSkippableBlocks) {
  // Uniform inputs of small scale: attention is nearly flat, so no a <= s_k skips much; a
  // target of 1 gives the largest reachable fraction and a never exceeds s_k.
  const test::Inputs in = test::random_inputs({{64, 64}}, 2, 2, 8, sp::DType::kFP32, 9, 0.1);
  const test::TestProblem tp = test::build_problem(in);
  sp::SoftmaxSkipCalibrator cal(1, 8, 8);
  ASSERT_TRUE(cal.add(0, tp.problem()).ok());
  double a = 0;
  ASSERT_TRUE(cal.factor_for(1.0, 0, &a).ok());
  EXPECT_LE(a, 64.0);
  sp::Status st = cal.factor_for(1.5, 0, &a);
  EXPECT_EQ(st.message(), "target_skip_fraction: expected a fraction in [0, 1], got 1.500000");
  st = cal.factor_for(0.5, 1, &a);
  EXPECT_EQ(st.message(), "layer: expected -1 (all layers) or 0 .. 0, got 1");
  sp::SoftmaxSkipCalibrator empty(1, 8, 8);
  st = empty.factor_for(0.5, 0, &a);
  EXPECT_EQ(st.message(), "layer 0: no skippable blocks seen (add samples first)");
}

// ---------------------------------------------------------------- estimate_select calibrator

void check_alpha_reproduces_density(bool pack_gqa) {
  const test::Inputs in = test::random_inputs({{128, 128}, {100, 140}}, 4, 2, 16, sp::DType::kBF16,
                                              pack_gqa ? 21 : 22, 1.5, test::Distribution::kNormal);
  test::LayoutOptions opt;
  opt.layout = test::Layout::kVarlen;
  const test::TestProblem tp = test::build_problem(in, opt);
  sp::EstimateSelectParams base;
  base.block = 8;
  base.sink = 1;
  base.window = 1;
  base.tail = 1;
  base.pack_gqa = pack_gqa;
  sp::EstimateSelectCalibrator cal(1, base);
  ASSERT_TRUE(cal.add(0, tp.problem()).ok());

  // The forced blocks alone and everything: the targets below lie strictly between.
  for (const double target : {0.4, 0.55, 0.7, 0.85}) {
    double alpha = 0;
    ASSERT_TRUE(cal.alpha_for(target, 0, &alpha).ok());
    sp::EstimateSelectParams p = base;
    p.alpha = alpha;
    sp::ref::Result r;
    ASSERT_TRUE(sp::ref::run_reference(tp.problem(), p, &r).ok());
    const Counts c = counts(tp.problem(), p, r);
    // With pack_gqa a decision covers the group's 2 query heads, so one block is 2 here.
    const double unit = pack_gqa ? 2.0 : 1.0;
    EXPECT_LE(std::abs(static_cast<double>(c.kept) - target * static_cast<double>(c.visible)), unit)
        << "target " << target << " alpha " << alpha << ": kept " << c.kept << " of " << c.visible;
  }
  // Density 0 keeps only the forced blocks; density 1 keeps every visible block.
  double alpha = 0;
  ASSERT_TRUE(cal.alpha_for(1.0, 0, &alpha).ok());
  sp::EstimateSelectParams p = base;
  p.alpha = alpha;
  sp::ref::Result r;
  ASSERT_TRUE(sp::ref::run_reference(tp.problem(), p, &r).ok());
  const Counts all = counts(tp.problem(), p, r);
  EXPECT_EQ(all.kept, all.visible);
  ASSERT_TRUE(cal.alpha_for(0.0, 0, &alpha).ok());
  EXPECT_GT(alpha, 1.0);
}

TEST(EstimateSelectCalibrator, AlphaReproducesTheTargetDensityInTheOracle) {
  check_alpha_reproduces_density(false);
}

TEST(EstimateSelectCalibrator, AlphaReproducesTheTargetDensityWithPackGqa) {
  check_alpha_reproduces_density(true);
}

TEST(EstimateSelectCalibrator, RejectsBadInputs) {
  sp::EstimateSelectParams base;
  base.block = 0;
  sp::EstimateSelectCalibrator bad(1, base);
  const test::Inputs in = test::random_inputs({{16, 16}}, 2, 1, 8, sp::DType::kFP32, 3);
  const test::TestProblem tp = test::build_problem(in);
  sp::Status st = bad.add(0, tp.problem());
  EXPECT_EQ(st.message().rfind("EstimateSelectCalibrator: base: block", 0), 0u) << st.message();
  sp::EstimateSelectCalibrator cal(1, sp::EstimateSelectParams{});
  double alpha = 0;
  st = cal.alpha_for(0.5, 0, &alpha);
  EXPECT_EQ(st.message(), "layer 0: no blocks seen (add samples first)");
  st = cal.alpha_for(std::nan(""), 0, &alpha);
  EXPECT_EQ(st.message(), "target_density: expected a fraction in [0, 1], got nan");
}

// ---------------------------------------------------------------- statistics (host and GPU routes)

// scale · q_r · k_t summed over d in order from 0.0, as the oracle's dot().
double score(const test::Inputs& in, int b, std::int64_t r, int h, std::int64_t t) {
  const test::SequenceData& s = in.seqs[static_cast<std::size_t>(b)];
  const int hk = h / (in.h_q / in.h_kv);
  double acc = 0.0;
  for (int i = 0; i < in.d; ++i) {
    acc += test::get(s.q, (r * in.h_q + h) * in.d + i) * test::get(s.k, (t * in.h_kv + hk) * in.d + i);
  }
  return acc / std::sqrt(static_cast<double>(in.d));
}

TEST(CalibrationStatistics, HostStatisticsFollowTheirDefinitions) {
  // A chunk (offset 25), GQA 3:1, blocks 8 x 16 (query blocks straddle key blocks).
  const test::Inputs in = test::random_inputs({{45, 70}}, 3, 1, 16, sp::DType::kFP32, 31, 1.0,
                                              test::Distribution::kNormal);
  const test::TestProblem tp = test::build_problem(in);
  std::vector<sp::BlockStatistics> stats;
  ASSERT_TRUE(sp::compute_block_statistics(tp.problem(), 8, 16, true, true, &stats).ok());
  ASSERT_EQ(stats.size(), 1u);
  const sp::BlockStatistics& st = stats[0];
  const sp::geom::BlockGeometry g{{45, 70, true}, 8, 16};
  const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
  ASSERT_EQ(st.block_max.size(), static_cast<std::size_t>(3 * nqb * nkb));
  ASSERT_EQ(st.skip_g.size(), st.block_max.size());
  const double inf = std::numeric_limits<double>::infinity();
  int plus_inf = 0;
  for (int h = 0; h < 3; ++h) {
    for (int qb = 0; qb < nqb; ++qb) {
      const std::size_t row = (static_cast<std::size_t>(h) * nqb + qb) * nkb;
      // Per row and visible block: the max over the keys the row sees (-inf when none).
      std::vector<std::vector<double>> tile(static_cast<std::size_t>(nkb));
      for (int kb = 0; kb < g.visible_end(qb); ++kb) {
        double block = -inf;
        for (std::int64_t r = g.row_begin(qb); r < g.row_end(qb); ++r) {
          double m = -inf;
          for (std::int64_t t = g.key_begin(kb); t < std::min(g.key_end(kb), g.seq.keys_seen(r)); ++t) {
            m = std::max(m, score(in, 0, r, h, t));
          }
          tile[static_cast<std::size_t>(kb)].push_back(m);
          block = std::max(block, m);
        }
        if (kb < g.full_end(qb)) EXPECT_EQ(st.block_max[row + kb], block) << h << " " << qb << " " << kb;
      }
      // BLASST order with the running max of every row.
      std::vector<double> m_run(static_cast<std::size_t>(g.row_end(qb) - g.row_begin(qb)), -inf);
      int visit = 0;
      for (int kb : [&] {
             std::vector<int> order;
             for (int k = g.visible_end(qb) - 1; k >= g.full_end(qb); --k) order.push_back(k);
             for (int k = g.full_end(qb) - 1; k >= 0; --k) order.push_back(k);
             return order;
           }()) {
        double stat = -inf;
        for (std::size_t i = 0; i < m_run.size(); ++i) {
          const double x = tile[static_cast<std::size_t>(kb)][i];
          if (x != -inf) stat = std::max(stat, m_run[i] == -inf ? inf : x - m_run[i]);
          m_run[i] = std::max(m_run[i], x);
        }
        if (visit++ > 0) {
          EXPECT_EQ(st.skip_g[row + kb], stat + std::log(70.0)) << h << " " << qb << " " << kb;
          plus_inf += stat == inf;
        }
      }
    }
  }
  EXPECT_GT(plus_inf, 0);  // 8-row query blocks meet 16-key blocks mid-way: rows see first keys late
}

TEST(CalibrationStatistics, CalibratorsReduceStatisticsExactlyLikeSamples) {
  const test::Inputs in = test::random_inputs({{96, 96}, {70, 121}}, 4, 2, 16, sp::DType::kBF16, 8, 1.0,
                                              test::Distribution::kNormal);
  test::LayoutOptions opt;
  opt.layout = test::Layout::kVarlen;
  const test::TestProblem tp = test::build_problem(in, opt);
  std::vector<sp::BlockStatistics> blocks;
  ASSERT_TRUE(sp::compute_block_statistics(tp.problem(), 8, 16, true, true, &blocks).ok());
  sp::EstimateSelectParams base;
  base.block = 8;
  base.sink = 1;
  base.window = 1;
  base.tail = 1;
  std::vector<sp::SelectStatistics> select;
  ASSERT_TRUE(sp::compute_select_statistics(tp.problem(), base, &select).ok());

  sp::ExactGateCalibrator gate_a(1, 4, {1, 2}, 8, 16), gate_b(1, 4, {1, 2}, 8, 16);
  ASSERT_TRUE(gate_a.add(0, tp.problem()).ok());
  ASSERT_TRUE(gate_b.add_statistics(0, blocks).ok());
  EXPECT_EQ(gate_a.finish().values, gate_b.finish().values);
  EXPECT_EQ(gate_a.finish().positions, gate_b.finish().positions);
  sp::SoftmaxSkipCalibrator skip_a(1, 8, 16), skip_b(1, 8, 16);
  ASSERT_TRUE(skip_a.add(0, tp.problem()).ok());
  ASSERT_TRUE(skip_b.add_statistics(0, blocks).ok());
  sp::EstimateSelectCalibrator sel_a(1, base), sel_b(1, base);
  ASSERT_TRUE(sel_a.add(0, tp.problem()).ok());
  ASSERT_TRUE(sel_b.add_statistics(0, select).ok());
  for (double target : {0.1, 0.3, 0.6}) {
    double a = 0, b = 0;
    ASSERT_TRUE(skip_a.factor_for(target, 0, &a).ok());
    ASSERT_TRUE(skip_b.factor_for(target, 0, &b).ok());
    EXPECT_EQ(a, b);
    ASSERT_TRUE(sel_a.alpha_for(target + 0.3, 0, &a).ok());
    ASSERT_TRUE(sel_b.alpha_for(target + 0.3, 0, &b).ok());
    EXPECT_EQ(a, b);
  }
}

// Hand-made records: the reduction reads exactly the documented entries (unread ones NaN).
TEST(CalibrationStatistics, HandMadeStatisticsReduceAsDocumented) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto record = [&](std::int64_t s_q, std::int64_t s_k) {
    sp::BlockStatistics st;
    st.s_q = s_q;
    st.s_k = s_k;
    st.heads = 1;
    st.block_q = st.block_k = 4;
    const sp::geom::BlockGeometry g{{s_q, s_k, true}, 4, 4};
    st.block_max.assign(static_cast<std::size_t>(g.num_q_blocks() * g.num_k_blocks()), nan);
    st.skip_g = st.block_max;
    return st;
  };
  // 12 x 12: query block 2 has full blocks {0, 1}; a 4 x 12 chunk: its one query block sits at
  // position 2 with full blocks {0, 1}. Budget 1: midpoints 2 and 3, mean 2.5 at position 2.
  sp::BlockStatistics a = record(12, 12), c = record(4, 12);
  a.block_max[2 * 3 + 0] = 3;
  a.block_max[2 * 3 + 1] = 1;
  a.block_max[1 * 3 + 0] = 7;  // query block 1: one full block, not above budget 1
  c.block_max[0] = 5;
  c.block_max[1] = 1;
  sp::ExactGateCalibrator gate(1, 1, {1}, 4, 4);
  ASSERT_TRUE(gate.add_statistics(0, {a, c}).ok());
  const sp::ThresholdTable t = gate.finish();
  ASSERT_EQ(t.positions, 3);
  EXPECT_EQ(t.at(0, 0, 0, 0), kNegInf);
  EXPECT_EQ(t.at(0, 0, 0, 1), kNegInf);
  EXPECT_EQ(t.at(0, 0, 0, 2), 2.5f);

  // softmax_skip on 12 x 12: visits (qb 0: 0), (qb 1: 1, 0), (qb 2: 2, 1, 0); g is read at
  // (1, 0), (2, 1), (2, 0): 3 statistics and 3 first blocks; ln(12) ~ 2.48 caps ln a.
  a.skip_g[1 * 3 + 0] = -3;
  a.skip_g[2 * 3 + 1] = -1;
  a.skip_g[2 * 3 + 0] = 5;
  sp::SoftmaxSkipCalibrator skip(1, 4, 4);
  ASSERT_TRUE(skip.add_statistics(0, {a}).ok());
  double f = 0;
  ASSERT_TRUE(skip.factor_for(1.0 / 6, 0, &f).ok());
  EXPECT_DOUBLE_EQ(std::log(f), -2.0);
  ASSERT_TRUE(skip.factor_for(2.0 / 6, 0, &f).ok());
  EXPECT_DOUBLE_EQ(std::log(f), 2.0);

  // estimate_select, block 4 over 24 x 24, sink/window/tail 1: ratios are read for the
  // non-forced scored blocks (tile, block) = (2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (4, 3);
  // 21 visible blocks of which 15 forced.
  sp::SelectStatistics r;
  r.s_q = r.s_k = 24;
  r.units = 1;
  r.block = 4;
  r.ratio.assign(36, nan);
  const double ratios[][3] = {{2, 1, 0.9}, {3, 1, 0.8}, {3, 2, 0.7}, {4, 1, 0.6}, {4, 2, 0.5}, {4, 3, 0.4}};
  for (const auto& x : ratios) r.ratio[static_cast<std::size_t>(x[0] * 6 + x[1])] = x[2];
  // Forced blocks (sink 0, window i, every block of the tail tile 5) are scored but never
  // ranked; unscored entries (j > i) stay NaN.
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j <= i; ++j) {
      if (j == 0 || j == i || i == 5) r.ratio[static_cast<std::size_t>(i * 6 + j)] = 1.0;
    }
  }
  sp::EstimateSelectParams base;
  base.block = 4;
  base.sink = 1;
  base.window = 1;
  base.tail = 1;
  sp::EstimateSelectCalibrator sel(1, base);
  ASSERT_TRUE(sel.add_statistics(0, {r}).ok());
  double alpha = 0;
  ASSERT_TRUE(sel.alpha_for(17.0 / 21, 0, &alpha).ok());
  EXPECT_DOUBLE_EQ(alpha, 0.75);
  ASSERT_TRUE(sel.alpha_for(15.0 / 21, 0, &alpha).ok());
  EXPECT_EQ(alpha, 2.0);
}

TEST(CalibrationStatistics, BadRecordsAreRejectedWithoutChangingTheCalibrator) {
  sp::BlockStatistics st;
  st.s_q = st.s_k = 12;
  st.heads = 1;
  st.block_q = st.block_k = 4;
  st.block_max.assign(9, 1.0);
  st.skip_g.assign(9, 1.0);
  sp::ExactGateCalibrator gate(1, 1, {1}, 4, 4);
  sp::BlockStatistics bad = st;
  bad.block_max.pop_back();
  EXPECT_EQ(gate.add_statistics(0, {st, bad}).message(),
            "ExactGateCalibrator: statistics[1].block_max: expected 9 values [heads, q_blocks, k_blocks], got 8");
  bad = st;
  bad.block_k = 8;
  EXPECT_EQ(gate.add_statistics(0, {bad}).message(),
            "ExactGateCalibrator: statistics[0]: block 4x8, calibrator expects 4x4");
  bad = st;
  bad.heads = 2;
  EXPECT_EQ(gate.add_statistics(0, {bad}).message(), "ExactGateCalibrator: statistics[0]: expected 1 query heads, got 2");
  bad = st;
  bad.block_max[2 * 3 + 1] = std::numeric_limits<double>::infinity();
  EXPECT_EQ(gate.add_statistics(0, {st, bad}).message(),
            "ExactGateCalibrator: statistics[1].block_max[7] is infinite (non-finite q or k?)");
  EXPECT_EQ(gate.add_statistics(1, {st}).message(), "ExactGateCalibrator: layer: expected 0 .. 0, got 1");
  EXPECT_EQ(gate.finish().positions, 0);  // nothing accumulated
  sp::SoftmaxSkipCalibrator skip(1, 4, 4);
  bad = st;
  bad.skip_g[1 * 3 + 0] = std::nan("");
  EXPECT_EQ(skip.add_statistics(0, {bad}).message(),
            "SoftmaxSkipCalibrator: statistics[0].skip_g[3] is NaN (non-finite q or k?)");
  double a = 0;
  EXPECT_FALSE(skip.factor_for(0.5, 0, &a).ok());
  sp::SelectStatistics r;
  r.s_q = r.s_k = 12;
  r.units = 1;
  r.block = 4;
  r.ratio.assign(9, 1.0);
  sp::EstimateSelectParams base;
  base.block = 4;
  sp::EstimateSelectCalibrator sel(1, base);
  sp::SelectStatistics packed = r;
  packed.pack_gqa = true;
  EXPECT_EQ(sel.add_statistics(0, {packed}).message(),
            "EstimateSelectCalibrator: statistics[0]: block 4 pack_gqa, calibrator expects block 4");
  EXPECT_FALSE(sel.alpha_for(0.5, 0, &a).ok());
}

// Enough statistics (about 80K per calibrator) for the multi-threaded ranking: the factors are
// the midpoints of neighbours in a plain full sort of the statistics read.
TEST(CalibrationStatistics, RankingOfManyStatisticsMatchesAFullSort) {
  constexpr int kBlocks = 400, kB = 128;
  std::uint64_t state = 7;
  const auto uniform = [&]() {  // (0, 1), distinct with overwhelming probability
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<double>(state >> 11) + 0.5) * 0x1.0p-53;
  };
  sp::BlockStatistics st;
  st.s_q = st.s_k = static_cast<std::int64_t>(kBlocks) * kB;
  st.heads = 1;
  st.block_q = st.block_k = kB;
  st.skip_g.assign(static_cast<std::size_t>(kBlocks) * kBlocks, std::nan(""));
  std::vector<double> read;
  for (int qb = 0; qb < kBlocks; ++qb) {
    for (int kb = 0; kb < qb; ++kb) {  // visible 0..qb; the first visited (qb) is not read
      const double g = 22.0 * uniform() - 20.0;
      st.skip_g[static_cast<std::size_t>(qb) * kBlocks + kb] = g;
      read.push_back(g);
    }
  }
  sp::SoftmaxSkipCalibrator skip(1, kB, kB);
  ASSERT_TRUE(skip.add_statistics(0, {st}).ok());
  std::sort(read.begin(), read.end());
  const double total = static_cast<double>(read.size() + kBlocks);
  for (double target : {0.1, 0.3}) {
    const auto n = static_cast<std::size_t>(std::ceil(target * total - 0.5));
    double a = 0;
    ASSERT_TRUE(skip.factor_for(target, 0, &a).ok());
    EXPECT_NEAR(std::log(a), 0.5 * (read[n - 1] + read[n]), 1e-12) << target;
  }

  sp::SelectStatistics r;
  r.s_q = r.s_k = st.s_q;
  r.units = 1;
  r.block = kB;
  r.ratio.assign(static_cast<std::size_t>(kBlocks) * kBlocks, 1.0);
  std::vector<double> ratios;
  std::int64_t forced = 0, visible = 0;
  for (int i = 0; i < kBlocks; ++i) {
    visible += i + 1;
    for (int j = 0; j <= i; ++j) {
      if (j == 0 || j == i || i == kBlocks - 1) {  // sink 1, window 1, tail 1
        ++forced;
        continue;
      }
      const double x = uniform();
      r.ratio[static_cast<std::size_t>(i) * kBlocks + j] = x;
      ratios.push_back(x);
    }
  }
  sp::EstimateSelectParams base;
  base.block = kB;
  base.sink = base.window = base.tail = 1;
  sp::EstimateSelectCalibrator sel(1, base);
  ASSERT_TRUE(sel.add_statistics(0, {r}).ok());
  std::sort(ratios.begin(), ratios.end(), std::greater<double>());
  for (double target : {0.2, 0.6}) {
    const auto n = static_cast<std::size_t>(std::ceil(target * static_cast<double>(visible) - static_cast<double>(forced) - 0.5));
    double alpha = 0;
    ASSERT_TRUE(sel.alpha_for(target, 0, &alpha).ok());
    EXPECT_EQ(alpha, 0.5 * (ratios[n - 1] + ratios[n])) << target;
  }
}

}  // namespace
