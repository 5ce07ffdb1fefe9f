// SPDX-License-Identifier: Apache-2.0
// Calibration: exact_gate threshold tables, the softmax_skip factor a and the estimate_select
// alpha, computed from Q/K samples, and the safetensors file that carries them.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sparseprefill/policy.h"
#include "sparseprefill/problem.h"
#include "sparseprefill/types.h"

namespace sparseprefill {

// exact_gate thresholds T[layer][budget][h_q][position] (DESIGN.md §3).
struct ThresholdTable {
  int layers = 0;
  int heads = 0;      // query heads
  int positions = 0;  // absolute query blocks covered; later positions reuse the last row
  int block_q = 128;
  int block_k = 128;
  std::vector<int> budgets;   // k values, ascending
  std::vector<float> values;  // [layers, budgets, heads, positions]; -inf keeps everything

  float at(int layer, int budget_index, int head, int position) const;
  // The [heads, positions] slice ExactGateParams::thresholds expects.
  HostTensor slice(int layer, int budget_index) const;
  Status validate() const;
};

// Everything one calibration run produces. Empty vectors mean "not calibrated".
struct Calibration {
  std::map<std::string, std::string> metadata;  // model, text, score_dtype, date, ...
  ThresholdTable exact_gate;
  std::vector<float> skip_targets;      // target skip fractions, ascending
  std::vector<float> skip_a;            // [layers, skip_targets] softmax_skip factor a
  std::vector<float> density_targets;   // target densities, ascending
  std::vector<float> alpha;             // [layers, density_targets] estimate_select alpha
  int layers = 0;                       // rows of skip_a and alpha
  int skip_block_q = 128, skip_block_k = 128;  // block sizes the factor a was fitted for
  EstimateSelectParams estimate_base;   // the non-alpha parameters alpha was fitted for

  Status validate() const;
};

Status save_calibration(const std::string& path, const Calibration& calibration);
Status load_calibration(const std::string& path, Calibration* calibration);
// Parses an in-memory file (the fuzz target's entry point).
Status parse_calibration(const std::uint8_t* data, std::size_t size, Calibration* calibration);

// ------------------------------------------------------------------ calibration statistics
// What the calibrators reduce, per causal sequence of one layer's sample. compute_*_statistics
// fill them from host tensors (scores scale·q·k in fp64 with the oracle's summation order) or
// from CUDA tensors (fp32 mma.sync scores on the GPU: seconds for a 128K-token sample; the
// difference from the host values is bounded in docs/cuda.md "Calibration statistics"). Each
// calibrator's add() is compute + add_statistics, so both routes share one reduction.

// exact_gate and softmax_skip statistics of one sequence, over the blocks of
// geom::BlockGeometry{(s_q, s_k, causal), block_q, block_k}.
struct BlockStatistics {
  std::int64_t s_q = 0, s_k = 0;
  int heads = 0;  // query heads
  int block_q = 0, block_k = 0;
  // Both [heads, num_q_blocks, num_k_blocks]; empty when not requested.
  // block_max: the maximum of scale·q·k over the block's pairs; defined for full blocks
  // (kb < full_end(qb)), the exact_gate statistic; other entries are unspecified.
  // skip_g: softmax_skip's g = max over rows of (tile_rowmax - m_run) + ln s_k of every
  // visible block visited after the query block's first one in BLASST order (partial blocks,
  // then full blocks, each descending); +inf where a row sees its first keys, -inf where no
  // row has a say. The first visited block's entry and invisible blocks are unspecified.
  std::vector<double> block_max, skip_g;
};

// One BlockStatistics per sequence of `sample` (host or CUDA tensors, causal, finite q/k;
// v is not read). block_q, block_k: any size >= 1 on the host; 64 or 128 on CUDA (bf16/fp16,
// d 64/128), which enqueues on cuda_stream and synchronises it.
Status compute_block_statistics(const AttentionProblem& sample, int block_q, int block_k,
                                bool block_max, bool skip_g, std::vector<BlockStatistics>* out,
                                void* cuda_stream = nullptr);

// estimate_select statistics of one sequence: per selection unit (query head, or KV head with
// pack_gqa) and query tile i of `block` rows, the energy ratios E_j / max E of the scored
// blocks j < (a_l + 1) / block (a_l: the tile's last absolute position), as the selector
// computes them (block means rounded to the dtype, x = scale·q·k̄_j for pairs whose row sees
// block j's first key).
struct SelectStatistics {
  std::int64_t s_q = 0, s_k = 0;
  int units = 0;
  int block = 0;
  bool pack_gqa = false;
  std::vector<double> ratio;  // [units, num_q_blocks, num_k_blocks]; unscored entries unspecified
};

// One SelectStatistics per sequence (host or CUDA tensors as above; CUDA: block 128, the GPU
// selector's energies). Only base.block and base.pack_gqa are read.
Status compute_select_statistics(const AttentionProblem& sample, const EstimateSelectParams& base,
                                 std::vector<SelectStatistics>* out, void* cuda_stream = nullptr);

// Accumulates exact_gate statistics sample by sample. For each sample, layer, query head and
// absolute query block: the maxima of the full blocks, sorted descending; the threshold is
// the midpoint of the k-th and (k+1)-th largest, -inf with at most k candidates; the table
// entry is the mean over samples of the finite values (-inf when there are none).
class ExactGateCalibrator {
 public:
  ExactGateCalibrator(int layers, int heads, std::vector<int> budgets, int block_q, int block_k);
  // q, k of one layer (host or CUDA tensors, any layout, causal); every sequence is one
  // sample. A rejected call (bad layer, shape, non-finite q/k) leaves the calibrator unchanged.
  Status add(int layer, const AttentionProblem& sample, void* cuda_stream = nullptr);
  // The same from precomputed statistics (block_max, this calibrator's block sizes).
  Status add_statistics(int layer, const std::vector<BlockStatistics>& sample);
  // positions = 1 + the largest absolute query block seen (0 before any sample).
  ThresholdTable finish() const;

 private:
  Status check_config() const;

  int layers_, heads_, block_q_, block_k_;
  std::vector<int> budgets_;
  // [(layer, budget, head)][position] -> (sum of finite thresholds, count)
  std::vector<std::vector<double>> sum_;
  std::vector<std::vector<std::int64_t>> count_;
  int positions_seen_ = 0;  // 1 + the largest absolute query block of any sample
};

// softmax_skip: for every visited block after the first (BLASST order), the statistic
// g = max over rows of (tile_rowmax - m_run) + ln s_k. The block is skipped iff g < ln a, and
// skipping never changes m_run while a <= s_k, so the skip fraction of a is exactly the
// fraction of g below ln a: a for a target fraction is exp of that quantile.
class SoftmaxSkipCalibrator {
 public:
  SoftmaxSkipCalibrator(int layers, int block_q, int block_k);
  Status add(int layer, const AttentionProblem& sample, void* cuda_stream = nullptr);
  // The same from precomputed statistics (skip_g, this calibrator's block sizes).
  Status add_statistics(int layer, const std::vector<BlockStatistics>& sample);
  // The fraction counts every visible block (the never-skippable first ones too). ln a lies
  // midway between neighbouring sorted statistics, and a never exceeds the shortest s_k seen
  // (skipping is off when s_k < a), so an unreachable target gives the largest reachable
  // fraction. layer = -1 pools every layer. Sorts the layer's statistics in place on first
  // use: not to be called concurrently with any other call on this calibrator.
  Status factor_for(double target_skip_fraction, int layer, double* a) const;

 private:
  int layers_, block_q_, block_k_;
  // Per layer, in the order added; factor_for sorts a layer in place (ranking is all it reads).
  mutable std::vector<std::vector<double>> g_;
  std::vector<std::int64_t> never_skippable_;   // first visited blocks, per layer
  std::vector<std::int64_t> min_s_k_;           // shortest key length seen, per layer
};

// estimate_select: per tile, the energy ratios E_j / max E of the scored, non-forced blocks.
// Density(alpha) = (forced + ratios >= alpha) / visible blocks is monotone in alpha, so alpha
// for a target density is found by ranking the ratios.
class EstimateSelectCalibrator {
 public:
  EstimateSelectCalibrator(int layers, EstimateSelectParams base);
  Status add(int layer, const AttentionProblem& sample, void* cuda_stream = nullptr);
  // The same from precomputed statistics (this calibrator's block and pack_gqa).
  Status add_statistics(int layer, const std::vector<SelectStatistics>& sample);
  // alpha lies midway between neighbouring ratios, giving the reachable density nearest to the
  // target; 2 (above every ratio) when the forced blocks alone reach it. layer = -1 pools.
  // Sorts in place on first use, as factor_for.
  Status alpha_for(double target_density, int layer, double* alpha) const;

 private:
  int layers_;
  EstimateSelectParams base_;
  // Per layer, in the order added; alpha_for sorts a layer in place (ranking is all it reads).
  mutable std::vector<std::vector<double>> ratios_;
  std::vector<std::int64_t> forced_, visible_;  // per layer
};

// ------------------------------------------------------------------ one calibration run
// What a run calibrates: empty target lists leave that policy out (at least one is needed).
struct CalibrationTargets {
  int layers = 0;
  int heads = 0;                         // query heads (exact_gate)
  int block_q = 128, block_k = 128;      // exact_gate and softmax_skip
  std::vector<int> budgets;              // exact_gate budgets, ascending
  std::vector<double> skip_targets;      // softmax_skip target skip fractions, ascending
  std::vector<double> density_targets;   // estimate_select target densities, ascending
  EstimateSelectParams estimate;         // estimate_select's non-alpha parameters
};

// The calibrators of one run, fed layer by layer (the CLI, the C ABI and Python use it): each
// sample's block statistics are computed once for exact_gate and softmax_skip, on the GPU for
// CUDA tensors; finish() fits every factor per layer into a Calibration.
class CalibrationRun {
 public:
  // Checks the targets; *out receives the run.
  static Status create(const CalibrationTargets& targets, std::unique_ptr<CalibrationRun>* out);
  // q, k of `layer` (causal; v is not read). A sample rejected before its statistics exist
  // (shape, layout, non-finite host q/k) changes nothing; one whose GPU statistics are not
  // finite (non-finite CUDA q/k) may already be in some calibrators: discard the run then.
  Status add(int layer, const AttentionProblem& sample, void* cuda_stream = nullptr);
  // Thresholds, factors a and alphas of every layer and target (metadata left empty).
  Status finish(Calibration* out) const;
  const CalibrationTargets& targets() const { return targets_; }

 private:
  explicit CalibrationRun(const CalibrationTargets& targets);

  CalibrationTargets targets_;
  std::unique_ptr<ExactGateCalibrator> gate_;
  std::unique_ptr<SoftmaxSkipCalibrator> skip_;
  std::unique_ptr<EstimateSelectCalibrator> select_;
};

}  // namespace sparseprefill
