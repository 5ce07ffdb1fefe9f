// SPDX-License-Identifier: Apache-2.0
// Exact comparison of Decisions (see decisions.h).
#include "decisions.h"

#include <sstream>
#include <string>

namespace sparseprefill::test {
namespace {

constexpr int kMaxListed = 8;

// Appends the differences of two masks to msg; returns the number found.
int diff_masks(const char* name, const BlockMask& e, const BlockMask& a, std::ostringstream* msg) {
  if (e.batch != a.batch || e.heads != a.heads || e.per_kv_head != a.per_kv_head ||
      e.block_q != a.block_q || e.block_k != a.block_k || e.num_q_blocks != a.num_q_blocks ||
      e.num_k_blocks != a.num_k_blocks) {
    *msg << name << ": geometry differs: expected batch " << e.batch << " heads " << e.heads
         << (e.per_kv_head ? " (KV)" : "") << " blocks " << e.block_q << "x" << e.block_k << " grid "
         << e.num_q_blocks << "x" << e.num_k_blocks << ", got batch " << a.batch << " heads " << a.heads
         << (a.per_kv_head ? " (KV)" : "") << " blocks " << a.block_q << "x" << a.block_k << " grid "
         << a.num_q_blocks << "x" << a.num_k_blocks << "\n";
    return 1;
  }
  const std::vector<std::uint8_t> de = e.to_dense(), da = a.to_dense();
  int n = 0;
  for (std::size_t i = 0; i < de.size(); ++i) {
    if (de[i] == da[i]) continue;
    if (n++ < kMaxListed) {
      const std::size_t kb = i % static_cast<std::size_t>(e.num_k_blocks);
      const std::size_t row = i / static_cast<std::size_t>(e.num_k_blocks);
      const std::size_t qb = row % static_cast<std::size_t>(e.num_q_blocks);
      const std::size_t h = row / static_cast<std::size_t>(e.num_q_blocks) % static_cast<std::size_t>(e.heads);
      const std::size_t b = row / static_cast<std::size_t>(e.num_q_blocks) / static_cast<std::size_t>(e.heads);
      *msg << name << "[b " << b << "][h " << h << "][qb " << qb << "][kb " << kb << "]: expected "
           << (de[i] ? "selected" : "not selected") << "\n";
    }
  }
  if (n > kMaxListed) *msg << name << ": " << n << " blocks differ in all\n";
  return n;
}

}  // namespace

::testing::AssertionResult same_decisions(const Decisions& expected, const Decisions& actual) {
  std::ostringstream msg;
  int n = 0;
  if (expected.policy != actual.policy) {
    msg << "policy: expected " << expected.policy << ", got " << actual.policy << "\n";
    ++n;
  }
  n += diff_masks("kept", expected.kept, actual.kept, &msg);
  n += diff_masks("corrected", expected.corrected, actual.corrected, &msg);
  if (expected.tiles.size() != actual.tiles.size()) {
    msg << "tiles: expected " << expected.tiles.size() << " entries, got " << actual.tiles.size() << "\n";
    ++n;
  } else {
    int listed = 0;
    for (std::size_t i = 0; i < expected.tiles.size(); ++i) {
      const PermuteTile& e = expected.tiles[i];
      const PermuteTile& a = actual.tiles[i];
      if (e.batch == a.batch && e.head == a.head && e.segment == a.segment && e.tile == a.tile &&
          e.chunks_visited == a.chunks_visited && e.chunks_total == a.chunks_total) {
        continue;
      }
      ++n;
      if (listed++ < kMaxListed) {
        msg << "tiles[" << i << "]: expected (b " << e.batch << ", h " << e.head << ", segment " << e.segment
            << ", tile " << e.tile << ", chunks " << e.chunks_visited << "/" << e.chunks_total << "), got (b "
            << a.batch << ", h " << a.head << ", segment " << a.segment << ", tile " << a.tile << ", chunks "
            << a.chunks_visited << "/" << a.chunks_total << ")\n";
      }
    }
  }
  if (expected.query_order != actual.query_order) {
    ++n;
    if (expected.query_order.size() != actual.query_order.size()) {
      msg << "query_order: expected " << expected.query_order.size() << " entries, got "
          << actual.query_order.size() << "\n";
    } else {
      for (std::size_t i = 0; i < expected.query_order.size(); ++i) {
        if (expected.query_order[i] != actual.query_order[i]) {
          msg << "query_order[" << i << "]: expected " << expected.query_order[i] << ", got "
              << actual.query_order[i] << " (first difference)\n";
          break;
        }
      }
    }
  }
  if (n == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg.str();
}

}  // namespace sparseprefill::test
