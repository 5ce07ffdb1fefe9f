// SPDX-License-Identifier: Apache-2.0
// BlockMask construction, validation and conversions (dense map, CSR).
#include "sparseprefill/block_mask.h"

#include <algorithm>
#include <string>

#include "core/block_mask_layout.h"
#include "core/geometry.h"
#include "core/shape_geometry.h"

namespace sparseprefill {
namespace {

geom::BlockGeometry geometry_of(const ProblemShape& s, int b, int block_q, int block_k) {
  return detail::block_geometry(s, b, block_q, block_k);
}

std::string where(int b, int h, int qb) {
  return "[" + std::to_string(b) + "][" + std::to_string(h) + "][" + std::to_string(qb) + "]";
}

// Inserts kb into the sorted prefix idx[0, count) (capacity cap); no-op if present.
void insert_sorted(std::int32_t* idx, std::int32_t* count, int kb) {
  std::int32_t* end = idx + *count;
  std::int32_t* it = std::lower_bound(idx, end, kb);
  if (it != end && *it == kb) return;
  std::copy_backward(it, end, end + 1);
  *it = kb;
  ++*count;
}

}  // namespace

namespace detail {

BlockMask block_mask_layout(const ProblemShape& s, int block_q, int block_k, bool per_kv_head) {
  BlockMask m;
  m.batch = s.batch;
  m.heads = per_kv_head ? s.h_kv : s.h_q;
  m.per_kv_head = per_kv_head;
  m.block_q = block_q;
  m.block_k = block_k;
  for (int b = 0; b < s.batch; ++b) {
    const geom::BlockGeometry g = geometry_of(s, b, block_q, block_k);
    m.num_q_blocks = std::max(m.num_q_blocks, g.num_q_blocks());
    m.num_k_blocks = std::max(m.num_k_blocks, g.num_k_blocks());
  }
  return m;
}

}  // namespace detail

BlockMask BlockMask::empty(const ProblemShape& s, int block_q, int block_k, bool per_kv_head) {
  BlockMask m = detail::block_mask_layout(s, block_q, block_k, per_kv_head);
  const std::size_t rows = static_cast<std::size_t>(m.batch) * m.heads * m.num_q_blocks;
  m.full_count.assign(rows, 0);
  m.partial_count.assign(rows, 0);
  m.full_index.assign(rows * m.num_k_blocks, -1);
  m.partial_index.assign(rows * m.num_k_blocks, -1);
  return m;
}

BlockMask BlockMask::all_visible(const ProblemShape& s, int block_q, int block_k, bool per_kv_head) {
  BlockMask m = empty(s, block_q, block_k, per_kv_head);
  for (int b = 0; b < m.batch; ++b) {
    const geom::BlockGeometry g = geometry_of(s, b, block_q, block_k);
    for (int h = 0; h < m.heads; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        const std::int64_t r = m.row(b, h, qb);
        const std::int64_t base = r * m.num_k_blocks;
        // Full blocks [full_begin, full_end); partial the bands below and above them.
        std::int32_t& full = m.full_count[static_cast<std::size_t>(r)];
        std::int32_t& partial = m.partial_count[static_cast<std::size_t>(r)];
        for (int kb = g.visible_begin(qb); kb < g.visible_end(qb); ++kb) {
          if (g.is_full(qb, kb)) {
            m.full_index[static_cast<std::size_t>(base + full++)] = kb;
          } else {
            m.partial_index[static_cast<std::size_t>(base + partial++)] = kb;
          }
        }
      }
    }
  }
  return m;
}

Status BlockMask::add(const ProblemShape& s, int b, int h, int qb, int kb) {
  if (b < 0 || b >= batch || h < 0 || h >= heads || qb < 0 || qb >= num_q_blocks) {
    return invalid_argument("BlockMask::add: row " + where(b, h, qb) + " out of range");
  }
  const geom::BlockGeometry g = geometry_of(s, b, block_q, block_k);
  if (!g.is_visible(qb, kb)) {
    return invalid_argument("BlockMask::add: key block " + std::to_string(kb) + " is not visible to query block " +
                            where(b, h, qb));
  }
  const std::int64_t r = row(b, h, qb);
  const std::int64_t base = r * num_k_blocks;
  if (g.is_full(qb, kb)) {
    insert_sorted(&full_index[static_cast<std::size_t>(base)], &full_count[static_cast<std::size_t>(r)], kb);
  } else {
    insert_sorted(&partial_index[static_cast<std::size_t>(base)], &partial_count[static_cast<std::size_t>(r)], kb);
  }
  return {};
}

bool BlockMask::contains(int b, int h, int qb, int kb) const {
  const std::int64_t r = row(b, h, qb);
  const std::int64_t base = r * num_k_blocks;
  const auto* f = &full_index[static_cast<std::size_t>(base)];
  const auto* p = &partial_index[static_cast<std::size_t>(base)];
  return std::binary_search(f, f + full_count[static_cast<std::size_t>(r)], kb) ||
         std::binary_search(p, p + partial_count[static_cast<std::size_t>(r)], kb);
}

std::int64_t BlockMask::selected_blocks() const {
  std::int64_t n = 0;
  for (std::int32_t c : full_count) n += c;
  for (std::int32_t c : partial_count) n += c;
  return n;
}

Status BlockMask::validate() const {
  if (batch < 0 || heads < 0 || num_q_blocks < 0 || num_k_blocks < 0) {
    return invalid_argument("BlockMask: negative dimension");
  }
  if (block_q <= 0 || block_k <= 0) {
    return invalid_argument("BlockMask: block_q and block_k must be positive, got " +
                            std::to_string(block_q) + " and " + std::to_string(block_k));
  }
  const std::size_t rows = static_cast<std::size_t>(batch) * heads * num_q_blocks;
  if (full_count.size() != rows || partial_count.size() != rows) {
    return invalid_argument("BlockMask: counts must have batch*heads*num_q_blocks = " + std::to_string(rows) + " entries");
  }
  if (full_index.size() != rows * num_k_blocks || partial_index.size() != rows * num_k_blocks) {
    return invalid_argument("BlockMask: indices must have batch*heads*num_q_blocks*num_k_blocks = " +
                            std::to_string(rows * num_k_blocks) + " entries");
  }
  // O(rows + selected blocks): a mask is validated on every run(), and at 128K tokens its
  // capacity (rows × num_k_blocks) is 30M entries per list while a sparse mask lists few.
  // Entries past a row's count are never read.
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int qb = 0; qb < num_q_blocks; ++qb) {
        const std::int64_t r = row(b, h, qb);
        const std::int32_t counts[2] = {full_count[static_cast<std::size_t>(r)], partial_count[static_cast<std::size_t>(r)]};
        const std::int32_t* lists[2] = {&full_index[static_cast<std::size_t>(r * num_k_blocks)],
                                        &partial_index[static_cast<std::size_t>(r * num_k_blocks)]};
        const char* names[2] = {"full", "partial"};
        for (int l = 0; l < 2; ++l) {
          if (counts[l] < 0 || counts[l] > num_k_blocks) {
            return invalid_argument("BlockMask: " + std::string(names[l]) + "_count" + where(b, h, qb) + " = " +
                                    std::to_string(counts[l]) + " outside [0, " + std::to_string(num_k_blocks) + "]");
          }
          for (int i = 0; i < counts[l]; ++i) {
            const std::int32_t kb = lists[l][i];
            if (kb < 0 || kb >= num_k_blocks) {
              return invalid_argument("BlockMask: " + std::string(names[l]) + "_index" + where(b, h, qb) + " entry " +
                                      std::to_string(kb) + " outside [0, " + std::to_string(num_k_blocks) + ")");
            }
            if (i > 0 && kb <= lists[l][i - 1]) {
              return invalid_argument("BlockMask: " + std::string(names[l]) + "_index" + where(b, h, qb) + " must be strictly ascending");
            }
          }
        }
        // Both lists ascending: a merge walk finds a shared block.
        for (int i = 0, j = 0; i < counts[0] && j < counts[1];) {
          if (lists[0][i] == lists[1][j]) {
            return invalid_argument("BlockMask: key block " + std::to_string(lists[0][i]) + " is both full and partial in row " + where(b, h, qb));
          }
          if (lists[0][i] < lists[1][j]) ++i; else ++j;
        }
      }
    }
  }
  return {};
}

Status BlockMask::validate_for(const ProblemShape& s) const {
  SP_RETURN_IF_ERROR(validate());
  const int expected_heads = per_kv_head ? s.h_kv : s.h_q;
  if (batch != s.batch || heads != expected_heads) {
    return invalid_argument("BlockMask: expected batch " + std::to_string(s.batch) + " and " +
                            std::to_string(expected_heads) + (per_kv_head ? " kv heads" : " query heads") +
                            ", got " + std::to_string(batch) + " and " + std::to_string(heads));
  }
  int expected_q_blocks = 0, expected_k_blocks = 0;
  for (int b = 0; b < s.batch; ++b) {
    const geom::BlockGeometry g = geometry_of(s, b, block_q, block_k);
    expected_q_blocks = std::max(expected_q_blocks, g.num_q_blocks());
    expected_k_blocks = std::max(expected_k_blocks, g.num_k_blocks());
  }
  if (num_q_blocks != expected_q_blocks || num_k_blocks != expected_k_blocks) {
    return invalid_argument("BlockMask: expected " + std::to_string(expected_q_blocks) + " query blocks and " +
                            std::to_string(expected_k_blocks) + " key blocks for blocks of " + std::to_string(block_q) +
                            "x" + std::to_string(block_k) + ", got " + std::to_string(num_q_blocks) + " and " +
                            std::to_string(num_k_blocks));
  }
  for (int b = 0; b < batch; ++b) {
    const geom::BlockGeometry g = geometry_of(s, b, block_q, block_k);
    for (int h = 0; h < heads; ++h) {
      for (int qb = 0; qb < num_q_blocks; ++qb) {
        const std::int64_t r = row(b, h, qb);
        for (int i = 0; i < full_count[static_cast<std::size_t>(r)]; ++i) {
          const int kb = full_index[static_cast<std::size_t>(r * num_k_blocks + i)];
          if (!g.is_full(qb, kb)) {
            return invalid_argument("BlockMask: key block " + std::to_string(kb) + " listed as full in row " + where(b, h, qb) +
                                    (g.is_visible(qb, kb) ? " is partial (the causal mask or the window cuts it)" : " is not visible"));
          }
        }
        for (int i = 0; i < partial_count[static_cast<std::size_t>(r)]; ++i) {
          const int kb = partial_index[static_cast<std::size_t>(r * num_k_blocks + i)];
          if (!g.is_partial(qb, kb)) {
            return invalid_argument("BlockMask: key block " + std::to_string(kb) + " listed as partial in row " + where(b, h, qb) +
                                    (g.is_full(qb, kb) ? " is full" : " is not visible"));
          }
        }
      }
    }
  }
  return {};
}

std::vector<std::uint8_t> BlockMask::to_dense() const {
  std::vector<std::uint8_t> map(static_cast<std::size_t>(batch) * heads * num_q_blocks * num_k_blocks, 0);
  for (std::size_t r = 0; r < full_count.size(); ++r) {
    const std::size_t base = r * num_k_blocks;
    for (int i = 0; i < full_count[r]; ++i) map[base + full_index[base + i]] = 1;
    for (int i = 0; i < partial_count[r]; ++i) map[base + partial_index[base + i]] = 1;
  }
  return map;
}

Status BlockMask::from_dense(const ProblemShape& s, int block_q, int block_k, bool per_kv_head,
                             const std::vector<std::uint8_t>& map, BlockMask* out) {
  if (block_q <= 0 || block_k <= 0) return invalid_argument("block sizes must be positive");
  BlockMask m = empty(s, block_q, block_k, per_kv_head);
  const std::size_t expected = static_cast<std::size_t>(m.batch) * m.heads * m.num_q_blocks * m.num_k_blocks;
  if (map.size() != expected) {
    return invalid_argument("map: expected [batch, heads, num_q_blocks, num_k_blocks] = [" + std::to_string(m.batch) + ", " +
                            std::to_string(m.heads) + ", " + std::to_string(m.num_q_blocks) + ", " +
                            std::to_string(m.num_k_blocks) + "] entries (" + std::to_string(expected) + "), got " +
                            std::to_string(map.size()));
  }
  for (int b = 0; b < m.batch; ++b) {
    for (int h = 0; h < m.heads; ++h) {
      for (int qb = 0; qb < m.num_q_blocks; ++qb) {
        const std::size_t base = static_cast<std::size_t>(m.row(b, h, qb)) * m.num_k_blocks;
        for (int kb = 0; kb < m.num_k_blocks; ++kb) {
          if (map[base + kb]) {
            Status st = m.add(s, b, h, qb, kb);
            if (!st.ok()) return invalid_argument("map" + where(b, h, qb) + "[" + std::to_string(kb) + "]: selected, but the block is not visible (causal mask and window)");
          }
        }
      }
    }
  }
  *out = std::move(m);
  return {};
}

void BlockMask::to_csr(std::vector<std::int32_t>* indptr, std::vector<std::int32_t>* indices) const {
  indptr->assign(1, 0);
  indices->clear();
  for (std::size_t r = 0; r < full_count.size(); ++r) {
    const std::size_t base = r * num_k_blocks;
    const std::int32_t* f = &full_index[base];
    const std::int32_t* p = &partial_index[base];
    const std::size_t start = indices->size();
    indices->insert(indices->end(), f, f + full_count[r]);
    indices->insert(indices->end(), p, p + partial_count[r]);
    std::inplace_merge(indices->begin() + static_cast<std::ptrdiff_t>(start),
                       indices->begin() + static_cast<std::ptrdiff_t>(start + full_count[r]), indices->end());
    indptr->push_back(static_cast<std::int32_t>(indices->size()));
  }
}

Status BlockMask::from_csr(const ProblemShape& s, int block_q, int block_k, bool per_kv_head,
                           const std::vector<std::int32_t>& indptr, const std::vector<std::int32_t>& indices,
                           BlockMask* out) {
  if (block_q <= 0 || block_k <= 0) return invalid_argument("block sizes must be positive");
  BlockMask m = empty(s, block_q, block_k, per_kv_head);
  const std::size_t rows = static_cast<std::size_t>(m.batch) * m.heads * m.num_q_blocks;
  if (indptr.size() != rows + 1) {
    return invalid_argument("indptr: expected batch*heads*num_q_blocks + 1 = " + std::to_string(rows + 1) +
                            " entries, got " + std::to_string(indptr.size()));
  }
  if (indptr[0] != 0 || static_cast<std::size_t>(indptr[rows]) != indices.size()) {
    return invalid_argument("indptr: must start at 0 and end at len(indices) = " + std::to_string(indices.size()));
  }
  // Monotone from 0 to len(indices) bounds every later read.
  for (std::size_t r = 0; r < rows; ++r) {
    if (indptr[r + 1] < indptr[r]) return invalid_argument("indptr: must be non-decreasing, entry " + std::to_string(r + 1) + " is smaller than entry " + std::to_string(r));
  }
  for (int b = 0; b < m.batch; ++b) {
    const geom::BlockGeometry g = geometry_of(s, b, block_q, block_k);
    for (int h = 0; h < m.heads; ++h) {
      for (int qb = 0; qb < m.num_q_blocks; ++qb) {
        const std::size_t r = static_cast<std::size_t>(m.row(b, h, qb));
        for (std::int32_t i = indptr[r]; i < indptr[r + 1]; ++i) {
          const int kb = indices[static_cast<std::size_t>(i)];
          if (i > indptr[r] && kb <= indices[static_cast<std::size_t>(i - 1)]) {
            return invalid_argument("indices: row " + where(b, h, qb) + " must be strictly ascending");
          }
          if (!g.is_visible(qb, kb)) {
            return invalid_argument("indices: key block " + std::to_string(kb) + " in row " + where(b, h, qb) + " is not visible (causal mask and window)");
          }
          // Ascending input: appending keeps both lists sorted.
          std::int32_t& count = g.is_full(qb, kb) ? m.full_count[r] : m.partial_count[r];
          std::vector<std::int32_t>& list = g.is_full(qb, kb) ? m.full_index : m.partial_index;
          list[r * static_cast<std::size_t>(m.num_k_blocks) + static_cast<std::size_t>(count++)] = kb;
        }
      }
    }
  }
  *out = std::move(m);
  return {};
}

}  // namespace sparseprefill
