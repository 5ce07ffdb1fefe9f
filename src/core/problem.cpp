// SPDX-License-Identifier: Apache-2.0
// validate_problem: every argument check of the public API, with messages that name the
// argument and what was expected, and the resolution of layouts into a ProblemShape.
#include <cmath>
#include <sstream>
#include <string>
#include <utility>

#include "sparseprefill/problem.h"

namespace sparseprefill {

std::int64_t ProblemShape::total_q() const {
  std::int64_t n = 0;
  for (std::int64_t s : seq_q) n += s;
  return n;
}
std::int64_t ProblemShape::max_seq_q() const {
  std::int64_t n = 0;
  for (std::int64_t s : seq_q) n = s > n ? s : n;
  return n;
}
std::int64_t ProblemShape::max_seq_k() const {
  std::int64_t n = 0;
  for (std::int64_t s : seq_k) n = s > n ? s : n;
  return n;
}

namespace {

std::string shape_str(const TensorView& t) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < t.rank; ++i) os << (i ? ", " : "") << t.shape[i];
  os << ']';
  return os.str();
}

Status check_float_tensor(const char* name, const TensorView& t, int rank_a, int rank_b,
                          const char* expected) {
  if (!t.defined()) return invalid_argument(std::string(name) + ": required, expected " + expected);
  if (t.rank != rank_a && t.rank != rank_b) {
    return invalid_argument(std::string(name) + ": expected " + expected + ", got rank " +
                            std::to_string(t.rank) + " " + shape_str(t));
  }
  if (t.data == nullptr && t.numel() > 0) return invalid_argument(std::string(name) + ": null data pointer");
  if (t.dtype != DType::kBF16 && t.dtype != DType::kFP16 && t.dtype != DType::kFP32 && t.dtype != DType::kFP8E4M3) {
    return invalid_argument(std::string(name) + ": expected dtype bf16, fp16, fp32 or fp8_e4m3, got " +
                            dtype_name(t.dtype));
  }
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0 || t.stride[i] < 0) {
      return invalid_argument(std::string(name) + ": negative shape or stride " + shape_str(t));
    }
  }
  if (t.shape[t.rank - 1] > 1 && t.stride[t.rank - 1] != 1) {
    return invalid_argument(std::string(name) + ": the last dimension (head_dim) must be contiguous (stride 1), got stride " +
                            std::to_string(t.stride[t.rank - 1]));
  }
  return {};
}

// A host int32 vector of `len` entries (len < 0: any length).
Status check_index_tensor(const char* name, const TensorView& t, int rank, std::int64_t len0,
                          const std::string& expected) {
  if (t.rank != rank) {
    return invalid_argument(std::string(name) + ": expected " + expected + ", got rank " +
                            std::to_string(t.rank));
  }
  if (t.dtype != DType::kInt32) {
    return invalid_argument(std::string(name) + ": expected dtype int32, got " + dtype_name(t.dtype));
  }
  if (t.device.kind != DeviceKind::kCPU) {
    return invalid_argument(std::string(name) + ": expected a host (CPU) tensor");
  }
  if (len0 >= 0 && t.shape[0] != len0) {
    return invalid_argument(std::string(name) + ": expected " + expected + ", got " + shape_str(t));
  }
  if (t.data == nullptr && t.numel() > 0) return invalid_argument(std::string(name) + ": null data pointer");
  return {};
}

std::int32_t at1(const TensorView& t, std::int64_t i) {
  return static_cast<const std::int32_t*>(t.data)[i * t.stride[0]];
}

// cu_seqlens: starts at 0, non-decreasing, last <= total rows.
Status read_cu_seqlens(const char* name, const TensorView& t, int batch, std::int64_t total,
                       std::vector<std::int64_t>* start, std::vector<std::int64_t>* len) {
  SP_RETURN_IF_ERROR(check_index_tensor(name, t, 1, batch + 1,
                                        "int32 [batch + 1] = [" + std::to_string(batch + 1) + "]"));
  if (at1(t, 0) != 0) return invalid_argument(std::string(name) + ": must start at 0, got " + std::to_string(at1(t, 0)));
  start->assign(static_cast<std::size_t>(batch), 0);
  len->assign(static_cast<std::size_t>(batch), 0);
  for (int b = 0; b < batch; ++b) {
    const std::int64_t lo = at1(t, b), hi = at1(t, b + 1);
    if (hi < lo) {
      return invalid_argument(std::string(name) + ": must be non-decreasing, but entry " +
                              std::to_string(b + 1) + " (" + std::to_string(hi) + ") < entry " +
                              std::to_string(b) + " (" + std::to_string(lo) + ")");
    }
    (*start)[static_cast<std::size_t>(b)] = lo;
    (*len)[static_cast<std::size_t>(b)] = hi - lo;
  }
  if (at1(t, batch) > total) {
    return invalid_argument(std::string(name) + ": last entry " + std::to_string(at1(t, batch)) +
                            " exceeds the " + std::to_string(total) + " rows of the packed tensor");
  }
  return {};
}

// FP8 descales: fp32 [b, h_kv] on q's device, any non-negative strides, only with fp8_e4m3
// inputs; host-readable values are checked finite.
Status check_descales(const AttentionProblem& p, const ProblemShape& s) {
  const std::pair<const char*, const TensorView*> descales[] = {
      {"q_descale", &p.q_descale}, {"k_descale", &p.k_descale}, {"v_descale", &p.v_descale}};
  for (const auto& [name, t] : descales) {
    if (!t->defined()) continue;
    if (s.dtype != DType::kFP8E4M3) {
      return invalid_argument(std::string(name) + ": only with fp8_e4m3 inputs, got " + dtype_name(s.dtype) + " inputs");
    }
    if (t->rank != 2 || t->shape[0] != s.batch || t->shape[1] != s.h_kv || t->dtype != DType::kFP32) {
      return invalid_argument(std::string(name) + ": expected fp32 [b, h_kv] = [" + std::to_string(s.batch) + ", " +
                              std::to_string(s.h_kv) + "], got " + describe(*t));
    }
    if (t->device != s.device) return invalid_argument(std::string(name) + ": expected q's device, got " + describe(*t));
    if (t->data == nullptr && t->numel() > 0) return invalid_argument(std::string(name) + ": null data pointer");
    if (t->stride[0] < 0 || t->stride[1] < 0) return invalid_argument(std::string(name) + ": negative stride");
    if (t->device.kind != DeviceKind::kCPU) continue;
    const auto* v = static_cast<const float*>(t->data);
    for (int b = 0; b < s.batch; ++b) {
      for (int h = 0; h < s.h_kv; ++h) {
        const float x = v[b * t->stride[0] + h * t->stride[1]];
        if (!std::isfinite(x)) {
          return invalid_argument(std::string(name) + "[" + std::to_string(b) + ", " + std::to_string(h) +
                                  "]: expected a finite number, got " + std::to_string(x));
        }
      }
    }
  }
  return {};
}

// window_left/right >= -1; attention_chunk >= 0; softcap 0 or finite positive; sinks fp32 [h_q] on q's device (any
// values: NaN and +inf reach the outputs as the semantics say, docs/semantics.md §1).
Status check_window_softcap_sinks(const AttentionProblem& p, ProblemShape* s) {
  const std::pair<const char*, int> bounds[] = {{"window_left", p.window_left}, {"window_right", p.window_right}};
  for (const auto& [name, w] : bounds) {
    if (w < -1) {
      return invalid_argument(std::string(name) + ": expected -1 (no bound) or a number of keys >= 0, got " + std::to_string(w));
    }
  }
  s->window_left = p.window_left;
  s->window_right = p.window_right;
  if (p.attention_chunk < 0) {
    return invalid_argument("attention_chunk: expected 0 (none) or a chunk of positions > 0, got " +
                            std::to_string(p.attention_chunk));
  }
  s->attention_chunk = p.attention_chunk;
  if (!(p.softcap >= 0.0) || std::isinf(p.softcap)) {
    return invalid_argument("softcap: expected 0 (none) or a finite positive number, got " + std::to_string(p.softcap));
  }
  s->softcap = p.softcap;
  const TensorView& t = p.sinks;
  if (!t.defined()) return {};
  if (t.rank != 1 || t.shape[0] != s->h_q || t.dtype != DType::kFP32) {
    return invalid_argument("sinks: expected fp32 [h_q] = [" + std::to_string(s->h_q) + "], got " + describe(t));
  }
  if (t.device != s->device) return invalid_argument("sinks: expected q's device, got " + describe(t));
  if (t.data == nullptr && t.numel() > 0) return invalid_argument("sinks: null data pointer");
  if (t.stride[0] < 0) return invalid_argument("sinks: negative stride");
  s->sinks = true;
  return {};
}

}  // namespace

Status validate_problem(const AttentionProblem& p, const AttentionOutput* out, ProblemShape* shape) {
  ProblemShape s;
  SP_RETURN_IF_ERROR(check_float_tensor("q", p.q, 4, 3, "[b, s_q, h_q, d] or varlen [total_q, h_q, d]"));
  SP_RETURN_IF_ERROR(check_float_tensor("k", p.k, 4, 3, "[b, s_k, h_kv, d], varlen [total_k, h_kv, d] or paged [num_pages, page_size, h_kv, d]"));
  SP_RETURN_IF_ERROR(check_float_tensor("v", p.v, 4, 3, "the shape of k (its last dimension d_v may differ)"));
  if (p.k.dtype != p.q.dtype || p.v.dtype != p.q.dtype) {
    return invalid_argument(std::string("k, v: expected q's dtype ") + dtype_name(p.q.dtype) +
                            ", got k " + dtype_name(p.k.dtype) + " and v " + dtype_name(p.v.dtype));
  }
  if (p.k.device != p.q.device || p.v.device != p.q.device) {
    return invalid_argument("q, k, v: expected one device, got q " + describe(p.q) + ", k " +
                            describe(p.k) + ", v " + describe(p.v));
  }
  // v is k's shape but for its head dim d_v (checked positive below).
  const auto v_mismatch = [&] {
    return invalid_argument("v: expected the shape of k " + shape_str(p.k) + " (any last dimension d_v), got " + shape_str(p.v));
  };
  if (p.k.rank != p.v.rank) return v_mismatch();
  for (int i = 0; i + 1 < p.k.rank; ++i) {
    if (p.k.shape[i] != p.v.shape[i]) return v_mismatch();
  }
  s.dtype = p.q.dtype;
  s.device = p.q.device;
  s.causal = p.causal;
  s.varlen_q = p.q.rank == 3;
  s.h_q = static_cast<int>(p.q.shape[p.q.rank - 2]);
  s.d = static_cast<int>(p.q.shape[p.q.rank - 1]);
  s.h_kv = static_cast<int>(p.k.shape[p.k.rank - 2]);
  const std::int64_t d_k = p.k.shape[p.k.rank - 1];
  if (s.d <= 0) return invalid_argument("q: head_dim must be positive, got " + std::to_string(s.d));
  if (d_k != s.d) {
    return invalid_argument("k: expected head_dim " + std::to_string(s.d) + " (q's), got " + std::to_string(d_k));
  }
  s.d_v = static_cast<int>(p.v.shape[p.v.rank - 1]);
  if (s.d_v <= 0) return invalid_argument("v: head_dim d_v must be positive, got " + std::to_string(s.d_v));
  if (s.h_q <= 0 || s.h_kv <= 0) return invalid_argument("q, k: head counts must be positive");
  if (s.h_q % s.h_kv != 0) {
    return invalid_argument("k: h_kv (" + std::to_string(s.h_kv) + ") must divide h_q (" +
                            std::to_string(s.h_q) + ")");
  }

  // Queries: batched or varlen.
  if (s.varlen_q) {
    if (!p.cu_seqlens_q.defined()) return invalid_argument("cu_seqlens_q: required when q is varlen [total_q, h_q, d]");
    s.batch = static_cast<int>(p.cu_seqlens_q.shape[0] - 1);
    if (p.cu_seqlens_q.rank != 1 || s.batch < 0) return invalid_argument("cu_seqlens_q: expected int32 [batch + 1]");
    SP_RETURN_IF_ERROR(read_cu_seqlens("cu_seqlens_q", p.cu_seqlens_q, s.batch, p.q.shape[0], &s.q_start, &s.seq_q));
  } else {
    if (p.cu_seqlens_q.defined()) return invalid_argument("cu_seqlens_q: given, but q is batched [b, s_q, h_q, d]; pass q as [total_q, h_q, d]");
    s.batch = static_cast<int>(p.q.shape[0]);
    s.seq_q.assign(static_cast<std::size_t>(s.batch), p.q.shape[1]);
    s.q_start.resize(static_cast<std::size_t>(s.batch));
    for (int b = 0; b < s.batch; ++b) s.q_start[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(b) * p.q.shape[1];
  }

  // Keys: paged, varlen or batched.
  std::vector<std::int64_t> capacity;
  if (p.block_table.defined()) {
    if (p.k.rank != 4) return invalid_argument("k: expected paged [num_pages, page_size, h_kv, d] with block_table, got " + shape_str(p.k));
    if (p.cu_seqlens_k.defined()) return invalid_argument("cu_seqlens_k: not allowed with block_table (use seqused_k)");
    s.kv_layout = KvLayout::kPaged;
    s.page_size = static_cast<int>(p.k.shape[1]);
    if (s.page_size <= 0) return invalid_argument("k: page_size must be positive");
    SP_RETURN_IF_ERROR(check_index_tensor("block_table", p.block_table, 2, s.batch,
                                          "int32 [batch, max_pages] with batch " + std::to_string(s.batch)));
    if (!p.seqused_k.defined()) return invalid_argument("seqused_k: required with block_table");
    capacity.assign(static_cast<std::size_t>(s.batch), p.block_table.shape[1] * s.page_size);
    s.k_start.assign(static_cast<std::size_t>(s.batch), 0);
  } else if (p.cu_seqlens_k.defined()) {
    if (p.k.rank != 3) return invalid_argument("k: expected varlen [total_k, h_kv, d] with cu_seqlens_k, got " + shape_str(p.k));
    s.kv_layout = KvLayout::kVarlen;
    SP_RETURN_IF_ERROR(read_cu_seqlens("cu_seqlens_k", p.cu_seqlens_k, s.batch, p.k.shape[0], &s.k_start, &capacity));
  } else {
    if (p.k.rank != 4) {
      return invalid_argument(s.varlen_q ? "k: expected cu_seqlens_k (varlen [total_k, h_kv, d]) or block_table (paged) when q is varlen"
                                         : "k: expected [b, s_k, h_kv, d], got " + shape_str(p.k));
    }
    if (p.k.shape[0] != s.batch) {
      return invalid_argument("k: expected batch " + std::to_string(s.batch) + " (q's), got " + std::to_string(p.k.shape[0]));
    }
    s.kv_layout = KvLayout::kBatched;
    capacity.assign(static_cast<std::size_t>(s.batch), p.k.shape[1]);
    s.k_start.resize(static_cast<std::size_t>(s.batch));
    for (int b = 0; b < s.batch; ++b) s.k_start[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(b) * p.k.shape[1];
  }
  s.seq_k = capacity;
  if (p.seqused_k.defined()) {
    SP_RETURN_IF_ERROR(check_index_tensor("seqused_k", p.seqused_k, 1, s.batch,
                                          "int32 [batch] with batch " + std::to_string(s.batch)));
    for (int b = 0; b < s.batch; ++b) {
      const std::int64_t used = at1(p.seqused_k, b);
      if (used < 0 || used > capacity[static_cast<std::size_t>(b)]) {
        return invalid_argument("seqused_k[" + std::to_string(b) + "]: expected 0.." +
                                std::to_string(capacity[static_cast<std::size_t>(b)]) + ", got " + std::to_string(used));
      }
      s.seq_k[static_cast<std::size_t>(b)] = used;
    }
  }
  if (s.kv_layout == KvLayout::kPaged) {
    const auto* table = static_cast<const std::int32_t*>(p.block_table.data);
    for (int b = 0; b < s.batch; ++b) {
      const std::int64_t pages = (s.seq_k[static_cast<std::size_t>(b)] + s.page_size - 1) / s.page_size;
      for (std::int64_t i = 0; i < pages; ++i) {
        const std::int32_t page = table[b * p.block_table.stride[0] + i * p.block_table.stride[1]];
        if (page < 0 || page >= p.k.shape[0]) {
          return invalid_argument("block_table[" + std::to_string(b) + "][" + std::to_string(i) +
                                  "]: page " + std::to_string(page) + " out of range [0, " +
                                  std::to_string(p.k.shape[0]) + ")");
        }
      }
    }
  }

  if (std::isnan(p.scale) || std::isinf(p.scale) || p.scale < 0) {
    return invalid_argument("scale: expected a finite positive number (or 0 for 1/sqrt(d)), got " + std::to_string(p.scale));
  }
  s.scale = p.scale == 0.0 ? 1.0 / std::sqrt(static_cast<double>(s.d)) : p.scale;
  SP_RETURN_IF_ERROR(check_descales(p, s));
  SP_RETURN_IF_ERROR(check_window_softcap_sinks(p, &s));

  if (out != nullptr) {
    const TensorView& o = out->o;
    if (!o.defined()) return invalid_argument("o: required, expected q's shape with v's head_dim last");
    // O: q's shape with v's head dim last.
    TensorView want = p.q;
    want.shape[want.rank - 1] = s.d_v;
    const std::string expected = "o: expected q's shape with v's head_dim " + std::to_string(s.d_v) + " last " + shape_str(want);
    if (o.rank != p.q.rank) return invalid_argument(expected + ", got " + shape_str(o));
    for (int i = 0; i < o.rank; ++i) {
      if (o.shape[i] != want.shape[i]) return invalid_argument(expected + ", got " + shape_str(o));
      if (o.stride[i] < 0) return invalid_argument("o: negative stride");
    }
    if (o.dtype != s.out_dtype()) {
      return invalid_argument((s.dtype == DType::kFP8E4M3 ? std::string("o: expected dtype bf16 (fp8_e4m3 inputs give a bf16 output)")
                                                          : std::string("o: expected q's dtype ") + dtype_name(p.q.dtype)) +
                              ", got " + dtype_name(o.dtype));
    }
    if (o.device != p.q.device) return invalid_argument("o: expected q's device, got " + describe(o));
    if (o.data == nullptr && o.numel() > 0) return invalid_argument("o: null data pointer");
    if (o.shape[o.rank - 1] > 1 && o.stride[o.rank - 1] != 1) return invalid_argument("o: the last dimension must be contiguous");
    const TensorView& l = out->lse;
    if (l.defined()) {
      const bool ok_shape = s.varlen_q
          ? (l.rank == 2 && l.shape[0] == s.h_q && l.shape[1] == p.q.shape[0])
          : (l.rank == 3 && l.shape[0] == s.batch && l.shape[1] == s.h_q && l.shape[2] == p.q.shape[1]);
      if (!ok_shape) {
        return invalid_argument(std::string("lse: expected fp32 ") +
                                (s.varlen_q ? "[h_q, total_q] = [" + std::to_string(s.h_q) + ", " + std::to_string(p.q.shape[0]) + "]"
                                            : "[b, h_q, s_q] = [" + std::to_string(s.batch) + ", " + std::to_string(s.h_q) + ", " + std::to_string(p.q.shape[1]) + "]") +
                                ", got " + shape_str(l));
      }
      if (l.dtype != DType::kFP32) return invalid_argument(std::string("lse: expected dtype fp32, got ") + dtype_name(l.dtype));
      if (l.device != p.q.device) return invalid_argument("lse: expected q's device, got " + describe(l));
      if (l.data == nullptr && l.numel() > 0) return invalid_argument("lse: null data pointer");
    }
  }
  *shape = std::move(s);
  return {};
}

}  // namespace sparseprefill
