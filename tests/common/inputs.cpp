// SPDX-License-Identifier: Apache-2.0
// Test inputs and layout builders (see inputs.h).
#include "inputs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "sparseprefill/generator.h"

namespace sparseprefill::test {
namespace {

void fill_nan(HostTensor* t) {
  for (std::int64_t i = 0; i < t->numel(); ++i) set(t, i, kNaN);
}

HostTensor int_tensor(const std::vector<std::int64_t>& shape, std::int32_t value) {
  HostTensor t(DType::kInt32, shape);
  std::fill(t.as<std::int32_t>(), t.as<std::int32_t>() + t.numel(), value);
  return t;
}

// Copies sequence tensor src [s, h, d] into dst starting at element `offset`.
void copy_rows(const HostTensor& src, HostTensor* dst, std::int64_t offset) {
  if (src.nbytes() == 0) return;  // an empty sequence may have no storage at all
  std::memcpy(static_cast<unsigned char*>(dst->data()) + offset * static_cast<std::int64_t>(dtype_size(dst->dtype())),
              src.data(), src.nbytes());
}

}  // namespace

std::uint64_t Random::next() { return splitmix64(&state_); }

double Random::uniform() {
  const std::uint64_t k = next() >> 40;  // 24 random bits
  return static_cast<double>(2 * k + 1) / 16777216.0 - 1.0;
}

double Random::normal() { return uniform() + uniform() + uniform(); }

std::uint64_t Random::below(std::uint64_t n) { return next() % n; }

double get(const HostTensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::kBF16: return bf16_to_float(t.as<std::uint16_t>()[i]);
    case DType::kFP16: return fp16_to_float(t.as<std::uint16_t>()[i]);
    case DType::kFP32: return t.as<float>()[i];
    case DType::kInt32: return t.as<std::int32_t>()[i];
    case DType::kFP8E4M3: return e4m3_to_float(t.as<std::uint8_t>()[i]);
  }
  return kNaN;
}

void set(HostTensor* t, std::int64_t i, double x) {
  const auto f = static_cast<float>(x);
  switch (t->dtype()) {
    case DType::kBF16: t->as<std::uint16_t>()[i] = float_to_bf16(f); break;
    case DType::kFP16: t->as<std::uint16_t>()[i] = float_to_fp16(f); break;
    case DType::kFP32: t->as<float>()[i] = f; break;
    case DType::kInt32: t->as<std::int32_t>()[i] = static_cast<std::int32_t>(x); break;
    case DType::kFP8E4M3: t->as<std::uint8_t>()[i] = float_to_e4m3(f); break;
  }
}

void put(HostTensor* t, std::int64_t row, int h, std::initializer_list<double> values) {
  const std::int64_t heads = t->shape()[1], d = t->shape()[2];
  std::int64_t i = 0;
  for (double x : values) set(t, (row * heads + h) * d + i++, x);
}

void fill_random(HostTensor* t, std::uint64_t seed, double scale, Distribution dist) {
  Random rng(seed);
  for (std::int64_t i = 0; i < t->numel(); ++i) {
    set(t, i, scale * (dist == Distribution::kUniform ? rng.uniform() : rng.normal()));
  }
}

Inputs empty_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, DType dtype, int d_v) {
  Inputs in;
  in.dtype = dtype;
  in.h_q = h_q;
  in.h_kv = h_kv;
  in.d = d;
  in.d_v = d_v > 0 ? d_v : d;
  for (const SeqLen& len : lengths) {
    in.seqs.push_back({HostTensor(dtype, {len.s_q, h_q, d}), HostTensor(dtype, {len.s_k, h_kv, d}),
                       HostTensor(dtype, {len.s_k, h_kv, in.d_v})});
  }
  return in;
}

Inputs random_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, DType dtype,
                     std::uint64_t seed, double scale, Distribution dist, int d_v) {
  Inputs in = empty_inputs(lengths, h_q, h_kv, d, dtype, d_v);
  Random seeds(seed);
  for (SequenceData& s : in.seqs) {
    fill_random(&s.q, seeds.next(), scale, dist);
    fill_random(&s.k, seeds.next(), scale, dist);
    fill_random(&s.v, seeds.next(), scale, dist);
  }
  return in;
}

Inputs repeat_kv(const Inputs& in) {
  const int group = in.h_q / in.h_kv;
  Inputs out = in;
  out.h_kv = in.h_q;
  for (std::size_t b = 0; b < in.seqs.size(); ++b) {
    const std::int64_t s_k = in.seqs[b].k.shape()[0];
    for (HostTensor SequenceData::*field : {&SequenceData::k, &SequenceData::v}) {
      const HostTensor& src = in.seqs[b].*field;
      const int dim = field == &SequenceData::k ? in.d : in.d_v;
      HostTensor dst(in.dtype, {s_k, in.h_q, dim});
      for (std::int64_t t = 0; t < s_k; ++t) {
        for (int h = 0; h < in.h_q; ++h) {
          for (int i = 0; i < dim; ++i) {
            set(&dst, (t * in.h_q + h) * dim + i, get(src, (t * in.h_kv + h / group) * dim + i));
          }
        }
      }
      out.seqs[b].*field = std::move(dst);
    }
  }
  return out;
}

AttentionProblem TestProblem::problem() const {
  AttentionProblem p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  if (!cu_seqlens_q.shape().empty()) p.cu_seqlens_q = cu_seqlens_q.view();
  if (!cu_seqlens_k.shape().empty()) p.cu_seqlens_k = cu_seqlens_k.view();
  if (!seqused_k.shape().empty()) p.seqused_k = seqused_k.view();
  if (!block_table.shape().empty()) p.block_table = block_table.view();
  if (!q_descale.shape().empty()) p.q_descale = q_descale.view();
  if (!k_descale.shape().empty()) p.k_descale = k_descale.view();
  if (!v_descale.shape().empty()) p.v_descale = v_descale.view();
  if (!sinks.shape().empty()) p.sinks = sinks.view();
  p.causal = causal;
  p.scale = scale;
  p.window_left = window_left;
  p.window_right = window_right;
  p.attention_chunk = attention_chunk;
  p.softcap = softcap;
  return p;
}

AttentionOutput TestProblem::output() const { return {o.view(), lse.view()}; }

TestProblem build_problem(const Inputs& in, const LayoutOptions& opt) {
  TestProblem tp;
  tp.causal = opt.causal;
  tp.scale = opt.scale;
  tp.window_left = opt.window_left;
  tp.window_right = opt.window_right;
  tp.attention_chunk = opt.attention_chunk;
  tp.softcap = opt.softcap;
  if (!in.sinks.empty()) {
    tp.sinks = HostTensor(DType::kFP32, {in.h_q});
    for (int h = 0; h < in.h_q; ++h) set(&tp.sinks, h, in.sinks[static_cast<std::size_t>(h)]);
  }
  const auto batch = static_cast<std::int64_t>(in.seqs.size());
  const std::int64_t row_q = static_cast<std::int64_t>(in.h_q) * in.d;   // elements per q row
  const std::int64_t row_k = static_cast<std::int64_t>(in.h_kv) * in.d;  // per k row
  const std::int64_t row_v = static_cast<std::int64_t>(in.h_kv) * in.d_v;  // per v row
  std::int64_t total_q = 0, total_k = 0, max_k = 0;
  for (int b = 0; b < batch; ++b) {
    total_q += in.s_q(b);
    total_k += in.s_k(b);
    max_k = std::max(max_k, in.s_k(b));
  }

  // Queries: batched (all s_q equal) or varlen.
  if (opt.layout == Layout::kBatched) {
    const std::int64_t s_q = batch > 0 ? in.s_q(0) : 0;
    for (int b = 0; b < batch; ++b) {
      // A later sequence longer than the first would write past the [batch, s_q] tensor.
      if (in.s_q(b) > s_q) throw std::invalid_argument("build_problem: a batched layout's first sequence is its longest");
    }
    tp.q = HostTensor(in.dtype, {batch, s_q, in.h_q, in.d});
    for (int b = 0; b < batch; ++b) copy_rows(in.seqs[static_cast<std::size_t>(b)].q, &tp.q, b * s_q * row_q);
    tp.lse = HostTensor(DType::kFP32, {batch, in.h_q, s_q});
  } else {
    tp.q = HostTensor(in.dtype, {total_q, in.h_q, in.d});
    tp.cu_seqlens_q = int_tensor({batch + 1}, 0);
    std::int64_t row = 0;
    for (int b = 0; b < batch; ++b) {
      copy_rows(in.seqs[static_cast<std::size_t>(b)].q, &tp.q, row * row_q);
      row += in.s_q(b);
      tp.cu_seqlens_q.as<std::int32_t>()[b + 1] = static_cast<std::int32_t>(row);
    }
    tp.lse = HostTensor(DType::kFP32, {in.h_q, total_q});
  }
  std::vector<std::int64_t> o_shape = tp.q.shape();
  o_shape.back() = in.d_v;
  tp.o = HostTensor(in.dtype == DType::kFP8E4M3 ? DType::kBF16 : in.dtype, o_shape);

  // Keys and values.
  switch (opt.layout) {
    case Layout::kBatched: {
      tp.k = HostTensor(in.dtype, {batch, max_k, in.h_kv, in.d});
      tp.v = HostTensor(in.dtype, {batch, max_k, in.h_kv, in.d_v});
      fill_nan(&tp.k);
      fill_nan(&tp.v);
      bool equal = true;
      for (int b = 0; b < batch; ++b) {
        copy_rows(in.seqs[static_cast<std::size_t>(b)].k, &tp.k, b * max_k * row_k);
        copy_rows(in.seqs[static_cast<std::size_t>(b)].v, &tp.v, b * max_k * row_v);
        equal = equal && in.s_k(b) == max_k;
      }
      if (!equal) {  // shorter sequences use a prefix of the capacity
        tp.seqused_k = int_tensor({batch}, 0);
        for (int b = 0; b < batch; ++b) tp.seqused_k.as<std::int32_t>()[b] = static_cast<std::int32_t>(in.s_k(b));
      }
      break;
    }
    case Layout::kVarlen: {
      tp.k = HostTensor(in.dtype, {total_k, in.h_kv, in.d});
      tp.v = HostTensor(in.dtype, {total_k, in.h_kv, in.d_v});
      tp.cu_seqlens_k = int_tensor({batch + 1}, 0);
      std::int64_t row = 0;
      for (int b = 0; b < batch; ++b) {
        copy_rows(in.seqs[static_cast<std::size_t>(b)].k, &tp.k, row * row_k);
        copy_rows(in.seqs[static_cast<std::size_t>(b)].v, &tp.v, row * row_v);
        row += in.s_k(b);
        tp.cu_seqlens_k.as<std::int32_t>()[b + 1] = static_cast<std::int32_t>(row);
      }
      break;
    }
    case Layout::kPaged: {
      const std::int64_t ps = opt.page_size;
      std::vector<std::int64_t> pages(static_cast<std::size_t>(batch));
      std::int64_t used = 0, max_pages = 1;
      for (int b = 0; b < batch; ++b) {
        pages[static_cast<std::size_t>(b)] = (in.s_k(b) + ps - 1) / ps;
        used += pages[static_cast<std::size_t>(b)];
        max_pages = std::max(max_pages, pages[static_cast<std::size_t>(b)]);
      }
      // One spare page that no sequence owns: the target of every unused table entry.
      const std::int64_t num_pages = used + 1;
      std::vector<std::int32_t> physical(static_cast<std::size_t>(num_pages));
      std::iota(physical.begin(), physical.end(), 0);
      Random rng(opt.page_seed);
      for (std::size_t i = physical.size(); i > 1; --i) std::swap(physical[i - 1], physical[rng.below(i)]);
      tp.k = HostTensor(in.dtype, {num_pages, ps, in.h_kv, in.d});
      tp.v = HostTensor(in.dtype, {num_pages, ps, in.h_kv, in.d_v});
      fill_nan(&tp.k);
      fill_nan(&tp.v);
      const std::int32_t spare = physical.back();
      tp.block_table = int_tensor({batch, max_pages}, spare);
      tp.seqused_k = int_tensor({batch}, 0);
      std::size_t next = 0;
      for (int b = 0; b < batch; ++b) {
        const SequenceData& s = in.seqs[static_cast<std::size_t>(b)];
        for (std::int64_t pg = 0; pg < pages[static_cast<std::size_t>(b)]; ++pg) {
          const std::int32_t phys = physical[next++];
          tp.block_table.as<std::int32_t>()[b * max_pages + pg] = phys;
          for (std::int64_t t = pg * ps; t < std::min((pg + 1) * ps, in.s_k(b)); ++t) {
            const std::int64_t slot = phys * ps + t - pg * ps;
            for (std::int64_t i = 0; i < row_k; ++i) set(&tp.k, slot * row_k + i, get(s.k, t * row_k + i));
            for (std::int64_t i = 0; i < row_v; ++i) set(&tp.v, slot * row_v + i, get(s.v, t * row_v + i));
          }
        }
        tp.seqused_k.as<std::int32_t>()[b] = static_cast<std::int32_t>(in.s_k(b));
      }
      break;
    }
  }
  return tp;
}

ProblemShape cuda_shape_of(std::int64_t s_q, std::int64_t s_k, int h_q, int h_kv, int d, DType dtype) {
  ProblemShape s;
  s.batch = 1;
  s.h_q = h_q;
  s.h_kv = h_kv;
  s.d = d;
  s.d_v = d;
  s.dtype = dtype;
  s.causal = true;
  s.scale = 1.0;
  s.seq_q = {s_q};
  s.seq_k = {s_k};
  s.q_start = {0};
  s.k_start = {0};
  s.device = Device{DeviceKind::kCUDA, 0};
  return s;
}

ProblemShape with_pages(ProblemShape s, int page_size) {
  s.kv_layout = KvLayout::kPaged;
  s.page_size = page_size;
  return s;
}

}  // namespace sparseprefill::test
