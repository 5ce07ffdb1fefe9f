// SPDX-License-Identifier: Apache-2.0
// Near-exact result comparisons (see results.h).
#include "results.h"

#include <algorithm>
#include <cmath>

namespace sparseprefill::test {
namespace {

::testing::AssertionResult same_values(const char* name, const std::vector<double>& got,
                                       const std::vector<double>& want, double tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << name << ": " << got.size() << " values, expected " << want.size();
  }
  std::int64_t bad = 0, first = -1;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double x = got[i], y = want[i];
    bool ok = false;
    if (std::isnan(y) || std::isnan(x)) {
      ok = std::isnan(x) && std::isnan(y);
    } else if (std::isinf(y) || std::isinf(x)) {
      ok = x == y;
    } else {
      ok = std::fabs(x - y) <= tol;
      worst = std::max(worst, std::fabs(x - y));
    }
    if (!ok && bad++ == 0) first = static_cast<std::int64_t>(i);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": " << bad << " values differ by more than " << tol
                                       << " (largest finite difference " << worst << "); first at flat index "
                                       << first << ": got " << got[static_cast<std::size_t>(first)] << ", expected "
                                       << want[static_cast<std::size_t>(first)];
}

}  // namespace

::testing::AssertionResult same_result(const ref::Result& got, const ref::Result& want, double tol) {
  ::testing::AssertionResult o = same_values("O", got.o, want.o, tol);
  if (!o) return o;
  return same_values("LSE", got.lse, want.lse, tol);
}

std::vector<int> kept_blocks(const BlockMask& m, int b, int h, int qb) {
  std::vector<int> out;
  const std::int64_t row = m.row(b, h, qb);
  const std::size_t base = static_cast<std::size_t>(row * m.num_k_blocks);
  for (std::int32_t i = 0; i < m.full_count[static_cast<std::size_t>(row)]; ++i) out.push_back(m.full_index[base + static_cast<std::size_t>(i)]);
  for (std::int32_t i = 0; i < m.partial_count[static_cast<std::size_t>(row)]; ++i) out.push_back(m.partial_index[base + static_cast<std::size_t>(i)]);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace sparseprefill::test
