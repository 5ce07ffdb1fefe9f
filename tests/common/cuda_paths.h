// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's path rules as its tests expect them (docs/cuda.md, "Path selection"), for
// the conformance suite's cuda-hopper target and the GPU suites' default-path runs: which calls
// the Hopper kernels serve on a compute capability 9.0 device, and the kernel families of each
// path (ExecutionInfo::instance). Header-only; nvcc and g++ both compile it.
#pragma once

#include <string>

#include "sparseprefill/policy.h"

namespace sparseprefill::test {

// Whether the Hopper kernels serve `policy` with K/V read through pages (reads_pages) or as
// contiguous rows, at Q/K head dim `head_dim` (its instances: hopper_compiles): dense, and every
// policy with 128-key blocks; permute_stop over contiguous K/V at 64 and 128 only.
inline bool hopper_serves(const Policy& policy, bool reads_pages, int head_dim = 128) {
  constexpr int kHopperBlockK = 128;
  if (const auto* p = std::get_if<BlockSparseParams>(&policy)) return p->mask.block_k == kHopperBlockK;
  if (const auto* p = std::get_if<ExactGateParams>(&policy)) return p->block_k == kHopperBlockK;
  if (const auto* p = std::get_if<SoftmaxSkipParams>(&policy)) return p->block_k == kHopperBlockK;
  if (const auto* p = std::get_if<EstimateSelectParams>(&policy)) return p->block == kHopperBlockK;
  if (const auto* p = std::get_if<PermuteStopParams>(&policy)) {
    return p->block_k == kHopperBlockK && !reads_pages && (head_dim == 64 || head_dim == 128);
  }
  return true;
}

// Whether a Hopper forward instance is compiled for head dims (d, d_v) with K/V read through
// pages (reads_pages) or as contiguous rows (variants.py): 64 and 128 both ways, 96, 256 and q/k
// 192 with v 128 over contiguous rows alone.
inline bool hopper_compiles(int d, int d_v, bool reads_pages) {
  if (d == d_v && (d == 64 || d == 128)) return true;
  return !reads_pages && ((d == d_v && (d == 96 || d == 256)) || (d == 192 && d_v == 128));
}

// The attention kernel family a path runs the policy with: permute_stop has its own (gathered,
// permuted tiles) on both paths.
inline std::string instance_family(const std::string& path, const Policy& policy) {
  const bool hopper = path == "cuda-hopper";
  if (std::holds_alternative<PermuteStopParams>(policy)) return hopper ? "permute_sm90_" : "permute_sm80_";
  return hopper ? "fwd_sm90_" : "fwd_sm80_";
}

}  // namespace sparseprefill::test
