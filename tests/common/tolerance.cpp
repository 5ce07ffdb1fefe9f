// SPDX-License-Identifier: Apache-2.0
// The calibrated comparison and the low-precision reference (see tolerance.h).
#include "tolerance.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "poison.h"
#include "reference/row_sets.h"
#include "core/rules/softcap.h"
#include "cuda/kernel/tuning.h"
#include "reference/sequence.h"

namespace sparseprefill::test {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double load(const TensorView& t, std::int64_t offset) {
  switch (t.dtype) {
    case DType::kBF16: return bf16_to_float(static_cast<const std::uint16_t*>(t.data)[offset]);
    case DType::kFP16: return fp16_to_float(static_cast<const std::uint16_t*>(t.data)[offset]);
    case DType::kFP32: return static_cast<const float*>(t.data)[offset];
    case DType::kInt32: return static_cast<const std::int32_t*>(t.data)[offset];
  }
  return std::nan("");
}

// A bf16 block mean of FP8 inputs as the Hopper kernel's mean tiles read it (FwdParams::k_mean8,
// v_mean_t): requantized to e4m3 in its tensor's descaled domain, x / descale rounded to nearest
// and saturated at ±448, times the descale again; 0 where 1 / descale is not finite.
float requantized_e4m3(float x, float descale) {
  const float inv = 1.0f / descale;
  if (!std::isfinite(inv)) return 0.0f;
  return round_to(DType::kFP8E4M3, std::clamp(x * inv, -448.0f, 448.0f)) * descale;
}

float max_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

// x rounded to 14 significant bits, to nearest even: frexp's m · 2^14 rounded to an integer,
// times 2^(e - 14). For normal numbers that is rounding the fp32 significand's low 10 bits
// away on the bit pattern (a carry moves into the exponent, past the largest finite value to
// infinity, as the libm form's); zero, subnormals, infinities and NaN take the libm form.
float round_to_14_bits(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  const std::uint32_t exponent = (bits >> 23) & 0xFFu;
  if (exponent == 0 || exponent == 0xFFu) {
    int e = 0;
    const float m = std::frexp(x, &e);
    return std::ldexp(std::nearbyint(std::ldexp(m, 14)), e - 14);
  }
  bits += 0x1FFu + ((bits >> 10) & 1u);
  bits &= ~0x3FFu;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// One row in the low-precision arithmetic of a FlashAttention-class kernel: fp32 scores
// (fp32 accumulation of q·k, then the fp32 scale and the fp32 softcap), fp32 exp and row sum,
// P rounded to the input dtype before P·V, fp32 accumulation, the fp32 sink term in the
// denominator, O rounded to the input dtype. FP8: mean_descale[0] and [1] hold k's and v's
// descales per KV head, with which the block means are requantized (requantized_e4m3).
void lowp_row(const ref::Sequence& seq, const std::vector<float>& q, const std::vector<float>& k,
              const std::vector<float>& v, int h, std::int64_t r, const ref::RowAttention& row,
              const ref::BlockMeans* means, const std::vector<float> (&mean_descale)[2], double* o, double* lse) {
  const auto d = static_cast<std::size_t>(seq.d), d_v = static_cast<std::size_t>(seq.d_v);
  const int hk = seq.kv_head(h);
  const float* q_row = &q[(static_cast<std::size_t>(r) * static_cast<std::size_t>(seq.h_q) + static_cast<std::size_t>(h)) * d];
  const auto kv_at = [&](const std::vector<float>& x, std::int64_t t, std::size_t dim) {
    return &x[(static_cast<std::size_t>(t) * static_cast<std::size_t>(seq.h_kv) + static_cast<std::size_t>(hk)) * dim];
  };
  // FP8 inputs: Hopper's e4m3 tensor cores keep about 14 significant bits while they accumulate
  // q·k, not fp32's 24 (DeepSeek-V3 technical report, §3.3.2), so the score keeps 14 bits after
  // every addition here.
  const bool fp8 = seq.dtype == DType::kFP8E4M3;
  const auto dot = [&](const float* a, const float* b) {
    float acc = 0.0f;
    for (std::size_t i = 0; i < d; ++i) {
      acc += a[i] * b[i];
      if (fp8) acc = round_to_14_bits(acc);
    }
    return acc;
  };
  const auto scale = static_cast<float>(seq.scale), softcap = static_cast<float>(seq.softcap);
  const auto score = [&](const float* key) { return rules::capped_score(scale * dot(q_row, key), softcap); };
  const std::size_t n = row.keys.size() + row.mean_blocks.size();
  std::vector<float> s(n);
  std::vector<std::vector<float>> mean_kv(2 * row.mean_blocks.size());
  std::vector<const float*> value(n);
  for (std::size_t i = 0; i < row.keys.size(); ++i) {
    s[i] = score(kv_at(k, row.keys[i], d));
    value[i] = kv_at(v, row.keys[i], d_v);
  }
  for (std::size_t i = 0; i < row.mean_blocks.size(); ++i) {
    const int j = row.mean_blocks[i];
    // Already in the input dtype.
    std::vector<float>& km = mean_kv[2 * i] = std::vector<float>(means->k_mean(j, hk), means->k_mean(j, hk) + d);
    std::vector<float>& vm = mean_kv[2 * i + 1] = std::vector<float>(means->v_mean(j, hk), means->v_mean(j, hk) + d_v);
    if (fp8) {
      for (float& x : km) x = requantized_e4m3(x, mean_descale[0][static_cast<std::size_t>(hk)]);
      for (float& x : vm) x = requantized_e4m3(x, mean_descale[1][static_cast<std::size_t>(hk)]);
    }
    const std::size_t u = row.keys.size() + i;
    s[u] = score(km.data()) + std::log(static_cast<float>(means->length[static_cast<std::size_t>(j)]));
    value[u] = vm.data();
  }
  const auto sink = static_cast<float>(seq.sink(h));
  if (n == 0 && sink == -std::numeric_limits<float>::infinity()) {
    for (std::size_t c = 0; c < d_v; ++c) o[c] = 0.0;
    *lse = kNegInf;
    return;
  }
  float m = sink;
  for (float x : s) m = max_nan(m, x);
  float l = std::exp(sink - m);
  std::vector<float> acc(d_v, 0.0f);
  // FP8: P is rounded to e4m3 at 2^kFp8PLog2Offset times its value, as the kernel exponentiates
  // it (its running max sits that far below the true one: docs/numerics.md, FP8).
  const float p_scale = fp8 ? std::ldexp(1.0f, cuda::tuning::kFp8PLog2Offset) : 1.0f;
  for (std::size_t u = 0; u < n; ++u) {
    const float p = std::exp(s[u] - m);
    const float p_rounded = fp8 ? round_to(seq.dtype, p * p_scale) / p_scale : round_to(seq.dtype, p);
    l += p;
    for (std::size_t c = 0; c < d_v; ++c) acc[c] += p_rounded * value[u][c];
  }
  // O in the output dtype (bf16 for fp8 inputs, whose P is rounded to fp8 as an FP8 kernel's).
  const DType out_dtype = seq.dtype == DType::kFP8E4M3 ? DType::kBF16 : seq.dtype;
  for (std::size_t c = 0; c < d_v; ++c) o[c] = round_to(out_dtype, acc[c] / l);
  *lse = static_cast<double>(m + std::log(l));
}

struct ErrorStats {
  double max_err = 0.0;
  double sum_err = 0.0;
  std::int64_t count = 0;
  std::int64_t argmax = -1;
  std::int64_t nan_mismatch = 0;   // NaN (or inf) where the oracle is finite, or the reverse
  std::int64_t first_mismatch = -1;
  double max_ref = 0.0;            // max |ref| over finite entries
};

// Element-wise comparison; an infinite oracle value (LSE of an empty row) must be matched exactly.
ErrorStats compare(const std::vector<double>& out, const std::vector<double>& ref) {
  ErrorStats e;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double x = out[i], y = ref[i];
    if (std::isnan(y) || std::isinf(y)) {
      const bool same = std::isnan(y) ? std::isnan(x) : x == y;
      if (!same) {
        if (e.first_mismatch < 0) e.first_mismatch = static_cast<std::int64_t>(i);
        ++e.nan_mismatch;
      }
      continue;
    }
    e.max_ref = std::max(e.max_ref, std::fabs(y));
    if (!std::isfinite(x)) {
      if (e.first_mismatch < 0) e.first_mismatch = static_cast<std::int64_t>(i);
      ++e.nan_mismatch;
      continue;
    }
    const double err = std::fabs(x - y);
    if (err > e.max_err || e.argmax < 0) {
      e.max_err = err;
      e.argmax = static_cast<std::int64_t>(i);
    }
    e.sum_err += err;
    ++e.count;
  }
  return e;
}

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP8E4M3: return std::ldexp(1.0, -8);  // fp8 inputs: a bf16 output
    case DType::kFP16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -20);
  }
}

}  // namespace

ref::Result read_output(const AttentionOutput& out, const ProblemShape& s) {
  ref::Result res;
  const std::int64_t rows = s.total_q();
  res.o.assign(static_cast<std::size_t>(rows * s.h_q * s.d_v), 0.0);
  if (out.lse.defined()) res.lse.assign(static_cast<std::size_t>(rows * s.h_q), 0.0);
  for (int b = 0; b < s.batch; ++b) {
    const std::int64_t row0 = s.q_start[static_cast<std::size_t>(b)];
    for (std::int64_t r = 0; r < s.seq_q[static_cast<std::size_t>(b)]; ++r) {
      for (int h = 0; h < s.h_q; ++h) {
        const std::int64_t base = s.varlen_q
            ? (row0 + r) * out.o.stride[0] + h * out.o.stride[1]
            : b * out.o.stride[0] + r * out.o.stride[1] + h * out.o.stride[2];
        for (int i = 0; i < s.d_v; ++i) {
          res.o[static_cast<std::size_t>(((row0 + r) * s.h_q + h) * s.d_v + i)] = load(out.o, base + i);
        }
        if (!out.lse.defined()) continue;
        const std::int64_t off = s.varlen_q
            ? h * out.lse.stride[0] + (row0 + r) * out.lse.stride[1]
            : b * out.lse.stride[0] + h * out.lse.stride[1] + r * out.lse.stride[2];
        res.lse[static_cast<std::size_t>(h * rows + row0 + r)] = load(out.lse, off);
      }
    }
  }
  return res;
}

Status run_lowp_reference(const AttentionProblem& problem, const Policy& policy,
                          const Decisions& decisions, ref::Result* result) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(validate_policy(policy));
  SP_RETURN_IF_ERROR(ref::check_decisions(shape, policy, decisions));
  const std::int64_t rows = shape.total_q();
  const auto d = static_cast<std::size_t>(shape.d_v);
  result->o.assign(static_cast<std::size_t>(rows * shape.h_q) * d, 0.0);
  result->lse.assign(static_cast<std::size_t>(rows * shape.h_q), kNegInf);
  ref::RowAttention row;
  for (int b = 0; b < shape.batch; ++b) {
    const ref::Sequence seq = ref::gather_sequence(problem, shape, b);
    ref::RowSets sets;
    sets.init(seq, shape, policy, decisions);
    // The inputs are values of their dtype, so these copies are exact.
    const std::vector<float> q(seq.q.begin(), seq.q.end());
    const std::vector<float> k(seq.k.begin(), seq.k.end());
    const std::vector<float> v(seq.v.begin(), seq.v.end());
    std::vector<float> mean_descale[2];  // FP8: k's and v's descales [h_kv] (1 where absent)
    if (shape.dtype == DType::kFP8E4M3) {
      const TensorView* descales[2] = {&problem.k_descale, &problem.v_descale};
      for (int i = 0; i < 2; ++i) {
        const TensorView& t = *descales[i];
        for (int hk = 0; hk < shape.h_kv; ++hk) {
          mean_descale[i].push_back(t.defined() ? static_cast<float>(load(t, b * t.stride[0] + hk * t.stride[1])) : 1.0f);
        }
      }
    }
    const std::int64_t row0 = shape.q_start[static_cast<std::size_t>(b)];
    for (int h = 0; h < shape.h_q; ++h) {
      for (std::int64_t r = 0; r < seq.geo.s_q; ++r) {
        sets.row(h, r, &row);
        lowp_row(seq, q, k, v, h, r, row, sets.means(), mean_descale,
                 &result->o[static_cast<std::size_t>((row0 + r) * shape.h_q + h) * d],
                 &result->lse[static_cast<std::size_t>(h * rows + row0 + r)]);
      }
    }
  }
  result->decisions = decisions;
  return {};
}

::testing::AssertionResult close_calibrated(DType dtype, const ref::Result& out,
                                            const ref::Result& ref64, const ref::Result& lowp,
                                            const Tolerance& tol) {
  if (out.o.size() != ref64.o.size() || lowp.o.size() != ref64.o.size()) {
    return ::testing::AssertionFailure() << "O sizes differ: out " << out.o.size() << ", oracle "
                                         << ref64.o.size() << ", low-precision " << lowp.o.size();
  }
  const ErrorStats e = compare(out.o, ref64.o);
  const ErrorStats low = compare(lowp.o, ref64.o);
  const double eps = tol.eps >= 0 ? tol.eps : unit_roundoff(dtype) * e.max_ref;
  const double bound = tol.factor * low.max_err + eps;
  std::ostringstream msg;
  bool ok = e.nan_mismatch == 0 && e.max_err <= bound;
  msg << "O: max err " << e.max_err << " at flat index " << e.argmax << " of [rows, h_q, d] (oracle "
      << (e.argmax >= 0 ? ref64.o[static_cast<std::size_t>(e.argmax)] : 0.0) << ", got "
      << (e.argmax >= 0 ? out.o[static_cast<std::size_t>(e.argmax)] : 0.0) << "), mean err "
      << (e.count > 0 ? e.sum_err / static_cast<double>(e.count) : 0.0) << "; bound " << bound << " = "
      << tol.factor << " x low-precision max err " << low.max_err << " + eps " << eps << " (max|O| "
      << e.max_ref << "); NaN/inf mismatches " << e.nan_mismatch;
  if (e.first_mismatch >= 0) {
    msg << " (first at flat index " << e.first_mismatch << ": oracle " << ref64.o[static_cast<std::size_t>(e.first_mismatch)]
        << ", got " << out.o[static_cast<std::size_t>(e.first_mismatch)] << ")";
  }
  if (!out.lse.empty()) {
    if (out.lse.size() != ref64.lse.size() || lowp.lse.size() != ref64.lse.size()) {
      return ::testing::AssertionFailure() << "LSE sizes differ: out " << out.lse.size() << ", oracle "
                                           << ref64.lse.size() << ", low-precision " << lowp.lse.size();
    }
    const ErrorStats el = compare(out.lse, ref64.lse);
    const ErrorStats lowl = compare(lowp.lse, ref64.lse);
    const double lse_eps = tol.lse_eps >= 0 ? tol.lse_eps : 1e-5 * std::max(1.0, el.max_ref);
    const double lse_bound = tol.factor * lowl.max_err + lse_eps;
    ok = ok && el.nan_mismatch == 0 && el.max_err <= lse_bound;
    msg << "\nLSE: max err " << el.max_err << " at flat index " << el.argmax << " of [h_q, rows], mean err "
        << (el.count > 0 ? el.sum_err / static_cast<double>(el.count) : 0.0) << "; bound " << lse_bound << " = "
        << tol.factor << " x low-precision max err " << lowl.max_err << " + eps " << lse_eps
        << "; NaN/inf mismatches " << el.nan_mismatch;
    if (el.first_mismatch >= 0) {
      msg << " (first at flat index " << el.first_mismatch << ": oracle "
          << ref64.lse[static_cast<std::size_t>(el.first_mismatch)] << ", got "
          << out.lse[static_cast<std::size_t>(el.first_mismatch)] << ")";
    }
  }
  if (ok) return ::testing::AssertionSuccess() << msg.str();
  return ::testing::AssertionFailure() << msg.str();
}

::testing::AssertionResult matches_reference(const AttentionProblem& problem,
                                             const Policy& policy, const AttentionOutput& out,
                                             const Tolerance& tol, ref::Result* ref64_out) {
  ProblemShape shape;
  Status st = validate_problem(problem, &out, &shape);
  if (!st.ok()) return ::testing::AssertionFailure() << "validate_problem: " << st.to_string();
  ref::Result ref64, lowp;
  st = ref::run_reference(problem, policy, &ref64);
  if (!st.ok()) return ::testing::AssertionFailure() << "run_reference: " << st.to_string();
  st = run_lowp_reference(problem, policy, ref64.decisions, &lowp);
  if (!st.ok()) return ::testing::AssertionFailure() << "run_lowp_reference: " << st.to_string();
  const ref::Result got = read_output(out, shape);
  ::testing::AssertionResult written = fully_written(got, ref64);
  ::testing::AssertionResult close = close_calibrated(shape.dtype, got, ref64, lowp, tol);
  if (ref64_out != nullptr) *ref64_out = std::move(ref64);
  if (!written) return written;
  return close;
}

}  // namespace sparseprefill::test
