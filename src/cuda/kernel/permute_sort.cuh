// SPDX-License-Identifier: Apache-2.0
// permute_stop's two sorts (the prefix-key ranking and the query order) as one CUB segmented
// radix sort of 32-bit ordered keys (rank_key) with int32 values: descending and stable, so
// equal keys keep their input order (ascending index: "ties, lower index first"). Dtype-free,
// hence one instance for every (dtype, head_dim). Included only by a generated instance file.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "cuda/kernel/launch_types.h"

namespace sparseprefill::cuda::permute {

// temp == nullptr: only *temp_bytes is set (a host computation; nothing is enqueued).
inline int sort_pairs_descending(const SortPairs& s, std::size_t* temp_bytes, int* current, void* stream) {
  cub::DoubleBuffer<std::uint32_t> keys(s.keys[0], s.keys[1]);
  cub::DoubleBuffer<std::int32_t> values(s.values[0], s.values[1]);
  std::size_t bytes = s.temp_bytes;
  const cudaError_t err = cub::DeviceSegmentedRadixSort::SortPairsDescending(
      s.temp, bytes, keys, values, s.items, s.segments, s.offsets, s.offsets + 1, 0, 32,
      static_cast<cudaStream_t>(stream));
  *temp_bytes = bytes;
  *current = keys.selector;
  return static_cast<int>(err);
}

}  // namespace sparseprefill::cuda::permute
