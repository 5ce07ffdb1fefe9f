// SPDX-License-Identifier: Apache-2.0
// The `sparseprefill` CLI, run as a process: help and exit codes, info, the demo smoke test, a
// run round trip against run() in-process, calibrate -> run, and every bad-input path (exit
// code, a one-line message naming the problem, and no output file left behind).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "sparseprefill/sparseprefill.h"

namespace sparseprefill {
namespace {

struct CliResult {
  int code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_STRNE(SP_CLI_PATH, "") << "the CLI target is not built (SP_BUILD_TOOLS=OFF)";
    char tmpl[] = "/tmp/sp_cli_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    const std::string cmd = "rm -rf '" + dir_ + "'";
    ASSERT_EQ(std::system(cmd.c_str()), 0);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // Runs the CLI with `args` (already shell-quoted where needed).
  CliResult cli(const std::string& args) const {
    const std::string out = path("stdout.txt"), err = path("stderr.txt");
    const std::string cmd =
        std::string("'") + SP_CLI_PATH + "' " + args + " >'" + out + "' 2>'" + err + "'";
    const int status = std::system(cmd.c_str());
    CliResult r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  // Expects exit `code`, an error that is the last line of stderr and names `needle`, and no
  // file at `output` (progress lines may precede the error).
  void expect_error(const std::string& args, int code, const std::string& needle,
                    const std::string& output) const {
    const CliResult r = cli(args);
    EXPECT_EQ(r.code, code) << args << "\nstderr: " << r.err;
    ASSERT_FALSE(r.err.empty()) << args;
    EXPECT_EQ(r.err.back(), '\n');
    const std::size_t start = r.err.rfind('\n', r.err.size() - 2);
    const std::string last = r.err.substr(start == std::string::npos ? 0 : start + 1);
    EXPECT_EQ(last.rfind("sparseprefill", 0), 0u) << "stderr: " << r.err;
    EXPECT_NE(last.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
    if (!output.empty()) {
      EXPECT_FALSE(exists(output)) << args;
      EXPECT_FALSE(exists(output + ".tmp")) << args;
    }
  }

  std::string dir_;
};

// q, k, v of a small generated problem as a safetensors file.
SafetensorsFile small_input() {
  GeneratorConfig c;
  c.seq_q = c.seq_k = 100;
  c.h_q = 4;
  c.h_kv = 2;
  c.d = 16;
  c.seed = 5;
  SafetensorsFile f;
  EXPECT_TRUE(generate(c, &f.tensors["q"], &f.tensors["k"], &f.tensors["v"]).ok());
  return f;
}

// The number after `"key": ` following the n-th occurrence of `anchor` in a JSON text.
double json_number_after(const std::string& json, const std::string& anchor,
                         const std::string& key) {
  const std::size_t at = json.find(anchor);
  if (at == std::string::npos) return NAN;
  const std::size_t k = json.find("\"" + key + "\": ", at);
  if (k == std::string::npos) return NAN;
  return std::strtod(json.c_str() + k + key.size() + 4, nullptr);
}

// ---------------------------------------------------------------- help, info, usage

TEST_F(CliTest, TopLevelHelpListsCommandsAndExitCodes) {
  const CliResult r = cli("--help");
  EXPECT_EQ(r.code, 0);
  for (const char* word : {"demo", "run", "calibrate", "info", "Exit codes", "4  I/O error"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << word;
  }
}

TEST_F(CliTest, EveryCommandHasHelp) {
  for (const std::string command : {"demo", "run", "calibrate", "info"}) {
    const CliResult r = cli(command + " --help");
    EXPECT_EQ(r.code, 0) << command;
    EXPECT_NE(r.out.find("Usage: sparseprefill " + command), std::string::npos) << command;
    EXPECT_NE(r.out.find("--json"), std::string::npos) << command;
    EXPECT_NE(r.out.find("Exit codes"), std::string::npos) << command;
  }
}

TEST_F(CliTest, UsageErrors) {
  EXPECT_EQ(cli("").code, 2);
  expect_error("frobnicate", 2, "unknown command 'frobnicate'", "");
  expect_error("info --bogus", 2, "unknown flag --bogus", "");
  expect_error("demo --seq", 2, "--seq: expected a value", "");
  expect_error("demo --seq 12x", 2, "--seq: expected an integer", "");
  expect_error("demo --heads-q 3 --heads-kv 2 --seq 64", 2, "h_q", "");
}

TEST_F(CliTest, InfoJson) {
  const CliResult r = cli("info --json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(std::string("\"version\": \"") + SPARSEPREFILL_VERSION_STRING + "\""),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\"backends\": {"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"cpu\": "), std::string::npos) << r.out;
  const CliResult text = cli("info");
  EXPECT_EQ(text.code, 0);
  EXPECT_EQ(text.out, build_info());
}

// ---------------------------------------------------------------- demo

TEST_F(CliTest, DemoJsonSmoke) {
  const std::string png = path("maps.png");
  const CliResult r = cli(
      "demo --json --seq 1024 --heads-q 4 --heads-kv 2 --dim 64 --threads 2 --plot '" + png + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* policy : {"dense", "exact_gate", "softmax_skip", "estimate_select",
                             "estimate_select+mc", "permute_stop"}) {
    const std::string anchor = std::string("\"policy\": \"") + policy + "\"";
    ASSERT_NE(r.out.find(anchor), std::string::npos) << policy << "\n" << r.out;
    const double density = json_number_after(r.out, anchor, "density");
    const double error = json_number_after(r.out, anchor, "rel_l2");
    if (std::string(policy) == "dense") {
      EXPECT_EQ(density, 1.0);
      EXPECT_EQ(error, 0.0);
    } else {
      EXPECT_GT(density, 0.0) << policy;
      EXPECT_LT(density, 1.0) << policy;
      EXPECT_LT(error, 0.5) << policy;
    }
    // With a GPU (backend auto) dense also ran on it (these 32-key blocks keep the block
    // policies on the CPU only: CUDA takes query blocks of 128), with the CPU decisions.
    if (cuda_device_count() > 0 && std::string(policy) == "dense") {
      EXPECT_GT(json_number_after(r.out, anchor, "gpu_ms"), 0.0) << policy;
      EXPECT_EQ(json_number_after(r.out, anchor, "gpu_decisions_differ"), 0.0) << policy;
      EXPECT_LT(json_number_after(r.out, anchor, "gpu_rel_l2"), 0.5) << policy;
    }
  }
  EXPECT_NE(r.out.find(cuda_device_count() > 0 ? "\"gpu\": true" : "\"gpu\": false"), std::string::npos) << r.out;
  // The PNG: signature, IHDR first, IEND last, and every chunk's CRC-32 correct (checked with
  // a bitwise CRC independent of the writer's table).
  const std::string bytes = slurp(png);
  ASSERT_GT(bytes.size(), 8u + 25 + 12);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  const auto u32 = [&](std::size_t at) {
    return (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at])) << 24) |
           (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 1])) << 16) |
           (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 2])) << 8) |
           static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 3]));
  };
  std::vector<std::string> types;
  std::string idat;
  for (std::size_t at = 8; at + 12 <= bytes.size();) {
    const std::uint32_t len = u32(at);
    ASSERT_LE(at + 12 + len, bytes.size());
    std::uint32_t crc = 0xFFFFFFFFu;
    for (std::size_t i = at + 4; i < at + 8 + len; ++i) {
      crc ^= static_cast<unsigned char>(bytes[i]);
      for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    EXPECT_EQ(crc ^ 0xFFFFFFFFu, u32(at + 8 + len)) << "chunk " << types.size();
    types.push_back(bytes.substr(at + 4, 4));
    if (types.back() == "IDAT") idat += bytes.substr(at + 8, len);
    at += 12 + len;
  }
  ASSERT_GE(types.size(), 3u);
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");
  // The zlib stream: stored blocks whose payload is height rows of (filter 0 + width * 3).
  const std::uint32_t width = u32(16), height = u32(20);
  std::string raw;
  std::size_t at = 2;
  for (bool last = false; !last;) {
    ASSERT_LT(at + 5, idat.size());
    last = (idat[at] & 1) != 0;
    const std::size_t len =
        static_cast<unsigned char>(idat[at + 1]) | (static_cast<unsigned char>(idat[at + 2]) << 8);
    raw += idat.substr(at + 5, len);
    at += 5 + len;
  }
  EXPECT_EQ(raw.size(), static_cast<std::size_t>(height) * (1 + 3 * width));
  std::uint32_t a = 1, b = 0;
  for (unsigned char c : raw) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  const std::string tail = idat.substr(idat.size() - 4);
  const std::uint32_t adler =
      (static_cast<std::uint32_t>(static_cast<unsigned char>(tail[0])) << 24) |
      (static_cast<std::uint32_t>(static_cast<unsigned char>(tail[1])) << 16) |
      (static_cast<std::uint32_t>(static_cast<unsigned char>(tail[2])) << 8) |
      static_cast<std::uint32_t>(static_cast<unsigned char>(tail[3]));
  EXPECT_EQ(adler, (b << 16) | a);
}

// ---------------------------------------------------------------- run

TEST_F(CliTest, RunRoundTripMatchesInProcessRun) {
  const std::string in = path("in.safetensors"), out = path("out.safetensors");
  SafetensorsFile input = small_input();
  ASSERT_TRUE(write_safetensors(in, input).ok());
  const CliResult r =
      cli("run --input '" + in +
          "' --policy estimate_select --set block=16 "
          "--set alpha=0.2 --set mean_correction=true --threads 1 --json --output '" +
          out + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"density\": "), std::string::npos) << r.out;

  SafetensorsFile result;
  ASSERT_TRUE(read_safetensors(out, &result).ok());
  Policy policy;
  ASSERT_TRUE(parse_policy("estimate_select",
                           {{"block", "16"}, {"alpha", "0.2"}, {"mean_correction", "true"}},
                           &policy)
                  .ok());
  AttentionProblem problem;
  problem.q = input.tensors["q"].view();
  problem.k = input.tensors["k"].view();
  problem.v = input.tensors["v"].view();
  HostTensor o(DType::kBF16, input.tensors["q"].shape());
  HostTensor lse(DType::kFP32, {1, 4, 100});
  RunOptions options;
  options.backend = Backend::kCPU;
  options.num_threads = 1;
  options.collect_decisions = true;
  RunStats stats;
  Decisions decisions;
  ASSERT_TRUE(run(problem, policy, {o.view(), lse.view()}, options, &stats, &decisions).ok());

  const HostTensor& o_cli = result.tensors.at("o");
  ASSERT_EQ(o_cli.shape(), o.shape());
  ASSERT_EQ(o_cli.dtype(), o.dtype());
  EXPECT_EQ(std::string(static_cast<const char*>(o_cli.data()), o_cli.nbytes()),
            std::string(static_cast<const char*>(o.data()), o.nbytes()));
  const HostTensor& lse_cli = result.tensors.at("lse");
  ASSERT_EQ(lse_cli.shape(), lse.shape());
  EXPECT_EQ(std::string(static_cast<const char*>(lse_cli.data()), lse_cli.nbytes()),
            std::string(static_cast<const char*>(lse.data()), lse.nbytes()));
  const HostTensor& kept = result.tensors.at("kept");
  ASSERT_EQ(kept.dtype(), DType::kInt32);
  const std::vector<std::uint8_t> map = decisions.kept.to_dense();
  ASSERT_EQ(static_cast<std::size_t>(kept.numel()), map.size());
  for (std::size_t i = 0; i < map.size(); ++i) ASSERT_EQ(kept.as<std::int32_t>()[i], map[i]) << i;
  EXPECT_EQ(result.tensors.count("corrected"), 1u);
  EXPECT_EQ(result.metadata.at("policy"), describe(policy));
  EXPECT_NEAR(std::stod(result.metadata.at("density")), stats.density(), 1e-8);
}

TEST_F(CliTest, RunVarlenAndPermuteStopTiles) {
  const std::string in = path("in.safetensors"), out = path("out.safetensors");
  SafetensorsFile input = small_input();
  // Two sequences (40 + 60 tokens) packed along seq: q [100, 4, 16], k/v [100, 2, 16].
  for (const char* name : {"q", "k", "v"}) {
    HostTensor& t = input.tensors[name];
    HostTensor packed(t.dtype(), {t.shape()[1], t.shape()[2], t.shape()[3]});
    std::copy(static_cast<const char*>(t.data()), static_cast<const char*>(t.data()) + t.nbytes(),
              static_cast<char*>(packed.data()));
    t = std::move(packed);
  }
  HostTensor cu(DType::kInt32, {3});
  cu.as<std::int32_t>()[0] = 0;
  cu.as<std::int32_t>()[1] = 40;
  cu.as<std::int32_t>()[2] = 100;
  input.tensors["cu_seqlens_q"] = cu;
  input.tensors["cu_seqlens_k"] = cu;
  ASSERT_TRUE(write_safetensors(in, input).ok());
  const CliResult r = cli("run --input '" + in +
                          "' --policy permute_stop --set segment=16 "
                          "--set block_q=8 --set block_k=8 --output '" +
                          out + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  SafetensorsFile result;
  ASSERT_TRUE(read_safetensors(out, &result).ok());
  EXPECT_EQ(result.tensors.at("o").shape(), (std::vector<std::int64_t>{100, 4, 16}));
  EXPECT_EQ(result.tensors.at("lse").shape(), (std::vector<std::int64_t>{4, 100}));
  const HostTensor& tiles = result.tensors.at("tiles");
  ASSERT_EQ(tiles.shape().size(), 2u);
  EXPECT_EQ(tiles.shape()[1], 6);
  EXPECT_GT(tiles.shape()[0], 0);
  EXPECT_EQ(result.tensors.at("query_order").shape(), (std::vector<std::int64_t>{2, 4, 60}));
}

TEST_F(CliTest, CalibrateThenRunExactGate) {
  const std::string cal = path("cal.safetensors"), in = path("in.safetensors"),
                    out = path("out.safetensors");
  const CliResult c =
      cli("calibrate --generate seq=256,heads-q=4,heads-kv=2,dim=16,samples=2 "
          "--budgets 2,4 --skip-targets 0.5 --density-targets 0.5 --block-q 32 "
          "--block-k 32 --block 32 --json --output '" +
          cal + "'");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.err.find("calibrate"), std::string::npos) << "progress expected on stderr";
  Calibration loaded;
  ASSERT_TRUE(load_calibration(cal, &loaded).ok());
  EXPECT_EQ(loaded.exact_gate.budgets, (std::vector<int>{2, 4}));
  EXPECT_EQ(loaded.exact_gate.heads, 4);
  EXPECT_EQ(loaded.skip_a.size(), 1u);
  EXPECT_EQ(loaded.alpha.size(), 1u);

  ASSERT_TRUE(write_safetensors(in, small_input()).ok());
  for (const std::string policy : {"exact_gate --budget 2", "softmax_skip --skip-target 0.5",
                                   "estimate_select --density-target 0.5"}) {
    const CliResult r = cli("run --input '" + in + "' --calibration '" + cal + "' --policy " +
                            policy + " --output '" + out + "'");
    EXPECT_EQ(r.code, 0) << policy << ": " << r.err;
    EXPECT_TRUE(exists(out));
    std::remove(out.c_str());
  }
  expect_error("run --input '" + in + "' --calibration '" + cal +
                   "' --policy exact_gate --budget 3 --output '" + out + "'",
               2, "--budget: 3 is not in the calibration file", out);
  expect_error("run --input '" + in + "' --policy exact_gate --output '" + out + "'", 2,
               "--calibration: required by exact_gate", out);
}

// ---------------------------------------------------------------- bad input

TEST_F(CliTest, RunRejectsBadInput) {
  const std::string out = path("out.safetensors");
  const auto write = [&](const std::string& name, const SafetensorsFile& f) {
    EXPECT_TRUE(write_safetensors(path(name), f).ok());
    return "--input '" + path(name) + "' --output '" + out + "'";
  };
  const std::string good = write("good.safetensors", small_input());

  SafetensorsFile no_v = small_input();
  no_v.tensors.erase("v");
  expect_error("run --policy dense " + write("no_v.safetensors", no_v), 2, "missing tensor 'v'",
               out);

  SafetensorsFile rank2 = small_input();
  rank2.tensors["q"] = HostTensor(DType::kBF16, {100, 64});
  expect_error("run --policy dense " + write("rank2.safetensors", rank2), 2, "q: expected", out);

  SafetensorsFile heads = small_input();
  HostTensor q3(DType::kBF16, {1, 100, 3, 16});
  std::copy(static_cast<const char*>(heads.tensors["q"].data()),
            static_cast<const char*>(heads.tensors["q"].data()) + q3.nbytes(),
            static_cast<char*>(q3.data()));
  heads.tensors["q"] = q3;
  expect_error("run --policy dense " + write("heads.safetensors", heads), 2, "must divide h_q",
               out);

  SafetensorsFile varlen = small_input();
  for (const char* name : {"q", "k", "v"}) {
    HostTensor& t = varlen.tensors[name];
    HostTensor packed(t.dtype(), {t.shape()[1], t.shape()[2], t.shape()[3]});
    t = std::move(packed);
  }
  HostTensor cu(DType::kInt32, {3});
  cu.as<std::int32_t>()[0] = 0;
  cu.as<std::int32_t>()[1] = 70;
  cu.as<std::int32_t>()[2] = 30;
  varlen.tensors["cu_seqlens_q"] = cu;
  varlen.tensors["cu_seqlens_k"] = cu;
  expect_error("run --policy dense " + write("monotone.safetensors", varlen), 2, "non-decreasing",
               out);

  SafetensorsFile float_cu = varlen;
  float_cu.tensors["cu_seqlens_q"] = HostTensor(DType::kFP32, {3});
  expect_error("run --policy dense " + write("float_cu.safetensors", float_cu), 2, "cu_seqlens_q",
               out);

  expect_error("run --policy bogus " + good, 2, "unknown name 'bogus'", out);
  expect_error("run --policy softmax_skip --set nope=1 " + good, 2, "unknown parameter 'nope'",
               out);
  expect_error("run --policy softmax_skip --set a=nan " + good, 2, "a: expected a finite number",
               out);
  expect_error("run --policy estimate_select --set alpha " + good, 2, "--set: expected KEY=VALUE",
               out);
  expect_error("run --policy dense --bogus " + good, 2, "unknown flag --bogus", out);
  expect_error("run --policy dense --input '" + path("good.safetensors") + "'", 2,
               "--output: required", "");
  expect_error("run --policy dense --backend tpu " + good, 2, "--backend", out);
  expect_error("run --policy estimate_select --non-causal " + good, 3, "causal", out);

  expect_error(
      "run --policy dense --input '" + path("missing.safetensors") + "' --output '" + out + "'", 4,
      "missing.safetensors", out);
  {
    std::ofstream garbage(path("garbage.safetensors"), std::ios::binary);
    garbage << "this is not a safetensors file at all";
  }
  expect_error(
      "run --policy dense --input '" + path("garbage.safetensors") + "' --output '" + out + "'", 2,
      "garbage.safetensors", out);
  const std::string unwritable = path("no_such_dir/out.safetensors");
  expect_error(
      "run --policy dense --input '" + path("good.safetensors") + "' --output '" + unwritable + "'",
      4, "no_such_dir", unwritable);
}

TEST_F(CliTest, CalibrateRejectsBadInput) {
  const std::string cal = path("cal.safetensors");
  const std::string gen = "--generate seq=64,heads-q=2,heads-kv=1,dim=16 --output '" + cal + "'";
  expect_error("calibrate " + gen, 2, "expected at least one", cal);
  expect_error("calibrate --budgets 4,2 " + gen, 2, "--budgets: expected strictly ascending", cal);
  expect_error("calibrate --skip-targets 0.5,nan " + gen, 2, "--skip-targets", cal);
  expect_error("calibrate --budgets 2 --generate seq=64,colour=red --output '" + cal + "'", 2,
               "unknown key 'colour'", cal);
  expect_error("calibrate --budgets 2 --output '" + cal + "'", 2, "--input/--generate", cal);
  SafetensorsFile no_layers = small_input();
  ASSERT_TRUE(write_safetensors(path("plain.safetensors"), no_layers).ok());
  expect_error(
      "calibrate --budgets 2 --input '" + path("plain.safetensors") + "' --output '" + cal + "'", 2,
      "missing tensor 'q_0'", cal);
}

TEST_F(CliTest, CalibrateFromFiles) {
  const std::string cal = path("cal.safetensors");
  SafetensorsFile sample;
  for (int layer = 0; layer < 2; ++layer) {
    SafetensorsFile one = small_input();
    sample.tensors["q_" + std::to_string(layer)] = one.tensors["q"];
    sample.tensors["k_" + std::to_string(layer)] = one.tensors["k"];
  }
  ASSERT_TRUE(write_safetensors(path("sample.safetensors"), sample).ok());
  const CliResult r = cli("calibrate --input '" + path("sample.safetensors") +
                          "' --budgets 1 "
                          "--block-q 16 --block-k 16 --output '" +
                          cal + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  Calibration loaded;
  ASSERT_TRUE(load_calibration(cal, &loaded).ok());
  EXPECT_EQ(loaded.exact_gate.layers, 2);
  EXPECT_EQ(loaded.exact_gate.block_q, 16);
}

}  // namespace
}  // namespace sparseprefill
