// SPDX-License-Identifier: Apache-2.0
// `sparseprefill calibrate`: exact_gate thresholds, softmax_skip factors a and estimate_select
// alphas from Q/K samples (safetensors files or the generator), saved with save_calibration.
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "commands.h"
#include "common.h"

namespace sparseprefill::cli {

namespace {

const std::vector<Flag>& calibrate_flags() {
  static const std::vector<Flag> flags = {
      {"input", "SAMPLE.safetensors",
       "one sample: q_<layer>, k_<layer> for layers 0..L-1 (optional int32 cu_seqlens_q, "
       "cu_seqlens_k shared by the layers)",
       true},
      {"generate", "SPEC",
       "generated samples instead of --input, e.g. seq=8192,heads-q=8,heads-kv=2,dim=128,"
       "seed=1,samples=2,layers=1,peakedness=1,dtype=bf16"},
      {"budgets", "K,K,...", "exact_gate budgets (full blocks kept per query block)"},
      {"skip-targets", "F,F,...", "softmax_skip target skip fractions in (0, 1)"},
      {"density-targets", "F,F,...", "estimate_select target densities in (0, 1]"},
      {"block-q", "N", "exact_gate / softmax_skip query block (default 128)"},
      {"block-k", "N", "exact_gate / softmax_skip key block (default 128)"},
      {"block", "N", "estimate_select block (default 128)"},
      {"model", "NAME", "recorded in the file's metadata"},
      {"output", "CAL.safetensors", "the calibration file to write"},
  };
  return flags;
}

const char* const kCalibrateHelp =
    "Usage: sparseprefill calibrate (--input SAMPLE.safetensors ... | --generate SPEC)\n"
    "                               [--budgets K,...] [--skip-targets F,...]\n"
    "                               [--density-targets F,...] --output CAL.safetensors\n"
    "\n"
    "Fits the calibrated parameters of DESIGN.md §3 from Q/K samples: exact_gate thresholds\n"
    "per layer, budget, query head and query block position; softmax_skip's a per layer and\n"
    "target skip fraction; estimate_select's alpha per layer and target density. Each --input\n"
    "file is one sample holding q_<layer> [b, s_q, h_q, d] and k_<layer> [b, s_k, h_kv, d]\n"
    "(or varlen with cu_seqlens_q / cu_seqlens_k) for every layer 0..L-1. With --generate,\n"
    "sample s of layer l is the generator at seed + s * layers + l. At least one of\n"
    "--budgets, --skip-targets, --density-targets is required. Use the file with\n"
    "`sparseprefill run --calibration CAL.safetensors`.\n"
    "\n";

struct GenerateSpec {
  GeneratorConfig config;
  int samples = 1;
  int layers = 1;
};

Status parse_generate_spec(const std::string& spec, GenerateSpec* out) {
  GenerateSpec g;
  std::string rest = spec;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string item = rest.substr(0, comma);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    const std::size_t eq = item.find('=');
    if (eq == std::string::npos)
      return invalid_argument("--generate: expected KEY=VALUE, got '" + item + "'");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    std::int64_t n = 0;
    double x = 0;
    const auto want_int = [&](std::int64_t lo, std::int64_t hi, int* field) {
      if (!parse_int64(value, &n) || n < lo || n > hi) {
        return invalid_argument("--generate: " + key + ": expected an integer in [" +
                                std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
                                value + "'");
      }
      *field = static_cast<int>(n);
      return Status::ok_status();
    };
    if (key == "seq") {
      SP_RETURN_IF_ERROR(want_int(1, 1 << 20, &g.config.seq_q));
      g.config.seq_k = g.config.seq_q;
    } else if (key == "batch") {
      SP_RETURN_IF_ERROR(want_int(1, 1024, &g.config.batch));
    } else if (key == "heads-q") {
      SP_RETURN_IF_ERROR(want_int(1, 1024, &g.config.h_q));
    } else if (key == "heads-kv") {
      SP_RETURN_IF_ERROR(want_int(1, 1024, &g.config.h_kv));
    } else if (key == "dim") {
      SP_RETURN_IF_ERROR(want_int(8, 1024, &g.config.d));
    } else if (key == "samples") {
      SP_RETURN_IF_ERROR(want_int(1, 1 << 16, &g.samples));
    } else if (key == "layers") {
      SP_RETURN_IF_ERROR(want_int(1, 1 << 12, &g.layers));
    } else if (key == "seed") {
      if (!parse_int64(value, &n) || n < 0)
        return invalid_argument("--generate: seed: expected a non-negative integer, got '" + value +
                                "'");
      g.config.seed = static_cast<std::uint64_t>(n);
    } else if (key == "peakedness") {
      if (!parse_finite_double(value, &x) || x < 0)
        return invalid_argument("--generate: peakedness: expected a finite number >= 0, got '" +
                                value + "'");
      g.config.peakedness = x;
    } else if (key == "dtype") {
      if (value == "bf16")
        g.config.dtype = DType::kBF16;
      else if (value == "fp16")
        g.config.dtype = DType::kFP16;
      else if (value == "fp32")
        g.config.dtype = DType::kFP32;
      else
        return invalid_argument("--generate: dtype: expected bf16, fp16 or fp32, got '" + value +
                                "'");
    } else {
      return invalid_argument(
          "--generate: unknown key '" + key +
          "' (expected seq, batch, heads-q, heads-kv, dim, seed, samples, layers, "
          "peakedness, dtype)");
    }
  }
  *out = g;
  return Status::ok_status();
}

// One sample's tensors for every layer. Views point into `file` or `generated`.
struct Sample {
  SafetensorsFile file;
  std::vector<AttentionProblem> layers;
};

Status load_sample(const std::string& path, int* layers, Sample* sample) {
  SP_RETURN_IF_ERROR(read_input(path, &sample->file));
  const HostTensor *cu_q = nullptr, *cu_k = nullptr;
  SP_RETURN_IF_ERROR(find_tensor(sample->file, path, "cu_seqlens_q", false, &cu_q));
  SP_RETURN_IF_ERROR(find_tensor(sample->file, path, "cu_seqlens_k", false, &cu_k));
  int count = 0;
  while (sample->file.tensors.count("q_" + std::to_string(count)) > 0) ++count;
  if (count == 0)
    return invalid_argument(path + ": missing tensor 'q_0' (expected q_<layer>, k_<layer>)");
  if (*layers > 0 && count != *layers) {
    return invalid_argument(path + ": expected " + std::to_string(*layers) +
                            " layers (as the first sample), got " + std::to_string(count));
  }
  *layers = count;
  for (int l = 0; l < count; ++l) {
    const HostTensor *q = nullptr, *k = nullptr;
    SP_RETURN_IF_ERROR(find_tensor(sample->file, path, "q_" + std::to_string(l), true, &q));
    SP_RETURN_IF_ERROR(find_tensor(sample->file, path, "k_" + std::to_string(l), true, &k));
    AttentionProblem p;
    p.q = q->view();
    p.k = k->view();
    p.v = p.k;  // the calibrators read q and k only
    if (cu_q != nullptr) p.cu_seqlens_q = cu_q->view();
    if (cu_k != nullptr) p.cu_seqlens_k = cu_k->view();
    ProblemShape shape;
    if (Status s = validate_problem(p, nullptr, &shape); !s.ok()) {
      return {s.code(), path + ": layer " + std::to_string(l) + ": " + s.message()};
    }
    sample->layers.push_back(p);
  }
  return Status::ok_status();
}

Status calibrate_command(const Args& args) {
  if (!args.has("output")) return invalid_argument("--output: required");
  if (args.has("input") == args.has("generate")) {
    return invalid_argument("--input/--generate: expected exactly one of them");
  }
  std::vector<int> budgets;
  std::vector<double> skip_targets, density_targets;
  SP_RETURN_IF_ERROR(args.get_int_list("budgets", 1, 1 << 20, &budgets));
  SP_RETURN_IF_ERROR(args.get_double_list("skip-targets", 0, 1, &skip_targets));
  SP_RETURN_IF_ERROR(args.get_double_list("density-targets", 0, 1, &density_targets));
  if (budgets.empty() && skip_targets.empty() && density_targets.empty()) {
    return invalid_argument("--budgets/--skip-targets/--density-targets: expected at least one");
  }
  for (std::size_t i = 1; i < budgets.size(); ++i) {
    if (budgets[i] <= budgets[i - 1])
      return invalid_argument("--budgets: expected strictly ascending values");
  }
  for (const auto* list : {&skip_targets, &density_targets}) {
    for (std::size_t i = 1; i < list->size(); ++i) {
      if ((*list)[i] <= (*list)[i - 1]) {
        return invalid_argument(std::string("--") + (list == &skip_targets ? "skip" : "density") +
                                "-targets: expected strictly ascending values");
      }
    }
  }
  int block_q = 128, block_k = 128;
  EstimateSelectParams estimate;
  SP_RETURN_IF_ERROR(args.get_int("block-q", 1, 1 << 16, &block_q));
  SP_RETURN_IF_ERROR(args.get_int("block-k", 1, 1 << 16, &block_k));
  SP_RETURN_IF_ERROR(args.get_int("block", 1, 1 << 16, &estimate.block));

  // Samples: loaded one at a time from files, or generated on the fly.
  const std::vector<std::string> inputs = args.all("input");
  GenerateSpec spec;
  if (args.has("generate")) SP_RETURN_IF_ERROR(parse_generate_spec(args.get("generate"), &spec));
  const int samples = args.has("input") ? static_cast<int>(inputs.size()) : spec.samples;
  int layers = args.has("input") ? 0 : spec.layers;
  int heads = spec.config.h_q;

  std::vector<Sample> loaded(static_cast<std::size_t>(samples));
  if (args.has("input")) {
    for (int s = 0; s < samples; ++s) {
      SP_RETURN_IF_ERROR(load_sample(inputs[static_cast<std::size_t>(s)], &layers,
                                     &loaded[static_cast<std::size_t>(s)]));
    }
    ProblemShape shape;
    SP_RETURN_IF_ERROR(validate_problem(loaded[0].layers[0], nullptr, &shape));
    heads = shape.h_q;
  }

  CalibrationTargets targets;
  targets.layers = layers;
  targets.heads = heads;
  targets.block_q = block_q;
  targets.block_k = block_k;
  targets.budgets = budgets;
  targets.skip_targets = skip_targets;
  targets.density_targets = density_targets;
  targets.estimate = estimate;
  std::unique_ptr<CalibrationRun> run;
  SP_RETURN_IF_ERROR(CalibrationRun::create(targets, &run));
  const bool gate = !budgets.empty(), skip = !skip_targets.empty(), select = !density_targets.empty();

  Progress progress("calibrate", samples * layers);
  for (int s = 0; s < samples; ++s) {
    for (int l = 0; l < layers; ++l) {
      progress.step("sample " + std::to_string(s) + " layer " + std::to_string(l));
      HostTensor q, k, v;
      AttentionProblem p;
      if (args.has("input")) {
        p = loaded[static_cast<std::size_t>(s)].layers[static_cast<std::size_t>(l)];
      } else {
        GeneratorConfig c = spec.config;
        c.seed = spec.config.seed +
                 static_cast<std::uint64_t>(s) * static_cast<std::uint64_t>(layers) +
                 static_cast<std::uint64_t>(l);
        SP_RETURN_IF_ERROR(generate(c, &q, &k, &v));
        p.q = q.view();
        p.k = k.view();
        p.v = v.view();
      }
      SP_RETURN_IF_ERROR(run->add(l, p));
    }
  }
  progress.done();

  Calibration cal;
  SP_RETURN_IF_ERROR(run->finish(&cal));
  cal.metadata["source"] = args.has("input") ? "files" : "generator " + args.get("generate");
  cal.metadata["samples"] = std::to_string(samples);
  cal.metadata["tool"] = std::string("sparseprefill calibrate ") + SPARSEPREFILL_VERSION_STRING;
  if (args.has("model")) cal.metadata["model"] = args.get("model");
  const std::string output = args.get("output");
  SP_RETURN_IF_ERROR(save_calibration(output, cal));

  if (args.has("json")) {
    JsonWriter json;
    json.begin_object().key("output").value(output).key("layers").value(layers);
    json.key("samples").value(samples).key("heads").value(heads);
    json.key("budgets").begin_array();
    for (int b : budgets) json.value(b);
    json.end_array().key("skip_a").begin_array();
    for (float a : cal.skip_a) json.value(static_cast<double>(a));
    json.end_array().key("alpha").begin_array();
    for (float a : cal.alpha) json.value(static_cast<double>(a));
    json.end_array().end_object();
    std::cout << json.str() << "\n";
  } else {
    std::cout << "calibrated " << layers << " layer(s) from " << samples << " sample(s)";
    if (gate) std::cout << "; exact_gate budgets " << args.get("budgets");
    if (skip) std::cout << "; softmax_skip a per target " << args.get("skip-targets");
    if (select) std::cout << "; estimate_select alpha per target " << args.get("density-targets");
    std::cout << "\nwrote " << output << "\n";
    for (int l = 0; l < layers && (skip || select); ++l) {
      std::cout << "layer " << l << ":";
      for (std::size_t i = 0; i < cal.skip_targets.size(); ++i) {
        std::cout << " a(skip " << fmt(cal.skip_targets[i]) << ")="
                  << fmt(cal.skip_a[static_cast<std::size_t>(l) * cal.skip_targets.size() + i], 4);
      }
      for (std::size_t i = 0; i < cal.density_targets.size(); ++i) {
        std::cout << " alpha(density " << fmt(cal.density_targets[i]) << ")="
                  << fmt(cal.alpha[static_cast<std::size_t>(l) * cal.density_targets.size() + i],
                         4);
      }
      std::cout << "\n";
    }
  }
  return Status::ok_status();
}

}  // namespace

int calibrate_main(int argc, char** argv, int first) {
  Args args;
  if (Status s = Args::parse(calibrate_flags(), argc, argv, first, &args); !s.ok()) {
    return report_error("calibrate", s);
  }
  if (args.has("help")) {
    std::cout << kCalibrateHelp << format_flags(calibrate_flags()) << "\n" << kExitCodesHelp;
    return kExitOk;
  }
  const Status s = calibrate_command(args);
  return s.ok() ? kExitOk : report_error("calibrate", s);
}

}  // namespace sparseprefill::cli
