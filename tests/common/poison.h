// SPDX-License-Identifier: Apache-2.0
// Output poisoning: fill output buffers with NaN before a run, then check that every element
// the oracle defines was written (an unwritten element still reads NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>

#include <gtest/gtest.h>

#include "reference/reference.h"
#include "sparseprefill/types.h"

namespace sparseprefill::test {

// Sets every element of a contiguous host tensor to a quiet NaN of its dtype.
inline void poison(HostTensor* t) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t i = 0; i < t->numel(); ++i) {
    switch (t->dtype()) {
      case DType::kBF16: t->as<std::uint16_t>()[i] = float_to_bf16(nan); break;
      case DType::kFP16: t->as<std::uint16_t>()[i] = float_to_fp16(nan); break;
      case DType::kFP32: t->as<float>()[i] = nan; break;
      case DType::kInt32: t->as<std::int32_t>()[i] = -1; break;
    }
  }
}

// `out` (a backend's output read back in the oracle's layout, see tolerance.h read_output)
// holds no NaN where the oracle's result is not NaN. An empty out.lse (no LSE written) is not
// checked.
inline ::testing::AssertionResult fully_written(const ref::Result& out, const ref::Result& ref64) {
  std::int64_t o_left = 0, lse_left = 0, first = -1;
  for (std::size_t i = 0; i < ref64.o.size() && i < out.o.size(); ++i) {
    if (std::isnan(out.o[i]) && !std::isnan(ref64.o[i])) {
      if (first < 0) first = static_cast<std::int64_t>(i);
      ++o_left;
    }
  }
  for (std::size_t i = 0; i < ref64.lse.size() && i < out.lse.size(); ++i) {
    lse_left += std::isnan(out.lse[i]) && !std::isnan(ref64.lse[i]);
  }
  if (out.o.size() != ref64.o.size() || (!out.lse.empty() && out.lse.size() != ref64.lse.size())) {
    return ::testing::AssertionFailure() << "output sizes differ from the oracle's";
  }
  if (o_left == 0 && lse_left == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << o_left << " O elements (first at flat index " << first
                                       << ") and " << lse_left << " LSE elements still hold the poison NaN";
}

}  // namespace sparseprefill::test
