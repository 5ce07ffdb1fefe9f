// SPDX-License-Identifier: Apache-2.0
// The geometry (core/geometry.h) of one sequence of a validated problem: its lengths, causal
// alignment and local window. Every host layer builds sequence geometries here, so that none
// forgets the window or the chunks. Host-only.
#pragma once

#include <cstddef>

#include "core/geometry.h"
#include "sparseprefill/problem.h"

namespace sparseprefill::detail {

inline geom::SeqGeometry sequence_geometry(const ProblemShape& s, int b) {
  geom::SeqGeometry g;
  g.s_q = s.seq_q[static_cast<std::size_t>(b)];
  g.s_k = s.seq_k[static_cast<std::size_t>(b)];
  g.causal = s.causal;
  g.window_left = s.window_left;
  g.window_right = s.window_right;
  g.chunk = s.attention_chunk;
  return g;
}

inline geom::BlockGeometry block_geometry(const ProblemShape& s, int b, int block_q, int block_k) {
  geom::BlockGeometry g;
  g.seq = sequence_geometry(s, b);
  g.block_q = block_q;
  g.block_k = block_k;
  return g;
}

}  // namespace sparseprefill::detail
