// SPDX-License-Identifier: Apache-2.0
// Host gathers and stores for every layout (batched, varlen, paged; any strides).
#include "core/tensor_access.h"

#include <cstring>

namespace sparseprefill::detail {
namespace {

float load_float(const void* base, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::kBF16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[offset]);
    case DType::kFP16: return fp16_to_float(static_cast<const std::uint16_t*>(base)[offset]);
    case DType::kFP32: return static_cast<const float*>(base)[offset];
    case DType::kInt32: return static_cast<float>(static_cast<const std::int32_t*>(base)[offset]);
    case DType::kFP8E4M3: return e4m3_to_float(static_cast<const std::uint8_t*>(base)[offset]);
  }
  return 0.0f;
}

void store_float(void* base, DType dtype, std::int64_t offset, float x) {
  switch (dtype) {
    case DType::kBF16: static_cast<std::uint16_t*>(base)[offset] = float_to_bf16(x); break;
    case DType::kFP16: static_cast<std::uint16_t*>(base)[offset] = float_to_fp16(x); break;
    case DType::kFP32: static_cast<float*>(base)[offset] = x; break;
    case DType::kInt32:
    case DType::kFP8E4M3: break;  // never an output dtype (validate_problem)
  }
}

// Element (b, kv head hk) of a defined [batch, h_kv] fp32 descale (FP8 inputs).
double descale_of(const TensorView& t, int b, int hk) {
  return static_cast<const float*>(t.data)[b * t.stride[0] + hk * t.stride[1]];
}

// Offset of element (row, head, 0) of sequence b's query rows in q-shaped tensor t.
std::int64_t q_offset(const TensorView& t, const ProblemShape& s, int b, std::int64_t r, int h) {
  if (s.varlen_q) return (s.q_start[static_cast<std::size_t>(b)] + r) * t.stride[0] + h * t.stride[1];
  return b * t.stride[0] + r * t.stride[1] + h * t.stride[2];
}

std::int64_t kv_offset(const AttentionProblem& p, const TensorView& t, const ProblemShape& s, int b,
                       std::int64_t pos, int h) {
  switch (s.kv_layout) {
    case KvLayout::kBatched: return b * t.stride[0] + pos * t.stride[1] + h * t.stride[2];
    case KvLayout::kVarlen:
      return (s.k_start[static_cast<std::size_t>(b)] + pos) * t.stride[0] + h * t.stride[1];
    case KvLayout::kPaged: {
      const auto* table = static_cast<const std::int32_t*>(p.block_table.data);
      const std::int64_t page =
          table[b * p.block_table.stride[0] + (pos / s.page_size) * p.block_table.stride[1]];
      return page * t.stride[0] + (pos % s.page_size) * t.stride[1] + h * t.stride[2];
    }
  }
  return 0;
}

}  // namespace

template <class T>
void gather_q(const AttentionProblem& p, const ProblemShape& s, int b, std::vector<T>* out) {
  const std::int64_t s_q = s.seq_q[static_cast<std::size_t>(b)];
  out->resize(static_cast<std::size_t>(s_q * s.h_q * s.d));
  T* dst = out->data();
  for (std::int64_t r = 0; r < s_q; ++r) {
    for (int h = 0; h < s.h_q; ++h) {
      const std::int64_t base = q_offset(p.q, s, b, r, h);
      if (p.q_descale.defined()) {
        // FP8: the value times its descale, computed in double (exact for the oracle's double).
        const double scale = descale_of(p.q_descale, b, h / s.group());
        for (int i = 0; i < s.d; ++i) {
          *dst++ = static_cast<T>(static_cast<double>(load_float(p.q.data, s.dtype, base + i)) * scale);
        }
        continue;
      }
      for (int i = 0; i < s.d; ++i) *dst++ = static_cast<T>(load_float(p.q.data, s.dtype, base + i));
    }
  }
}

template <class T>
void gather_kv(const AttentionProblem& p, const ProblemShape& s, int b, bool value,
               std::vector<T>* out) {
  const TensorView& t = value ? p.v : p.k;
  const std::int64_t s_k = s.seq_k[static_cast<std::size_t>(b)];
  const int dim = value ? s.d_v : s.d;
  out->resize(static_cast<std::size_t>(s_k * s.h_kv * dim));
  const TensorView& descale = value ? p.v_descale : p.k_descale;
  T* dst = out->data();
  for (std::int64_t pos = 0; pos < s_k; ++pos) {
    for (int h = 0; h < s.h_kv; ++h) {
      const std::int64_t base = kv_offset(p, t, s, b, pos, h);
      if (descale.defined()) {
        const double scale = descale_of(descale, b, h);
        for (int i = 0; i < dim; ++i) {
          *dst++ = static_cast<T>(static_cast<double>(load_float(t.data, s.dtype, base + i)) * scale);
        }
        continue;
      }
      for (int i = 0; i < dim; ++i) *dst++ = static_cast<T>(load_float(t.data, s.dtype, base + i));
    }
  }
}

void gather_sinks(const AttentionProblem& p, const ProblemShape& s, std::vector<double>* out) {
  out->resize(static_cast<std::size_t>(s.h_q));
  for (int h = 0; h < s.h_q; ++h) (*out)[static_cast<std::size_t>(h)] = static_cast<const float*>(p.sinks.data)[h * p.sinks.stride[0]];
}

template <class T>
void store_output(const AttentionOutput& out, const ProblemShape& s, int b, const T* o,
                  const T* lse) {
  const std::int64_t s_q = s.seq_q[static_cast<std::size_t>(b)];
  for (std::int64_t r = 0; r < s_q; ++r) {
    for (int h = 0; h < s.h_q; ++h) {
      const std::int64_t base = q_offset(out.o, s, b, r, h);
      const T* src = o + (r * s.h_q + h) * s.d_v;
      for (int i = 0; i < s.d_v; ++i) store_float(out.o.data, s.out_dtype(), base + i, static_cast<float>(src[i]));
    }
  }
  if (!out.lse.defined() || lse == nullptr) return;
  auto* l = static_cast<float*>(out.lse.data);
  for (int h = 0; h < s.h_q; ++h) {
    for (std::int64_t r = 0; r < s_q; ++r) {
      const std::int64_t off = s.varlen_q
          ? h * out.lse.stride[0] + (s.q_start[static_cast<std::size_t>(b)] + r) * out.lse.stride[1]
          : b * out.lse.stride[0] + h * out.lse.stride[1] + r * out.lse.stride[2];
      l[off] = static_cast<float>(lse[h * s_q + r]);
    }
  }
}

template void gather_q<float>(const AttentionProblem&, const ProblemShape&, int, std::vector<float>*);
template void gather_q<double>(const AttentionProblem&, const ProblemShape&, int, std::vector<double>*);
template void gather_kv<float>(const AttentionProblem&, const ProblemShape&, int, bool, std::vector<float>*);
template void gather_kv<double>(const AttentionProblem&, const ProblemShape&, int, bool, std::vector<double>*);
template void store_output<float>(const AttentionOutput&, const ProblemShape&, int, const float*, const float*);
template void store_output<double>(const AttentionOutput&, const ProblemShape&, int, const double*, const double*);

void load_block_mean(const TensorView& cache, int b, int hk, std::int64_t j, int d, float* out) {
  const std::int64_t base = b * cache.stride[0] + hk * cache.stride[1] + j * cache.stride[2];
  for (int i = 0; i < d; ++i) out[i] = load_float(cache.data, cache.dtype, base + i);
}

void store_block_mean(const TensorView& cache, int b, int hk, std::int64_t j, int d, const float* in) {
  const std::int64_t base = b * cache.stride[0] + hk * cache.stride[1] + j * cache.stride[2];
  for (int i = 0; i < d; ++i) store_float(cache.data, cache.dtype, base + i, in[i]);
}

}  // namespace sparseprefill::detail
