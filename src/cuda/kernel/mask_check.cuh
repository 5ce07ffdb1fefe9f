// SPDX-License-Identifier: Apache-2.0
// The device check of a block mask read in place (MaskCheckParams, fwd_params.h): one warp per
// mask row walks its lists 32 entries at a time, accepts the prefix that the entry rule
// (core/rules/block_sparse.h) accepts — in range, strictly ascending, not in both lists — and
// writes its length and start for the forward kernel, which therefore never reads a bad
// entry. The first offence of the call is recorded for check_device_errors(). One instance for
// every dtype. Included only by a generated instance file.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/geometry.h"
#include "core/rules/block_sparse.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::maskcheck {

constexpr int kWarps = tuning::kMaskCheckWarps;

__device__ __forceinline__ void record(const MaskCheckParams& p, rules::MaskFault fault, int list, int b, int h, int qb,
                                       int entry, std::int64_t value, std::int64_t limit) {
  rules::MaskFaultRecord* f = p.fault;
  if (atomicCAS(&f->fault, 0, static_cast<std::int32_t>(fault)) != 0) return;  // an earlier offence stands
  f->list = list;
  f->b = b;
  f->h = h;
  f->qb = qb;
  f->entry = entry;
  f->value = value;
  f->limit = limit;
}

__global__ void __launch_bounds__(kWarps * 32) mask_check_kernel(const __grid_constant__ MaskCheckParams p) {
  extern __shared__ std::uint32_t bitmaps[];  // [kWarps][bitmap_words]: list 0's accepted blocks
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.heads * p.num_q_blocks;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= rows) return;
  const int qb = static_cast<int>(row % p.num_q_blocks);
  const int h = static_cast<int>(row / p.num_q_blocks % p.heads);
  const int b = static_cast<int>(row / p.num_q_blocks / p.heads);
  const SeqInfo seq = p.seqs[b];
  const geom::BlockGeometry g{{seq.s_q, seq.s_k, p.causal, p.window_left, p.window_right, p.attention_chunk}, p.block_q, p.block_k};
  std::uint32_t* seen = bitmaps + warp * p.bitmap_words;
  for (int w = lane; w < p.bitmap_words; w += 32) seen[w] = 0u;
  __syncwarp();
  const bool in_seq = qb < g.num_q_blocks();  // rows past the sequence's end hold nothing
  const int visible = in_seq ? g.visible_end(qb) : 0;
  const int visible_begin = in_seq ? g.visible_begin(qb) : 0;
  std::uint32_t* kept = p.kept_bits != nullptr ? p.kept_bits + row * p.bitmap_words : nullptr;
  for (int list = 0; list < 2; ++list) {
    const MaskListView& v = p.list[list];
    std::int64_t first = 0, n = 0;
    rules::MaskFault count_fault = rules::kMaskOk;
    if (p.csr_indptr != nullptr) {
      if (list == 0) {
        if (lane == 0) {
          p.count_out[0][row] = 0;
          p.start_out[0][row] = 0;
        }
        continue;
      }
      first = p.csr_indptr[row];
      n = p.csr_indptr[row + 1] - first;
      if (n < 0 || first < 0 || first + n > p.csr_nnz) count_fault = rules::kMaskIndptr;
    } else if (v.count != nullptr) {
      const std::int64_t bb = b, hh = h;
      n = v.count[bb * v.count_stride[0] + hh * v.count_stride[1] + qb * v.count_stride[2]];
      first = bb * v.index_stride[0] + hh * v.index_stride[1] + qb * v.index_stride[2];
      if (n < 0 || n > v.capacity) count_fault = rules::kMaskCount;
    }
    if (!in_seq) n = 0;
    if (count_fault != rules::kMaskOk && in_seq) {
      if (lane == 0) {
        const bool csr = p.csr_indptr != nullptr;
        record(p, count_fault, csr ? 2 : list, b, h, qb, csr ? static_cast<int>(row) : 0, csr ? first + n : n,
               csr ? p.csr_nnz : v.capacity);
      }
      n = 0;
    }
    std::int64_t accepted = n, prev = -1;
    for (std::int64_t base = 0; base < n; base += 32) {
      const std::int64_t i = base + lane;
      const std::int64_t kb = i < n ? v.index[first + i] : 0;
      std::int64_t before = __shfl_up_sync(0xffffffffu, kb, 1);
      if (lane == 0) before = prev;
      rules::MaskFault fault = i < n ? rules::mask_entry_fault(kb, before, visible, visible_begin) : rules::kMaskOk;
      if (fault == rules::kMaskOk && i < n && list == 1 && (seen[kb / 32] >> (kb % 32) & 1u)) fault = rules::kMaskBoth;
      const unsigned bad = __ballot_sync(0xffffffffu, fault != rules::kMaskOk);
      const int ok_lanes = bad != 0u ? __ffs(static_cast<int>(bad)) - 1 : 32;
      if (lane < ok_lanes && i < n) {
        if (list == 0) atomicOr(&seen[kb / 32], 1u << (kb % 32));
        if (kept != nullptr) atomicOr(&kept[kb / 32], 1u << (kb % 32));
      }
      if (bad != 0u) {
        accepted = base + ok_lanes;
        if (lane == ok_lanes) {
          record(p, fault, p.csr_indptr != nullptr ? 2 : list, b, h, qb, static_cast<int>(i), kb,
                 fault == rules::kMaskRange ? visible : before);
        }
        break;
      }
      prev = __shfl_sync(0xffffffffu, kb, 31);
      __syncwarp();
    }
    __syncwarp();
    if (lane == 0) {
      p.count_out[list][row] = static_cast<std::int32_t>(accepted);
      p.start_out[list][row] = first;
    }
  }
}

inline int launch_mask_check(const MaskCheckParams& p, void* stream) {
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.heads * p.num_q_blocks;
  if (rows == 0) return static_cast<int>(cudaSuccess);
  const std::size_t smem = static_cast<std::size_t>(kWarps) * static_cast<std::size_t>(p.bitmap_words) * 4;
  auto* kernel = mask_check_kernel;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  const auto grid = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  kernel<<<grid, kWarps * 32, smem, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::maskcheck
