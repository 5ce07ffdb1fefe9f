// SPDX-License-Identifier: Apache-2.0
// Work accounting derived from a policy's decisions and the block geometry, shared by every
// backend so that densities mean the same thing everywhere.
#pragma once

#include "sparseprefill/attention.h"

namespace sparseprefill::detail {

// Per (batch, query head): visible and kept blocks and pairs (see HeadStats). For block
// policies `decisions.kept` is read (per KV head masks count once per query head of the
// group); for permute_stop `decisions.tiles` is read.
RunStats stats_from_decisions(const ProblemShape& shape, const Policy& policy,
                              const Decisions& decisions);

}  // namespace sparseprefill::detail
