// SPDX-License-Identifier: Apache-2.0
// Calibration statistics of CUDA samples (compute_block_statistics / compute_select_statistics):
// the calibration kernel's block maxima and BLASST statistic, and the selector's energy ratios,
// copied back per sequence.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/launch.h"

namespace sparseprefill::cuda {

namespace {

// What both statistics launches share: the device, the pool, a stream that is not capturing
// (the statistics are read back), scratch and the sequence table.
struct StatisticsCall : DeviceCall {
  Status enter(const AttentionProblem& sample, const ProblemShape& shape, void* cuda_stream) {
    SP_RETURN_IF_ERROR(check_qk_layout(sample));
    SP_RETURN_IF_ERROR(DeviceCall::enter(shape.device.index, cuda_stream));
    if (capturing) {
      return unsupported("cuda_stream: is capturing a CUDA graph, and calibration statistics are read back to the host");
    }
    return {};
  }
};

std::vector<SeqInfo> qk_seq_infos(const AttentionProblem& sample, const ProblemShape& shape) {
  AttentionOutput none;
  none.o = sample.q;  // o/lse offsets are not read by the statistics kernels
  return make_seq_infos(sample, shape, none);
}

}  // namespace

Status block_statistics_cuda(const AttentionProblem& sample, const ProblemShape& shape, int block_q, int block_k,
                             bool want_max, bool want_g, void* cuda_stream, std::vector<BlockStatistics>* out) {
  SP_RETURN_IF_ERROR(check_calib_support(shape, block_q, block_k));
  StatisticsCall call;
  SP_RETURN_IF_ERROR(call.enter(sample, shape, cuda_stream));
  std::vector<float> block_max, skip_g;
  CalibParams p = make_calib_params(sample, shape, block_q, block_k);
  {
    Scratch scratch(call.stream, call.pool, shape.device.index, false);
    SP_RETURN_IF_ERROR(scratch.upload(qk_seq_infos(sample, shape), &p.seqs));
    // Zeroed: entries the kernel does not write (invisible blocks) are never NaN.
    const std::size_t cells = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_q) *
                              static_cast<std::size_t>(p.num_q_blocks) * static_cast<std::size_t>(p.num_k_blocks);
    if (want_max) SP_RETURN_IF_ERROR(scratch.zeros(cells, &p.block_max));
    if (want_g) SP_RETURN_IF_ERROR(scratch.zeros(cells, &p.skip_g));
    const CalibVariant* calib = find_calib(shape.dtype, shape.d);
    SP_RETURN_IF_ERROR(launch_status(calib->launch(p, call.stream), calib->name));
    if (want_max) SP_RETURN_IF_ERROR(scratch.download(p.block_max, cells, &block_max));
    if (want_g) SP_RETURN_IF_ERROR(scratch.download(p.skip_g, cells, &skip_g));
    SP_CUDA_TRY(cudaStreamSynchronize(call.stream), "cudaStreamSynchronize (calibration statistics)");
  }
  *out = block_statistics_from_device(shape, block_q, block_k, p.num_q_blocks, p.num_k_blocks, block_max, skip_g);
  return {};
}

Status select_statistics_cuda(const AttentionProblem& sample, const ProblemShape& shape,
                              const EstimateSelectParams& base, const SelectVariant* select, void* cuda_stream,
                              std::vector<SelectStatistics>* out) {
  SP_RETURN_IF_ERROR(check_select_statistics_support(shape, base));
  StatisticsCall call;
  SP_RETURN_IF_ERROR(call.enter(sample, shape, cuda_stream));
  std::vector<float> ratio;
  SelectParams sp = make_select_statistics_params(sample, shape, base);
  {
    Scratch scratch(call.stream, call.pool, shape.device.index, false);
    SP_RETURN_IF_ERROR(scratch.upload(qk_seq_infos(sample, shape), &sp.seqs));
    SP_RETURN_IF_ERROR(alloc_block_means(shape, &scratch, &sp));
    const int units = base.pack_gqa ? shape.h_kv : shape.h_q;
    const std::size_t cells = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(units) *
                              static_cast<std::size_t>(sp.num_q_blocks) * static_cast<std::size_t>(sp.num_k_blocks);
    SP_RETURN_IF_ERROR(scratch.zeros(cells, &sp.energy_ratio));
    SP_RETURN_IF_ERROR(launch_status(select->launch(SelectStage::kMeans, sp, call.stream), select->name));
    SP_RETURN_IF_ERROR(launch_status(select->launch(SelectStage::kSelect, sp, call.stream), select->name));
    SP_RETURN_IF_ERROR(scratch.download(sp.energy_ratio, cells, &ratio));
    SP_CUDA_TRY(cudaStreamSynchronize(call.stream), "cudaStreamSynchronize (calibration statistics)");
  }
  *out = select_statistics_from_device(shape, base, sp.num_q_blocks, sp.num_k_blocks, ratio);
  return {};
}

}  // namespace sparseprefill::cuda
