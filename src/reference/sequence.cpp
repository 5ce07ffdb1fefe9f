// SPDX-License-Identifier: Apache-2.0
// Gathering one sequence for the oracle (see sequence.h).
#include "reference/sequence.h"

#include <limits>

#include "core/rules/softcap.h"
#include "core/shape_geometry.h"
#include "core/tensor_access.h"

namespace sparseprefill::ref {

double Sequence::capped(double x) const { return rules::capped_score(scale * x, softcap); }

double Sequence::score(std::int64_t r, int h, std::int64_t t) const {
  return capped(dot(q_row(r, h), k_row(t, kv_head(h)), d));
}

double Sequence::sink(int h) const {
  return sinks.empty() ? -std::numeric_limits<double>::infinity() : sinks[static_cast<std::size_t>(h)];
}

Sequence gather_sequence(const AttentionProblem& problem, const ProblemShape& shape, int b) {
  Sequence seq;
  seq.batch = b;
  seq.geo = detail::sequence_geometry(shape, b);
  seq.h_q = shape.h_q;
  seq.h_kv = shape.h_kv;
  seq.d = shape.d;
  seq.d_v = shape.d_v;
  seq.scale = shape.scale;
  seq.softcap = shape.softcap;
  seq.dtype = shape.dtype;
  detail::gather_q(problem, shape, b, &seq.q);
  detail::gather_kv(problem, shape, b, /*value=*/false, &seq.k);
  detail::gather_kv(problem, shape, b, /*value=*/true, &seq.v);
  if (shape.sinks) detail::gather_sinks(problem, shape, &seq.sinks);
  return seq;
}

double dot(const double* a, const double* b, int d) {
  double acc = 0.0;
  for (int i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace sparseprefill::ref
