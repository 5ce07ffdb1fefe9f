// SPDX-License-Identifier: Apache-2.0
// Plain types of the launch contract that kernel headers and the host registry share (no CUDA
// headers): a permute_stop sort's buffers, the uploader the Hopper forward launch hands its
// tensor maps to, and the launch stages of the multi-kernel policies, which the host sequences
// (src/cuda/permute_stop.cpp, estimate_select.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparseprefill::cuda {

// One segmented sort of permute_stop (kernel/permute_sort.cuh): descending, stable, 32-bit
// keys with int32 values, buffers in CUB double-buffer pairs ([0] holds the input).
struct SortPairs {
  std::uint32_t* keys[2];
  std::int32_t* values[2];
  int items;
  int segments;
  const std::int32_t* offsets;  // [segments + 1]
  void* temp;                   // nullptr: size query only
  std::size_t temp_bytes;
};
// Copies `bytes` of host memory into device memory that stays valid and unchanged until the
// launch has run — and, under CUDA graph capture, for every replay — and returns it in
// *device, 64-byte aligned. Returns a cudaError_t value (0 = success) or kUploadRefused.
struct HostUpload {
  void* context;
  int (*fn)(void* context, const void* host, std::size_t bytes, const void** device);
};
// An upload the backend declined (new metadata while a graph is being captured); the launch
// returns it unchanged and the backend reports why.
constexpr int kUploadRefused = -1;

// permute_stop's launches, in the order the host enqueues them: the slot order's initial
// state, each item's mean query, the prefix keys' ranking scores, (the ranking sort,) the
// guide keys of the query order, (the query sort,) then the attention (the portable kernel's;
// the Hopper one is its own instance).
enum class PermuteStage : std::int32_t { kOrderInit, kQueryMeans, kPrefixScores, kGuide, kAttend };
// estimate_select's launches: the block means, then the selector over them.
enum class SelectStage : std::int32_t { kMeans, kSelect };

}  // namespace sparseprefill::cuda
