// SPDX-License-Identifier: Apache-2.0
// The naive masked softmax (see naive.h).
#include "naive.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace sparseprefill::test {

bool causally_visible(std::int64_t s_q, std::int64_t s_k, std::int64_t r, std::int64_t t) {
  return t <= r + s_k - s_q;
}

bool window_visible(std::int64_t s_q, std::int64_t s_k, bool causal, int left, int right, std::int64_t r,
                    std::int64_t t, int chunk) {
  const std::int64_t a = r + s_k - s_q;
  if (causal && t > a) return false;
  if (left >= 0 && t < a - left) return false;
  if (chunk > 0) {
    const std::int64_t c0 = a - ((a % chunk) + chunk) % chunk;  // FlashAttention's chunk start
    if (t < c0 || t >= c0 + chunk) return false;
  }
  return right < 0 || t <= a + right;
}

ref::Result masked_softmax(const Inputs& in, double scale, const ElementMask& keep, double softcap) {
  if (scale == 0.0) scale = 1.0 / std::sqrt(static_cast<double>(in.d));
  std::int64_t rows = 0;
  for (int b = 0; b < static_cast<int>(in.seqs.size()); ++b) rows += in.s_q(b);
  ref::Result res;
  res.o.assign(static_cast<std::size_t>(rows * in.h_q * in.d_v), 0.0);
  res.lse.assign(static_cast<std::size_t>(rows * in.h_q), -std::numeric_limits<double>::infinity());
  std::int64_t row0 = 0;
  for (int b = 0; b < static_cast<int>(in.seqs.size()); ++b) {
    const SequenceData& s = in.seqs[static_cast<std::size_t>(b)];
    for (std::int64_t r = 0; r < in.s_q(b); ++r) {
      for (int h = 0; h < in.h_q; ++h) {
        const int hk = h / (in.h_q / in.h_kv);
        std::vector<double> score;
        std::vector<std::int64_t> key;
        for (std::int64_t t = 0; t < in.s_k(b); ++t) {
          if (!keep(b, h, r, t)) continue;
          double dot = 0.0;
          for (int i = 0; i < in.d; ++i) dot += get(s.q, (r * in.h_q + h) * in.d + i) * get(s.k, (t * in.h_kv + hk) * in.d + i);
          score.push_back(softcap > 0 ? softcap * std::tanh(scale * dot / softcap) : scale * dot);
          key.push_back(t);
        }
        // The sink: a logit whose value row is 0 (gpt-oss appends it as a softmax column); -inf
        // adds nothing.
        const bool sink = !in.sinks.empty() && in.sinks[static_cast<std::size_t>(h)] != -std::numeric_limits<double>::infinity();
        if (key.empty() && !sink) continue;
        double m = sink ? in.sinks[static_cast<std::size_t>(h)] : score[0];
        for (double x : score) m = std::max(m, x);
        double den = sink ? std::exp(in.sinks[static_cast<std::size_t>(h)] - m) : 0.0;
        double* o = &res.o[static_cast<std::size_t>(((row0 + r) * in.h_q + h) * in.d_v)];
        for (std::size_t n = 0; n < key.size(); ++n) {
          const double w = std::exp(score[n] - m);
          den += w;
          for (int i = 0; i < in.d_v; ++i) o[i] += w * get(s.v, (key[n] * in.h_kv + hk) * in.d_v + i);
        }
        for (int i = 0; i < in.d_v; ++i) o[i] /= den;
        res.lse[static_cast<std::size_t>(h * rows + row0 + r)] = m + std::log(den);
      }
    }
    row0 += in.s_q(b);
  }
  return res;
}

}  // namespace sparseprefill::test
