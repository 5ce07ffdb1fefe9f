// SPDX-License-Identifier: Apache-2.0
// The C ABI (include/sparseprefill/c_api.h) over the C++ API: converts the plain structs to
// TensorView/AttentionProblem/Policy, calls run(), and turns every error and exception into a
// status code plus a thread-local message.
#include "sparseprefill/c_api.h"

#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "sparseprefill/attention.h"
#include "sparseprefill/block_mask.h"
#include "sparseprefill/calibration.h"
#include "sparseprefill/generator.h"
#include "sparseprefill/plan.h"
#include "sparseprefill/policy.h"
#include "sparseprefill/problem.h"
#include "sparseprefill/types.h"

struct sp_policy {
  sparseprefill::Policy policy;
  std::string description;
};

// Decisions with their masks converted to CSR once, so views stay valid until the next fill.
struct sp_decisions {
  sparseprefill::Decisions decisions;
  struct Csr {
    std::vector<std::int32_t> indptr;
    std::vector<std::int32_t> indices;
  };
  Csr kept;
  Csr corrected;
  std::vector<sp_permute_tile> tiles;
};

struct sp_plan {
  sparseprefill::Plan plan;
  std::string description;
};

struct sp_calibrator {
  std::unique_ptr<sparseprefill::CalibrationRun> run;
};

namespace {

using sparseprefill::Status;
using sparseprefill::StatusCode;
using sparseprefill::TensorView;

// sp_status mirrors StatusCode so that codes pass through unchanged.
static_assert(SP_ERR_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(SP_ERR_UNSUPPORTED == static_cast<int>(StatusCode::kUnsupported));
static_assert(SP_ERR_IO == static_cast<int>(StatusCode::kIoError));
static_assert(SP_ERR_CORRUPT_DATA == static_cast<int>(StatusCode::kCorruptData));
static_assert(SP_ERR_CUDA == static_cast<int>(StatusCode::kCudaError));
static_assert(SP_ERR_INTERNAL == static_cast<int>(StatusCode::kInternal));

thread_local std::string t_last_error;

int finish(const Status& status) {
  if (status.ok()) {
    t_last_error.clear();
    return SP_OK;
  }
  t_last_error = status.message();
  return static_cast<int>(status.code());
}

int fail(StatusCode code, std::string message) { return finish(Status(code, std::move(message))); }

// Runs `body` (returning Status) so that no exception crosses the ABI.
template <class Body>
int guarded(Body&& body) {
  try {
    return finish(body());
  } catch (const std::bad_alloc&) {
    return fail(StatusCode::kInternal, "out of host memory");
  } catch (const std::exception& e) {
    return fail(StatusCode::kInternal, std::string("unexpected exception: ") + e.what());
  } catch (...) {
    return fail(StatusCode::kInternal, "unexpected exception of unknown type");
  }
}

Status to_view(const sp_tensor& t, const char* name, TensorView* out) {
  *out = TensorView{};
  if (t.rank == 0) {
    if (t.data != nullptr) {
      return sparseprefill::invalid_argument(std::string(name) +
                                             ": rank 0 (absent) but data is not NULL");
    }
    return Status::ok_status();
  }
  if (t.rank < 0 || t.rank > SP_MAX_RANK) {
    return sparseprefill::invalid_argument(std::string(name) + ": expected rank 1.." +
                                           std::to_string(SP_MAX_RANK) + ", got " +
                                           std::to_string(t.rank));
  }
  switch (t.dtype) {
    case SP_DTYPE_BF16: out->dtype = sparseprefill::DType::kBF16; break;
    case SP_DTYPE_FP16: out->dtype = sparseprefill::DType::kFP16; break;
    case SP_DTYPE_FP32: out->dtype = sparseprefill::DType::kFP32; break;
    case SP_DTYPE_INT32: out->dtype = sparseprefill::DType::kInt32; break;
    case SP_DTYPE_FP8_E4M3: out->dtype = sparseprefill::DType::kFP8E4M3; break;
    default:
      return sparseprefill::invalid_argument(std::string(name) +
                                             ": expected an sp_dtype code 0..4, got " +
                                             std::to_string(t.dtype));
  }
  switch (t.device_type) {
    case SP_DEVICE_CPU: out->device.kind = sparseprefill::DeviceKind::kCPU; break;
    case SP_DEVICE_CUDA: out->device.kind = sparseprefill::DeviceKind::kCUDA; break;
    default:
      return sparseprefill::invalid_argument(std::string(name) +
                                             ": expected device_type 0 (CPU) or 1 (CUDA), got " +
                                             std::to_string(t.device_type));
  }
  if (t.device_index < 0) {
    return sparseprefill::invalid_argument(std::string(name) +
                                           ": expected device_index >= 0, got " +
                                           std::to_string(t.device_index));
  }
  out->device.index = t.device_index;
  out->data = t.data;
  out->rank = t.rank;
  for (int i = 0; i < t.rank; ++i) {
    out->shape[i] = t.shape[i];
    out->stride[i] = t.stride[i];
  }
  return Status::ok_status();
}

Status to_problem(const sp_problem* p, sparseprefill::AttentionProblem* out) {
  if (p == nullptr) return sparseprefill::invalid_argument("problem: expected non-NULL");
  SP_RETURN_IF_ERROR(to_view(p->q, "q", &out->q));
  SP_RETURN_IF_ERROR(to_view(p->k, "k", &out->k));
  SP_RETURN_IF_ERROR(to_view(p->v, "v", &out->v));
  SP_RETURN_IF_ERROR(to_view(p->cu_seqlens_q, "cu_seqlens_q", &out->cu_seqlens_q));
  SP_RETURN_IF_ERROR(to_view(p->cu_seqlens_k, "cu_seqlens_k", &out->cu_seqlens_k));
  SP_RETURN_IF_ERROR(to_view(p->seqused_k, "seqused_k", &out->seqused_k));
  SP_RETURN_IF_ERROR(to_view(p->block_table, "block_table", &out->block_table));
  SP_RETURN_IF_ERROR(to_view(p->q_descale, "q_descale", &out->q_descale));
  SP_RETURN_IF_ERROR(to_view(p->k_descale, "k_descale", &out->k_descale));
  SP_RETURN_IF_ERROR(to_view(p->v_descale, "v_descale", &out->v_descale));
  out->causal = p->causal != 0;
  out->scale = p->scale;
  if (p->local != 0) {
    out->window_left = p->window_left;
    out->window_right = p->window_right;
  } else if (p->window_left != 0 || p->window_right != 0) {
    return sparseprefill::invalid_argument("window_left/window_right: set while local = 0 (no window); set local to "
                                           "1 for a window, or leave both 0");
  }
  out->attention_chunk = p->attention_chunk;
  out->softcap = p->softcap;
  return to_view(p->sinks, "sinks", &out->sinks);
}

Status to_backend(int32_t code, sparseprefill::Backend* out) {
  switch (code) {
    case SP_BACKEND_AUTO: *out = sparseprefill::Backend::kAuto; return Status::ok_status();
    case SP_BACKEND_REFERENCE: *out = sparseprefill::Backend::kReference; return Status::ok_status();
    case SP_BACKEND_CPU: *out = sparseprefill::Backend::kCPU; return Status::ok_status();
    case SP_BACKEND_CUDA: *out = sparseprefill::Backend::kCUDA; return Status::ok_status();
    default:
      return sparseprefill::invalid_argument("backend: expected an sp_backend code 0..3, got " +
                                             std::to_string(code));
  }
}

Status check_policy(const sp_policy* policy) {
  if (policy == nullptr) {
    return sparseprefill::invalid_argument("policy: expected a handle from sp_policy_create");
  }
  return Status::ok_status();
}

void add_head(sp_head_stats* sum, const sparseprefill::HeadStats& h) {
  sum->visible_blocks += h.visible_blocks;
  sum->kept_blocks += h.kept_blocks;
  sum->corrected_blocks += h.corrected_blocks;
  sum->visible_pairs += h.visible_pairs;
  sum->computed_pairs += h.computed_pairs;
}

// An ExecutionInfo string as a static one the C caller may keep (the strings are few: paths
// and instance names).
const char* interned(const std::string& s) {
  static std::mutex mutex;
  static std::set<std::string> strings;
  std::lock_guard<std::mutex> lock(mutex);
  return strings.insert(s).first->c_str();
}

void fill_stats(const sparseprefill::RunStats& rs, sp_stats* out) {
  out->total = sp_head_stats{};
  for (const auto& h : rs.heads) add_head(&out->total, h);
  out->density = rs.density();
  out->pair_density = rs.pair_density();
  out->batch = rs.batch;
  out->h_q = rs.h_q;
  out->num_heads = static_cast<std::int64_t>(rs.heads.size());
  out->path = interned(rs.execution.path);
  out->instance = interned(rs.execution.instance);
  out->decision_instance = interned(rs.execution.decision_instance);
  out->passes = rs.execution.passes;
  out->q_pack = rs.execution.q_pack;
  if (out->heads != nullptr && out->heads_capacity >= out->num_heads) {
    for (std::size_t i = 0; i < rs.heads.size(); ++i) {
      out->heads[i] = sp_head_stats{};
      add_head(&out->heads[i], rs.heads[i]);
    }
  }
}

Status to_options(const sp_options* options, sparseprefill::RunOptions* out) {
  *out = sparseprefill::RunOptions{};
  if (options == nullptr) return Status::ok_status();
  SP_RETURN_IF_ERROR(to_backend(options->backend, &out->backend));
  if (options->num_threads < 0) {
    return sparseprefill::invalid_argument("options.num_threads: expected >= 0, got " +
                                           std::to_string(options->num_threads));
  }
  out->num_threads = options->num_threads;
  out->cuda_stream = options->cuda_stream;
  using Overrides = sparseprefill::ExecutionOverrides;
  const auto choice = [](std::int32_t v, const char* name, Overrides::Choice* c) -> Status {
    if (v < 0 || v > 2) {
      return sparseprefill::invalid_argument(std::string("options.") + name +
                                             ": expected 0 (auto), 1 (always) or 2 (never), got " + std::to_string(v));
    }
    *c = v == 1 ? Overrides::Choice::kAlways : v == 2 ? Overrides::Choice::kNever : Overrides::Choice::kAuto;
    return Status::ok_status();
  };
  if (options->cuda_path < 0 || options->cuda_path > 2) {
    return sparseprefill::invalid_argument("options.cuda_path: expected 0 (auto), 1 (portable) or 2 (hopper), got " +
                                           std::to_string(options->cuda_path));
  }
  out->overrides.cuda_path = options->cuda_path == 1   ? Overrides::CudaPath::kPortable
                             : options->cuda_path == 2 ? Overrides::CudaPath::kHopper
                                                       : Overrides::CudaPath::kAuto;
  SP_RETURN_IF_ERROR(choice(options->pack_gqa, "pack_gqa", &out->overrides.pack_gqa));
  SP_RETURN_IF_ERROR(choice(options->kv_staging, "kv_staging", &out->overrides.kv_staging));
  if (options->gate_passes < 0 || options->gate_passes > 2) {
    return sparseprefill::invalid_argument("options.gate_passes: expected 0 (auto), 1 or 2, got " +
                                           std::to_string(options->gate_passes));
  }
  out->overrides.gate_passes = options->gate_passes;
  return Status::ok_status();
}


Status to_output(const sp_output* output, sparseprefill::AttentionOutput* out) {
  if (output == nullptr) return sparseprefill::invalid_argument("output: expected non-NULL");
  SP_RETURN_IF_ERROR(to_view(output->o, "o", &out->o));
  return to_view(output->lse, "lse", &out->lse);
}

Status check_stats(const sp_stats* stats) {
  if (stats != nullptr && stats->heads_capacity < 0) {
    return sparseprefill::invalid_argument("stats.heads_capacity: expected >= 0, got " +
                                           std::to_string(stats->heads_capacity));
  }
  return Status::ok_status();
}

// Moves `d` into the handle and builds the CSR views of its masks.
void fill_decisions(sparseprefill::Decisions&& d, sp_decisions* out) {
  out->decisions = std::move(d);
  const sparseprefill::Decisions& dec = out->decisions;
  auto csr = [](const sparseprefill::BlockMask& m, sp_decisions::Csr* c) {
    c->indptr.clear();
    c->indices.clear();
    if (!m.full_count.empty()) m.to_csr(&c->indptr, &c->indices);
  };
  csr(dec.kept, &out->kept);
  csr(dec.corrected, &out->corrected);
  out->tiles.clear();
  out->tiles.reserve(dec.tiles.size());
  for (const auto& t : dec.tiles) {
    out->tiles.push_back(sp_permute_tile{t.batch, t.head, t.segment, t.tile, t.chunks_visited, t.chunks_total});
  }
}

// The optional outputs of a run or a select: stats and decisions requested when non-NULL.
Status finish_run(const sparseprefill::RunStats& rs, sparseprefill::Decisions&& d, sp_stats* stats,
                  sp_decisions* decisions) {
  if (stats != nullptr) fill_stats(rs, stats);
  if (decisions != nullptr) fill_decisions(std::move(d), decisions);
  return Status::ok_status();
}

}  // namespace

extern "C" {

int sp_policy_create(const char* name, const sp_setting* settings, int32_t num_settings,
                     sp_policy** out) {
  return guarded([&]() -> Status {
    if (out == nullptr) return sparseprefill::invalid_argument("out: expected non-NULL");
    *out = nullptr;
    if (name == nullptr) return sparseprefill::invalid_argument("name: expected a policy name");
    if (num_settings < 0 || (num_settings > 0 && settings == nullptr)) {
      return sparseprefill::invalid_argument(
          "settings: expected num_settings >= 0 and a non-NULL array when it is positive");
    }
    std::vector<std::pair<std::string, std::string>> kv;
    kv.reserve(static_cast<std::size_t>(num_settings));
    for (int32_t i = 0; i < num_settings; ++i) {
      if (settings[i].key == nullptr || settings[i].value == nullptr) {
        return sparseprefill::invalid_argument("settings[" + std::to_string(i) +
                                               "]: expected non-NULL key and value");
      }
      kv.emplace_back(settings[i].key, settings[i].value);
    }
    auto handle = std::make_unique<sp_policy>();
    SP_RETURN_IF_ERROR(sparseprefill::parse_policy(name, kv, &handle->policy));
    handle->description = sparseprefill::describe(handle->policy);
    *out = handle.release();
    return Status::ok_status();
  });
}

void sp_policy_destroy(sp_policy* policy) { delete policy; }

int sp_policy_set_thresholds(sp_policy* policy, const sp_tensor* thresholds) {
  return guarded([&]() -> Status {
    SP_RETURN_IF_ERROR(check_policy(policy));
    auto* gate = std::get_if<sparseprefill::ExactGateParams>(&policy->policy);
    if (gate == nullptr) {
      return sparseprefill::invalid_argument(
          std::string("thresholds: only exact_gate takes a threshold table, the policy is ") +
          sparseprefill::policy_name(policy->policy));
    }
    if (thresholds == nullptr) return sparseprefill::invalid_argument("thresholds: expected non-NULL");
    TensorView view;
    SP_RETURN_IF_ERROR(to_view(*thresholds, "thresholds", &view));
    gate->thresholds = view;
    policy->description = sparseprefill::describe(policy->policy);
    return Status::ok_status();
  });
}

namespace {

// The estimate_select parameters of a policy handle, or an error naming `what`.
Status estimate_select_of(sp_policy* policy, const char* what, sparseprefill::EstimateSelectParams** out) {
  SP_RETURN_IF_ERROR(check_policy(policy));
  *out = std::get_if<sparseprefill::EstimateSelectParams>(&policy->policy);
  if (*out == nullptr) {
    return sparseprefill::invalid_argument(std::string(what) + ": only estimate_select takes it, the policy is " +
                                           sparseprefill::policy_name(policy->policy));
  }
  return Status::ok_status();
}

// An optional tensor: NULL is absent, like rank 0.
Status optional_view(const sp_tensor* t, const char* name, TensorView* out) {
  *out = TensorView{};
  return t == nullptr ? Status::ok_status() : to_view(*t, name, out);
}

}  // namespace

int sp_policy_set_prompt_len(sp_policy* policy, const sp_tensor* prompt_len) {
  return guarded([&]() -> Status {
    sparseprefill::EstimateSelectParams* es = nullptr;
    SP_RETURN_IF_ERROR(estimate_select_of(policy, "prompt_len", &es));
    TensorView view;
    SP_RETURN_IF_ERROR(optional_view(prompt_len, "prompt_len", &view));
    es->prompt_len = view;
    return Status::ok_status();
  });
}

int sp_policy_set_block_means(sp_policy* policy, const sp_tensor* k_means, const sp_tensor* v_means,
                              const sp_tensor* valid) {
  return guarded([&]() -> Status {
    sparseprefill::EstimateSelectParams* es = nullptr;
    SP_RETURN_IF_ERROR(estimate_select_of(policy, "block means", &es));
    sparseprefill::EstimateSelectParams next = *es;
    SP_RETURN_IF_ERROR(optional_view(k_means, "k_block_means", &next.k_block_means));
    SP_RETURN_IF_ERROR(optional_view(v_means, "v_block_means", &next.v_block_means));
    SP_RETURN_IF_ERROR(optional_view(valid, "block_means_valid", &next.block_means_valid));
    SP_RETURN_IF_ERROR(sparseprefill::validate_policy(next));  // all three or none
    *es = next;
    return Status::ok_status();
  });
}

int sp_policy_set_block_mask(sp_policy* policy, const sp_problem* problem,
                             const sp_block_mask_csr* mask) {
  return guarded([&]() -> Status {
    SP_RETURN_IF_ERROR(check_policy(policy));
    auto* sparse = std::get_if<sparseprefill::BlockSparseParams>(&policy->policy);
    if (sparse == nullptr) {
      return sparseprefill::invalid_argument(
          std::string("mask: only block_sparse takes a block mask, the policy is ") +
          sparseprefill::policy_name(policy->policy));
    }
    if (mask == nullptr) return sparseprefill::invalid_argument("mask: expected non-NULL");
    if (mask->num_rows < 0 || mask->indptr == nullptr) {
      return sparseprefill::invalid_argument(
          "mask.indptr: expected num_rows >= 0 and num_rows + 1 entries");
    }
    if (mask->num_indices < 0 || (mask->num_indices > 0 && mask->indices == nullptr)) {
      return sparseprefill::invalid_argument(
          "mask.indices: expected num_indices >= 0 and a non-NULL array when it is positive");
    }
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(problem, &p));
    sparseprefill::ProblemShape shape;
    SP_RETURN_IF_ERROR(sparseprefill::validate_problem(p, nullptr, &shape));
    std::vector<std::int32_t> indptr(mask->indptr, mask->indptr + mask->num_rows + 1);
    std::vector<std::int32_t> indices(mask->indices, mask->indices + mask->num_indices);
    sparseprefill::BlockMask built;
    SP_RETURN_IF_ERROR(sparseprefill::BlockMask::from_csr(shape, mask->block_q, mask->block_k,
                                                          mask->per_kv_head != 0, indptr,
                                                          indices, &built));
    sparse->mask = std::move(built);
    policy->description = sparseprefill::describe(policy->policy);
    return Status::ok_status();
  });
}

const char* sp_policy_describe(const sp_policy* policy) {
  return policy == nullptr ? "" : policy->description.c_str();
}

namespace {

Status to_device_mask(const sp_device_block_mask* mask, sparseprefill::DeviceBlockMask* out) {
  if (mask == nullptr) return sparseprefill::invalid_argument("mask: expected non-NULL");
  SP_RETURN_IF_ERROR(optional_view(&mask->kv_num_blocks, "kv_num_blocks", &out->partial_count));
  SP_RETURN_IF_ERROR(optional_view(&mask->kv_indices, "kv_indices", &out->partial_index));
  SP_RETURN_IF_ERROR(optional_view(&mask->full_kv_num_blocks, "full_kv_num_blocks", &out->full_count));
  SP_RETURN_IF_ERROR(optional_view(&mask->full_kv_indices, "full_kv_indices", &out->full_index));
  SP_RETURN_IF_ERROR(optional_view(&mask->csr_indptr, "csr_indptr", &out->csr_indptr));
  SP_RETURN_IF_ERROR(optional_view(&mask->csr_indices, "csr_indices", &out->csr_indices));
  out->block_q = mask->block_q;
  out->block_k = mask->block_k;
  out->per_kv_head = mask->per_kv_head != 0;
  if (!out->defined()) return sparseprefill::invalid_argument("mask: kv_num_blocks/kv_indices or csr_indptr/csr_indices required");
  return Status::ok_status();
}

}  // namespace

int sp_policy_set_device_block_mask(sp_policy* policy, const sp_device_block_mask* mask) {
  return guarded([&]() -> Status {
    SP_RETURN_IF_ERROR(check_policy(policy));
    auto* sparse = std::get_if<sparseprefill::BlockSparseParams>(&policy->policy);
    if (sparse == nullptr) {
      return sparseprefill::invalid_argument(std::string("mask: only block_sparse takes a block mask, the policy is ") +
                                             sparseprefill::policy_name(policy->policy));
    }
    sparseprefill::BlockSparseParams next;
    SP_RETURN_IF_ERROR(to_device_mask(mask, &next.device_mask));
    SP_RETURN_IF_ERROR(sparseprefill::validate_policy(next));
    *sparse = std::move(next);
    policy->description = sparseprefill::describe(policy->policy);
    return Status::ok_status();
  });
}

int sp_select_into(const sp_problem* problem, const sp_policy* policy, const sp_options* options,
                   const sp_device_block_mask* out) {
  return guarded([&]() -> Status {
    SP_RETURN_IF_ERROR(check_policy(policy));
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(problem, &p));
    sparseprefill::RunOptions opts;
    SP_RETURN_IF_ERROR(to_options(options, &opts));
    sparseprefill::DeviceBlockMask into;
    SP_RETURN_IF_ERROR(to_device_mask(out, &into));
    return sparseprefill::select_into(p, policy->policy, opts, into);
  });
}

int sp_check_device_errors(int32_t device) {
  return guarded([&]() -> Status { return sparseprefill::check_device_errors(device); });
}

int sp_run(const sp_problem* problem, const sp_policy* policy, const sp_output* output,
           const sp_options* options, sp_stats* stats) {
  return sp_run_decisions(problem, policy, output, options, stats, nullptr);
}

int sp_run_decisions(const sp_problem* problem, const sp_policy* policy, const sp_output* output,
                     const sp_options* options, sp_stats* stats, sp_decisions* decisions) {
  return guarded([&]() -> Status {
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(problem, &p));
    SP_RETURN_IF_ERROR(check_policy(policy));
    sparseprefill::AttentionOutput out;
    SP_RETURN_IF_ERROR(to_output(output, &out));
    sparseprefill::RunOptions opts;
    SP_RETURN_IF_ERROR(to_options(options, &opts));
    SP_RETURN_IF_ERROR(check_stats(stats));
    sparseprefill::RunStats rs;
    sparseprefill::Decisions d;
    SP_RETURN_IF_ERROR(sparseprefill::run(p, policy->policy, out, opts, stats != nullptr ? &rs : nullptr,
                                          decisions != nullptr ? &d : nullptr));
    return finish_run(rs, std::move(d), stats, decisions);
  });
}

int sp_select(const sp_problem* problem, const sp_policy* policy, const sp_options* options,
              sp_decisions* decisions, sp_stats* stats) {
  return guarded([&]() -> Status {
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(problem, &p));
    SP_RETURN_IF_ERROR(check_policy(policy));
    if (decisions == nullptr) {
      return sparseprefill::invalid_argument("decisions: expected a handle from sp_decisions_create");
    }
    sparseprefill::RunOptions opts;
    SP_RETURN_IF_ERROR(to_options(options, &opts));
    SP_RETURN_IF_ERROR(check_stats(stats));
    sparseprefill::RunStats rs;
    sparseprefill::Decisions d;
    SP_RETURN_IF_ERROR(sparseprefill::select(p, policy->policy, opts, &d, stats != nullptr ? &rs : nullptr));
    return finish_run(rs, std::move(d), stats, decisions);
  });
}

int sp_decisions_create(sp_decisions** out) {
  return guarded([&]() -> Status {
    if (out == nullptr) return sparseprefill::invalid_argument("out: expected non-NULL");
    *out = new sp_decisions();
    return Status::ok_status();
  });
}

void sp_decisions_destroy(sp_decisions* decisions) { delete decisions; }

const char* sp_decisions_policy(const sp_decisions* decisions) {
  return decisions == nullptr ? "" : decisions->decisions.policy.c_str();
}

int sp_decisions_mask(const sp_decisions* decisions, int32_t which, sp_block_mask_view* out) {
  return guarded([&]() -> Status {
    if (decisions == nullptr) return sparseprefill::invalid_argument("decisions: expected non-NULL");
    if (out == nullptr) return sparseprefill::invalid_argument("out: expected non-NULL");
    if (which != SP_MASK_KEPT && which != SP_MASK_CORRECTED) {
      return sparseprefill::invalid_argument("which: expected SP_MASK_KEPT (0) or SP_MASK_CORRECTED (1), got " +
                                             std::to_string(which));
    }
    const bool kept = which == SP_MASK_KEPT;
    const sparseprefill::BlockMask& m = kept ? decisions->decisions.kept : decisions->decisions.corrected;
    const sp_decisions::Csr& c = kept ? decisions->kept : decisions->corrected;
    *out = sp_block_mask_view{};
    if (c.indptr.empty()) return Status::ok_status();
    out->batch = m.batch;
    out->heads = m.heads;
    out->num_q_blocks = m.num_q_blocks;
    out->num_k_blocks = m.num_k_blocks;
    out->block_q = m.block_q;
    out->block_k = m.block_k;
    out->per_kv_head = m.per_kv_head ? 1 : 0;
    out->num_rows = static_cast<std::int64_t>(c.indptr.size()) - 1;
    out->indptr = c.indptr.data();
    out->num_indices = static_cast<std::int64_t>(c.indices.size());
    out->indices = c.indices.empty() ? nullptr : c.indices.data();
    return Status::ok_status();
  });
}

int sp_decisions_tiles(const sp_decisions* decisions, const sp_permute_tile** tiles, int64_t* count) {
  return guarded([&]() -> Status {
    if (decisions == nullptr || tiles == nullptr || count == nullptr) {
      return sparseprefill::invalid_argument("decisions, tiles, count: expected non-NULL");
    }
    *tiles = decisions->tiles.empty() ? nullptr : decisions->tiles.data();
    *count = static_cast<std::int64_t>(decisions->tiles.size());
    return Status::ok_status();
  });
}

int sp_decisions_query_order(const sp_decisions* decisions, const int32_t** order, int64_t* count) {
  return guarded([&]() -> Status {
    if (decisions == nullptr || order == nullptr || count == nullptr) {
      return sparseprefill::invalid_argument("decisions, order, count: expected non-NULL");
    }
    const auto& q = decisions->decisions.query_order;
    *order = q.empty() ? nullptr : q.data();
    *count = static_cast<std::int64_t>(q.size());
    return Status::ok_status();
  });
}

int sp_plan_create(const sp_problem* problem, const sp_policy* policy, const sp_options* options,
                   sp_plan** out) {
  return guarded([&]() -> Status {
    if (out == nullptr) return sparseprefill::invalid_argument("out: expected non-NULL");
    *out = nullptr;
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(problem, &p));
    SP_RETURN_IF_ERROR(check_policy(policy));
    sparseprefill::RunOptions opts;
    SP_RETURN_IF_ERROR(to_options(options, &opts));
    auto handle = std::make_unique<sp_plan>();
    SP_RETURN_IF_ERROR(sparseprefill::make_plan(p, policy->policy, opts, &handle->plan));
    handle->description = policy->description;
    *out = handle.release();
    return Status::ok_status();
  });
}

void sp_plan_destroy(sp_plan* plan) { delete plan; }

const char* sp_plan_describe(const sp_plan* plan) { return plan == nullptr ? "" : plan->description.c_str(); }

int sp_plan_run(const sp_plan* plan, const sp_problem* problem, const sp_output* output,
                const sp_options* options, sp_stats* stats, sp_decisions* decisions) {
  return guarded([&]() -> Status {
    if (plan == nullptr) return sparseprefill::invalid_argument("plan: expected a handle from sp_plan_create");
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(problem, &p));
    sparseprefill::AttentionOutput out;
    SP_RETURN_IF_ERROR(to_output(output, &out));
    sparseprefill::RunOptions opts;
    SP_RETURN_IF_ERROR(to_options(options, &opts));
    SP_RETURN_IF_ERROR(check_stats(stats));
    sparseprefill::RunStats rs;
    sparseprefill::Decisions d;
    SP_RETURN_IF_ERROR(sparseprefill::run(plan->plan, p, out, opts, stats != nullptr ? &rs : nullptr,
                                          decisions != nullptr ? &d : nullptr));
    return finish_run(rs, std::move(d), stats, decisions);
  });
}

int sp_can_run(const sp_problem* problem, const sp_policy* policy, int32_t backend) {
  return guarded([&]() -> Status {
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(problem, &p));
    SP_RETURN_IF_ERROR(check_policy(policy));
    sparseprefill::Backend b = sparseprefill::Backend::kAuto;
    SP_RETURN_IF_ERROR(to_backend(backend, &b));
    return sparseprefill::can_run(p, policy->policy, b);
  });
}

// ---------------------------------------------------------------- calibration

int sp_calibrator_create(const sp_calibration_targets* targets, sp_calibrator** out) {
  return guarded([&]() -> Status {
    if (out == nullptr) return sparseprefill::invalid_argument("out: expected non-NULL");
    *out = nullptr;
    if (targets == nullptr) return sparseprefill::invalid_argument("targets: expected non-NULL");
    const sp_calibration_targets& t = *targets;
    const std::pair<const char*, std::pair<const void*, int32_t>> lists[] = {
        {"budgets", {t.budgets, t.num_budgets}},
        {"skip_targets", {t.skip_targets, t.num_skip_targets}},
        {"density_targets", {t.density_targets, t.num_density_targets}}};
    for (const auto& [name, list] : lists) {
      if (list.second < 0 || (list.second > 0 && list.first == nullptr)) {
        return sparseprefill::invalid_argument(std::string("targets.") + name +
                                               ": expected a length >= 0 and a non-NULL array when it is positive");
      }
    }
    sparseprefill::CalibrationTargets c;
    c.layers = t.layers;
    c.heads = t.heads;
    c.block_q = t.block_q;
    c.block_k = t.block_k;
    c.estimate.block = t.select_block;
    c.budgets.assign(t.budgets, t.budgets + t.num_budgets);
    c.skip_targets.assign(t.skip_targets, t.skip_targets + t.num_skip_targets);
    c.density_targets.assign(t.density_targets, t.density_targets + t.num_density_targets);
    auto handle = std::make_unique<sp_calibrator>();
    SP_RETURN_IF_ERROR(sparseprefill::CalibrationRun::create(c, &handle->run));
    *out = handle.release();
    return Status::ok_status();
  });
}

void sp_calibrator_destroy(sp_calibrator* calibrator) { delete calibrator; }

int sp_calibrator_add(sp_calibrator* calibrator, int32_t layer, const sp_problem* sample, const sp_options* options) {
  return guarded([&]() -> Status {
    if (calibrator == nullptr) {
      return sparseprefill::invalid_argument("calibrator: expected a handle from sp_calibrator_create");
    }
    sparseprefill::AttentionProblem p;
    SP_RETURN_IF_ERROR(to_problem(sample, &p));
    return calibrator->run->add(layer, p, options != nullptr ? options->cuda_stream : nullptr);
  });
}

int sp_calibrator_save(const sp_calibrator* calibrator, const char* path, const sp_setting* metadata,
                       int32_t num_metadata) {
  return guarded([&]() -> Status {
    if (calibrator == nullptr) {
      return sparseprefill::invalid_argument("calibrator: expected a handle from sp_calibrator_create");
    }
    if (path == nullptr) return sparseprefill::invalid_argument("path: expected non-NULL");
    if (num_metadata < 0 || (num_metadata > 0 && metadata == nullptr)) {
      return sparseprefill::invalid_argument(
          "metadata: expected num_metadata >= 0 and a non-NULL array when it is positive");
    }
    sparseprefill::Calibration cal;
    SP_RETURN_IF_ERROR(calibrator->run->finish(&cal));
    for (int32_t i = 0; i < num_metadata; ++i) {
      if (metadata[i].key == nullptr || metadata[i].value == nullptr) {
        return sparseprefill::invalid_argument("metadata[" + std::to_string(i) + "]: expected non-NULL key and value");
      }
      cal.metadata[metadata[i].key] = metadata[i].value;
    }
    return sparseprefill::save_calibration(path, cal);
  });
}

int sp_generate(const sp_generator_config* config, const sp_tensor* q, const sp_tensor* k, const sp_tensor* v) {
  return guarded([&]() -> Status {
    if (config == nullptr || q == nullptr || k == nullptr || v == nullptr) {
      return sparseprefill::invalid_argument("sp_generate: expected non-NULL config, q, k and v");
    }
    TensorView views[3];
    SP_RETURN_IF_ERROR(to_view(*q, "q", &views[0]));
    SP_RETURN_IF_ERROR(to_view(*k, "k", &views[1]));
    SP_RETURN_IF_ERROR(to_view(*v, "v", &views[2]));
    sparseprefill::GeneratorConfig c;
    c.batch = config->batch;
    c.seq_q = config->seq_q;
    c.seq_k = config->seq_k;
    c.h_q = config->h_q;
    c.h_kv = config->h_kv;
    c.d = config->d;
    c.dtype = views[0].dtype;
    c.seed = config->seed;
    c.peakedness = config->peakedness;
    sparseprefill::HostTensor made[3];
    SP_RETURN_IF_ERROR(sparseprefill::generate(c, &made[0], &made[1], &made[2]));
    // Checked after generating so that the generator's own messages name bad configurations.
    const char* names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      const TensorView& t = views[i];
      const TensorView want = made[i].view();
      bool same = t.rank == want.rank && t.dtype == want.dtype && t.device.kind == sparseprefill::DeviceKind::kCPU;
      for (int j = 0; same && j < t.rank; ++j) same = t.shape[j] == want.shape[j] && t.stride[j] == want.stride[j];
      if (!same || t.data == nullptr) {
        return sparseprefill::invalid_argument(std::string("sp_generate: ") + names[i] + ": expected " +
                                               sparseprefill::describe(want) + " (contiguous), got " +
                                               sparseprefill::describe(t));
      }
    }
    for (int i = 0; i < 3; ++i) std::memcpy(views[i].data, made[i].data(), made[i].nbytes());
    return Status::ok_status();
  });
}

const char* sp_last_error(void) { return t_last_error.c_str(); }

const char* sp_status_name(int32_t code) {
  if (code < SP_OK || code > SP_ERR_INTERNAL) return "unknown";
  return sparseprefill::status_code_name(static_cast<StatusCode>(code));
}

const char* sp_build_info(void) {
  // Built once; a function-local static is initialised thread-safely.
  static const std::string info = []() {
    try {
      return sparseprefill::build_info();
    } catch (...) {
      return std::string("sparseprefill (build_info failed)");
    }
  }();
  return info.c_str();
}

int32_t sp_abi_version(void) { return SP_ABI_VERSION; }

}  // extern "C"
