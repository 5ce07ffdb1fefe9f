// SPDX-License-Identifier: Apache-2.0
// A seeded structured generator of Q/K/V whose attention looks like an LLM's: attention
// sinks, local windows, vertical stripes (keys many queries retrieve), slash diagonals and
// noise, with a knob for how peaked the heads are. Bit-reproducible from C++ and Python: the
// random stream is splitmix64 and every value is built from +, -, * on doubles in a fixed
// order (docs/generator.md gives the recipe).
#pragma once

#include <cstdint>

#include "sparseprefill/types.h"

namespace sparseprefill {

// One step of splitmix64: advances *state and returns the next 64-bit value.
std::uint64_t splitmix64(std::uint64_t* state);

struct GeneratorConfig {
  int batch = 1;
  int seq_q = 8192;
  int seq_k = 8192;   // >= seq_q; queries are the last seq_q positions (bottom-right)
  int h_q = 8;
  int h_kv = 2;
  int d = 128;
  DType dtype = DType::kBF16;
  std::uint64_t seed = 0;
  double peakedness = 1.0;  // 0: near-uniform attention; larger: sharper heads, lower density
};

// Fills q [batch, seq_q, h_q, d], k and v [batch, seq_k, h_kv, d] (allocated here).
Status generate(const GeneratorConfig& config, HostTensor* q, HostTensor* k, HostTensor* v);

}  // namespace sparseprefill
