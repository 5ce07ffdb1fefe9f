// SPDX-License-Identifier: Apache-2.0
// Gathering one sequence for the oracle (see sequence.h).
#include "reference/sequence.h"

#include "core/tensor_access.h"

namespace sparseprefill::ref {

double Sequence::score(std::int64_t r, int h, std::int64_t t) const {
  return scale * dot(q_row(r, h), k_row(t, kv_head(h)), d);
}

Sequence gather_sequence(const AttentionProblem& problem, const ProblemShape& shape, int b) {
  Sequence seq;
  seq.batch = b;
  seq.geo.s_q = shape.seq_q[static_cast<std::size_t>(b)];
  seq.geo.s_k = shape.seq_k[static_cast<std::size_t>(b)];
  seq.geo.causal = shape.causal;
  seq.h_q = shape.h_q;
  seq.h_kv = shape.h_kv;
  seq.d = shape.d;
  seq.scale = shape.scale;
  seq.dtype = shape.dtype;
  detail::gather_q(problem, shape, b, &seq.q);
  detail::gather_kv(problem, shape, b, /*value=*/false, &seq.k);
  detail::gather_kv(problem, shape, b, /*value=*/true, &seq.v);
  return seq;
}

double dot(const double* a, const double* b, int d) {
  double acc = 0.0;
  for (int i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace sparseprefill::ref
