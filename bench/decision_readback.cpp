// SPDX-License-Identifier: Apache-2.0
// The host side of reading a CUDA call's decisions back (decisions, or collect_stats() in Python,
// which the quality suite holds open for every prefill): the selector's arrays into a BlockMask
// (mask_from_arrays, estimate_select), a gate's kept bits into one (mask_from_bits, exact_gate and
// softmax_skip), and the statistics from it (stats_from_decisions). No GPU: the arrays are made
// here. Shape of a RULER batch on Qwen2.5-Coder-1.5B: 16 sequences of 32K, 12 query heads,
// blocks of 128, causal; per row the sink and the last four blocks kept, the others with
// probability 0.12 (about the quality run's density). Median of --repeats (one layer each).
// Usage: sp_decision_readback [--batch 16] [--length 32768] [--repeats 7]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "core/stats.h"
#include "cuda/plan.h"

namespace sp = sparseprefill;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void check(const sp::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.to_string().c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int batch = 16, repeats = 7;
  std::int64_t length = 32768;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch")) batch = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--length")) length = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
  }
  sp::ProblemShape s;
  s.batch = batch;
  s.h_q = 12;
  s.h_kv = 2;
  s.d = s.d_v = 128;
  s.scale = 0.088;
  for (int b = 0; b < batch; ++b) {
    s.seq_q.push_back(length);
    s.seq_k.push_back(length);
    s.q_start.push_back(b * length);
    s.k_start.push_back(b * length);
  }
  const int nq = static_cast<int>((length + 127) / 128), words = sp::cuda::bitmap_words(nq);
  const std::size_t rows = static_cast<std::size_t>(batch) * s.h_q * nq, cap = static_cast<std::size_t>(nq);
  std::vector<std::int32_t> fc(rows, 0), fi(rows * cap, 0), pc(rows, 1), pi(rows * cap, 0);
  std::vector<std::uint32_t> bits(rows * static_cast<std::size_t>(words), 0u);
  std::mt19937 rng(1);
  for (std::size_t r = 0; r < rows; ++r) {
    const int qb = static_cast<int>(r % static_cast<std::size_t>(nq));
    for (int kb = 0; kb < qb; ++kb) {
      if (kb == 0 || kb >= qb - 4 || rng() % 100 < 12) {
        fi[r * cap + static_cast<std::size_t>(fc[r]++)] = kb;
        bits[r * static_cast<std::size_t>(words) + static_cast<std::size_t>(kb / 32)] |= 1u << (kb % 32);
      }
    }
    pi[r * cap] = qb;  // the diagonal block, the one partial block of a causal row
    bits[r * static_cast<std::size_t>(words) + static_cast<std::size_t>(qb / 32)] |= 1u << (qb % 32);
  }
  sp::Policy policy = sp::EstimateSelectParams{};
  std::vector<double> arrays, from_bits, stats;
  double density = 0.0;
  for (int i = 0; i < repeats; ++i) {
    std::vector<std::int32_t> a = fc, b = fi, c = pc, d = pi;  // as downloaded: the conversion owns them
    sp::Decisions dec;
    auto t0 = std::chrono::steady_clock::now();
    check(sp::cuda::mask_from_arrays(s, 128, false, std::move(a), std::move(b), std::move(c), std::move(d), &dec.kept),
          "mask_from_arrays");
    arrays.push_back(ms_since(t0));
    t0 = std::chrono::steady_clock::now();
    const sp::RunStats rs = sp::detail::stats_from_decisions(s, policy, dec);
    stats.push_back(ms_since(t0));
    density = rs.density();
    sp::BlockMask m;
    t0 = std::chrono::steady_clock::now();
    check(sp::cuda::mask_from_bits(s, 128, 128, false, bits, &m), "mask_from_bits");
    from_bits.push_back(ms_since(t0));
  }
  std::printf("batch %d, length %lld, %d query heads, block 128, block density %.3f; median of %d, ms per layer:\n",
              batch, static_cast<long long>(length), s.h_q, density, repeats);
  std::printf("  mask_from_arrays      %8.1f\n  mask_from_bits        %8.1f\n  stats_from_decisions  %8.1f\n",
              median(arrays), median(from_bits), median(stats));
  return 0;
}
