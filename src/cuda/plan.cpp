// SPDX-License-Identifier: Apache-2.0
// Host-side planning of a CUDA call: support checks, instance choice, kernel parameters and
// BlockMask conversions. Pure host code (g++), no CUDA headers.
#include "cuda/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/block_mask_layout.h"
#include "core/geometry.h"
#include "core/shape_geometry.h"
#include "cuda/kernel/tuning.h"
#include "cuda/registry.h"

namespace sparseprefill::cuda {
namespace {

bool is_supported_block_k(int block_k) { return block_k == 64 || block_k == 128; }

Status check_blocks(const char* policy, int block_q, int block_k) {
  if (block_q != kBlockQ || !is_supported_block_k(block_k)) {
    return unsupported(std::string(policy) + ": CUDA kernels need block_q = 128 and block_k = 64 or 128, got block_q = " +
                       std::to_string(block_q) + ", block_k = " + std::to_string(block_k) + " (" + support_summary() + ")");
  }
  return {};
}

std::int64_t max_blocks(const ProblemShape& s, int block) {
  return geom::ceil_div(s.max_seq_k(), block);
}

// Row and head strides of a [.., s, h, d] tensor (the last three dimensions).
std::int64_t row_stride(const TensorView& t) { return t.stride[t.rank - 3]; }
std::int64_t head_stride(const TensorView& t) { return t.stride[t.rank - 2]; }

// Element offset of sequence b's first row: the batch stride for [b, s, h, d], the packed row
// start for varlen [total, h, d].
std::int64_t seq_offset(const TensorView& t, std::int64_t batch_index, std::int64_t packed_start) {
  return t.rank == 4 ? batch_index * t.stride[0] : packed_start * t.stride[0];
}

Status check_view(const char* name, const TensorView& t) {
  const auto address = reinterpret_cast<std::uintptr_t>(t.data);
  if (address % 16 != 0) {
    return unsupported(std::string(name) + ": the CUDA kernels need a 16-byte aligned data pointer");
  }
  for (int i = 0; i + 1 < t.rank; ++i) {
    if (t.shape[i] > 1 && t.stride[i] % 8 != 0) {
      return unsupported(std::string(name) + ": the CUDA kernels need strides that are multiples of 8 elements (16 bytes), got " +
                         describe(t));
    }
  }
  return {};
}

}  // namespace

std::string support_summary() {
  return "compiled CUDA kernels (portable sm80 path): " + compiled_fwd_summary() +
         "; block_q 128, block_k 64 or 128; estimate_select block 128; policies dense, block_sparse, "
         "exact_gate, softmax_skip, estimate_select, permute_stop (block_q 128, block_k 64 or 128, at most 2^31 - 1 "
         "ranked prefix keys per call); Hopper sm90 path (compute capability 9.0: dense and every policy with "
         "128-key blocks, contiguous or paged K/V of any page size, permute_stop with contiguous K/V; block_k 64 uses "
         "the portable path there): " +
         compiled_fwd90_summary() + "; paged K/V (any page size): every policy on the portable path; "
         "fp8_e4m3 inputs on the Hopper path, contiguous K/V: dense, block_sparse, exact_gate and softmax_skip at "
         "head_dim " + fwd90_head_dims(DType::kFP8E4M3) +
         ", estimate_select (with or without mean correction) at head_dim " + select90_head_dims(DType::kFP8E4M3) +
         "; local windows and chunks "
         "(window_size, attention_chunk): dense and block_sparse on both paths, with softcap and learned sinks on bf16 and fp16; "
         "not on CUDA: fp32";
}

bool tma_describable(const TensorView& t) {
  constexpr std::int64_t kMaxStrideBytes = std::int64_t{1} << 40;
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(t.dtype));
  for (int i = 0; i + 1 < t.rank; ++i) {
    if (t.shape[i] <= 1) continue;
    if (t.stride[i] <= 0 || t.stride[i] >= kMaxStrideBytes / elem || (t.stride[i] * elem) % 16 != 0) return false;
  }
  return true;
}

bool tma_describable(const AttentionProblem& problem) {
  return tma_describable(problem.q) && tma_describable(problem.k) && tma_describable(problem.v);
}

int hopper_block_k() { return 128; }

// TMA boxes need pages of whole 8-row groups that tile the 128-key tile or hold whole tiles;
// they beat gathering from tuning::kHopperBoxMinPageKeys keys per page up.
bool hopper_can_box_pages(int page_size) {
  return page_size >= 8 && (128 % page_size == 0 || page_size % 128 == 0);
}

bool hopper_gathers_pages(int page_size) {
  return !(hopper_can_box_pages(page_size) && page_size >= tuning::kHopperBoxMinPageKeys);
}

Status cuda_path_mode(const char* env_value, ExecutionOverrides::CudaPath* mode) {
  const std::string v = env_value == nullptr ? std::string() : std::string(env_value);
  if (v.empty() || v == "auto") {
    *mode = ExecutionOverrides::CudaPath::kAuto;
  } else if (v == "portable") {
    *mode = ExecutionOverrides::CudaPath::kPortable;
  } else if (v == "hopper") {
    *mode = ExecutionOverrides::CudaPath::kHopper;
  } else {
    return invalid_argument(std::string(kPathEnv) + ": expected \"auto\", \"portable\" or \"hopper\" (or unset), got \"" +
                            v + "\"");
  }
  return {};
}

FwdPath choose_fwd_path(const ProblemShape& shape, const Policy& policy, bool tma_ok, int cc_major, int cc_minor) {
  const bool hopper = cc_major == 9 && cc_minor == 0;
  // Paged K/V of any page size: the Hopper kernel's paged instances load a key tile as one TMA
  // box when a page holds whole tiles and gather its rows with cp.async otherwise.
  const bool paged = shape.kv_layout == KvLayout::kPaged;
  if (!hopper || !tma_ok || find_fwd90(shape.dtype, shape.d, shape.d_v, paged) == nullptr) return FwdPath::kPortable;
  // The Hopper kernel's key tile is one 128-key block: dense (no blocks) and every policy with
  // 128-key blocks run there; 64-key blocks keep the portable kernel's 64-key sub-tiles.
  const bool served = std::visit(
      [&](const auto& p) {
        using P = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<P, DenseParams>) {
          return true;
        } else if constexpr (std::is_same_v<P, BlockSparseParams>) {
          return p.block_k() == hopper_block_k();
        } else if constexpr (std::is_same_v<P, ExactGateParams> || std::is_same_v<P, SoftmaxSkipParams>) {
          return p.block_k == hopper_block_k();
        } else if constexpr (std::is_same_v<P, EstimateSelectParams>) {
          return p.block == hopper_block_k();
        } else {
          // permute_stop: one 128-key tile per ranked chunk, rows gathered from contiguous K/V.
          return p.block_k == hopper_block_k() && !paged && find_permute90(shape.dtype, shape.d) != nullptr;
        }
      },
      policy);
  return served ? FwdPath::kHopper : FwdPath::kPortable;
}

Status pack_gqa_mode(const char* env_value, PackGqa* mode) {
  const std::string v = env_value == nullptr ? std::string() : std::string(env_value);
  if (v.empty() || v == "auto") {
    *mode = PackGqa::kAuto;
  } else if (v == "always") {
    *mode = PackGqa::kAlways;
  } else if (v == "never") {
    *mode = PackGqa::kNever;
  } else {
    return invalid_argument(std::string(kPackGqaEnv) + ": expected \"auto\", \"always\" or \"never\" (or unset), got \"" +
                            v + "\"");
  }
  return {};
}

bool kv_major_grid(const ProblemShape& shape, std::int64_t l2_bytes) {
  std::int64_t kv_bytes = 0;
  const auto row_bytes = static_cast<std::int64_t>(2 * shape.h_kv * shape.d * dtype_size(shape.dtype));
  for (const std::int64_t s_k : shape.seq_k) kv_bytes += s_k * row_bytes;
  return kv_bytes > l2_bytes;
}

int choose_q_pack(const ProblemShape& shape, PolicyMode mode, bool mask_per_kv_head, PackGqa pack) {
  const int g = shape.group();
  const bool shared_visits = mode == PolicyMode::kDense || (mode == PolicyMode::kBlockMask && mask_per_kv_head);
  if (pack == PackGqa::kNever || g < 2 || kBlockQ % g != 0 || !shared_visits) return 1;
  if (pack == PackGqa::kAlways) return g;
  // The margin (tuning.h) keeps calls whose tiles are full anyway on the path they always ran.
  std::int64_t packed = 0, unpacked = 0;
  for (const std::int64_t s : shape.seq_q) {
    packed += geom::ceil_div(s * g, kBlockQ) * shape.h_kv;
    unpacked += geom::ceil_div(s, kBlockQ) * shape.h_q;
  }
  return tuning::kPackGqaDen * packed < tuning::kPackGqaNum * unpacked ? g : 1;
}

Status gate_passes_mode(const char* env_value, GatePasses* mode) {
  const std::string v = env_value == nullptr ? std::string() : std::string(env_value);
  if (v.empty() || v == "auto") {
    *mode = GatePasses::kAuto;
  } else if (v == "1") {
    *mode = GatePasses::kOne;
  } else if (v == "2") {
    *mode = GatePasses::kTwo;
  } else {
    return invalid_argument(std::string(kGatePassesEnv) + ": expected \"auto\", \"1\" or \"2\" (or unset), got \"" + v +
                            "\"");
  }
  return {};
}

bool choose_gate_passes(const ProblemShape& shape, bool instance, GatePasses mode) {
  const bool possible = instance && shape.kv_layout != KvLayout::kPaged && shape.dtype != DType::kFP8E4M3;
  return possible && mode != GatePasses::kOne;
}

int gate_heads_per_cta(int group) {
  for (int h = tuning::kGateHeadsPerCta; h > 1; --h) {
    if (group % h == 0) return h;
  }
  return 1;
}

GateListEntries gate_list_entries(const ProblemShape& shape, int block_k, int num_q_blocks) {
  GateListEntries out;
  for (int b = 0; b < shape.batch; ++b) {
    const geom::BlockGeometry geo{{shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)],
                                   shape.causal},
                                  kBlockQ,
                                  block_k};
    out.partial += static_cast<std::int64_t>(shape.h_q) * num_q_blocks * geo.ungated_room();
  }
  out.full = shape.h_q * gate_seq_gated(shape, block_k).back();
  return out;
}

std::vector<std::int64_t> gate_seq_gated(const ProblemShape& shape, int block_k) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(shape.batch) + 1, 0);
  for (int b = 0; b < shape.batch; ++b) {
    const geom::BlockGeometry geo{{shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)],
                                   shape.causal},
                                  kBlockQ,
                                  block_k};
    std::int64_t gated = 0;
    for (int qb = 0; qb < geo.num_q_blocks(); ++qb) gated += geo.gated_end(qb);
    out[static_cast<std::size_t>(b) + 1] = out[static_cast<std::size_t>(b)] + gated;
  }
  return out;
}

FwdPath choose_select_path(const ProblemShape& shape, int cc_major, int cc_minor, bool portable) {
  const bool hopper = cc_major == 9 && cc_minor == 0 && !portable;
  return hopper && shape.d_v == shape.d && find_select90(shape.dtype, shape.d) != nullptr ? FwdPath::kHopper
                                                                                          : FwdPath::kPortable;
}

int dense_block_k(int head_dim) {
  (void)head_dim;
  return tuning::kDenseBlockK;
}

namespace {

// The model-family features the kernels take, and those they do not take yet (docs/cuda.md,
// support matrix), each refused by name, so that backend auto on CUDA tensors fails clearly
// instead of computing something else; the reference and cpu backends run them all. A local
// window, a softcap and learned sinks run for dense and block_sparse in the forward kernels'
// kFeatures kernel (FwdParams; softcap and sinks on 16-bit inputs); the other policies' decision
// kernels (exact_gate's, the selector, permute_stop's ranking) and in-loop gates read none of
// them yet. At the head dims without a permute kernel (variants.py's WIDE_HEAD_DIMS: 256, 192
// with v 128) permute_stop is refused by name (compiled_policies).
Status check_features(const ProblemShape& shape, const Policy& policy) {
  const char* host = "; the reference and cpu backends run it";
  const bool featured_policy =
      std::holds_alternative<DenseParams>(policy) || std::holds_alternative<BlockSparseParams>(policy);
  const auto refuse_other_policies = [&](const std::string& feature) {
    return unsupported(feature + " runs dense and block_sparse on CUDA, not " + policy_name(policy) + host);
  };
  if (shape.local() && !featured_policy) {
    return refuse_other_policies(shape.attention_chunk > 0 ? "attention_chunk: chunked local attention"
                                                           : "window_left/window_right: local (sliding-window) attention");
  }
  if (shape.softcap != 0.0 && !featured_policy) return refuse_other_policies("softcap: score soft-capping");
  if (shape.sinks && !featured_policy) return refuse_other_policies("sinks: learned attention sinks");
  if ((shape.softcap != 0.0 || shape.sinks) && shape.dtype == DType::kFP8E4M3) {
    return unsupported(std::string(shape.sinks ? "sinks" : "softcap") +
                       ": fp8_e4m3 inputs on CUDA take no softcap or sinks (bf16 and fp16 do)" + host);
  }
  const bool compiled = find_fwd(shape.dtype, shape.d, shape.d_v, false, true) != nullptr;
  if (shape.d_v != shape.d && !compiled) {
    return unsupported("v: a V head dim unlike Q/K's (d_v " + std::to_string(shape.d_v) + ", d " + std::to_string(shape.d) +
                       ") has no CUDA kernel (" + compiled_fwd_summary() + ")" + host);
  }
  if (!compiled) return {};
  const CompiledPolicies policies = compiled_policies(shape.dtype, shape.d, shape.d_v);
  const bool runs = std::visit(
      [&](const auto& p) {
        using P = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<P, ExactGateParams> || std::is_same_v<P, SoftmaxSkipParams>) {
          return policies.gates;
        } else if constexpr (std::is_same_v<P, EstimateSelectParams>) {
          return policies.select;
        } else if constexpr (std::is_same_v<P, PermuteStopParams>) {
          return policies.permute;
        } else {
          return true;  // dense and block_sparse (the forward instance), or refused by check_support
        }
      },
      policy);
  if (!runs) {
    return unsupported("head_dim " + std::to_string(shape.d) +
                       (shape.d_v != shape.d ? " (d_v " + std::to_string(shape.d_v) + ")" : "") + " runs " +
                       policies.describe() + " on CUDA, not " + policy_name(policy) + host);
  }
  return {};
}

// estimate_select's blocks on CUDA: the selector's query tile is its pooling block, 128, and
// its energies of a tile live in shared memory (kMaxSelectBlocks key blocks).
Status check_select_blocks(const ProblemShape& shape, const EstimateSelectParams& p) {
  if (p.block != kBlockQ) {
    return unsupported("estimate_select: the CUDA selector needs block = 128, got " + std::to_string(p.block));
  }
  if (max_blocks(shape, p.block) > kMaxSelectBlocks) {
    return unsupported("estimate_select: the CUDA selector handles at most " + std::to_string(kMaxSelectBlocks) +
                       " key blocks, got " + std::to_string(max_blocks(shape, p.block)));
  }
  if (p.mean_correction && geom::ceil_div(max_blocks(shape, p.block), kMeanChunk) > kMaxMeanChunks) {
    return unsupported("estimate_select: mean correction on CUDA handles at most " +
                       std::to_string(kMaxMeanChunks * kMeanChunk) + " key blocks");
  }
  return {};
}

}  // namespace

Status check_support(const ProblemShape& shape, const Policy& policy, int* block_k) {
  SP_RETURN_IF_ERROR(check_features(shape, policy));
  if (shape.dtype == DType::kFP8E4M3) {
    // The Hopper kernel's fp8 instances, over contiguous K/V (run_cuda also needs a compute
    // capability 9.0 device and TMA-describable tensors).
    if (find_fwd90(shape.dtype, shape.d, shape.d_v, false) == nullptr) {
      return unsupported("q: fp8_e4m3 inputs run on CUDA with head_dim " + fwd90_head_dims(shape.dtype) +
                         " only (the Hopper kernel's fp8 instances), got " + std::to_string(shape.d) +
                         (shape.d_v != shape.d ? " (d_v " + std::to_string(shape.d_v) + ")" : "") +
                         "; the reference and cpu backends run every head_dim");
    }
    if (shape.kv_layout == KvLayout::kPaged) {
      return unsupported("k: fp8_e4m3 inputs need contiguous K/V on CUDA (paged K/V: the reference and cpu backends)");
    }
    const auto* mask = std::get_if<BlockSparseParams>(&policy);
    const auto* es = std::get_if<EstimateSelectParams>(&policy);
    const auto* eg = std::get_if<ExactGateParams>(&policy);
    const auto* skip = std::get_if<SoftmaxSkipParams>(&policy);
    if (std::holds_alternative<PermuteStopParams>(policy)) {
      return unsupported(std::string(policy_name(policy)) + ": fp8_e4m3 inputs on CUDA run dense, block_sparse, "
                         "exact_gate, softmax_skip and estimate_select (the reference and cpu backends run every policy)");
    }
    // The fp8 instance's blocks are its 128-key tiles (the gates in its loop: one pass).
    const auto blocks_of = [&]() -> std::pair<int, int> {
      if (mask != nullptr) return {mask->block_q(), mask->block_k()};
      if (eg != nullptr) return {eg->block_q, eg->block_k};
      if (skip != nullptr) return {skip->block_q, skip->block_k};
      return {kBlockQ, hopper_block_k()};
    };
    const auto [bq, bk] = blocks_of();
    if (bq != kBlockQ || bk != hopper_block_k()) {
      return unsupported(std::string(policy_name(policy)) + (mask != nullptr ? " mask" : "") +
                         ": fp8_e4m3 inputs on CUDA need 128 x 128 blocks, got " + std::to_string(bq) + " x " +
                         std::to_string(bk));
    }
    if (es != nullptr) {
      // The selector's fp8 instance scores e4m3 queries against bf16 means; the forward
      // instance of its head dim has the mean tiles (variants.py).
      SP_RETURN_IF_ERROR(check_select_blocks(shape, *es));
      if (find_select90(shape.dtype, shape.d) == nullptr) {
        return unsupported(std::string("estimate_select: no compiled selector for fp8_e4m3 head_dim ") +
                           std::to_string(shape.d) + " (" + support_summary() + ")");
      }
    }
    *block_k = std::holds_alternative<DenseParams>(policy) ? dense_block_k(shape.d) : hopper_block_k();
    return {};
  }
  if (shape.dtype != DType::kBF16 && shape.dtype != DType::kFP16) {
    return unsupported(std::string("q: dtype ") + dtype_name(shape.dtype) + " has no CUDA kernel; expected bf16 or fp16 (" +
                       support_summary() + ")");
  }
  int n = 0;
  Status st = std::visit(
      [&](const auto& p) -> Status {
        using P = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<P, DenseParams>) {
          n = dense_block_k(shape.d);
        } else if constexpr (std::is_same_v<P, BlockSparseParams>) {
          SP_RETURN_IF_ERROR(check_blocks("block_sparse mask", p.block_q(), p.block_k()));
          n = p.block_k();
        } else if constexpr (std::is_same_v<P, ExactGateParams>) {
          SP_RETURN_IF_ERROR(check_blocks("exact_gate", p.block_q, p.block_k));
          n = p.block_k;
        } else if constexpr (std::is_same_v<P, SoftmaxSkipParams>) {
          SP_RETURN_IF_ERROR(check_blocks("softmax_skip", p.block_q, p.block_k));
          n = p.block_k;
        } else if constexpr (std::is_same_v<P, EstimateSelectParams>) {
          SP_RETURN_IF_ERROR(check_select_blocks(shape, p));
          n = p.block;
          if (find_select(shape.dtype, shape.d, shape.d_v) == nullptr) {
            return unsupported(std::string("estimate_select: no compiled selector for ") + dtype_name(shape.dtype) +
                               " head_dim " + std::to_string(shape.d) + " (" + support_summary() + ")");
          }
        } else if constexpr (std::is_same_v<P, PermuteStopParams>) {
          SP_RETURN_IF_ERROR(check_blocks("permute_stop", p.block_q, p.block_k));
          if (find_permute(shape.dtype, shape.d) == nullptr) {
            return unsupported(std::string("permute_stop: no compiled kernel for ") + dtype_name(shape.dtype) +
                               " head_dim " + std::to_string(shape.d) + " (" + support_summary() + ")");
          }
          PermuteLayout layout;
          SP_RETURN_IF_ERROR(permute_layout(shape, p, &layout));
          n = p.block_k;
        } else {
          return unsupported(std::string(policy_name(policy)) +
                             ": not implemented on CUDA yet (the cpu and reference backends run it)");
        }
        return {};
      },
      policy);
  SP_RETURN_IF_ERROR(st);
  const bool gated = std::holds_alternative<ExactGateParams>(policy) || std::holds_alternative<SoftmaxSkipParams>(policy);
  // Every compiled (dtype, head_dim) has its plain, general and gated instances.
  if (find_fwd(shape.dtype, shape.d, shape.d_v, gated, false) == nullptr) {
    return unsupported(std::string("no compiled CUDA kernel for dtype ") + dtype_name(shape.dtype) + ", head_dim " +
                       std::to_string(shape.d) + " (" + support_summary() + ")");
  }
  *block_k = n;
  return {};
}

Status check_layout(const AttentionProblem& problem, const AttentionOutput& output) {
  SP_RETURN_IF_ERROR(check_view("q", problem.q));
  SP_RETURN_IF_ERROR(check_view("k", problem.k));
  SP_RETURN_IF_ERROR(check_view("v", problem.v));
  SP_RETURN_IF_ERROR(check_view("o", output.o));
  return {};
}

std::vector<SeqInfo> make_seq_infos(const AttentionProblem& problem, const ProblemShape& shape,
                                    const AttentionOutput& output) {
  std::vector<SeqInfo> seqs(static_cast<std::size_t>(shape.batch));
  for (int b = 0; b < shape.batch; ++b) {
    const auto u = static_cast<std::size_t>(b);
    SeqInfo& s = seqs[u];
    s.s_q = shape.seq_q[u];
    s.s_k = shape.seq_k[u];
    s.q_off = seq_offset(problem.q, b, shape.q_start[u]);
    s.o_off = seq_offset(output.o, b, shape.q_start[u]);
    // Paged K/V: rows are found through the block table from the tensor's start.
    const bool paged = shape.kv_layout == KvLayout::kPaged;
    s.k_off = paged ? 0 : seq_offset(problem.k, b, shape.k_start[u]);
    s.v_off = paged ? 0 : seq_offset(problem.v, b, shape.k_start[u]);
    const TensorView& l = output.lse;
    // LSE is [b, h_q, s_q] (batched) or [h_q, total_q] (varlen).
    s.lse_off = !l.defined() ? 0 : (l.rank == 3 ? b * l.stride[0] : shape.q_start[u] * l.stride[1]);
  }
  return seqs;
}

FwdParams make_fwd_params(const AttentionProblem& problem, const ProblemShape& shape,
                          const AttentionOutput& output, int block_k) {
  FwdParams p{};
  p.q = problem.q.data;
  p.k = problem.k.data;
  p.v = problem.v.data;
  p.o = output.o.data;
  p.lse = output.lse.defined() ? static_cast<float*>(output.lse.data) : nullptr;
  p.q_row_stride = row_stride(problem.q);
  p.q_head_stride = head_stride(problem.q);
  p.k_row_stride = row_stride(problem.k);
  p.k_head_stride = head_stride(problem.k);
  p.v_row_stride = row_stride(problem.v);
  p.v_head_stride = head_stride(problem.v);
  p.o_row_stride = row_stride(output.o);
  p.o_head_stride = head_stride(output.o);
  if (output.lse.defined()) {
    const TensorView& l = output.lse;
    p.lse_head_stride = l.rank == 3 ? l.stride[1] : l.stride[0];
    p.lse_row_stride = l.rank == 3 ? l.stride[2] : l.stride[1];
  }
  if (shape.kv_layout == KvLayout::kPaged) {
    p.paged.table_stride = block_table_stride(shape);
    p.paged.page_size = shape.page_size;
    p.paged.k_page_stride = problem.k.stride[0];
    p.paged.v_page_stride = problem.v.stride[0];
    p.paged.gather_rows = hopper_gathers_pages(shape.page_size);
  }
  p.batch = shape.batch;
  p.h_q = shape.h_q;
  p.h_kv = shape.h_kv;
  p.group = shape.group();
  p.num_q_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_q(), kBlockQ));
  p.q_pack = 1;
  p.causal = shape.causal;
  if (shape.local()) {  // else plain causal or full: a causal call's right bound hides no key
    p.window_left = shape.window_left;
    p.window_right = shape.window_right;
    p.attention_chunk = shape.attention_chunk;
  }
  p.scale = static_cast<float>(shape.scale);
  p.scale_log2 = static_cast<float>(shape.scale * 1.4426950408889634);  // scale · log2(e)
  if (shape.softcap != 0.0) {  // the capped score is the logit: the softmax then scales by 1
    p.softcap = static_cast<float>(shape.softcap);
    p.cap_scale = p.scale;
    p.scale = 1.f;
    p.scale_log2 = 1.4426950408889634f;
  }
  if (shape.sinks) {
    p.sinks = static_cast<const float*>(problem.sinks.data);
    p.sinks_stride = problem.sinks.stride[0];
  }
  p.mode = PolicyMode::kDense;
  p.block_k = block_k;
  const TensorView* descales[3] = {&problem.q_descale, &problem.k_descale, &problem.v_descale};
  for (int i = 0; i < 3; ++i) {
    if (!descales[i]->defined()) continue;
    p.descale[i] = static_cast<const float*>(descales[i]->data);
    p.descale_stride[i][0] = descales[i]->stride[0];
    p.descale_stride[i][1] = descales[i]->stride[1];
  }
  return p;
}

std::int64_t block_table_stride(const ProblemShape& shape) {
  std::int64_t pages = 1;  // never empty: a null table would read as contiguous K/V
  for (std::int64_t s_k : shape.seq_k) pages = geom::max64(pages, geom::ceil_div(s_k, shape.page_size));
  return pages;
}

std::vector<std::int32_t> compact_block_table(const AttentionProblem& problem, const ProblemShape& shape) {
  const std::int64_t stride = block_table_stride(shape);
  std::vector<std::int32_t> table(static_cast<std::size_t>(shape.batch * stride), 0);
  const TensorView& t = problem.block_table;
  const auto* src = static_cast<const std::int32_t*>(t.data);
  for (int b = 0; b < shape.batch; ++b) {
    const std::int64_t pages = geom::ceil_div(shape.seq_k[static_cast<std::size_t>(b)], shape.page_size);
    for (std::int64_t i = 0; i < pages; ++i) {
      table[static_cast<std::size_t>(b * stride + i)] = src[b * t.stride[0] + i * t.stride[1]];
    }
  }
  return table;
}

namespace {

// (query, key) pairs the mask lets sequence b's queries see: row i of a causal call sees
// keys 0 .. i + s_k - s_q (bottom-right aligned); under a local window, row by row.
double visible_pairs(const ProblemShape& shape, int b) {
  const geom::SeqGeometry g = detail::sequence_geometry(shape, b);
  const std::int64_t s_q = g.s_q, s_k = g.s_k;
  if (s_q <= 0 || s_k <= 0) return 0.0;
  if (shape.local()) {
    double pairs = 0.0;
    for (std::int64_t r = 0; r < s_q; ++r) pairs += static_cast<double>(g.keys_in(g.position(r), 0, s_k));
    return pairs;
  }
  const bool causal = g.causal;
  if (!causal) return static_cast<double>(s_q) * static_cast<double>(s_k);
  const std::int64_t first = geom::max64(0, s_q - s_k);  // the first row that sees a key
  const double rows = static_cast<double>(s_q - first);
  // Row i sees i + s_k - s_q + 1 keys: from first + s_k - s_q + 1 up to s_k.
  return rows * (static_cast<double>(first + s_k - s_q + 1) + static_cast<double>(s_k)) / 2.0;
}

}  // namespace

KvStaging plan_kv_staging(const ProblemShape& shape, const Policy& policy, std::size_t free_bytes) {
  using tuning::kFlopsPerCopyByte;
  using tuning::kGatheredCost;
  using tuning::kSparseDensity;
  constexpr int kMaxBatch = 65535;  // the copy's grid.y
  KvStaging out;
  if (shape.kv_layout != KvLayout::kPaged || shape.batch > kMaxBatch) return out;
  double pairs = 0.0;
  out.k_start.resize(static_cast<std::size_t>(shape.batch));
  for (int b = 0; b < shape.batch; ++b) {
    const auto u = static_cast<std::size_t>(b);
    out.k_start[u] = out.rows;
    out.rows += shape.seq_k[u];
    pairs += visible_pairs(shape, b);
  }
  // A key's K and V rows (V's head dim is d_v).
  const std::size_t row_bytes = static_cast<std::size_t>(shape.h_kv) * static_cast<std::size_t>(shape.d + shape.d_v) *
                                dtype_size(shape.dtype);
  out.bytes = static_cast<std::size_t>(out.rows) * row_bytes;
  if (out.rows == 0 || pairs == 0.0) return out;
  const double density = std::visit(
      [&](const auto& p) -> double {
        using P = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<P, BlockSparseParams>) {
          if (p.in_place()) return 1.0;  // a device mask's density is not known on the host
          double kept = 0.0;
          for (std::size_t r = 0; r < p.mask.full_count.size(); ++r) {
            kept += static_cast<double>(p.mask.full_count[r]) + static_cast<double>(p.mask.partial_count[r]);
          }
          const double units = p.mask.per_kv_head ? shape.h_kv : shape.h_q;
          const double visible = pairs * units / (static_cast<double>(p.mask.block_q) * p.mask.block_k);
          return visible > 0.0 ? std::min(1.0, kept / visible) : 1.0;
        } else if constexpr (std::is_same_v<P, EstimateSelectParams> || std::is_same_v<P, PermuteStopParams>) {
          return kSparseDensity;
        } else {
          return 1.0;
        }
      },
      policy);
  const double attention_flops = 2.0 * (shape.d + shape.d_v) * shape.h_q * pairs * density;
  const double copy_bytes = 2.0 * static_cast<double>(out.bytes);  // read and write
  out.stage = copy_bytes * kFlopsPerCopyByte <= kGatheredCost * attention_flops &&
              out.bytes <= free_bytes / tuning::kStagingFreeShare;
  return out;
}

ProblemShape staged_shape(const ProblemShape& shape, const KvStaging& staging) {
  ProblemShape s = shape;
  s.kv_layout = KvLayout::kVarlen;
  s.page_size = 0;
  s.k_start = staging.k_start;
  return s;
}

CompactMask compact_mask(const BlockMask& mask) {
  CompactMask c;
  c.full_count = mask.full_count;
  c.partial_count = mask.partial_count;
  const std::size_t rows = mask.full_count.size();
  c.full_start.resize(rows);
  c.partial_start.resize(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t base = r * static_cast<std::size_t>(mask.num_k_blocks);
    c.full_start[r] = static_cast<std::int64_t>(c.full_index.size());
    c.full_index.insert(c.full_index.end(), mask.full_index.begin() + static_cast<std::ptrdiff_t>(base),
                        mask.full_index.begin() + static_cast<std::ptrdiff_t>(base) + mask.full_count[r]);
    c.partial_start[r] = static_cast<std::int64_t>(c.partial_index.size());
    c.partial_index.insert(c.partial_index.end(), mask.partial_index.begin() + static_cast<std::ptrdiff_t>(base),
                           mask.partial_index.begin() + static_cast<std::ptrdiff_t>(base) + mask.partial_count[r]);
  }
  return c;
}

Status permute_layout(const ProblemShape& shape, const PermuteStopParams& params, PermuteLayout* out) {
  constexpr std::int64_t kMaxItems = 2147483647;  // CUB's segmented sort counts items in int
  std::int64_t max_segments = 0, max_prefix = 0;
  const auto seg_geo = [&](int b) {
    const auto u = static_cast<std::size_t>(b);
    return geom::SegmentGeometry{{shape.seq_q[u], shape.seq_k[u], true}, params.segment};
  };
  for (int b = 0; b < shape.batch; ++b) max_segments = geom::max64(max_segments, seg_geo(b).count());
  const std::int64_t max_s_q = shape.max_seq_q();
  const std::int64_t slots = std::int64_t{shape.batch} * shape.h_q * max_s_q;
  PermuteLayout l;
  l.rank_offsets.reserve(static_cast<std::size_t>(std::int64_t{shape.batch} * shape.h_q * max_segments + 1));
  l.query_offsets.reserve(static_cast<std::size_t>(std::int64_t{shape.batch} * shape.h_q * (max_segments + 2) + 1));
  std::int64_t ranked = 0;
  l.rank_offsets.push_back(0);
  l.query_offsets.push_back(0);
  for (int b = 0; b < shape.batch; ++b) {
    const geom::SegmentGeometry sg = seg_geo(b);
    for (int h = 0; h < shape.h_q; ++h) {
      const std::int64_t base = (std::int64_t{b} * shape.h_q + h) * max_s_q;
      l.query_offsets.push_back(static_cast<std::int32_t>(base + sg.first_row()));
      for (std::int64_t slot = 0; slot < max_segments; ++slot) {
        const bool real = slot < sg.count();
        const std::int64_t prefix = real ? sg.prefix(sg.first() + slot) : 0;
        max_prefix = geom::max64(max_prefix, prefix);
        ranked += prefix;
        if (ranked > kMaxItems) break;
        l.rank_offsets.push_back(static_cast<std::int32_t>(ranked));
        l.query_offsets.push_back(static_cast<std::int32_t>(base + (real ? sg.row_end(sg.first() + slot) : sg.seq.s_q)));
      }
      if (ranked > kMaxItems || slots > kMaxItems) {
        return unsupported("permute_stop: the CUDA sorts take at most 2^31 - 1 items; this call has " +
                           (ranked > kMaxItems ? std::string("more") : std::to_string(ranked)) +
                           " ranked prefix keys (per sequence, query head and segment: the keys before the "
                           "segment) and " + std::to_string(slots) + " query slots (batch · h_q · max s_q); " +
                           "use a longer segment or fewer tokens per call");
      }
      l.query_offsets.push_back(static_cast<std::int32_t>(base + max_s_q));
    }
  }
  l.max_segments = static_cast<int>(max_segments);
  l.max_s_q = static_cast<int>(max_s_q);
  l.max_prefix = static_cast<int>(max_prefix);
  l.tiles_per_segment = static_cast<int>(geom::ceil_div(geom::min64(params.segment, max_s_q), kBlockQ));
  *out = std::move(l);
  return {};
}

std::vector<PermuteTile> permute_tiles(const ProblemShape& shape, const PermuteStopParams& params,
                                       const PermuteLayout& layout, const std::vector<std::int32_t>& visited) {
  std::vector<PermuteTile> tiles;
  for (int b = 0; b < shape.batch; ++b) {
    const auto u = static_cast<std::size_t>(b);
    const geom::SegmentGeometry sg{{shape.seq_q[u], shape.seq_k[u], true}, params.segment};
    for (int h = 0; h < shape.h_q; ++h) {
      for (std::int64_t slot = 0; slot < sg.count(); ++slot) {
        const std::int64_t s = sg.first() + slot;
        const std::int64_t item = (std::int64_t{b} * shape.h_q + h) * layout.max_segments + slot;
        const std::int64_t n_tiles = geom::ceil_div(sg.row_end(s) - sg.row_begin(s), kBlockQ);
        for (std::int64_t t = 0; t < n_tiles; ++t) {
          PermuteTile pt;
          pt.batch = b;
          pt.head = h;
          pt.segment = static_cast<int>(s);
          pt.tile = static_cast<int>(t);
          pt.chunks_visited = visited[static_cast<std::size_t>(item * layout.tiles_per_segment + t)];
          pt.chunks_total = static_cast<int>(geom::ceil_div(sg.prefix(s), params.block_k));
          tiles.push_back(pt);
        }
      }
    }
  }
  return tiles;
}

int bitmap_words(int num_k_blocks) { return (num_k_blocks + 31) / 32; }

std::vector<SelectSeq> make_select_seqs(const EstimateSelectParams& params, const detail::EstimateChunks& chunks) {
  std::vector<SelectSeq> out;
  if (!params.prompt_len.defined() && !chunks.cached) return out;
  out.resize(chunks.valid.size());
  for (std::size_t b = 0; b < out.size(); ++b) out[b] = SelectSeq{chunks.prompt_len[b], chunks.valid[b]};
  return out;
}

MeanCache mean_cache(const TensorView& cache) {
  if (!cache.defined()) return MeanCache{nullptr, 0, 0, 0};
  return MeanCache{cache.data, cache.stride[0], cache.stride[1], cache.stride[2]};
}

Status mask_from_bits(const ProblemShape& shape, int block_q, int block_k, bool per_kv_head,
                      const std::vector<std::uint32_t>& bits, BlockMask* out) {
  BlockMask m = BlockMask::empty(shape, block_q, block_k, per_kv_head);
  const int words = bitmap_words(m.num_k_blocks);
  const std::size_t rows = m.full_count.size();
  if (bits.size() != rows * static_cast<std::size_t>(words)) {
    return {StatusCode::kInternal, "mask_from_bits: bitmap has " + std::to_string(bits.size()) + " words, expected " +
                                       std::to_string(rows * static_cast<std::size_t>(words))};
  }
  // A row's bits in ascending order are its sorted lists, each block classified as
  // BlockMask::add does (by the sequence's geometry), without add's per-block search.
  for (int b = 0; b < m.batch; ++b) {
    const geom::BlockGeometry g = detail::block_geometry(shape, b, block_q, block_k);
    for (int h = 0; h < m.heads; ++h) {
      for (int qb = 0; qb < m.num_q_blocks; ++qb) {
        const std::size_t row = static_cast<std::size_t>(m.row(b, h, qb));
        const std::size_t base = row * static_cast<std::size_t>(m.num_k_blocks);
        std::int32_t& full = m.full_count[row];
        std::int32_t& partial = m.partial_count[row];
        for (int w = 0; w < words; ++w) {
          for (std::uint32_t word = bits[row * static_cast<std::size_t>(words) + static_cast<std::size_t>(w)]; word != 0u;
               word &= word - 1u) {
            const int kb = w * 32 + __builtin_ctz(word);
            if (!g.is_visible(qb, kb)) {
              return {StatusCode::kInternal, "CUDA decisions: key block " + std::to_string(kb) +
                                                 " is not visible to query block " + std::to_string(qb) + " of row (" +
                                                 std::to_string(b) + ", " + std::to_string(h) + ")"};
            }
            if (g.is_full(qb, kb)) {
              m.full_index[base + static_cast<std::size_t>(full++)] = kb;
            } else {
              m.partial_index[base + static_cast<std::size_t>(partial++)] = kb;
            }
          }
        }
      }
    }
  }
  *out = std::move(m);
  return {};
}

Status mask_from_arrays(const ProblemShape& shape, int block, bool per_kv_head, std::vector<std::int32_t>&& full_count,
                        std::vector<std::int32_t>&& full_index, std::vector<std::int32_t>&& partial_count,
                        std::vector<std::int32_t>&& partial_index, BlockMask* out) {
  // The arrays become the mask's (they have its layout): no second allocation of
  // rows x num_k_blocks entries, which a selection read back at every layer paid for.
  BlockMask m = detail::block_mask_layout(shape, block, block, per_kv_head);
  const std::size_t rows = static_cast<std::size_t>(m.batch) * static_cast<std::size_t>(m.heads) *
                           static_cast<std::size_t>(m.num_q_blocks);
  const std::size_t cap = static_cast<std::size_t>(m.num_k_blocks);
  if (full_count.size() != rows || partial_count.size() != rows || full_index.size() != rows * cap ||
      partial_index.size() != rows * cap) {
    return {StatusCode::kInternal, "mask_from_arrays: array sizes do not match the mask geometry"};
  }
  // Entries past a row's count are -1, as BlockMask promises; a count out of [0, cap] is left
  // for validate_for to name.
  const auto clear_tail = [cap](std::int32_t* row, std::int32_t count) {
    const std::int64_t used = std::clamp<std::int64_t>(count, 0, static_cast<std::int64_t>(cap));
    std::fill(row + used, row + static_cast<std::int64_t>(cap), -1);
  };
  for (std::size_t r = 0; r < rows; ++r) {
    clear_tail(full_index.data() + r * cap, full_count[r]);
    clear_tail(partial_index.data() + r * cap, partial_count[r]);
  }
  m.full_count = std::move(full_count);
  m.full_index = std::move(full_index);
  m.partial_count = std::move(partial_count);
  m.partial_index = std::move(partial_index);
  Status st = m.validate_for(shape);
  if (!st.ok()) return {StatusCode::kInternal, "CUDA selector produced an invalid mask: " + st.message()};
  *out = std::move(m);
  return {};
}

Status check_calib_support(const ProblemShape& shape, int block_q, int block_k) {
  if (shape.dtype != DType::kBF16 && shape.dtype != DType::kFP16) {
    return unsupported(std::string("calibration statistics: q: dtype ") + dtype_name(shape.dtype) +
                       " has no CUDA kernel; expected bf16 or fp16");
  }
  if (shape.kv_layout == KvLayout::kPaged) {
    return unsupported("calibration statistics: paged K/V is not supported on CUDA");
  }
  if (!is_supported_block_k(block_q) || !is_supported_block_k(block_k)) {
    return unsupported("calibration statistics: the CUDA kernel needs block_q and block_k of 64 or 128, got " +
                       std::to_string(block_q) + " x " + std::to_string(block_k));
  }
  if (find_calib(shape.dtype, shape.d) == nullptr) {
    return unsupported(std::string("calibration statistics: no compiled CUDA kernel for ") + dtype_name(shape.dtype) +
                       " head_dim " + std::to_string(shape.d) + " (" + support_summary() + ")");
  }
  return {};
}

Status check_select_statistics_support(const ProblemShape& shape, const EstimateSelectParams& base) {
  if (shape.kv_layout == KvLayout::kPaged) {
    return unsupported("estimate_select statistics: paged K/V is not supported on CUDA");
  }
  if (shape.dtype != DType::kBF16 && shape.dtype != DType::kFP16) {
    return unsupported(std::string("estimate_select statistics: q: dtype ") + dtype_name(shape.dtype) +
                       " has no CUDA selector; expected bf16 or fp16");
  }
  if (base.block != kBlockQ) {
    return unsupported("estimate_select statistics: the CUDA selector needs block = 128, got " +
                       std::to_string(base.block));
  }
  if (max_blocks(shape, base.block) > kMaxSelectBlocks) {
    return unsupported("estimate_select statistics: the CUDA selector handles at most " +
                       std::to_string(kMaxSelectBlocks) + " key blocks, got " +
                       std::to_string(max_blocks(shape, base.block)));
  }
  if (find_select(shape.dtype, shape.d, shape.d_v) == nullptr) {
    return unsupported(std::string("estimate_select statistics: no compiled selector for ") + dtype_name(shape.dtype) +
                       " head_dim " + std::to_string(shape.d) + " (" + support_summary() + ")");
  }
  return {};
}

Status check_qk_layout(const AttentionProblem& problem) {
  SP_RETURN_IF_ERROR(check_view("q", problem.q));
  SP_RETURN_IF_ERROR(check_view("k", problem.k));
  return {};
}

CalibParams make_calib_params(const AttentionProblem& problem, const ProblemShape& shape, int block_q, int block_k) {
  CalibParams p{};
  p.q = problem.q.data;
  p.k = problem.k.data;
  p.q_row_stride = row_stride(problem.q);
  p.q_head_stride = head_stride(problem.q);
  p.k_row_stride = row_stride(problem.k);
  p.k_head_stride = head_stride(problem.k);
  p.batch = shape.batch;
  p.h_q = shape.h_q;
  p.group = shape.group();
  p.scale = static_cast<float>(shape.scale);
  p.block_q = block_q;
  p.block_k = block_k;
  p.num_q_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_q(), block_q));
  p.num_k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), block_k));
  return p;
}

SelectParams make_select_statistics_params(const AttentionProblem& problem, const ProblemShape& shape,
                                           const EstimateSelectParams& base) {
  SelectParams sp{};
  sp.q = problem.q.data;
  sp.k = problem.k.data;
  sp.v = problem.k.data;
  sp.q_row_stride = row_stride(problem.q);
  sp.q_head_stride = head_stride(problem.q);
  sp.k_row_stride = row_stride(problem.k);
  sp.k_head_stride = head_stride(problem.k);
  sp.v_row_stride = sp.k_row_stride;
  sp.v_head_stride = sp.k_head_stride;
  sp.batch = shape.batch;
  sp.h_q = shape.h_q;
  sp.h_kv = shape.h_kv;
  sp.group = shape.group();
  sp.scale = static_cast<float>(shape.scale);
  sp.block = base.block;
  sp.num_q_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_q(), base.block));
  sp.num_k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), base.block));
  sp.alpha = 1.0f;  // no mask is written
  sp.pack_gqa = base.pack_gqa;
  return sp;
}

namespace {

// Copies a sequence's [heads, nqb, nkb] corner out of a capacity-layout [batch, heads, cap_q,
// cap_k] array, applying fn to each value.
template <class Fn>
std::vector<double> corner(const std::vector<float>& a, int b, int heads, int cap_q, int cap_k, int nqb, int nkb,
                           const Fn& fn) {
  std::vector<double> out(static_cast<std::size_t>(heads) * nqb * nkb);
  for (int h = 0; h < heads; ++h) {
    for (int qb = 0; qb < nqb; ++qb) {
      const std::size_t src = ((static_cast<std::size_t>(b) * heads + h) * cap_q + qb) * cap_k;
      const std::size_t dst = (static_cast<std::size_t>(h) * nqb + qb) * nkb;
      for (int kb = 0; kb < nkb; ++kb) out[dst + kb] = fn(static_cast<double>(a[src + kb]));
    }
  }
  return out;
}

}  // namespace

std::vector<BlockStatistics> block_statistics_from_device(const ProblemShape& shape, int block_q, int block_k,
                                                          int num_q_blocks, int num_k_blocks,
                                                          const std::vector<float>& block_max,
                                                          const std::vector<float>& skip_g) {
  std::vector<BlockStatistics> out(static_cast<std::size_t>(shape.batch));
  for (int b = 0; b < shape.batch; ++b) {
    BlockStatistics& st = out[static_cast<std::size_t>(b)];
    st.s_q = shape.seq_q[static_cast<std::size_t>(b)];
    st.s_k = shape.seq_k[static_cast<std::size_t>(b)];
    st.heads = shape.h_q;
    st.block_q = block_q;
    st.block_k = block_k;
    const geom::BlockGeometry g{{st.s_q, st.s_k, true}, block_q, block_k};
    const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
    if (!block_max.empty()) {
      st.block_max = corner(block_max, b, shape.h_q, num_q_blocks, num_k_blocks, nqb, nkb, [](double x) { return x; });
    }
    if (!skip_g.empty()) {
      const double ln_s_k = st.s_k > 0 ? std::log(static_cast<double>(st.s_k)) : 0.0;
      st.skip_g = corner(skip_g, b, shape.h_q, num_q_blocks, num_k_blocks, nqb, nkb,
                         [ln_s_k](double x) { return x + ln_s_k; });
    }
  }
  return out;
}

std::vector<SelectStatistics> select_statistics_from_device(const ProblemShape& shape, const EstimateSelectParams& base,
                                                            int num_q_blocks, int num_k_blocks,
                                                            const std::vector<float>& ratio) {
  const int units = base.pack_gqa ? shape.h_kv : shape.h_q;
  std::vector<SelectStatistics> out(static_cast<std::size_t>(shape.batch));
  for (int b = 0; b < shape.batch; ++b) {
    SelectStatistics& st = out[static_cast<std::size_t>(b)];
    st.s_q = shape.seq_q[static_cast<std::size_t>(b)];
    st.s_k = shape.seq_k[static_cast<std::size_t>(b)];
    st.units = units;
    st.block = base.block;
    st.pack_gqa = base.pack_gqa;
    const geom::BlockGeometry g{{st.s_q, st.s_k, true}, base.block, base.block};
    st.ratio = corner(ratio, b, units, num_q_blocks, num_k_blocks, g.num_q_blocks(), g.num_k_blocks(),
                      [](double x) { return x; });
  }
  return out;
}

}  // namespace sparseprefill::cuda
