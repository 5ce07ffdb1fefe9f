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

ref::Result masked_softmax(const Inputs& in, double scale, const ElementMask& keep) {
  if (scale == 0.0) scale = 1.0 / std::sqrt(static_cast<double>(in.d));
  std::int64_t rows = 0;
  for (int b = 0; b < static_cast<int>(in.seqs.size()); ++b) rows += in.s_q(b);
  ref::Result res;
  res.o.assign(static_cast<std::size_t>(rows * in.h_q * in.d), 0.0);
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
          score.push_back(scale * dot);
          key.push_back(t);
        }
        if (key.empty()) continue;
        double m = score[0];
        for (double x : score) m = std::max(m, x);
        double den = 0.0;
        double* o = &res.o[static_cast<std::size_t>(((row0 + r) * in.h_q + h) * in.d)];
        for (std::size_t n = 0; n < key.size(); ++n) {
          const double w = std::exp(score[n] - m);
          den += w;
          for (int i = 0; i < in.d; ++i) o[i] += w * get(s.v, (key[n] * in.h_kv + hk) * in.d + i);
        }
        for (int i = 0; i < in.d; ++i) o[i] /= den;
        res.lse[static_cast<std::size_t>(h * rows + row0 + r)] = m + std::log(den);
      }
    }
    row0 += in.s_q(b);
  }
  return res;
}

}  // namespace sparseprefill::test
