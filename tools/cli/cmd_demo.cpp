// SPDX-License-Identifier: Apache-2.0
// `sparseprefill demo`: generated inputs, dense attention and every policy (calibrated on a
// different seed of the generator), a table of density / error / time, a text map of the kept
// blocks of one head, and optionally a PNG of the maps.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "commands.h"
#include "common.h"
#include "png.h"

namespace sparseprefill::cli {

namespace {

const std::vector<Flag>& demo_flags() {
  static const std::vector<Flag> flags = {
      {"seq", "N", "sequence length (default 8192)"},
      {"heads-q", "H", "query heads (default 8)"},
      {"heads-kv", "H", "KV heads (default 2)"},
      {"dim", "D", "head dimension (default 128)"},
      {"dtype", "T", "bf16 (default), fp16 or fp32"},
      {"seed", "S", "generator seed of the inputs (default 0); calibration uses S + 1"},
      {"peakedness", "P", "generator peakedness (default 1)"},
      {"block", "N", "block size of every policy (default 128; seq / 32 below 4096 tokens)"},
      {"budget", "K", "exact_gate budget (default: key blocks / 8)"},
      {"skip-target", "F", "softmax_skip target skip fraction (default 0.7)"},
      {"density-target", "F",
       "estimate_select target density (default: the density of its forced "
       "sink/window/tail blocks + 0.15)"},
      {"segment", "N", "permute_stop segment (default 2048, at most seq / 8)"},
      {"tau", "X", "permute_stop tau (default 0.005)"},
      {"threads", "T", "CPU threads (default: every core)"},
      {"backend", "NAME",
       "auto (default: cuda when a GPU is present, timed beside the cpu backend's decisions), cpu, reference or cuda"},
      {"map-policy", "NAME", "whose kept blocks the text map shows (default exact_gate)"},
      {"map-head", "H", "which query head the map shows (default 0)"},
      {"plot", "FILE.png", "also draw the block maps of every block policy into a PNG"},
  };
  return flags;
}

const char* const kDemoHelp =
    "Usage: sparseprefill demo [--seq N] [--heads-q H] [--heads-kv H] [--dim D] [--seed S]\n"
    "                          [--threads T] [--backend auto|cpu|reference|cuda] [--plot FILE.png]\n"
    "\n"
    "Generates structured inputs (sinks, local windows, stripes, slash diagonals; see\n"
    "docs/generator.md), runs dense attention and every policy, and prints per policy its\n"
    "settings, density (kept / causally visible blocks), relative L2 and max abs error of O\n"
    "against dense, and time. exact_gate thresholds, softmax_skip's a and estimate_select's\n"
    "alpha are calibrated on a different seed (S + 1). Then a map of the kept blocks of one\n"
    "head: '#' at least half kept, ':' some kept, '.' none kept, ' ' not causally visible,\n"
    "rows are query blocks (top = first), columns key blocks. Progress goes to stderr.\n"
    "With a GPU (backend auto or cuda) every policy also runs on the CUDA backend: the table\n"
    "then adds its device time (gpu_ms, the kernels alone), its error against the CPU's dense\n"
    "output and whether its decisions equal the CPU backend's ('same', else the blocks that\n"
    "differ); density, error and the map stay the CPU backend's (the oracle's decisions).\n"
    "\n";

struct Entry {
  std::string label;     // table name
  std::string settings;  // short settings for the table
  Policy policy;
  RunStats stats;
  Decisions decisions;
  ErrorStats error;
  double seconds = 0;
  // The same call on the CUDA backend (with a GPU): its device time, error against the CPU's
  // dense output, and the blocks (or permute_stop tiles) whose decisions differ from the CPU's.
  bool on_gpu = false;
  std::string gpu_skipped;  // why the CUDA backend does not run it (e.g. blocks other than 128)
  double gpu_ms = 0;
  ErrorStats gpu_error;
  std::int64_t gpu_differ = 0;
};

Entry entry(std::string label, std::string settings, Policy policy) {
  Entry e;
  e.label = std::move(label);
  e.settings = std::move(settings);
  e.policy = std::move(policy);
  return e;
}

// Blocks (permute_stop: tiles) whose decision differs between two runs of one policy.
std::int64_t decisions_differ(const Decisions& a, const Decisions& b) {
  if (!a.tiles.empty() || !b.tiles.empty()) {
    std::int64_t n = a.tiles.size() == b.tiles.size() ? 0 : 1;
    for (std::size_t i = 0; i < std::min(a.tiles.size(), b.tiles.size()); ++i) {
      n += a.tiles[i].chunks_visited != b.tiles[i].chunks_visited;
    }
    return n;
  }
  const std::vector<std::uint8_t> x = a.kept.to_dense(), y = b.kept.to_dense();
  if (x.size() != y.size()) return static_cast<std::int64_t>(std::max(x.size(), y.size()));
  std::int64_t n = 0;
  for (std::size_t i = 0; i < x.size(); ++i) n += x[i] != y[i];
  return n;
}

// Per-block state of one head's map: 0 invisible, 1 visible skipped, 2 kept, 3 corrected.
std::vector<std::uint8_t> head_map(const ProblemShape& shape, const Entry& e, int head) {
  const BlockMask& kept = e.decisions.kept;
  const BlockMask visible = BlockMask::all_visible(shape, kept.block_q, kept.block_k, false);
  const std::vector<std::uint8_t> vis = visible.to_dense();
  const std::vector<std::uint8_t> kep = kept.to_dense();
  std::vector<std::uint8_t> cor;
  if (e.decisions.corrected.batch > 0) cor = e.decisions.corrected.to_dense();
  const int mask_head = kept.per_kv_head ? head / shape.group() : head;
  const std::size_t nq = static_cast<std::size_t>(kept.num_q_blocks);
  const std::size_t nk = static_cast<std::size_t>(kept.num_k_blocks);
  std::vector<std::uint8_t> map(nq * nk, 0);
  for (std::size_t i = 0; i < nq * nk; ++i) {
    const std::size_t vis_at = static_cast<std::size_t>(head) * nq * nk + i;
    const std::size_t at = static_cast<std::size_t>(mask_head) * nq * nk + i;
    if (!vis[vis_at]) continue;
    map[i] = kep[at] ? 2 : (!cor.empty() && cor[at] ? 3 : 1);
  }
  return map;
}

void print_text_map(const std::vector<std::uint8_t>& map, int nq, int nk, int columns) {
  const int avail = std::max(16, columns - 2);
  const int fk = (nk + avail - 1) / avail;
  const int fq = 2 * fk;  // terminal cells are about twice as tall as wide
  for (int r0 = 0; r0 < nq; r0 += fq) {
    std::string line = "  ";
    for (int c0 = 0; c0 < nk; c0 += fk) {
      int vis = 0, kept = 0;
      for (int r = r0; r < std::min(nq, r0 + fq); ++r) {
        for (int c = c0; c < std::min(nk, c0 + fk); ++c) {
          const std::uint8_t m = map[static_cast<std::size_t>(r) * nk + c];
          vis += m != 0;
          kept += m == 2;
        }
      }
      line += vis == 0 ? ' ' : (2 * kept >= vis ? '#' : (kept > 0 ? ':' : '.'));
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::cout << line << "\n";
  }
}

// Panels side by side, one per block policy: white = not visible, grey = skipped, blue =
// kept, orange = mean-corrected; blocks grouped so a panel is at most 512 pixels wide.
Status write_plot(const std::string& path, const ProblemShape& shape,
                  const std::vector<const Entry*>& entries, int head) {
  const int nq = entries[0]->decisions.kept.num_q_blocks;
  const int nk = entries[0]->decisions.kept.num_k_blocks;
  const int group = (std::max(nq, nk) + 511) / 512;
  const int gq = (nq + group - 1) / group, gk = (nk + group - 1) / group;
  const int px = std::max(1, 256 / std::max(gq, gk));
  constexpr int kGap = 8;
  const int panel_w = gk * px, panel_h = gq * px;
  const int n = static_cast<int>(entries.size());
  const int width = n * panel_w + (n + 1) * kGap, height = panel_h + 2 * kGap;
  std::vector<std::uint8_t> rgb(static_cast<std::size_t>(width) * height * 3, 255);
  const std::uint8_t skipped[3] = {222, 222, 222}, kept[3] = {32, 64, 160},
                     corrected[3] = {230, 150, 40};
  for (int e = 0; e < n; ++e) {
    const std::vector<std::uint8_t> map =
        head_map(shape, *entries[static_cast<std::size_t>(e)], head);
    for (int qi = 0; qi < gq; ++qi) {
      for (int ki = 0; ki < gk; ++ki) {
        int vis = 0, kc = 0, cc = 0;
        for (int r = qi * group; r < std::min(nq, (qi + 1) * group); ++r) {
          for (int c = ki * group; c < std::min(nk, (ki + 1) * group); ++c) {
            const std::uint8_t m = map[static_cast<std::size_t>(r) * nk + c];
            vis += m != 0;
            kc += m == 2;
            cc += m == 3;
          }
        }
        if (vis == 0) continue;
        std::uint8_t color[3];
        for (int ch = 0; ch < 3; ++ch) {
          const double mix = (kc * kept[ch] + cc * corrected[ch] + (vis - kc - cc) * skipped[ch]) /
                             static_cast<double>(vis);
          color[ch] = static_cast<std::uint8_t>(mix + 0.5);
        }
        for (int y = 0; y < px; ++y) {
          for (int x = 0; x < px; ++x) {
            const int X = kGap + e * (panel_w + kGap) + ki * px + x;
            const int Y = kGap + qi * px + y;
            std::copy(color, color + 3,
                      rgb.begin() + (static_cast<std::ptrdiff_t>(Y) * width + X) * 3);
          }
        }
      }
    }
  }
  return write_png(path, width, height, rgb);
}

Status demo_command(const Args& args) {
  GeneratorConfig config;
  SP_RETURN_IF_ERROR(args.get_int("seq", 1, 1 << 20, &config.seq_q));
  config.seq_k = config.seq_q;
  SP_RETURN_IF_ERROR(args.get_int("heads-q", 1, 1024, &config.h_q));
  SP_RETURN_IF_ERROR(args.get_int("heads-kv", 1, 1024, &config.h_kv));
  SP_RETURN_IF_ERROR(args.get_int("dim", 8, 1024, &config.d));
  SP_RETURN_IF_ERROR(args.get_u64("seed", &config.seed));
  SP_RETURN_IF_ERROR(args.get_double("peakedness", 0, 100, &config.peakedness));
  const std::string dtype = args.get("dtype", "bf16");
  if (dtype == "bf16")
    config.dtype = DType::kBF16;
  else if (dtype == "fp16")
    config.dtype = DType::kFP16;
  else if (dtype == "fp32")
    config.dtype = DType::kFP32;
  else
    return invalid_argument("--dtype: expected bf16, fp16 or fp32, got '" + dtype + "'");

  // Below 4096 tokens 128-blocks leave too few blocks for a policy to choose from: use
  // power-of-two blocks of about seq / 32 (at least 16) instead.
  int block = 128;
  while (block > 16 && block * 32 > config.seq_k) block /= 2;
  SP_RETURN_IF_ERROR(args.get_int("block", 1, 1 << 16, &block));
  const int key_blocks = (config.seq_k + block - 1) / block;
  int budget = std::max(1, key_blocks / 8);
  double skip_target = 0.7, density_target = 0;
  PermuteStopParams permute;
  permute.block_q = permute.block_k = block;
  // Eight segments per sequence (at most the default 2048): at 8K, 1024-token segments keep
  // the in-segment dense pass (pass 1) small enough for the early stop to matter.
  while (permute.segment > block && permute.segment * 8 > config.seq_k) permute.segment /= 2;
  SP_RETURN_IF_ERROR(args.get_int("budget", 1, 1 << 20, &budget));
  SP_RETURN_IF_ERROR(args.get_double("skip-target", 0.01, 0.99, &skip_target));
  SP_RETURN_IF_ERROR(args.get_double("density-target", 0.01, 1, &density_target));
  SP_RETURN_IF_ERROR(args.get_int("segment", 1, 1 << 20, &permute.segment));
  SP_RETURN_IF_ERROR(args.get_double("tau", 0, 1, &permute.tau));
  RunOptions options;
  Backend asked = Backend::kCPU;
  SP_RETURN_IF_ERROR(parse_backend(args.get("backend", "auto"), &asked));
  // The table's decisions come from a host backend; a CUDA run is timed beside it.
  options.backend = asked == Backend::kReference ? Backend::kReference : Backend::kCPU;
  SP_RETURN_IF_ERROR(args.get_int("threads", 0, 4096, &options.num_threads));
  options.collect_decisions = true;
  RunOptions gpu_options = options;
  gpu_options.backend = Backend::kCUDA;
  const bool on_gpu = asked == Backend::kCUDA;
  int map_head = 0;
  SP_RETURN_IF_ERROR(args.get_int("map-head", 0, config.h_q - 1, &map_head));
  const std::string map_policy = args.get("map-policy", "exact_gate");
  if (map_policy != "exact_gate" && map_policy != "softmax_skip" &&
      map_policy != "estimate_select" && map_policy != "estimate_select+mc") {
    return invalid_argument(
        "--map-policy: expected exact_gate, softmax_skip, estimate_select or "
        "estimate_select+mc, got '" +
        map_policy + "'");
  }

  const Stopwatch total;
  constexpr int kPolicies =
      6;  // dense, exact_gate, softmax_skip, estimate_select (x2), permute_stop
  Progress progress("demo", 5 + kPolicies);
  progress.step("generating inputs (seed " + std::to_string(config.seed) +
                ") and calibration "
                "inputs (seed " +
                std::to_string(config.seed + 1) + ")");
  HostTensor q, k, v, cq, ck, cv;
  SP_RETURN_IF_ERROR(generate(config, &q, &k, &v));
  GeneratorConfig cal_config = config;
  cal_config.seed = config.seed + 1;
  SP_RETURN_IF_ERROR(generate(cal_config, &cq, &ck, &cv));
  AttentionProblem problem;
  problem.q = q.view();
  problem.k = k.view();
  problem.v = v.view();
  AttentionProblem cal_problem;
  cal_problem.q = cq.view();
  cal_problem.k = ck.view();
  cal_problem.v = cv.view();
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));

  progress.step("calibrating exact_gate (budget " + std::to_string(budget) + ")");
  ExactGateCalibrator gate_cal(1, config.h_q, {budget}, block, block);
  SP_RETURN_IF_ERROR(gate_cal.add(0, cal_problem));
  const ThresholdTable table = gate_cal.finish();
  HostTensor thresholds = table.slice(0, 0);
  progress.step("calibrating softmax_skip (skip " + fmt(skip_target) + ")");
  SoftmaxSkipCalibrator skip_cal(1, block, block);
  SP_RETURN_IF_ERROR(skip_cal.add(0, cal_problem));
  double a = 0;
  SP_RETURN_IF_ERROR(skip_cal.factor_for(skip_target, 0, &a));
  EstimateSelectParams select;
  select.block = block;
  if (density_target == 0) {
    // alpha > 1 keeps only the forced blocks: their density is the floor of any target.
    progress.step("measuring estimate_select's forced blocks");
    EstimateSelectParams forced = select;
    forced.alpha = 2;
    HostTensor o(cq.dtype(), cq.shape());
    HostTensor lse(DType::kFP32, {shape.batch, shape.h_q, shape.max_seq_q()});
    RunStats forced_stats;
    SP_RETURN_IF_ERROR(
        run(cal_problem, forced, AttentionOutput{o.view(), lse.view()}, options, &forced_stats));
    density_target = std::min(1.0, forced_stats.density() + 0.15);
  } else {
    progress.step("estimate_select target density " + fmt(density_target));
  }
  progress.step("calibrating estimate_select (density " + fmt(density_target, 2) + ")");
  EstimateSelectCalibrator select_cal(1, select);
  SP_RETURN_IF_ERROR(select_cal.add(0, cal_problem));
  SP_RETURN_IF_ERROR(select_cal.alpha_for(density_target, 0, &select.alpha));

  std::vector<Entry> entries;
  entries.push_back(entry("dense", "", DenseParams{}));
  ExactGateParams gate;
  gate.block_q = gate.block_k = block;
  gate.thresholds = thresholds.view();
  entries.push_back(entry("exact_gate", "budget=" + std::to_string(budget), gate));
  SoftmaxSkipParams skip;
  skip.block_q = skip.block_k = block;
  skip.a = a;
  entries.push_back(entry("softmax_skip", "a=" + fmt(a, 4) + " (skip " + fmt(skip_target) + ")", skip));
  const std::string alpha =
      "alpha=" + fmt(select.alpha, 3) + " (density " + fmt(density_target, 2) + ")";
  entries.push_back(entry("estimate_select", alpha, select));
  EstimateSelectParams corrected = select;
  corrected.mean_correction = true;
  entries.push_back(entry("estimate_select+mc", "alpha=" + fmt(select.alpha, 3) + ", mean correction",
                          corrected));
  entries.push_back(entry("permute_stop", "segment=" + std::to_string(permute.segment) + " tau=" + fmt(permute.tau),
                          permute));

  std::vector<HostTensor> outputs, gpu_outputs;
  for (Entry& e : entries) {
    progress.step("running " + e.label + (on_gpu ? " (cpu, then cuda)" : ""));
    HostTensor o(q.dtype(), q.shape());
    HostTensor lse(DType::kFP32, {shape.batch, shape.h_q, shape.max_seq_q()});
    const Stopwatch timer;
    SP_RETURN_IF_ERROR(run(problem, e.policy, AttentionOutput{o.view(), lse.view()}, options,
                           &e.stats, &e.decisions));
    e.seconds = timer.seconds();
    outputs.push_back(std::move(o));
    if (!on_gpu) continue;
    if (const Status can = can_run(problem, e.policy, Backend::kCUDA); !can.ok()) {
      e.gpu_skipped = can.message();
      continue;
    }
    HostTensor go(q.dtype(), q.shape());
    HostTensor glse(DType::kFP32, {shape.batch, shape.h_q, shape.max_seq_q()});
    RunStats gpu_stats;
    Decisions gpu_decisions;
    const AttentionOutput gpu_out{go.view(), glse.view()};
    SP_RETURN_IF_ERROR(run(problem, e.policy, gpu_out, gpu_options));  // warm-up (module loading, caches)
    SP_RETURN_IF_ERROR(run(problem, e.policy, gpu_out, gpu_options, &gpu_stats, &gpu_decisions));
    e.on_gpu = true;
    e.gpu_ms = gpu_stats.execution.device_ms;
    e.gpu_differ = decisions_differ(e.decisions, gpu_decisions);
    gpu_outputs.push_back(std::move(go));
  }
  progress.done();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    entries[i].error = compare(outputs[i], outputs[0]);
    if (entries[i].on_gpu) entries[i].gpu_error = compare(gpu_outputs[i], outputs[0]);
  }
  const double wall = total.seconds();

  const Entry* mapped = nullptr;
  std::vector<const Entry*> block_entries;
  for (const Entry& e : entries) {
    if (e.label == map_policy) mapped = &e;
    if (e.label != "dense" && e.label != "permute_stop" && e.decisions.kept.batch > 0) {
      block_entries.push_back(&e);
    }
  }
  if (args.has("plot"))
    SP_RETURN_IF_ERROR(write_plot(args.get("plot"), shape, block_entries, map_head));

  if (args.has("json")) {
    JsonWriter json;
    json.begin_object()
        .key("config")
        .begin_object()
        .key("seq")
        .value(config.seq_q)
        .key("heads_q")
        .value(config.h_q)
        .key("heads_kv")
        .value(config.h_kv)
        .key("dim")
        .value(config.d)
        .key("dtype")
        .value(dtype_name(config.dtype))
        .key("seed")
        .value(static_cast<std::int64_t>(config.seed))
        .key("calibration_seed")
        .value(static_cast<std::int64_t>(cal_config.seed))
        .key("peakedness")
        .value(config.peakedness)
        .key("backend")
        .value(backend_name(options.backend))
        .key("gpu")
        .value(on_gpu)
        .end_object();
    json.key("policies").begin_array();
    for (const Entry& e : entries) {
      json.begin_object()
          .key("policy")
          .value(e.label)
          .key("settings")
          .value(e.settings)
          .key("description")
          .value(describe(e.policy))
          .key("density")
          .value(e.stats.density())
          .key("pair_density")
          .value(e.stats.pair_density())
          .key("rel_l2")
          .value(e.error.rel_l2)
          .key("max_abs")
          .value(e.error.max_abs)
          .key("seconds")
          .value(e.seconds);
      if (e.on_gpu) {
        json.key("gpu_ms")
            .value(e.gpu_ms)
            .key("gpu_rel_l2")
            .value(e.gpu_error.rel_l2)
            .key("gpu_decisions_differ")
            .value(e.gpu_differ);
      }
      json.end_object();
    }
    json.end_array().key("wall_seconds").value(wall).end_object();
    std::cout << json.str() << "\n";
    return Status::ok_status();
  }

  std::cout << "sparseprefill demo: generator seq=" << config.seq_q << " h_q=" << config.h_q
            << " h_kv=" << config.h_kv << " d=" << config.d << " " << dtype_name(config.dtype)
            << " seed=" << config.seed << " peakedness=" << fmt(config.peakedness) << ", causal, "
            << block << "x" << block << " blocks, backend " << backend_name(options.backend)
            << (on_gpu ? " (decisions) and cuda (gpu_ms)" : "")
            << "; calibrated on seed " << cal_config.seed << "\n\n";
  if (!on_gpu) {
    std::printf("%-19s %-32s %8s %10s %10s %10s\n", "policy", "settings", "density", "rel_l2",
                "max_abs", "time_ms");
  } else {
    std::printf("%-19s %-32s %8s %10s %10s %10s %10s %10s  %s\n", "policy", "settings", "density", "rel_l2",
                "max_abs", "cpu_ms", "gpu_ms", "gpu_rel_l2", "gpu decisions");
  }
  for (const Entry& e : entries) {
    std::printf("%-19s %-32s %8.3f %10.2e %10.2e %10.1f", e.label.c_str(), e.settings.c_str(),
                e.stats.density(), e.error.rel_l2, e.error.max_abs, e.seconds * 1e3);
    if (e.on_gpu) {
      const std::string same = e.gpu_differ == 0 ? "same" : std::to_string(e.gpu_differ) + " differ";
      std::printf(" %10.3f %10.2e  %s", e.gpu_ms, e.gpu_error.rel_l2, same.c_str());
    } else if (on_gpu) {
      std::printf(" %10s %10s  %s", "-", "-", "not run (see below)");
    }
    std::printf("\n");
  }
  for (const Entry& e : entries) {
    if (!e.gpu_skipped.empty()) std::cout << e.label << " on cuda: " << e.gpu_skipped << "\n";
  }
  std::fflush(stdout);
  if (mapped != nullptr && mapped->decisions.kept.batch > 0) {
    const char* env = std::getenv("COLUMNS");
    const int columns = env != nullptr && std::atoi(env) > 0 ? std::atoi(env) : 80;
    std::cout << "\nkept blocks of " << map_policy << ", query head " << map_head << " (density "
              << fmt(mapped->stats.head_density(0, map_head), 3)
              << "): '#' kept, ':' partly kept, '.' skipped, ' ' not visible\n";
    print_text_map(head_map(shape, *mapped, map_head), mapped->decisions.kept.num_q_blocks,
                   mapped->decisions.kept.num_k_blocks, columns);
  }
  if (args.has("plot")) {
    std::cout << "\nwrote " << args.get("plot") << " (panels:";
    for (const Entry* e : block_entries) std::cout << " " << e->label;
    std::cout << "; head " << map_head << ")\n";
  }
  std::cout << "\ntotal " << fmt(wall, 3) << " s\n";
  return Status::ok_status();
}

}  // namespace

int demo_main(int argc, char** argv, int first) {
  Args args;
  if (Status s = Args::parse(demo_flags(), argc, argv, first, &args); !s.ok()) {
    return report_error("demo", s);
  }
  if (args.has("help")) {
    std::cout << kDemoHelp << format_flags(demo_flags()) << "\n" << kExitCodesHelp;
    return kExitOk;
  }
  const Status s = demo_command(args);
  return s.ok() ? kExitOk : report_error("demo", s);
}

}  // namespace sparseprefill::cli
