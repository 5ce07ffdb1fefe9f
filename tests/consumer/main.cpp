// SPDX-License-Identifier: Apache-2.0
// Consumer check: dense attention through the installed library equals a direct softmax.
#include <cmath>
#include <cstdio>
#include <vector>

#include "sparseprefill/sparseprefill.h"

int main() {
  namespace sp = sparseprefill;
  const int s = 5, d = 4;
  std::vector<float> q(s * d), k(s * d), v(s * d), o(s * d), lse(s);
  for (int i = 0; i < s * d; ++i) {
    q[i] = 0.125f * static_cast<float>((i * 7) % 11) - 0.5f;
    k[i] = 0.25f * static_cast<float>((i * 5) % 9) - 1.0f;
    v[i] = 0.5f * static_cast<float>((i * 3) % 7) - 1.5f;
  }
  sp::AttentionProblem p;
  p.q = sp::TensorView::contiguous(q.data(), sp::DType::kFP32, {1, s, 1, d});
  p.k = sp::TensorView::contiguous(k.data(), sp::DType::kFP32, {1, s, 1, d});
  p.v = sp::TensorView::contiguous(v.data(), sp::DType::kFP32, {1, s, 1, d});
  sp::AttentionOutput out;
  out.o = sp::TensorView::contiguous(o.data(), sp::DType::kFP32, {1, s, 1, d});
  out.lse = sp::TensorView::contiguous(lse.data(), sp::DType::kFP32, {1, 1, s});
  const sp::Status st = sp::run(p, sp::DenseParams{}, out);
  if (!st.ok()) {
    std::fprintf(stderr, "consumer: %s\n", st.to_string().c_str());
    return 1;
  }
  double worst = 0;
  for (int i = 0; i < s; ++i) {
    std::vector<double> w(static_cast<size_t>(i + 1));
    double m = -1e300, sum = 0;
    for (int j = 0; j <= i; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[i * d + c]) * k[j * d + c];
      w[j] = dot / std::sqrt(static_cast<double>(d));
      m = std::fmax(m, w[j]);
    }
    for (int j = 0; j <= i; ++j) sum += (w[j] = std::exp(w[j] - m));
    for (int c = 0; c < d; ++c) {
      double acc = 0;
      for (int j = 0; j <= i; ++j) acc += w[j] * v[j * d + c];
      worst = std::fmax(worst, std::fabs(acc / sum - o[i * d + c]));
    }
  }
  std::printf("consumer: dense attention max error %.3g\n", worst);
  return worst < 1e-5 ? 0 : 1;
}
