// SPDX-License-Identifier: Apache-2.0
// sparseprefill._ext: a thin pybind11 layer over the C ABI (include/sparseprefill/c_api.h).
// Tensors arrive as plain descriptors built by the Python side from NumPy arrays or torch
// tensors, (data_ptr, dtype, device_type, device_index, shape, strides in elements), so this
// file knows neither framework; every failing ABI call raises the exception of its code.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sparseprefill/c_api.h"

namespace py = pybind11;

namespace {

// Exception classes by sp_status code, created once at import.
struct Exceptions {
  py::object base, invalid_argument, unsupported, io, corrupt_data, cuda, internal;
};
Exceptions* g_exc = nullptr;

py::object exception_for(int code) {
  switch (code) {
    case SP_ERR_INVALID_ARGUMENT: return g_exc->invalid_argument;
    case SP_ERR_UNSUPPORTED: return g_exc->unsupported;
    case SP_ERR_IO: return g_exc->io;
    case SP_ERR_CORRUPT_DATA: return g_exc->corrupt_data;
    case SP_ERR_CUDA: return g_exc->cuda;
    default: return g_exc->internal;
  }
}

[[noreturn]] void raise(int code, const std::string& message) {
  PyErr_SetString(exception_for(code).ptr(), message.c_str());
  throw py::error_already_set();
}

// Raises the exception of a failed ABI call with the library's message.
void check(int code) {
  if (code != SP_OK) raise(code, sp_last_error());
}

// None -> an absent tensor (rank 0). Otherwise a 6-tuple descriptor.
sp_tensor to_tensor(py::handle obj, const char* name) {
  sp_tensor t{};
  if (obj.is_none()) return t;
  auto desc = py::reinterpret_borrow<py::tuple>(obj);
  if (desc.size() != 6) {
    raise(SP_ERR_INVALID_ARGUMENT, std::string(name) + ": expected a 6-field tensor descriptor");
  }
  auto shape = desc[4].cast<std::vector<std::int64_t>>();
  auto stride = desc[5].cast<std::vector<std::int64_t>>();
  if (shape.empty() || shape.size() > SP_MAX_RANK || stride.size() != shape.size()) {
    raise(SP_ERR_INVALID_ARGUMENT, std::string(name) + ": expected rank 1.." +
                                       std::to_string(SP_MAX_RANK) + ", got rank " +
                                       std::to_string(shape.size()));
  }
  t.data = reinterpret_cast<void*>(desc[0].cast<std::uintptr_t>());
  t.dtype = desc[1].cast<std::int32_t>();
  t.device_type = desc[2].cast<std::int32_t>();
  t.device_index = desc[3].cast<std::int32_t>();
  t.rank = static_cast<std::int32_t>(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride[i];
  }
  return t;
}

// (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, q_descale, k_descale,
//  v_descale, causal, scale, local, window_left, window_right, attention_chunk, softcap, sinks):
// sp_problem's fields in order.
sp_problem to_problem(const py::tuple& p) {
  if (p.size() != 18) raise(SP_ERR_INVALID_ARGUMENT, "problem: expected an 18-field tuple");
  sp_problem out{};
  out.q = to_tensor(p[0], "q");
  out.k = to_tensor(p[1], "k");
  out.v = to_tensor(p[2], "v");
  out.cu_seqlens_q = to_tensor(p[3], "cu_seqlens_q");
  out.cu_seqlens_k = to_tensor(p[4], "cu_seqlens_k");
  out.seqused_k = to_tensor(p[5], "seqused_k");
  out.block_table = to_tensor(p[6], "block_table");
  out.q_descale = to_tensor(p[7], "q_descale");
  out.k_descale = to_tensor(p[8], "k_descale");
  out.v_descale = to_tensor(p[9], "v_descale");
  out.causal = p[10].cast<bool>() ? 1 : 0;
  out.scale = p[11].cast<double>();
  out.local = p[12].cast<bool>() ? 1 : 0;
  out.window_left = p[13].cast<std::int32_t>();
  out.window_right = p[14].cast<std::int32_t>();
  out.attention_chunk = p[15].cast<std::int32_t>();
  out.softcap = p[16].cast<double>();
  out.sinks = to_tensor(p[17], "sinks");
  return out;
}

// An owned sp_policy plus the Python object whose memory a threshold view points into.
class PolicyHandle {
 public:
  PolicyHandle(const std::string& name, const std::vector<std::pair<std::string, std::string>>& settings) {
    std::vector<sp_setting> raw;
    raw.reserve(settings.size());
    for (const auto& [key, value] : settings) raw.push_back(sp_setting{key.c_str(), value.c_str()});
    check(sp_policy_create(name.c_str(), raw.data(), static_cast<std::int32_t>(raw.size()), &policy_));
  }
  ~PolicyHandle() { sp_policy_destroy(policy_); }
  PolicyHandle(const PolicyHandle&) = delete;
  PolicyHandle& operator=(const PolicyHandle&) = delete;

  // `owner` keeps the memory behind the fp32 [h_q, positions] view alive.
  void set_thresholds(py::handle desc, py::object owner) {
    sp_tensor t = to_tensor(desc, "thresholds");
    check(sp_policy_set_thresholds(policy_, &t));
    owner_ = std::move(owner);
  }

  // estimate_select's chunked-prefill tensors (descriptors or None); `owner` keeps their memory
  // alive as long as the handle.
  void set_chunked(py::handle prompt_len, py::handle k_means, py::handle v_means, py::handle valid,
                   py::object owner) {
    const sp_tensor len = to_tensor(prompt_len, "prompt_len");
    const sp_tensor k = to_tensor(k_means, "k_block_means");
    const sp_tensor v = to_tensor(v_means, "v_block_means");
    const sp_tensor n = to_tensor(valid, "block_means_valid");
    check(sp_policy_set_prompt_len(policy_, &len));
    check(sp_policy_set_block_means(policy_, &k, &v, &n));
    chunked_owner_ = std::move(owner);
  }

  // CSR over rows (b, h, qb); indptr/indices are host int32 arrays the caller keeps alive
  // for this call only (the library copies them).
  void set_block_mask(const py::tuple& problem, int block_q, int block_k, bool per_kv_head,
                      std::int64_t num_rows, std::uintptr_t indptr, std::int64_t num_indices,
                      std::uintptr_t indices) {
    sp_problem p = to_problem(problem);
    sp_block_mask_csr mask{};
    mask.block_q = block_q;
    mask.block_k = block_k;
    mask.per_kv_head = per_kv_head ? 1 : 0;
    mask.num_rows = num_rows;
    mask.indptr = reinterpret_cast<const std::int32_t*>(indptr);
    mask.num_indices = num_indices;
    mask.indices = reinterpret_cast<const std::int32_t*>(indices);
    check(sp_policy_set_block_mask(policy_, &p, &mask));
  }

  // A block mask read in place (descriptors of FlexAttention's tensors or CSR; None for the
  // absent ones); `owner` keeps their memory alive as long as the handle.
  void set_device_block_mask(py::handle kv_num_blocks, py::handle kv_indices, py::handle full_kv_num_blocks,
                             py::handle full_kv_indices, py::handle csr_indptr, py::handle csr_indices, int block_q,
                             int block_k, bool per_kv_head, py::object owner) {
    const sp_device_block_mask mask = device_mask(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                                  csr_indptr, csr_indices, block_q, block_k, per_kv_head);
    check(sp_policy_set_device_block_mask(policy_, &mask));
    mask_owner_ = std::move(owner);
  }

  std::string describe() const { return sp_policy_describe(policy_); }
  const sp_policy* get() const { return policy_; }

  static sp_device_block_mask device_mask(py::handle kv_num_blocks, py::handle kv_indices,
                                          py::handle full_kv_num_blocks, py::handle full_kv_indices,
                                          py::handle csr_indptr, py::handle csr_indices, int block_q, int block_k,
                                          bool per_kv_head) {
    sp_device_block_mask m{};
    m.kv_num_blocks = to_tensor(kv_num_blocks, "kv_num_blocks");
    m.kv_indices = to_tensor(kv_indices, "kv_indices");
    m.full_kv_num_blocks = to_tensor(full_kv_num_blocks, "full_kv_num_blocks");
    m.full_kv_indices = to_tensor(full_kv_indices, "full_kv_indices");
    m.csr_indptr = to_tensor(csr_indptr, "csr_indptr");
    m.csr_indices = to_tensor(csr_indices, "csr_indices");
    m.block_q = block_q;
    m.block_k = block_k;
    m.per_kv_head = per_kv_head ? 1 : 0;
    return m;
  }

 private:
  sp_policy* policy_ = nullptr;
  py::object owner_;
  py::object chunked_owner_;
  py::object mask_owner_;
};

py::tuple head_tuple(const sp_head_stats& h) {
  return py::make_tuple(h.visible_blocks, h.kept_blocks, h.corrected_blocks, h.visible_pairs,
                        h.computed_pairs);
}

// batch * h_q from q's descriptor (varlen q: batch from cu_seqlens_q), for the stats buffer.
std::int64_t head_count(const sp_problem& p) {
  if (p.q.rank < 3) return 0;
  const std::int64_t h_q = p.q.shape[p.q.rank - 2];
  const std::int64_t batch = p.q.rank == 4 ? p.q.shape[0]
                             : p.cu_seqlens_q.rank == 1 ? p.cu_seqlens_q.shape[0] - 1
                                                        : 0;
  return batch > 0 && h_q > 0 ? batch * h_q : 0;
}

// sp_stats with a per-head buffer sized for `p` (when wanted), and its conversion to a dict:
// density, pair_density, batch, h_q, total (5 counters) and heads (a list of batch * h_q
// counter tuples, row-major [b, h_q]); counters are (visible_blocks, kept_blocks,
// corrected_blocks, visible_pairs, computed_pairs).
struct StatsBuffer {
  sp_stats stats{};
  std::vector<sp_head_stats> heads;
  bool wanted = false;

  StatsBuffer(const sp_problem& p, bool want) : wanted(want) {
    if (!want) return;
    heads.resize(static_cast<std::size_t>(head_count(p)));
    stats.heads = heads.data();
    stats.heads_capacity = static_cast<std::int64_t>(heads.size());
  }
  sp_stats* get() { return wanted ? &stats : nullptr; }
  py::object to_python() const {
    if (!wanted) return py::none();
    py::list per_head;
    if (stats.num_heads <= static_cast<std::int64_t>(heads.size())) {
      for (std::int64_t i = 0; i < stats.num_heads; ++i) per_head.append(head_tuple(heads[static_cast<std::size_t>(i)]));
    }
    py::dict d;
    d["density"] = stats.density;
    d["pair_density"] = stats.pair_density;
    d["batch"] = stats.batch;
    d["h_q"] = stats.h_q;
    d["total"] = head_tuple(stats.total);
    d["heads"] = per_head;
    return std::move(d);
  }
};

sp_options make_options(int backend, int num_threads, std::uintptr_t stream) {
  sp_options options{};
  options.backend = backend;
  options.num_threads = num_threads;
  options.cuda_stream = reinterpret_cast<void*>(stream);
  return options;
}

sp_output make_output(py::handle o, py::handle lse) {
  sp_output out{};
  out.o = to_tensor(o, "out");
  out.lse = to_tensor(lse, "lse");
  return out;
}

// An sp_decisions owned by the binding for one call.
class DecisionsBuffer {
 public:
  explicit DecisionsBuffer(bool want) {
    if (want) check(sp_decisions_create(&handle_));
  }
  ~DecisionsBuffer() { sp_decisions_destroy(handle_); }
  DecisionsBuffer(const DecisionsBuffer&) = delete;
  DecisionsBuffer& operator=(const DecisionsBuffer&) = delete;
  sp_decisions* get() { return handle_; }

  // None, or a dict: policy, kept and corrected (None or a mask dict: batch, heads,
  // num_q_blocks, num_k_blocks, block_q, block_k, per_kv_head, and indptr / indices as bytes of
  // int32), tiles (bytes of int32 [n, 6]: batch, head, segment, tile, chunks_visited,
  // chunks_total) and query_order (bytes of int32).
  py::object to_python() const {
    if (handle_ == nullptr) return py::none();
    py::dict d;
    d["policy"] = std::string(sp_decisions_policy(handle_));
    d["kept"] = mask(SP_MASK_KEPT);
    d["corrected"] = mask(SP_MASK_CORRECTED);
    const sp_permute_tile* tiles = nullptr;
    std::int64_t count = 0;
    check(sp_decisions_tiles(handle_, &tiles, &count));
    static_assert(sizeof(sp_permute_tile) == 6 * sizeof(std::int32_t), "tiles are read as int32 [n, 6]");
    d["tiles"] = py::bytes(reinterpret_cast<const char*>(tiles), static_cast<std::size_t>(count) * sizeof(sp_permute_tile));
    const std::int32_t* order = nullptr;
    check(sp_decisions_query_order(handle_, &order, &count));
    d["query_order"] = py::bytes(reinterpret_cast<const char*>(order), static_cast<std::size_t>(count) * sizeof(std::int32_t));
    return std::move(d);
  }

 private:
  py::object mask(int which) const {
    sp_block_mask_view v{};
    check(sp_decisions_mask(handle_, which, &v));
    if (v.num_rows == 0) return py::none();
    py::dict m;
    m["batch"] = v.batch;
    m["heads"] = v.heads;
    m["num_q_blocks"] = v.num_q_blocks;
    m["num_k_blocks"] = v.num_k_blocks;
    m["block_q"] = v.block_q;
    m["block_k"] = v.block_k;
    m["per_kv_head"] = v.per_kv_head != 0;
    m["indptr"] = py::bytes(reinterpret_cast<const char*>(v.indptr), static_cast<std::size_t>(v.num_rows + 1) * 4);
    m["indices"] = py::bytes(reinterpret_cast<const char*>(v.indices), static_cast<std::size_t>(v.num_indices) * 4);
    return std::move(m);
  }

  sp_decisions* handle_ = nullptr;
};

// Runs one call. Returns None, or with want_stats the StatsBuffer dict.
py::object run(const py::tuple& problem, const PolicyHandle& policy, py::handle o, py::handle lse,
               int backend, int num_threads, std::uintptr_t stream, bool want_stats) {
  const sp_problem p = to_problem(problem);
  const sp_output out = make_output(o, lse);
  const sp_options options = make_options(backend, num_threads, stream);
  StatsBuffer stats(p, want_stats);
  int code;
  {
    py::gil_scoped_release release;
    code = sp_run(&p, policy.get(), &out, &options, stats.get());
  }
  check(code);
  return stats.to_python();
}

// Runs one call and returns (stats dict or None, decisions dict).
py::tuple run_decisions(const py::tuple& problem, const PolicyHandle& policy, py::handle o, py::handle lse,
                        int backend, int num_threads, std::uintptr_t stream, bool want_stats) {
  const sp_problem p = to_problem(problem);
  const sp_output out = make_output(o, lse);
  const sp_options options = make_options(backend, num_threads, stream);
  StatsBuffer stats(p, want_stats);
  DecisionsBuffer decisions(true);
  int code;
  {
    py::gil_scoped_release release;
    code = sp_run_decisions(&p, policy.get(), &out, &options, stats.get(), decisions.get());
  }
  check(code);
  return py::make_tuple(stats.to_python(), decisions.to_python());
}

// The policy's selector alone: (stats dict, decisions dict).
py::tuple select_blocks(const py::tuple& problem, const PolicyHandle& policy, int backend, int num_threads,
                 std::uintptr_t stream) {
  const sp_problem p = to_problem(problem);
  const sp_options options = make_options(backend, num_threads, stream);
  StatsBuffer stats(p, true);
  DecisionsBuffer decisions(true);
  int code;
  {
    py::gil_scoped_release release;
    code = sp_select(&p, policy.get(), &options, decisions.get(), stats.get());
  }
  check(code);
  return py::make_tuple(stats.to_python(), decisions.to_python());
}

// estimate_select's selection into four device tensors in FlexAttention's form (descriptors),
// enqueued on `stream` without a synchronisation.
void select_into(const py::tuple& problem, const PolicyHandle& policy, int backend, std::uintptr_t stream,
                 py::handle kv_num_blocks, py::handle kv_indices, py::handle full_kv_num_blocks,
                 py::handle full_kv_indices, bool per_kv_head, int block) {
  const sp_problem p = to_problem(problem);
  const sp_options options = make_options(backend, 0, stream);
  const sp_device_block_mask out = PolicyHandle::device_mask(kv_num_blocks, kv_indices, full_kv_num_blocks,
                                                             full_kv_indices, py::none(), py::none(), 128, block,
                                                             per_kv_head);
  int code;
  {
    py::gil_scoped_release release;
    code = sp_select_into(&p, policy.get(), &options, &out);
  }
  check(code);
}

// An owned sp_plan. The plan copies the policy; `owner` keeps alive what the policy only views
// (exact_gate's threshold table).
class PlanHandle {
 public:
  PlanHandle(const py::tuple& problem, const PolicyHandle& policy, int backend, std::uintptr_t stream,
             py::object owner)
      : owner_(std::move(owner)) {
    const sp_problem p = to_problem(problem);
    const sp_options options = make_options(backend, 0, stream);
    int code;
    {
      py::gil_scoped_release release;
      code = sp_plan_create(&p, policy.get(), &options, &plan_);
    }
    check(code);
  }
  ~PlanHandle() { sp_plan_destroy(plan_); }
  PlanHandle(const PlanHandle&) = delete;
  PlanHandle& operator=(const PlanHandle&) = delete;

  // (stats dict or None, decisions dict or None).
  py::tuple run(const py::tuple& problem, py::handle o, py::handle lse, int backend, int num_threads,
                std::uintptr_t stream, bool want_stats, bool want_decisions) {
    const sp_problem p = to_problem(problem);
    const sp_output out = make_output(o, lse);
    const sp_options options = make_options(backend, num_threads, stream);
    StatsBuffer stats(p, want_stats);
    DecisionsBuffer decisions(want_decisions);
    int code;
    {
      py::gil_scoped_release release;
      code = sp_plan_run(plan_, &p, &out, &options, stats.get(), decisions.get());
    }
    check(code);
    return py::make_tuple(stats.to_python(), decisions.to_python());
  }

  std::string describe() const { return sp_plan_describe(plan_); }
  const sp_plan* get() const { return plan_; }

 private:
  sp_plan* plan_ = nullptr;
  py::object owner_;
};

// A plan bound to the descriptors of one call that the Python side validated (shapes,
// strides, dtypes, devices, index tensors, the output's layout, backend, threads), converted
// once: run_ptrs patches the data pointers of q, k, v, the descales, the sinks, out and lse and
// runs the plan, so a repeated call converts no descriptor. `plan` (the PlanHandle) and `keep` (what
// the index descriptors point into) live as long as the binding. Immutable: several threads
// may run one binding at once.
class PlanCall {
 public:
  PlanCall(py::object plan, const py::tuple& problem, py::handle o, py::handle lse, int backend, int num_threads,
           py::object keep)
      : plan_owner_(std::move(plan)),
        plan_(plan_owner_.cast<const PlanHandle&>().get()),
        problem_(to_problem(problem)),
        output_(make_output(o, lse)),
        options_(make_options(backend, num_threads, 0)),
        keep_(std::move(keep)) {}

  void run_ptrs(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t o, std::uintptr_t lse,
                std::uintptr_t stream, std::uintptr_t q_descale, std::uintptr_t k_descale,
                std::uintptr_t v_descale, std::uintptr_t sinks) const {
    sp_problem p = problem_;
    patch(&p.q, q, "q");
    patch(&p.k, k, "k");
    patch(&p.v, v, "v");
    patch(&p.q_descale, q_descale, "q_descale");
    patch(&p.k_descale, k_descale, "k_descale");
    patch(&p.v_descale, v_descale, "v_descale");
    patch(&p.sinks, sinks, "sinks");
    sp_output out = output_;
    patch(&out.o, o, "out");
    patch(&out.lse, lse, "lse");
    sp_options options = options_;
    options.cuda_stream = reinterpret_cast<void*>(stream);
    int code;
    {
      py::gil_scoped_release release;
      code = sp_plan_run(plan_, &p, &out, &options, nullptr, nullptr);
    }
    check(code);
  }

 private:
  // A pointer for a tensor the bound call has, or 0 for one it lacks: anything else would
  // run a call other than the one validated.
  static void patch(sp_tensor* t, std::uintptr_t data, const char* name) {
    if (t->rank == 0) {
      if (data != 0) raise(SP_ERR_INVALID_ARGUMENT, std::string(name) + ": the bound call has none");
      return;
    }
    t->data = reinterpret_cast<void*>(data);
  }

  py::object plan_owner_;
  const sp_plan* plan_;
  sp_problem problem_;
  sp_output output_;
  sp_options options_;
  py::object keep_;
};

// (code, message): code 0 when `backend` can run the combination.
py::tuple can_run(const py::tuple& problem, const PolicyHandle& policy, int backend) {
  const sp_problem p = to_problem(problem);
  const int code = sp_can_run(&p, policy.get(), backend);
  return py::make_tuple(code, std::string(code == SP_OK ? "" : sp_last_error()));
}

// ---- Calibration (sp_calibrator_*): one run fed layer by layer, written with save().
class CalibratorHandle {
 public:
  CalibratorHandle(int layers, int heads, int block_q, int block_k, int select_block, const std::vector<std::int32_t>& budgets,
                   const std::vector<double>& skip_targets, const std::vector<double>& density_targets) {
    sp_calibration_targets t{};
    t.layers = layers;
    t.heads = heads;
    t.block_q = block_q;
    t.block_k = block_k;
    t.select_block = select_block;
    t.budgets = budgets.data();
    t.num_budgets = static_cast<std::int32_t>(budgets.size());
    t.skip_targets = skip_targets.data();
    t.num_skip_targets = static_cast<std::int32_t>(skip_targets.size());
    t.density_targets = density_targets.data();
    t.num_density_targets = static_cast<std::int32_t>(density_targets.size());
    check(sp_calibrator_create(&t, &calibrator_));
  }
  ~CalibratorHandle() { sp_calibrator_destroy(calibrator_); }
  CalibratorHandle(const CalibratorHandle&) = delete;
  CalibratorHandle& operator=(const CalibratorHandle&) = delete;

  // q, k of one layer (the problem tuple of run(); v may repeat k); synchronises `stream`.
  void add(int layer, const py::tuple& problem, std::uintptr_t stream) {
    const sp_problem p = to_problem(problem);
    sp_options options{};
    options.cuda_stream = reinterpret_cast<void*>(stream);
    int code;
    {
      py::gil_scoped_release release;
      code = sp_calibrator_add(calibrator_, layer, &p, &options);
    }
    check(code);
  }

  void save(const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata) {
    std::vector<sp_setting> raw;
    raw.reserve(metadata.size());
    for (const auto& [key, value] : metadata) raw.push_back(sp_setting{key.c_str(), value.c_str()});
    check(sp_calibrator_save(calibrator_, path.c_str(), raw.data(), static_cast<std::int32_t>(raw.size())));
  }

 private:
  sp_calibrator* calibrator_ = nullptr;
};

py::object new_exception(py::module_& m, const char* name, py::handle bases, const char* doc) {
  const std::string qualified = std::string("sparseprefill.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) throw py::error_already_set();
  py::object obj = py::reinterpret_steal<py::object>(cls);
  m.attr(name) = obj;
  return obj;
}

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "The C ABI of sparseprefill (libsparseprefill_c) for Python; see sparseprefill.";
  if (sp_abi_version() != SP_ABI_VERSION) {
    throw std::runtime_error("sparseprefill: libsparseprefill_c has ABI version " +
                             std::to_string(sp_abi_version()) + ", the module was built for " +
                             std::to_string(SP_ABI_VERSION));
  }

  static Exceptions exc;
  exc.base = new_exception(m, "Error", PyExc_RuntimeError, "Any error reported by sparseprefill.");
  exc.invalid_argument = new_exception(m, "InvalidArgumentError",
                                       py::make_tuple(exc.base, py::handle(PyExc_ValueError)),
                                       "A malformed argument; the message names it.");
  exc.unsupported = new_exception(m, "UnsupportedError",
                                  py::make_tuple(exc.base, py::handle(PyExc_NotImplementedError)),
                                  "Well-formed, but no compiled backend runs the combination.");
  exc.io = new_exception(m, "FileError", exc.base, "A file could not be read or written.");
  exc.corrupt_data = new_exception(m, "CorruptDataError",
                                   py::make_tuple(exc.base, py::handle(PyExc_ValueError)),
                                   "A malformed, truncated or inconsistent file.");
  exc.cuda = new_exception(m, "CudaError", exc.base, "A CUDA runtime error.");
  exc.internal = new_exception(m, "InternalError", exc.base, "A broken invariant in the library.");
  g_exc = &exc;

  m.attr("ABI_VERSION") = SP_ABI_VERSION;
  m.attr("DTYPE_BF16") = static_cast<int>(SP_DTYPE_BF16);
  m.attr("DTYPE_FP16") = static_cast<int>(SP_DTYPE_FP16);
  m.attr("DTYPE_FP32") = static_cast<int>(SP_DTYPE_FP32);
  m.attr("DTYPE_INT32") = static_cast<int>(SP_DTYPE_INT32);
  m.attr("DTYPE_FP8_E4M3") = static_cast<int>(SP_DTYPE_FP8_E4M3);
  m.attr("DEVICE_CPU") = static_cast<int>(SP_DEVICE_CPU);
  m.attr("DEVICE_CUDA") = static_cast<int>(SP_DEVICE_CUDA);
  m.attr("BACKENDS") = py::dict(py::arg("auto") = static_cast<int>(SP_BACKEND_AUTO),
                                py::arg("reference") = static_cast<int>(SP_BACKEND_REFERENCE),
                                py::arg("cpu") = static_cast<int>(SP_BACKEND_CPU),
                                py::arg("cuda") = static_cast<int>(SP_BACKEND_CUDA));

  py::class_<PolicyHandle>(m, "PolicyHandle")
      .def(py::init<const std::string&, const std::vector<std::pair<std::string, std::string>>&>(),
           py::arg("name"), py::arg("settings"))
      .def("set_thresholds", &PolicyHandle::set_thresholds, py::arg("desc"), py::arg("owner"))
      .def("set_chunked", &PolicyHandle::set_chunked, py::arg("prompt_len"), py::arg("k_block_means"),
           py::arg("v_block_means"), py::arg("block_means_valid"), py::arg("owner"))
      .def("set_block_mask", &PolicyHandle::set_block_mask, py::arg("problem"),
           py::arg("block_q"), py::arg("block_k"), py::arg("per_kv_head"), py::arg("num_rows"),
           py::arg("indptr"), py::arg("num_indices"), py::arg("indices"))
      .def("set_device_block_mask", &PolicyHandle::set_device_block_mask, py::arg("kv_num_blocks"),
           py::arg("kv_indices"), py::arg("full_kv_num_blocks"), py::arg("full_kv_indices"), py::arg("csr_indptr"),
           py::arg("csr_indices"), py::arg("block_q"), py::arg("block_k"), py::arg("per_kv_head"), py::arg("owner"))
      .def("describe", &PolicyHandle::describe);

  py::class_<CalibratorHandle>(m, "CalibratorHandle")
      .def(py::init<int, int, int, int, int, const std::vector<std::int32_t>&, const std::vector<double>&,
                    const std::vector<double>&>(),
           py::arg("layers"), py::arg("heads"), py::arg("block_q"), py::arg("block_k"), py::arg("select_block"),
           py::arg("budgets"), py::arg("skip_targets"), py::arg("density_targets"))
      .def("add", &CalibratorHandle::add, py::arg("layer"), py::arg("problem"), py::arg("stream"))
      .def("save", &CalibratorHandle::save, py::arg("path"), py::arg("metadata"));

  m.def("run", &run, py::arg("problem"), py::arg("policy"), py::arg("out"), py::arg("lse"),
        py::arg("backend"), py::arg("num_threads"), py::arg("stream"), py::arg("want_stats"));

  // Select, plan, run (sp_select, sp_run_decisions, sp_plan_*).
  m.def("run_decisions", &run_decisions, py::arg("problem"), py::arg("policy"), py::arg("out"), py::arg("lse"),
        py::arg("backend"), py::arg("num_threads"), py::arg("stream"), py::arg("want_stats"));
  m.def("select", &select_blocks, py::arg("problem"), py::arg("policy"), py::arg("backend"), py::arg("num_threads"),
        py::arg("stream"));
  py::class_<PlanHandle>(m, "PlanHandle")
      .def(py::init<const py::tuple&, const PolicyHandle&, int, std::uintptr_t, py::object>(), py::arg("problem"),
           py::arg("policy"), py::arg("backend"), py::arg("stream"), py::arg("owner"))
      .def("run", &PlanHandle::run, py::arg("problem"), py::arg("out"), py::arg("lse"), py::arg("backend"),
           py::arg("num_threads"), py::arg("stream"), py::arg("want_stats"), py::arg("want_decisions"))
      .def(
          "bind",
          [](py::object self, const py::tuple& problem, py::handle o, py::handle lse, int backend, int num_threads,
             py::object keep) {
            return std::make_unique<PlanCall>(std::move(self), problem, o, lse, backend, num_threads,
                                              std::move(keep));
          },
          py::arg("problem"), py::arg("out"), py::arg("lse"), py::arg("backend"), py::arg("num_threads"),
          py::arg("keep"))
      .def("describe", &PlanHandle::describe);
  py::class_<PlanCall>(m, "PlanCall")
      .def("run_ptrs", &PlanCall::run_ptrs, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
           py::arg("stream"), py::arg("q_descale") = 0, py::arg("k_descale") = 0, py::arg("v_descale") = 0,
           py::arg("sinks") = 0);
  m.def("select_into", &select_into, py::arg("problem"), py::arg("policy"), py::arg("backend"), py::arg("stream"),
        py::arg("kv_num_blocks"), py::arg("kv_indices"), py::arg("full_kv_num_blocks"), py::arg("full_kv_indices"),
        py::arg("per_kv_head"), py::arg("block"));
  m.def(
      "check_device_errors",
      [](int device) {
        int code;
        {
          py::gil_scoped_release release;
          code = sp_check_device_errors(device);
        }
        check(code);
      },
      py::arg("device"));
  m.def("can_run", &can_run, py::arg("problem"), py::arg("policy"), py::arg("backend"));
  m.def("build_info", []() { return std::string(sp_build_info()); });
  m.def("abi_version", []() { return sp_abi_version(); });
  m.def("status_name", [](int code) { return std::string(sp_status_name(code)); });
}
