// SPDX-License-Identifier: Apache-2.0
// permute_stop's ranking order (DESIGN.md §3) as a sort key: a pure function compiled for the
// host (tested in cuda_plan_host_test) and for the kernels, which sort by it with CUB. No CUDA
// headers.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/geometry.h"

namespace sparseprefill::cuda {

// A ranking score (the fp64 dot product rounded to fp32, rules::ranking_score) as a
// 32-bit key whose unsigned order is the ranking order: numbers by value; NaN below every
// number (0: it ranks last in a descending sort); -0 equal to +0 (the stable sort then breaks
// the tie by index, as for any other tie).
SP_HD std::uint32_t rank_key(float x) {
  if (x != x) return 0;
  if (x == 0.0f) x = 0.0f;
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits >> 31) != 0 ? ~bits : bits | (std::uint32_t{1} << 31);
}

}  // namespace sparseprefill::cuda
