// SPDX-License-Identifier: Apache-2.0
// The call: run() computes O and LSE for a problem under a policy, on the backend the tensors'
// device selects, and reports per-head statistics and, on request, the keep/skip decisions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "sparseprefill/block_mask.h"
#include "sparseprefill/policy.h"
#include "sparseprefill/problem.h"
#include "sparseprefill/types.h"

namespace sparseprefill {

enum class Backend : std::uint8_t {
  kAuto,       // CPU tensors -> kCPU, CUDA tensors -> kCUDA
  kReference,  // the fp64 oracle (slow; obvious loops; the specification)
  kCPU,        // fp32, multithreaded, same decisions as the oracle
  kCUDA,       // GPU kernels (when compiled in); host tensors are staged to the current device
               // and back (run() only, synchronously)
};

// CUDA devices the library can run on: 0 without the CUDA backend or a GPU.
int cuda_device_count();

const char* backend_name(Backend backend);

// How a CUDA call executes, where the library would otherwise choose (docs/cuda.md, "Path
// selection"). None of these changes which blocks a policy keeps. kAuto (every default) defers
// to the environment variable named beside each field, read once per process, and then to the
// library's own rule; an explicit value here wins over the variable. A forced choice that the
// call cannot take is an error (kUnsupported) naming it, never a silent fallback.
struct ExecutionOverrides {
  enum class CudaPath : std::uint8_t { kAuto, kPortable, kHopper };  // SPARSEPREFILL_CUDA_PATH
  enum class Choice : std::uint8_t { kAuto, kAlways, kNever };
  CudaPath cuda_path = CudaPath::kAuto;
  Choice pack_gqa = Choice::kAuto;    // SPARSEPREFILL_PACK_GQA: GQA heads packed into one tile
  Choice kv_staging = Choice::kAuto;  // SPARSEPREFILL_KV_STAGING: paged K/V copied into rows first
  int gate_passes = 0;                // SPARSEPREFILL_EXACT_GATE_PASSES: 0 auto, 1 or 2
};

struct RunOptions {
  Backend backend = Backend::kAuto;
  void* cuda_stream = nullptr;  // cudaStream_t for kCUDA; nullptr = default stream
  int num_threads = 0;          // kCPU: 0 = every core
  bool collect_decisions = false;
  ExecutionOverrides overrides;
};

// What a backend runs for a call: the execution plan's summary (Plan::execution(), RunStats).
struct ExecutionInfo {
  Backend backend = Backend::kAuto;
  std::string path;               // "reference", "cpu", "cuda-portable", "cuda-hopper"
  std::string instance;           // the attention kernel instance, e.g. "fwd_sm90_bf16_hd128"
  std::string decision_instance;  // the kernel deciding ahead of it (selector, gate, ranking), or ""
  int passes = 1;                 // exact_gate: 2 when a decision kernel runs ahead of attention
  int q_pack = 1;                 // query heads per tile (GQA packing on the Hopper path)
  bool kv_staged = false;         // paged K/V copied into contiguous rows before the call
  bool kv_major = false;          // the grid walks KV heads outermost (L2 reuse of K/V tiles)
  std::size_t scratch_bytes = 0;  // device scratch of one call
  std::int64_t grid = 0;          // CTAs of the attention launch
  double device_ms = 0.0;         // host tensors on kCUDA (staged to the device): the device time
                                  // of the call's kernels, copies excluded; 0 otherwise
  std::string to_string() const;  // one line, e.g. for logs
};

// Work accounting for one (batch, query head). A block is "visible" when at least one valid
// query of the query block sees at least one key of it; "kept" when its keys entered the
// softmax (mean-correction pseudo-tokens are counted separately).
struct HeadStats {
  std::int64_t visible_blocks = 0;
  std::int64_t kept_blocks = 0;
  std::int64_t corrected_blocks = 0;  // estimate_select mean-correction pseudo-tokens
  std::int64_t visible_pairs = 0;     // (query, key) pairs the causal mask allows
  std::int64_t computed_pairs = 0;    // pairs whose score entered the softmax
};

struct RunStats {
  int batch = 0;
  int h_q = 0;
  std::vector<HeadStats> heads;  // [batch, h_q]
  ExecutionInfo execution;       // what ran
  double density() const;        // kept / visible blocks over the whole call
  double pair_density() const;   // computed / visible pairs
  double head_density(int b, int h) const;
};

// permute_stop's decision for one query tile of one segment.
struct PermuteTile {
  int batch = 0;
  int head = 0;            // query head
  int segment = 0;         // absolute segment index
  int tile = 0;            // tile index inside the segment's permuted order
  int chunks_visited = 0;  // ranked prefix chunks attended in pass 2
  int chunks_total = 0;    // ceil(prefix keys / block_k)
};

// What the policy decided. Block policies fill `kept` (per query head, or per KV head for
// estimate_select with pack_gqa); estimate_select with mean correction fills `corrected`;
// permute_stop fills `tiles` (sorted by batch, head, segment, tile) and `query_order`
// ([batch, h_q, max s_q]: for each slot of the call's rows in visit order, the call-relative
// row it holds; -1 past a sequence's end).
struct Decisions {
  std::string policy;
  BlockMask kept;
  BlockMask corrected;
  std::vector<PermuteTile> tiles;
  std::vector<std::int32_t> query_order;
};

// Computes attention for `problem` under `policy` into `output`. Tensors must all be on one
// device. Never allocates output memory; `stats` and `decisions` may be null.
Status run(const AttentionProblem& problem, const Policy& policy, const AttentionOutput& output,
           const RunOptions& options = {}, RunStats* stats = nullptr,
           Decisions* decisions = nullptr);

// Whether `backend` can run this combination; when not, the message says what is compiled
// (dtypes, head dims, block sizes, policies).
Status can_run(const AttentionProblem& problem, const Policy& policy, Backend backend);

// Version, compiled backends, CUDA architectures and kernel variants, one item per line.
std::string build_info();

}  // namespace sparseprefill
