// SPDX-License-Identifier: Apache-2.0
// The oracle's view of one sequence of a call: q, k, v gathered exactly as double into
// contiguous [s, h, d] arrays, with the sequence's geometry. Every decision rule and the
// compute stage read only this. Host-only.
#pragma once

#include <cstdint>
#include <vector>

#include "core/geometry.h"
#include "sparseprefill/problem.h"

namespace sparseprefill::ref {

struct Sequence {
  int batch = 0;             // b, the sequence's index in the call
  geom::SeqGeometry geo;     // s_q, s_k, causal, window; row r sits at absolute position r + s_k - s_q
  int h_q = 0;
  int h_kv = 0;
  int d = 0;                 // head dim of q and k
  int d_v = 0;               // head dim of v and O
  double scale = 0.0;        // resolved softmax scale
  double softcap = 0.0;      // 0: none
  DType dtype = DType::kBF16;
  std::vector<double> q;     // [s_q, h_q, d], exact copies of the input values
  std::vector<double> k;     // [s_k, h_kv, d]
  std::vector<double> v;     // [s_k, h_kv, d_v]
  std::vector<double> sinks; // [h_q] sink logits; empty without sinks

  int group() const { return h_q / h_kv; }
  int kv_head(int h) const { return h / group(); }  // contiguous GQA
  const double* q_row(std::int64_t r, int h) const { return &q[index(r, h, h_q, d)]; }
  const double* k_row(std::int64_t t, int hk) const { return &k[index(t, hk, h_kv, d)]; }
  const double* v_row(std::int64_t t, int hk) const { return &v[index(t, hk, h_kv, d_v)]; }
  // The score the softmax and the rules read, rules::capped_score(scale · x) of a dot product x.
  double capped(double x) const;
  // s = capped(q_r · k_t) for query head h (reading kv head h / group).
  double score(std::int64_t r, int h, std::int64_t t) const;
  // Query head h's sink logit; -inf (no term) without sinks.
  double sink(int h) const;

 private:
  static std::size_t index(std::int64_t s, int h, int heads, int dim) {
    return (static_cast<std::size_t>(s) * static_cast<std::size_t>(heads) +
            static_cast<std::size_t>(h)) * static_cast<std::size_t>(dim);
  }
};

// Sequence b of a validated problem.
Sequence gather_sequence(const AttentionProblem& problem, const ProblemShape& shape, int b);

double dot(const double* a, const double* b, int d);

}  // namespace sparseprefill::ref
