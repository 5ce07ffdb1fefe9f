// SPDX-License-Identifier: Apache-2.0
// The fp64 oracle: validate, gather each sequence exactly as double, decide (one rule per
// policy, decide.h), expand the decisions into per-row key sets (row_sets.h) and compute every
// row's softmax over exactly those keys, in obvious loops.
#include "reference/reference.h"

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "core/estimate_chunks.h"
#include "core/rules/nan_max.h"
#include "reference/decide.h"
#include "reference/row_sets.h"
#include "reference/sequence.h"

namespace sparseprefill::ref {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

Status check_host(const ProblemShape& shape) {
  if (shape.device.kind != DeviceKind::kCPU) {
    return unsupported("reference backend: expected host (CPU) tensors, got q on CUDA device " +
                       std::to_string(shape.device.index));
  }
  return {};
}

// The policy's checks that need the problem's shape (validate_policy checks the rest).
Status check_policy_for(const ProblemShape& shape, const Policy& policy) {
  if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    const Status s = bs->mask.validate_for(shape);
    if (!s.ok()) return {s.code(), "mask: " + s.message()};
  } else if (const auto* eg = std::get_if<ExactGateParams>(&policy)) {
    if (eg->thresholds.shape[0] != shape.h_q) {
      return invalid_argument("thresholds: expected [h_q, positions] with h_q = " + std::to_string(shape.h_q) +
                              ", got " + describe(eg->thresholds));
    }
    if (eg->thresholds.device.kind != DeviceKind::kCPU) {
      return unsupported("thresholds: the reference backend reads host (CPU) tensors, got " + describe(eg->thresholds));
    }
  } else if (std::holds_alternative<EstimateSelectParams>(policy) ||
             std::holds_alternative<PermuteStopParams>(policy)) {
    if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
      detail::EstimateChunks chunks;
      SP_RETURN_IF_ERROR(detail::read_estimate_chunks(*es, shape, &chunks));
    }
    if (!shape.causal) {
      return unsupported(std::string(policy_name(policy)) + ": requires causal = true (the policy is defined on a causal prefix)");
    }
  }
  return {};
}

Status decide(const Sequence& seq, const ProblemShape& shape, const Policy& policy, Decisions* d) {
  if (const auto* p = std::get_if<ExactGateParams>(&policy)) return decide_exact_gate(seq, shape, *p, d);
  if (const auto* p = std::get_if<SoftmaxSkipParams>(&policy)) return decide_softmax_skip(seq, shape, *p, d);
  if (const auto* p = std::get_if<EstimateSelectParams>(&policy)) return decide_estimate_select(seq, shape, *p, d);
  if (const auto* p = std::get_if<PermuteStopParams>(&policy)) return decide_permute_stop(seq, shape, *p, d);
  return {};  // dense and block_sparse decide nothing per sequence
}

// Softmax of row r of head h over the row's keys and pseudo-tokens, all in double, with head h's
// sink logit as one more term of the denominator and the maximum (docs/semantics.md §1). A
// pseudo-token of block j has score capped(q·k̄_j) + ln n_j: weight n_j on e^{capped(q·k̄_j)}.
// o: [d_v]. No term (or only a -inf sink): O = 0, LSE = -inf; only a sink: O = 0, LSE = the sink.
// A NaN anywhere (a NaN or +inf sink too) makes the maximum, and so O and LSE, NaN.
void attend_row(const Sequence& seq, int h, std::int64_t r, const RowAttention& row,
                const BlockMeans* means, double* o, double* lse) {
  const auto d_v = static_cast<std::size_t>(seq.d_v);
  for (std::size_t i = 0; i < d_v; ++i) o[i] = 0.0;
  const std::size_t n = row.keys.size() + row.mean_blocks.size();
  const double sink = seq.sink(h);
  if (n == 0 && sink == kNegInf) {
    *lse = kNegInf;
    return;
  }
  std::vector<double> s(n);
  std::vector<const double*> value(n);
  const int hk = seq.kv_head(h);
  for (std::size_t i = 0; i < row.keys.size(); ++i) {
    s[i] = seq.score(r, h, row.keys[i]);
    value[i] = seq.v_row(row.keys[i], hk);
  }
  for (std::size_t i = 0; i < row.mean_blocks.size(); ++i) {
    const int j = row.mean_blocks[i];
    const std::size_t u = row.keys.size() + i;
    s[u] = seq.capped(dot(seq.q_row(r, h), means->k_mean(j, hk), seq.d)) +
           std::log(static_cast<double>(means->length[static_cast<std::size_t>(j)]));
    value[u] = means->v_mean(j, hk);
  }
  double m = sink;
  for (double x : s) m = rules::nan_max(m, x);
  double den = std::exp(sink - m);
  for (std::size_t u = 0; u < n; ++u) {
    const double w = std::exp(s[u] - m);
    den += w;
    for (std::size_t i = 0; i < d_v; ++i) o[i] += w * value[u][i];
  }
  for (std::size_t i = 0; i < d_v; ++i) o[i] /= den;
  *lse = m + std::log(den);
}

}  // namespace

void init_decisions(const ProblemShape& shape, const Policy& policy, Decisions* d) {
  *d = Decisions{};
  d->policy = policy_name(policy);
  if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    d->kept = bs->mask;
  } else if (const auto* eg = std::get_if<ExactGateParams>(&policy)) {
    d->kept = BlockMask::empty(shape, eg->block_q, eg->block_k, false);
  } else if (const auto* ss = std::get_if<SoftmaxSkipParams>(&policy)) {
    d->kept = BlockMask::empty(shape, ss->block_q, ss->block_k, false);
  } else if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    d->kept = BlockMask::empty(shape, es->block, es->block, es->pack_gqa);
    if (es->mean_correction) d->corrected = BlockMask::empty(shape, es->block, es->block, es->pack_gqa);
  } else if (std::holds_alternative<PermuteStopParams>(policy)) {
    d->query_order.assign(static_cast<std::size_t>(shape.batch * shape.h_q * shape.max_seq_q()), -1);
  }
}

Status attend_decisions(const AttentionProblem& problem, const Policy& policy,
                        const Decisions& decisions, Result* result) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(check_host(shape));
  SP_RETURN_IF_ERROR(validate_policy(policy));
  SP_RETURN_IF_ERROR(check_policy_for(shape, policy));
  SP_RETURN_IF_ERROR(check_decisions(shape, policy, decisions));

  // O [rows, h_q, d_v] and LSE [h_q, rows], rows in batch order: row = q_start[b] + r.
  const std::int64_t rows = shape.total_q();
  const auto d = static_cast<std::size_t>(shape.d_v);
  result->o.assign(static_cast<std::size_t>(rows * shape.h_q) * d, 0.0);
  result->lse.assign(static_cast<std::size_t>(rows * shape.h_q), kNegInf);
  RowAttention row;
  for (int b = 0; b < shape.batch; ++b) {
    const Sequence seq = gather_sequence(problem, shape, b);
    RowSets sets;
    sets.init(seq, shape, policy, decisions);
    const std::int64_t row0 = shape.q_start[static_cast<std::size_t>(b)];
    for (int h = 0; h < shape.h_q; ++h) {
      for (std::int64_t r = 0; r < seq.geo.s_q; ++r) {
        sets.row(h, r, &row);
        const std::int64_t out_row = row0 + r;
        attend_row(seq, h, r, row, sets.means(),
                   &result->o[static_cast<std::size_t>(out_row * shape.h_q + h) * d],
                   &result->lse[static_cast<std::size_t>(h * rows + out_row)]);
      }
    }
  }
  return {};
}

Status decide_reference(const AttentionProblem& problem, const Policy& policy, Decisions* decisions) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(check_host(shape));
  SP_RETURN_IF_ERROR(validate_policy(policy));
  SP_RETURN_IF_ERROR(check_policy_for(shape, policy));
  init_decisions(shape, policy, decisions);
  for (int b = 0; b < shape.batch; ++b) {
    SP_RETURN_IF_ERROR(decide(gather_sequence(problem, shape, b), shape, policy, decisions));
  }
  return {};
}

Status run_reference(const AttentionProblem& problem, const Policy& policy, Result* result) {
  Decisions decisions;
  SP_RETURN_IF_ERROR(decide_reference(problem, policy, &decisions));
  SP_RETURN_IF_ERROR(attend_decisions(problem, policy, decisions, result));
  result->decisions = std::move(decisions);
  return {};
}

}  // namespace sparseprefill::ref
