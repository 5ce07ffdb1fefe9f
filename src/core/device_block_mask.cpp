// SPDX-License-Identifier: Apache-2.0
// DeviceBlockMask (block_mask.h): its shape checks against a call, and the host backends'
// reading of host tensors as a BlockMask, with the entry rule of core/rules/block_sparse.h.
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/geometry.h"
#include "core/mask_faults.h"
#include "core/rules/block_sparse.h"
#include "core/shape_geometry.h"
#include "sparseprefill/block_mask.h"

namespace sparseprefill {
namespace {

const char* const kListNames[3] = {"kv_indices", "full_kv_indices", "csr_indices"};

std::string dims(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

Status check_int32(const char* name, const TensorView& t, int rank, const ProblemShape& shape) {
  if (!t.defined()) return invalid_argument(std::string("mask.") + name + ": required");
  if (t.dtype != DType::kInt32 || t.rank != rank) {
    return invalid_argument(std::string("mask.") + name + ": expected int32 of rank " + std::to_string(rank) + ", got " +
                            describe(t));
  }
  if (t.device != shape.device) return invalid_argument(std::string("mask.") + name + ": expected q's device, got " + describe(t));
  if (t.data == nullptr && t.numel() > 0) return invalid_argument(std::string("mask.") + name + ": data is null");
  return {};
}

// The rows of the call: batch x heads x the longest sequence's query blocks.
int call_q_blocks(const ProblemShape& s, int block_q) {
  int n = 0;
  for (const std::int64_t s_q : s.seq_q) n = std::max(n, static_cast<int>(geom::ceil_div(s_q, block_q)));
  return n;
}

}  // namespace

std::string detail::mask_fault_message(const rules::MaskFaultRecord& f) {
  std::string where = std::string("mask.") + kListNames[f.list] + ": row (b " + std::to_string(f.b) + ", h " +
                      std::to_string(f.h) + ", q block " + std::to_string(f.qb) + ")";
  switch (f.fault) {
    case rules::kMaskCount:
      return where + " has count " + std::to_string(f.value) + ", outside 0 .. " + std::to_string(f.limit) +
             " (the index tensor's last dimension)";
    case rules::kMaskRange:
      return where + " entry " + std::to_string(f.entry) + " is key block " + std::to_string(f.value) +
             ", not visible to its query block (the causal mask leaves key blocks below " + std::to_string(f.limit) +
             ", a local window fewer)";
    case rules::kMaskOrder:
      return where + " entry " + std::to_string(f.entry) + " is key block " + std::to_string(f.value) +
             ", not above the entry before it (each list must be strictly ascending)";
    case rules::kMaskBoth:
      return where + " entry " + std::to_string(f.entry) + " is key block " + std::to_string(f.value) +
             ", which the row's other list holds too";
    case rules::kMaskIndptr:
      return "mask.csr_indptr[" + std::to_string(f.entry) + "] = " + std::to_string(f.value) +
             ": decreases or points past the " + std::to_string(f.limit) + " indices";
    default: break;
  }
  return where + ": fault " + std::to_string(f.fault);
}

Status DeviceBlockMask::validate_for(const ProblemShape& s) const {
  if (block_q < 1 || block_k < 1) {
    return invalid_argument("mask: block sizes must be >= 1, got " + std::to_string(block_q) + " x " +
                            std::to_string(block_k));
  }
  const int heads = per_kv_head ? s.h_kv : s.h_q;
  const int nqb = call_q_blocks(s, block_q);
  if (is_csr()) {
    if (partial_count.defined() || full_count.defined()) {
      return invalid_argument("mask: give FlexAttention's tensors or CSR (csr_indptr, csr_indices), not both");
    }
    SP_RETURN_IF_ERROR(check_int32("csr_indptr", csr_indptr, 1, s));
    SP_RETURN_IF_ERROR(check_int32("csr_indices", csr_indices, 1, s));
    const std::int64_t rows = std::int64_t{s.batch} * heads * nqb;
    if (csr_indptr.shape[0] != rows + 1 || csr_indptr.stride[0] != 1 || csr_indices.stride[0] != 1) {
      return invalid_argument("mask.csr_indptr: expected contiguous int32 [batch * heads * q_blocks + 1] = [" +
                              std::to_string(rows + 1) + "], got " + describe(csr_indptr));
    }
    return {};
  }
  SP_RETURN_IF_ERROR(check_int32("kv_num_blocks", partial_count, 3, s));
  SP_RETURN_IF_ERROR(check_int32("kv_indices", partial_index, 4, s));
  if (full_count.defined() != full_index.defined()) {
    return invalid_argument("mask: full_kv_num_blocks and full_kv_indices go together (both, or neither)");
  }
  const TensorView* pairs[2][2] = {{&partial_count, &partial_index}, {&full_count, &full_index}};
  for (int list = 0; list < 2; ++list) {
    const TensorView& count = *pairs[list][0];
    const TensorView& index = *pairs[list][1];
    if (!count.defined()) continue;
    const char* count_name = list == 0 ? "kv_num_blocks" : "full_kv_num_blocks";
    if (list == 1) {
      SP_RETURN_IF_ERROR(check_int32(count_name, count, 3, s));
      SP_RETURN_IF_ERROR(check_int32(kListNames[1], index, 4, s));
    }
    const std::int64_t b = count.shape[0], h = count.shape[1], q = count.shape[2];
    if ((b != 1 && b != s.batch) || (h != 1 && h != heads) || q < nqb) {
      return invalid_argument(std::string("mask.") + count_name + ": expected [B, H, Q] with B 1 or " +
                              std::to_string(s.batch) + ", H 1 or " + std::to_string(heads) +
                              (per_kv_head ? " (kv heads)" : " (query heads)") + " and Q >= " + std::to_string(nqb) +
                              " query blocks of " + std::to_string(block_q) + ", got " + dims(count));
    }
    if (index.shape[0] != b || index.shape[1] != h || index.shape[2] != q || index.shape[3] < 1 ||
        index.stride[3] != 1) {
      return invalid_argument(std::string("mask.") + kListNames[list] + ": expected [" + std::to_string(b) + ", " +
                              std::to_string(h) + ", " + std::to_string(q) +
                              ", K] with K >= 1 and its last dimension contiguous, got " + describe(index));
    }
  }
  return {};
}

Status DeviceBlockMask::to_block_mask(const ProblemShape& s, BlockMask* out) const {
  SP_RETURN_IF_ERROR(validate_for(s));
  if (s.device.kind != DeviceKind::kCPU) return invalid_argument("mask: to_block_mask reads host tensors only");
  const int heads = per_kv_head ? s.h_kv : s.h_q;
  BlockMask m = BlockMask::empty(s, block_q, block_k, per_kv_head);
  const auto at = [](const TensorView& t, std::int64_t offset) { return static_cast<const std::int32_t*>(t.data)[offset]; };
  rules::MaskFaultRecord f{};
  for (int b = 0; b < s.batch && f.fault == 0; ++b) {
    const geom::BlockGeometry g = detail::block_geometry(s, b, block_q, block_k);
    for (int h = 0; h < heads && f.fault == 0; ++h) {
      for (int qb = 0; qb < g.num_q_blocks() && f.fault == 0; ++qb) {
        const int visible = g.visible_end(qb), visible_begin = g.visible_begin(qb);
        for (int list = 0; list < (is_csr() ? 1 : 2) && f.fault == 0; ++list) {
          // The list's entries: [first, first + n) of `index` (strided rows of Flex's tensors, or CSR).
          const TensorView& index = is_csr() ? csr_indices : (list == 0 ? partial_index : full_index);
          const TensorView& count = list == 0 ? partial_count : full_count;
          std::int64_t first = 0, n = 0, cap = 0;
          const std::int64_t row = (std::int64_t{b} * heads + h) * m.num_q_blocks + qb;
          if (is_csr()) {
            first = at(csr_indptr, row);
            n = at(csr_indptr, row + 1) - first;
            cap = csr_indices.shape[0];
            if (n < 0 || first < 0 || first + n > cap) {
              f = {rules::kMaskIndptr, 2, b, h, qb, static_cast<std::int32_t>(n < 0 ? row + 1 : row), first + n, cap};
              break;
            }
          } else {
            if (!count.defined()) continue;
            const std::int64_t bb = count.shape[0] == 1 ? 0 : b, hh = count.shape[1] == 1 ? 0 : h;
            n = at(count, bb * count.stride[0] + hh * count.stride[1] + qb * count.stride[2]);
            first = bb * index.stride[0] + hh * index.stride[1] + qb * index.stride[2];
            cap = index.shape[3];
            if (n < 0 || n > cap) {
              f = {rules::kMaskCount, list, b, h, qb, 0, n, cap};
              break;
            }
          }
          std::int64_t prev = -1;
          for (std::int64_t i = 0; i < n; ++i) {
            const std::int64_t kb = at(index, first + i);
            rules::MaskFault fault = rules::mask_entry_fault(kb, prev, visible, visible_begin);
            if (fault == rules::kMaskOk && m.contains(b, h, qb, static_cast<int>(kb))) fault = rules::kMaskBoth;
            if (fault != rules::kMaskOk) {
              f = {fault, is_csr() ? 2 : list, b, h, qb, static_cast<std::int32_t>(i), kb,
                   fault == rules::kMaskRange ? visible : prev};
              break;
            }
            SP_RETURN_IF_ERROR(m.add(s, b, h, qb, static_cast<int>(kb)));
            prev = kb;
          }
        }
      }
    }
  }
  if (f.fault != 0) return invalid_argument(detail::mask_fault_message(f));
  *out = std::move(m);
  return {};
}

}  // namespace sparseprefill
