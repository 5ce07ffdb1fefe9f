// SPDX-License-Identifier: Apache-2.0
// Paged K/V staged into contiguous rows ahead of a long prefill (plan_kv_staging, plan.h): one
// copy kernel, after which the call reads [Σ s_k, h_kv, d] varlen K/V with the contiguous
// kernels, bit for bit their results.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/launch.h"

namespace sparseprefill::cuda {

Status stage_kv_rows(const AttentionProblem& problem, const ProblemShape& shape, const KvStaging& staging,
                     const AttentionOutput& output, Scratch* buffers, cudaStream_t stream, AttentionProblem* staged) {
  const ProblemShape to = staged_shape(shape, staging);
  const std::size_t elem = dtype_size(shape.dtype);
  const std::int64_t dims[2] = {shape.d, shape.d_v};  // K's and V's head dims
  std::uint8_t* rows[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    const std::size_t bytes = static_cast<std::size_t>(staging.rows * shape.h_kv * dims[i]) * elem;
    SP_RETURN_IF_ERROR(buffers->alloc(bytes, &rows[i]));
  }
  *staged = problem;
  staged->k = TensorView::contiguous(rows[0], shape.dtype, {staging.rows, shape.h_kv, shape.d}, shape.device);
  staged->v = TensorView::contiguous(rows[1], shape.dtype, {staging.rows, shape.h_kv, shape.d_v}, shape.device);
  const std::vector<SeqInfo> seqs = make_seq_infos(*staged, to, output);
  const std::vector<std::int32_t> table = compact_block_table(problem, shape);
  StageKvParams sp{};
  const TensorView* caches[2] = {&problem.k, &problem.v};
  for (int i = 0; i < 2; ++i) {
    sp.src[i] = caches[i]->data;
    sp.dst[i] = rows[i];
    sp.page_stride[i] = caches[i]->stride[0];
    sp.row_stride[i] = caches[i]->stride[1];
    sp.head_stride[i] = caches[i]->stride[2];
    sp.row_chunks[i] = static_cast<int>(static_cast<std::size_t>(dims[i]) * elem / 16);
  }
  SP_RETURN_IF_ERROR(buffers->upload(table, &sp.block_table));
  SP_RETURN_IF_ERROR(buffers->upload(seqs, &sp.seqs));
  sp.table_stride = block_table_stride(shape);
  sp.page_size = shape.page_size;
  sp.batch = shape.batch;
  sp.h_kv = shape.h_kv;
  sp.elem_bytes = static_cast<int>(elem);
  sp.max_s_k = shape.max_seq_k();
  return launch_status(stage_paged_kv(sp, stream), "stage_kv_sm80");
}

}  // namespace sparseprefill::cuda
