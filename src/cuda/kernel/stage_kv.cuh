// SPDX-License-Identifier: Apache-2.0
// Paged K/V copied into contiguous varlen rows (StageKvParams, fwd_params.h) so that a long
// prefill reads them as contiguous K/V: one pass at memory bandwidth instead of a block-table
// lookup per row in every query tile that visits the key (plan_kv_staging, plan.h, decides
// when that pays). Dtype-free (16-byte chunks), hence one instance for every (dtype,
// head_dim). Included only by a generated instance file.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::stage {

constexpr int kThreads = tuning::kStageKvThreads;

// Grid (ceil(max_s_k · h_kv · max(row_chunks) / kThreads), batch, 2: K and V). Thread i of a
// sequence copies 16-byte chunk i % row_chunks of head (i / row_chunks) % h_kv of key
// i / (h_kv · row_chunks), row_chunks K's or V's: a warp reads whole rows of consecutive heads,
// and since the staged rows are [key, head, d] row-major its chunk lands at byte 16 · i past the
// sequence's start.
__global__ void __launch_bounds__(kThreads) stage_paged_kv_kernel(const StageKvParams p) {
  const int b = static_cast<int>(blockIdx.y);
  const int which = static_cast<int>(blockIdx.z);
  const int row_chunks = p.row_chunks[which];
  const std::int64_t per_key = static_cast<std::int64_t>(p.h_kv) * row_chunks;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t key = i / per_key;
  const SeqInfo s = p.seqs[b];
  if (key >= s.s_k) return;
  const std::int64_t within = i - key * per_key;
  const std::int64_t head = within / row_chunks;
  const std::int64_t chunk = within - head * row_chunks;
  const std::int64_t page = p.block_table[b * p.table_stride + key / p.page_size];
  const std::int64_t src_elem =
      page * p.page_stride[which] + (key % p.page_size) * p.row_stride[which] + head * p.head_stride[which];
  const auto* src = static_cast<const std::uint8_t*>(p.src[which]) + src_elem * p.elem_bytes + chunk * 16;
  auto* dst = static_cast<std::uint8_t*>(p.dst[which]) + (which == 0 ? s.k_off : s.v_off) * p.elem_bytes + i * 16;
  *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
}

inline int launch_stage_paged_kv(const StageKvParams& p, void* stream) {
  const int row_chunks = p.row_chunks[0] > p.row_chunks[1] ? p.row_chunks[0] : p.row_chunks[1];
  const std::int64_t threads = p.max_s_k * p.h_kv * row_chunks;
  if (threads == 0 || p.batch == 0) return static_cast<int>(cudaSuccess);
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads), static_cast<unsigned>(p.batch), 2);
  stage_paged_kv_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::stage
