// SPDX-License-Identifier: Apache-2.0
// `sparseprefill run`: one policy over q, k, v read from a safetensors file; writes o, lse and
// the policy's decisions to another safetensors file.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "commands.h"
#include "common.h"

namespace sparseprefill::cli {

namespace {

const std::vector<Flag>& run_flags() {
  static const std::vector<Flag> flags = {
      {"input", "IN.safetensors",
       "tensors q, k, v (and optional int32 cu_seqlens_q, cu_seqlens_k)"},
      {"policy", "NAME", "dense, exact_gate, softmax_skip, estimate_select or permute_stop"},
      {"set", "KEY=VALUE", "a policy parameter, e.g. --set alpha=0.05", true},
      {"calibration", "CAL.safetensors", "a calibration file (sparseprefill calibrate)"},
      {"thresholds", "CAL.safetensors", "same as --calibration"},
      {"layer", "L", "the calibration layer to use (default 0)"},
      {"budget", "K", "exact_gate: the calibrated budget whose thresholds to use"},
      {"skip-target", "F", "softmax_skip: use the calibrated a of this target skip fraction"},
      {"density-target", "F", "estimate_select: use the calibrated alpha of this density"},
      {"output", "OUT.safetensors", "where o, lse and the decisions go"},
      {"backend", "NAME", "auto (default: cuda when a GPU is present, else cpu), cpu, reference or cuda"},
      {"threads", "T", "CPU threads (default: every core)"},
      {"scale", "X", "softmax scale (default 1/sqrt(d))"},
      {"non-causal", "", "attend to every key (dense, exact_gate, softmax_skip only)"},
  };
  return flags;
}

const char* const kRunHelp =
    "Usage: sparseprefill run --input IN.safetensors --policy NAME [--set KEY=VALUE ...]\n"
    "                         [--calibration CAL.safetensors --layer L (--budget K |\n"
    "                          --skip-target F | --density-target F)] --output OUT.safetensors\n"
    "\n"
    "Runs one attention call. q is [b, s_q, h_q, d] (or varlen [total_q, h_q, d] with\n"
    "cu_seqlens_q), k and v [b, s_k, h_kv, d] (or varlen with cu_seqlens_k); bf16, fp16 or fp32.\n"
    "Writes o (q's shape and dtype), lse (fp32 [b, h_q, s_q] or [h_q, total_q]) and the\n"
    "decisions: kept and corrected (int32 block maps [b, heads, q_blocks, k_blocks]; heads are\n"
    "KV heads when metadata kept_heads = kv), permute_stop's tiles (int32 [n, 6]: batch, head,\n"
    "segment, tile, chunks_visited, chunks_total) and query_order (int32 [b, h_q, max s_q]).\n"
    "Metadata: policy, density, pair_density, backend. The output is written atomically.\n"
    "\n";

HostTensor int32_tensor(std::vector<std::int64_t> shape, const std::vector<std::int32_t>& data) {
  HostTensor t(DType::kInt32, std::move(shape));
  std::copy(data.begin(), data.end(), t.as<std::int32_t>());
  return t;
}

HostTensor block_map(const BlockMask& mask) {
  std::vector<std::int32_t> map;
  for (std::uint8_t x : mask.to_dense()) map.push_back(x);
  return int32_tensor({mask.batch, mask.heads, mask.num_q_blocks, mask.num_k_blocks}, map);
}

// Index of `value` in `list`, or an error naming the flag and the calibrated values.
template <class T>
Status find_calibrated(const std::string& flag, const std::vector<T>& list, double value,
                       int* index) {
  std::string have;
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (std::fabs(static_cast<double>(list[i]) - value) <= 1e-6 * std::max(1.0, std::fabs(value))) {
      *index = static_cast<int>(i);
      return Status::ok_status();
    }
    have += (i ? ", " : "") + fmt(static_cast<double>(list[i]), 6);
  }
  return invalid_argument(
      "--" + flag + ": " + fmt(value, 6) +
      " is not in the calibration file (calibrated: " + (have.empty() ? "none" : have) + ")");
}

// Applies the calibration file's values to `policy` (thresholds, a or alpha). `thresholds`
// owns the exact_gate table the policy's view points to.
Status apply_calibration(const Args& args, Policy* policy, HostTensor* thresholds) {
  const std::string path = args.get("calibration", args.get("thresholds"));
  const bool wants = args.has("budget") || args.has("skip-target") || args.has("density-target");
  if (path.empty()) {
    if (wants)
      return invalid_argument("--budget/--skip-target/--density-target: need --calibration");
    if (std::holds_alternative<ExactGateParams>(*policy)) {
      return invalid_argument(
          "--calibration: required by exact_gate (thresholds from "
          "sparseprefill calibrate, with --budget K)");
    }
    return Status::ok_status();
  }
  Calibration cal;
  if (Status s = load_calibration(path, &cal); !s.ok()) {
    return s.message().find(path) != std::string::npos
               ? s
               : Status(s.code(), path + ": " + s.message());
  }
  int layer = 0;
  SP_RETURN_IF_ERROR(args.get_int("layer", 0, 1 << 20, &layer));
  if (auto* gate = std::get_if<ExactGateParams>(policy)) {
    if (!args.has("budget"))
      return invalid_argument("--budget: required by exact_gate with --calibration");
    double budget = 0;
    SP_RETURN_IF_ERROR(args.get_double("budget", 0, 1e9, &budget));
    const ThresholdTable& t = cal.exact_gate;
    if (layer >= t.layers) {
      return invalid_argument("--layer: expected < " + std::to_string(t.layers) +
                              " (the file's exact_gate layers), got " + std::to_string(layer));
    }
    int bi = 0;
    SP_RETURN_IF_ERROR(find_calibrated("budget", t.budgets, budget, &bi));
    *thresholds = t.slice(layer, bi);
    gate->thresholds = thresholds->view();
    gate->block_q = t.block_q;
    gate->block_k = t.block_k;
  } else if (auto* skip = std::get_if<SoftmaxSkipParams>(policy)) {
    if (!args.has("skip-target"))
      return invalid_argument("--skip-target: required by softmax_skip with --calibration");
    double target = 0;
    SP_RETURN_IF_ERROR(args.get_double("skip-target", 0, 1, &target));
    if (layer >= cal.layers) {
      return invalid_argument("--layer: expected < " + std::to_string(cal.layers) + ", got " +
                              std::to_string(layer));
    }
    int ti = 0;
    SP_RETURN_IF_ERROR(find_calibrated("skip-target", cal.skip_targets, target, &ti));
    skip->a = cal.skip_a[static_cast<std::size_t>(layer) * cal.skip_targets.size() +
                         static_cast<std::size_t>(ti)];
    skip->block_q = cal.skip_block_q;
    skip->block_k = cal.skip_block_k;
  } else if (auto* select = std::get_if<EstimateSelectParams>(policy)) {
    if (!args.has("density-target"))
      return invalid_argument("--density-target: required by estimate_select with --calibration");
    double target = 0;
    SP_RETURN_IF_ERROR(args.get_double("density-target", 0, 1, &target));
    if (layer >= cal.layers) {
      return invalid_argument("--layer: expected < " + std::to_string(cal.layers) + ", got " +
                              std::to_string(layer));
    }
    int ti = 0;
    SP_RETURN_IF_ERROR(find_calibrated("density-target", cal.density_targets, target, &ti));
    const bool correction = select->mean_correction;
    *select = cal.estimate_base;
    select->mean_correction = correction;
    select->alpha = cal.alpha[static_cast<std::size_t>(layer) * cal.density_targets.size() +
                              static_cast<std::size_t>(ti)];
  } else {
    return invalid_argument("--calibration: the policy " + std::string(policy_name(*policy)) +
                            " takes no calibrated values");
  }
  return Status::ok_status();
}

Status parse_settings(const Args& args, std::vector<std::pair<std::string, std::string>>* out) {
  for (const std::string& kv : args.all("set")) {
    const std::size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return invalid_argument("--set: expected KEY=VALUE, got '" + kv + "'");
    }
    out->emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return Status::ok_status();
}

Status run_command(const Args& args) {
  for (const char* required : {"input", "policy", "output"}) {
    if (!args.has(required)) return invalid_argument(std::string("--") + required + ": required");
  }
  RunOptions options;
  options.backend = Backend::kCPU;
  SP_RETURN_IF_ERROR(parse_backend(args.get("backend", "auto"), &options.backend));
  SP_RETURN_IF_ERROR(args.get_int("threads", 0, 4096, &options.num_threads));
  options.collect_decisions = true;

  std::vector<std::pair<std::string, std::string>> settings;
  SP_RETURN_IF_ERROR(parse_settings(args, &settings));
  Policy policy;
  SP_RETURN_IF_ERROR(parse_policy(args.get("policy"), settings, &policy));
  HostTensor thresholds;
  SP_RETURN_IF_ERROR(apply_calibration(args, &policy, &thresholds));

  const std::string input = args.get("input");
  SafetensorsFile in;
  SP_RETURN_IF_ERROR(read_input(input, &in));
  const HostTensor *q = nullptr, *k = nullptr, *v = nullptr, *cu_q = nullptr, *cu_k = nullptr;
  SP_RETURN_IF_ERROR(find_tensor(in, input, "q", true, &q));
  SP_RETURN_IF_ERROR(find_tensor(in, input, "k", true, &k));
  SP_RETURN_IF_ERROR(find_tensor(in, input, "v", true, &v));
  SP_RETURN_IF_ERROR(find_tensor(in, input, "cu_seqlens_q", false, &cu_q));
  SP_RETURN_IF_ERROR(find_tensor(in, input, "cu_seqlens_k", false, &cu_k));

  AttentionProblem problem;
  problem.q = q->view();
  problem.k = k->view();
  problem.v = v->view();
  if (cu_q != nullptr) problem.cu_seqlens_q = cu_q->view();
  if (cu_k != nullptr) problem.cu_seqlens_k = cu_k->view();
  problem.causal = !args.has("non-causal");
  SP_RETURN_IF_ERROR(args.get_double("scale", 0, 1e6, &problem.scale));
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));

  HostTensor o(q->dtype(), q->shape());
  HostTensor lse = shape.varlen_q
                       ? HostTensor(DType::kFP32, {shape.h_q, shape.total_q()})
                       : HostTensor(DType::kFP32, {shape.batch, shape.h_q, shape.max_seq_q()});
  AttentionOutput output{o.view(), lse.view()};
  RunStats stats;
  Decisions decisions;
  const Stopwatch timer;
  SP_RETURN_IF_ERROR(run(problem, policy, output, options, &stats, &decisions));
  const double seconds = timer.seconds();

  SafetensorsFile out;
  out.tensors["o"] = std::move(o);
  out.tensors["lse"] = std::move(lse);
  if (decisions.kept.batch > 0) {
    out.tensors["kept"] = block_map(decisions.kept);
    out.metadata["kept_heads"] = decisions.kept.per_kv_head ? "kv" : "query";
    out.metadata["block_q"] = std::to_string(decisions.kept.block_q);
    out.metadata["block_k"] = std::to_string(decisions.kept.block_k);
  }
  if (decisions.corrected.batch > 0) out.tensors["corrected"] = block_map(decisions.corrected);
  if (!decisions.tiles.empty()) {
    std::vector<std::int32_t> table;
    for (const PermuteTile& t : decisions.tiles) {
      table.insert(table.end(),
                   {t.batch, t.head, t.segment, t.tile, t.chunks_visited, t.chunks_total});
    }
    out.tensors["tiles"] =
        int32_tensor({static_cast<std::int64_t>(decisions.tiles.size()), 6}, table);
  }
  if (!decisions.query_order.empty()) {
    out.tensors["query_order"] =
        int32_tensor({shape.batch, shape.h_q, shape.max_seq_q()}, decisions.query_order);
  }
  out.metadata["policy"] = describe(policy);
  out.metadata["density"] = fmt(stats.density(), 9);
  out.metadata["pair_density"] = fmt(stats.pair_density(), 9);
  out.metadata["backend"] = backend_name(options.backend);
  out.metadata["input"] = input;
  const std::string output_path = args.get("output");
  SP_RETURN_IF_ERROR(write_safetensors(output_path, out));

  if (args.has("json")) {
    JsonWriter json;
    json.begin_object()
        .key("policy")
        .value(describe(policy))
        .key("backend")
        .value(backend_name(options.backend))
        .key("density")
        .value(stats.density())
        .key("pair_density")
        .value(stats.pair_density())
        .key("seconds")
        .value(seconds)
        .key("device_ms")
        .value(stats.execution.device_ms)
        .key("execution")
        .value(stats.execution.to_string())
        .key("output")
        .value(output_path)
        .end_object();
    std::cout << json.str() << "\n";
  } else {
    std::cout << describe(policy) << "\n"
              << "density " << fmt(stats.density(), 4) << " (pairs " << fmt(stats.pair_density(), 4)
              << "), " << fmt(seconds * 1e3, 4) << " ms on " << stats.execution.to_string()
              << (options.backend == Backend::kCUDA ? " (device " + fmt(stats.execution.device_ms, 4) + " ms)" : "")
              << "; wrote " << output_path << "\n";
  }
  return Status::ok_status();
}

}  // namespace

int run_main(int argc, char** argv, int first) {
  Args args;
  if (Status s = Args::parse(run_flags(), argc, argv, first, &args); !s.ok()) {
    return report_error("run", s);
  }
  if (args.has("help")) {
    std::cout << kRunHelp << format_flags(run_flags()) << "\n" << kExitCodesHelp;
    return kExitOk;
  }
  const Status s = run_command(args);
  return s.ok() ? kExitOk : report_error("run", s);
}

}  // namespace sparseprefill::cli
