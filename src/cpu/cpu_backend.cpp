// SPDX-License-Identifier: Apache-2.0
// The CPU backend (cpu_backend.h). Per sequence, Q/K/V are gathered to fp32 and K is laid out
// as transposed key tiles; a work list of (batch, head, query block) items then runs over
// std::threads, each item the kernel-shaped block loop of tile_kernel.h with the policy's gate
// inside the loop (DESIGN.md §3). Every item is computed by one thread from the same inputs,
// so results do not depend on the thread count.
#include "cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/estimate_chunks.h"
#include "core/geometry.h"
#include "core/rules/estimate_select.h"
#include "core/rules/exact_gate.h"
#include "core/rules/nan_max.h"
#include "core/rules/permute_stop.h"
#include "core/rules/softmax_skip.h"
#include "core/shape_geometry.h"
#include "core/tensor_access.h"
#include "cpu/cpu_policies.h"
#include "cpu/tile_kernel.h"

namespace sparseprefill::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// Dense attention has no blocks; it runs the same loop over 128 × 128 tiles.
constexpr int kDenseBlock = 128;

using Index = std::int64_t;

inline std::size_t sz(Index x) { return static_cast<std::size_t>(x); }

int resolve_threads(int n) {
  if (n > 0) return n;
  const unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

// fn(item, worker) for every item in [0, n). Items are claimed in order from an atomic counter;
// each is computed by exactly one worker.
template <class Fn>
void parallel_for(Index n, int threads, Fn&& fn) {
  const int workers = static_cast<int>(std::min<Index>(threads, n));
  if (workers <= 1) {
    for (Index i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<Index> next{0};
  auto body = [&](int worker) {
    for (Index i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, worker);
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) pool.emplace_back(body, w);
  body(0);
  for (std::thread& t : pool) t.join();
}

// The first error any worker reports (they only fail on broken invariants).
class ErrorSlot {
 public:
  void set(Status s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (first_.ok()) first_ = std::move(s);
  }
  Status take() { return std::move(first_); }

 private:
  std::mutex mu_;
  Status first_;
};

// One sequence gathered to fp32.
struct Sequence {
  geom::SeqGeometry seq;
  int num_k_blocks = 0;   // of the key tiles below
  int block_k = 0;        // keys per key tile (0: no key tiles)
  int ld_k = 0;           // round_up(block_k, kKeyAlign)
  std::vector<float> q;   // [s_q, h_q, d]
  std::vector<float> k;   // [s_k, h_kv, d] (kept only where keys are re-ordered)
  std::vector<float> kt;  // [h_kv, num_k_blocks, d, ld_k]: key tiles transposed, zero padded
  std::vector<float> v;   // [h_kv, s_k, ld_v]: features zero padded to ld_v
  std::vector<float> o;   // [s_q, h_q, d_v]
  std::vector<float> lse; // [h_q, s_q]
};

struct Context {
  const AttentionProblem& problem;
  const ProblemShape& shape;
  int threads = 1;
  int d = 0;
  int ld = 0;    // round_up(d, kKeyAlign)
  int d_v = 0;
  int ld_v = 0;  // round_up(d_v, kKeyAlign)
  float scale = 1.0f;
  float softcap = 0.0f;
  std::vector<float> sinks;  // [h_q] sink logits; empty without sinks
  std::vector<Sequence> seqs;

  Context(const AttentionProblem& p, const ProblemShape& s, int num_threads)
      : problem(p), shape(s), threads(resolve_threads(num_threads)), d(s.d),
        ld(round_up(s.d, kKeyAlign)), d_v(s.d_v), ld_v(round_up(s.d_v, kKeyAlign)),
        scale(static_cast<float>(s.scale)), softcap(static_cast<float>(s.softcap)) {
    if (!s.sinks) return;
    std::vector<double> exact;
    detail::gather_sinks(p, s, &exact);
    sinks.assign(exact.begin(), exact.end());
  }
  float sink(int h) const { return sinks.empty() ? -kInf : sinks[sz(h)]; }

  geom::BlockGeometry geometry(int b, int block_q, int block_k) const {
    geom::BlockGeometry g;
    g.seq = seqs[sz(b)].seq;
    g.block_q = block_q;
    g.block_k = block_k;
    return g;
  }
};

// Transposes keys [s_k, h_kv, d] into tiles [h_kv, nkb, d, ld_k] of block_k keys each.
void build_key_tiles(const std::vector<float>& k, Index s_k, int h_kv, int d, int block_k, int ld_k,
                     int nkb, std::vector<float>* kt) {
  kt->assign(sz(Index{h_kv} * nkb * d * ld_k), 0.0f);
  for (Index pos = 0; pos < s_k; ++pos) {
    const Index kb = pos / block_k, jj = pos % block_k;
    for (int g = 0; g < h_kv; ++g) {
      const float* src = k.data() + (pos * h_kv + g) * d;
      float* dst = kt->data() + ((Index{g} * nkb + kb) * d) * ld_k + jj;
      for (int c = 0; c < d; ++c) dst[Index{c} * ld_k] = src[c];
    }
  }
}

// Gathers every sequence. block_k > 0 builds key tiles; keep_k keeps plain keys.
void gather_all(Context* ctx, int block_k, bool keep_k) {
  const ProblemShape& s = ctx->shape;
  ctx->seqs.resize(sz(s.batch));
  std::vector<float> raw;
  for (int b = 0; b < s.batch; ++b) {
    Sequence& sq = ctx->seqs[sz(b)];
    sq.seq = detail::sequence_geometry(s, b);
    const Index s_q = sq.seq.s_q, s_k = sq.seq.s_k;
    detail::gather_q<float>(ctx->problem, s, b, &sq.q);
    detail::gather_kv<float>(ctx->problem, s, b, false, &sq.k);
    if (block_k > 0) {
      sq.block_k = block_k;
      sq.ld_k = round_up(block_k, kKeyAlign);
      sq.num_k_blocks = static_cast<int>(geom::ceil_div(s_k, block_k));
      build_key_tiles(sq.k, s_k, s.h_kv, s.d, block_k, sq.ld_k, sq.num_k_blocks, &sq.kt);
    }
    if (!keep_k) std::vector<float>().swap(sq.k);
    detail::gather_kv<float>(ctx->problem, s, b, true, &raw);
    sq.v.assign(sz(Index{s.h_kv} * s_k * ctx->ld_v), 0.0f);
    for (Index pos = 0; pos < s_k; ++pos) {
      for (int g = 0; g < s.h_kv; ++g) {
        std::copy_n(raw.data() + (pos * s.h_kv + g) * s.d_v, s.d_v,
                    sq.v.data() + (Index{g} * s_k + pos) * ctx->ld_v);
      }
    }
    sq.o.assign(sz(s_q * s.h_q * s.d_v), 0.0f);
    sq.lse.assign(sz(Index{s.h_q} * s_q), 0.0f);
  }
}

void store_all(const Context& ctx, const AttentionOutput& output) {
  for (int b = 0; b < ctx.shape.batch; ++b) {
    const Sequence& sq = ctx.seqs[sz(b)];
    detail::store_output<float>(output, ctx.shape, b, sq.o.data(), sq.lse.data());
  }
}

// Per-worker scratch, sized once per launch: nothing is allocated inside an item.
struct Scratch {
  std::vector<float> q, o, m, l;  // TileState storage
  std::vector<float> s;           // scores / probabilities [rows_pad, max ld of a key tile]
  std::vector<float> row_max, dl;
  std::vector<int> begin, limit;  // each row's columns of the current key tile: [begin, limit)
  std::vector<std::uint8_t> seen;
  std::vector<Index> rows;        // call-relative rows of the tile
  std::vector<Index> first_key;   // the first key each row sees (0 without a left window bound)
  std::vector<Index> keys_seen;   // one past the last key each row sees
  std::vector<float> kt_extra, v_extra;  // mean-correction pseudo-tokens
  TileState t;

  Scratch(const Context& ctx, int max_rows, int max_ld_k) {
    const int rows_pad = round_up(max_rows, kRowGroup);
    q.assign(sz(Index{rows_pad} * ctx.ld), 0.0f);
    o.assign(sz(Index{rows_pad} * ctx.ld_v), 0.0f);
    m.assign(sz(rows_pad), 0.0f);
    l.assign(sz(rows_pad), 0.0f);
    s.assign(sz(Index{rows_pad} * max_ld_k), 0.0f);
    row_max.assign(sz(rows_pad), 0.0f);
    dl.assign(sz(rows_pad), 0.0f);
    begin.assign(sz(rows_pad), 0);
    limit.assign(sz(rows_pad), 0);
    seen.assign(sz(rows_pad), 0);
    rows.assign(sz(rows_pad), 0);
    first_key.assign(sz(rows_pad), 0);
    keys_seen.assign(sz(rows_pad), 0);
    t.d = ctx.d;
    t.ld = ctx.ld;
    t.d_v = ctx.d_v;
    t.ld_v = ctx.ld_v;
    t.scale = ctx.scale;
    t.softcap = ctx.softcap;
    t.q = q.data();
    t.o = o.data();
    t.m = m.data();
    t.l = l.data();
  }
};

// One scratch per worker. Reserved up front: TileState points into the vectors' buffers.
std::vector<Scratch> make_scratch(const Context& ctx, int workers, int max_rows, int max_ld_k) {
  std::vector<Scratch> out;
  out.reserve(sz(workers));
  for (int w = 0; w < workers; ++w) out.emplace_back(ctx, max_rows, max_ld_k);
  return out;
}

int worker_count(const Context& ctx, std::size_t items) {
  return static_cast<int>(std::max<Index>(1, std::min<Index>(ctx.threads, static_cast<Index>(items))));
}

// Loads the queries of head h at rows w.rows[0 .. n) and clears the softmax state.
void begin_tile(const Context& ctx, const Sequence& sq, int h, int n, Scratch* w) {
  TileState& t = w->t;
  t.rows = n;
  t.rows_pad = round_up(n, kRowGroup);
  std::fill(w->q.begin(), w->q.begin() + Index{t.rows_pad} * t.ld, 0.0f);
  for (int i = 0; i < n; ++i) {
    const Index r = w->rows[sz(i)];
    std::copy_n(sq.q.data() + (r * ctx.shape.h_q + h) * ctx.d, ctx.d, w->q.data() + Index{i} * t.ld);
    w->first_key[sz(i)] = sq.seq.first_key(r);
    w->keys_seen[sz(i)] = sq.seq.keys_seen(r);
  }
  t.reset();
}

// Rows r0 .. r1-1 as the tile's rows.
void set_row_range(Index r0, Index r1, Scratch* w) {
  for (Index r = r0; r < r1; ++r) w->rows[sz(r - r0)] = r;
}

// Writes the finished rows of head h (with its sink) back to the sequence's O and LSE.
void finish_tile(const Context& ctx, Sequence* sq, int h, Scratch* w) {
  for (int i = 0; i < w->t.rows; ++i) {
    const Index r = w->rows[sz(i)];
    tile_finish_row(w->t, i, ctx.sink(h), sq->o.data() + (r * ctx.shape.h_q + h) * ctx.d_v,
                    sq->lse.data() + Index{h} * sq->seq.s_q + r);
  }
}

// A key tile: keys key0 .. key0+n-1 (positions ascending), transposed, with their values.
struct KeyTile {
  const float* kt = nullptr;  // [d, ld_k]
  int ld_k = 0;
  const float* v = nullptr;   // [n, ld_v]
  int n = 0;
  Index key0 = 0;             // position of the first key; limits follow each row's key range
};

KeyTile key_block(const Context& ctx, const Sequence& sq, int kvh, int kb) {
  KeyTile k;
  k.kt = sq.kt.data() + ((Index{kvh} * sq.num_k_blocks + kb) * ctx.d) * sq.ld_k;
  k.ld_k = sq.ld_k;
  k.key0 = Index{kb} * sq.block_k;
  k.n = static_cast<int>(std::min<Index>(sq.block_k, sq.seq.s_k - k.key0));
  k.v = sq.v.data() + (Index{kvh} * sq.seq.s_k + k.key0) * ctx.ld_v;
  return k;
}

// The rows' columns (each row's key range: causal mask and window), scores and row maxima of
// one key tile (the QK half of a main-loop step). Returns whether some row sees some key of the
// tile (otherwise nothing was computed).
bool prepare(const KeyTile& k, Scratch* w) {
  TileState& t = w->t;
  bool any = false;
  for (int i = 0; i < t.rows; ++i) {
    const Index lo = std::clamp<Index>(w->first_key[sz(i)] - k.key0, 0, k.n);
    const Index lim = std::clamp<Index>(w->keys_seen[sz(i)] - k.key0, 0, k.n);
    w->begin[sz(i)] = static_cast<int>(lo);
    w->limit[sz(i)] = static_cast<int>(lim);
    any |= lim > lo;
  }
  if (!any) return false;
  tile_scores(t, k.kt, k.ld_k, w->s.data());
  tile_row_max(w->s.data(), k.ld_k, t.rows, w->begin.data(), w->limit.data(), w->row_max.data());
  return true;
}

// The softmax/PV half of a main-loop step, after the gate kept the tile.
void accumulate(const Context& ctx, const KeyTile& k, Scratch* w, float* dl = nullptr) {
  tile_update(w->t, w->s.data(), k.ld_k, w->begin.data(), w->limit.data(), k.n, w->row_max.data(), k.v,
              ctx.ld_v, dl);
}

float tile_max(const Scratch& w) {
  float m = -kInf;
  for (int i = 0; i < w.t.rows; ++i) m = rules::nan_max(m, w.row_max[sz(i)]);
  return m;
}

// (batch, head, query block) items, heaviest query blocks first (those that see the most blocks).
struct BlockItem {
  int b = 0;
  int h = 0;
  int qb = 0;
};

std::vector<BlockItem> block_items(const Context& ctx, int heads, int block_q, int block_k) {
  std::vector<BlockItem> items;
  for (int b = 0; b < ctx.shape.batch; ++b) {
    const geom::BlockGeometry g = ctx.geometry(b, block_q, block_k);
    for (int h = 0; h < heads; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) items.push_back({b, h, qb});
    }
  }
  const auto visible = [&](const BlockItem& it) {
    const geom::BlockGeometry g = ctx.geometry(it.b, block_q, block_k);
    return g.visible_end(it.qb) - g.visible_begin(it.qb);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const BlockItem& x, const BlockItem& y) { return visible(x) > visible(y); });
  return items;
}

// Runs fn(item, scratch) for every (b, h_q, qb) item of a block_q × block_k geometry.
template <class Fn>
void run_block_items(Context& ctx, int block_q, int block_k, int max_ld_k, Fn&& fn) {
  const std::vector<BlockItem> items = block_items(ctx, ctx.shape.h_q, block_q, block_k);
  const int workers = worker_count(ctx, items.size());
  std::vector<Scratch> scratch = make_scratch(ctx, workers, block_q, max_ld_k);
  parallel_for(static_cast<Index>(items.size()), workers, [&](Index i, int worker) {
    const BlockItem& it = items[sz(i)];
    Scratch& w = scratch[sz(worker)];
    Sequence& sq = ctx.seqs[sz(it.b)];
    const geom::BlockGeometry g = ctx.geometry(it.b, block_q, block_k);
    set_row_range(g.row_begin(it.qb), g.row_end(it.qb), &w);
    begin_tile(ctx, sq, it.h, static_cast<int>(g.row_end(it.qb) - g.row_begin(it.qb)), &w);
    fn(it, g, sq, w);
    finish_tile(ctx, &sq, it.h, &w);
  });
}

// ------------------------------------------------------------------ dense and block_sparse

void run_dense(Context& ctx) {
  gather_all(&ctx, kDenseBlock, false);
  run_block_items(ctx, kDenseBlock, kDenseBlock, round_up(kDenseBlock, kKeyAlign),
                  [&](const BlockItem& it, const geom::BlockGeometry& g, const Sequence& sq, Scratch& w) {
                    const int kvh = it.h / ctx.shape.group();
                    for (int kb = g.visible_begin(it.qb); kb < g.visible_end(it.qb); ++kb) {
                      const KeyTile k = key_block(ctx, sq, kvh, kb);
                      const bool any = prepare(k, &w);
                      if (any) accumulate(ctx, k, &w);
                    }
                  });
}

// The listed blocks of one mask row, ascending (full and partial merged).
void mask_row_blocks(const BlockMask& mask, int b, int h, int qb, std::vector<int>* out) {
  out->clear();
  const Index r = mask.row(b, h, qb);
  const Index base = r * mask.num_k_blocks;
  for (int i = 0; i < mask.full_count[sz(r)]; ++i) out->push_back(mask.full_index[sz(base + i)]);
  for (int i = 0; i < mask.partial_count[sz(r)]; ++i) out->push_back(mask.partial_index[sz(base + i)]);
  std::sort(out->begin(), out->end());
}

void run_block_sparse(Context& ctx, const BlockSparseParams& params, Decisions* decisions) {
  const BlockMask& mask = params.mask;
  gather_all(&ctx, mask.block_k, false);
  run_block_items(ctx, mask.block_q, mask.block_k, round_up(mask.block_k, kKeyAlign),
                  [&](const BlockItem& it, const geom::BlockGeometry&, const Sequence& sq, Scratch& w) {
                    const int kvh = it.h / ctx.shape.group();
                    std::vector<int> blocks;
                    mask_row_blocks(mask, it.b, mask.per_kv_head ? kvh : it.h, it.qb, &blocks);
                    for (int kb : blocks) {
                      const KeyTile k = key_block(ctx, sq, kvh, kb);
                      const bool any = prepare(k, &w);
                      if (any) accumulate(ctx, k, &w);
                    }
                  });
  decisions->kept = mask;
}

// ------------------------------------------------------------------ exact_gate

Status run_exact_gate(Context& ctx, const ExactGateParams& params, Decisions* decisions) {
  gather_all(&ctx, params.block_k, false);
  const TensorView& thr = params.thresholds;
  const int positions = static_cast<int>(thr.shape[1]);
  const auto* table = static_cast<const float*>(thr.data);
  BlockMask kept = BlockMask::empty(ctx.shape, params.block_q, params.block_k, false);
  ErrorSlot error;
  run_block_items(ctx, params.block_q, params.block_k, round_up(params.block_k, kKeyAlign),
                  [&](const BlockItem& it, const geom::BlockGeometry& g, const Sequence& sq, Scratch& w) {
                    const int kvh = it.h / ctx.shape.group();
                    const float threshold =
                        rules::gate_threshold(table, thr.stride[0], thr.stride[1], positions, g, it.h, it.qb);
                    for (int kb = g.visible_begin(it.qb); kb < g.visible_end(it.qb); ++kb) {
                      const KeyTile k = key_block(ctx, sq, kvh, kb);
                      const bool any = prepare(k, &w);
                      if (!any) continue;
                      if (rules::gate_gated(g, it.qb, kb) && !rules::gate_keeps(tile_max(w), threshold)) continue;
                      accumulate(ctx, k, &w);
                      error.set(kept.add(ctx.shape, it.b, it.h, it.qb, kb));
                    }
                  });
  decisions->kept = std::move(kept);
  return error.take();
}

// ------------------------------------------------------------------ softmax_skip

Status run_softmax_skip(Context& ctx, const SoftmaxSkipParams& params, Decisions* decisions) {
  gather_all(&ctx, params.block_k, false);
  BlockMask kept = BlockMask::empty(ctx.shape, params.block_q, params.block_k, false);
  ErrorSlot error;
  run_block_items(ctx, params.block_q, params.block_k, round_up(params.block_k, kKeyAlign),
                  [&](const BlockItem& it, const geom::BlockGeometry& g, const Sequence& sq, Scratch& w) {
                    const int kvh = it.h / ctx.shape.group();
                    const rules::SkipRule rule = rules::skip_rule(sq.seq.s_k, params.a);
                    std::fill(w.seen.begin(), w.seen.end(), std::uint8_t{0});
                    // The visit order is part of the semantics (rules::blasst_block). Every
                    // visible block holds a key some row of the query block sees.
                    for (int visit = 0; visit < rules::blasst_visits(g, it.qb); ++visit) {
                      const int kb = rules::blasst_block(g, it.qb, visit);
                      const KeyTile k = key_block(ctx, sq, kvh, kb);
                      const bool any = prepare(k, &w);
                      if (!any) continue;
                      bool keep = !rule.gates(visit);
                      for (int i = 0; i < w.t.rows && !keep; ++i) {
                        keep = rules::skip_vote(w.limit[sz(i)] > w.begin[sz(i)], w.seen[sz(i)] != 0, w.row_max[sz(i)],
                                                w.t.m[i], rule.ln_lambda) == rules::RowVote::kKeep;
                      }
                      if (!keep) continue;
                      accumulate(ctx, k, &w);
                      for (int i = 0; i < w.t.rows; ++i) {
                        if (w.limit[sz(i)] > w.begin[sz(i)]) w.seen[sz(i)] = 1;
                      }
                      error.set(kept.add(ctx.shape, it.b, it.h, it.qb, kb));
                    }
                  });
  decisions->kept = std::move(kept);
  return error.take();
}

// ------------------------------------------------------------------ permute_stop

// One (batch, query head, segment) of permute_stop.
struct SegmentItem {
  int b = 0;
  int h = 0;
  Index segment = 0;
  Index row0 = 0;  // the segment's call-relative rows row0 .. row1-1
  Index row1 = 0;
};

// Transposes keys[idx[0 .. n)] of KV head g into chunks [ceil(n / bk), d, ld_k] and copies
// their values into [n, ld_v].
void gather_chunks(const Context& ctx, const Sequence& sq, int g, const Index* idx, Index n, int bk,
                   int ld_k, std::vector<float>* kt, std::vector<float>* v) {
  const Index chunks = geom::ceil_div(n, bk);
  const int h_kv = ctx.shape.h_kv, d = ctx.d;
  kt->assign(sz(chunks * d * ld_k), 0.0f);
  v->resize(sz(n * ctx.ld_v));
  for (Index t = 0; t < n; ++t) {
    const Index key = idx[t];
    const float* src = sq.k.data() + (key * h_kv + g) * d;
    float* dst = kt->data() + (t / bk) * d * ld_k + t % bk;
    for (int c = 0; c < d; ++c) dst[Index{c} * ld_k] = src[c];
    std::copy_n(sq.v.data() + (Index{g} * sq.seq.s_k + key) * ctx.ld_v, ctx.ld_v, v->data() + t * ctx.ld_v);
  }
}

Status run_permute_stop(Context& ctx, const PermuteStopParams& params, Decisions* decisions) {
  gather_all(&ctx, 0, true);
  const ProblemShape& s = ctx.shape;
  const Index seg_len = params.segment;
  const Index max_s_q = s.max_seq_q();
  decisions->query_order.assign(sz(Index{s.batch} * s.h_q * max_s_q), -1);
  std::vector<SegmentItem> items;
  for (int b = 0; b < s.batch; ++b) {
    Sequence& sq = ctx.seqs[sz(b)];
    const geom::SeqGeometry& seq = sq.seq;
    // Segments cover absolute positions >= 0. Rows before the first key (s_q > s_k) see
    // nothing: they keep their place in the order and get O = 0, LSE = -inf (the sink with one).
    const geom::SegmentGeometry segs{seq, seg_len};
    const Index empty = segs.first_row();
    for (int h = 0; h < s.h_q; ++h) {
      for (Index r = 0; r < empty; ++r) {
        decisions->query_order[sz((Index{b} * s.h_q + h) * max_s_q + r)] = static_cast<std::int32_t>(r);
        sq.lse[sz(Index{h} * seq.s_q + r)] = ctx.sink(h);
      }
    }
    for (int h = 0; h < s.h_q; ++h) {
      for (Index sg = segs.first(); sg < segs.first() + segs.count(); ++sg) {
        items.push_back({b, h, sg, segs.row_begin(sg), segs.row_end(sg)});
      }
    }
  }
  // Heaviest first: the later a segment, the longer its prefix.
  std::vector<Index> order(items.size());
  std::iota(order.begin(), order.end(), Index{0});
  std::stable_sort(order.begin(), order.end(), [&](Index x, Index y) {
    return items[sz(x)].segment > items[sz(y)].segment;
  });

  std::vector<std::vector<PermuteTile>> tiles(items.size());
  const int ld_k = round_up(params.block_k, kKeyAlign);
  const int workers = worker_count(ctx, items.size());
  std::vector<Scratch> scratch = make_scratch(ctx, workers, params.block_q, ld_k);
  std::vector<std::vector<float>> seg_kt(sz(workers)), seg_v(sz(workers));

  parallel_for(static_cast<Index>(items.size()), workers, [&](Index n, int worker) {
    const SegmentItem& it = items[sz(order[sz(n)])];
    Scratch& w = scratch[sz(worker)];
    Sequence& sq = ctx.seqs[sz(it.b)];
    const int g = it.h / s.group(), d = ctx.d;
    const Index n_rows = it.row1 - it.row0;
    const geom::SegmentGeometry segs{sq.seq, seg_len};
    const Index prefix = segs.prefix(it.segment);
    // The ranked keys are ranked_begin .. prefix - 1 (all preceding keys without a left window
    // bound).
    const Index rank_begin = segs.ranked_begin(it.segment), rank_n = prefix - rank_begin;

    // Ranking (fp64 from the exact inputs: a selection, not attention arithmetic).
    std::vector<double> qbar(sz(d), 0.0);
    for (Index r = it.row0; r < it.row1; ++r) {
      const float* q = sq.q.data() + (r * s.h_q + it.h) * d;
      for (int c = 0; c < d; ++c) qbar[sz(c)] += q[c];
    }
    for (double& x : qbar) x /= static_cast<double>(n_rows);
    std::vector<double> key(sz(rank_n));
    for (Index i = 0; i < rank_n; ++i) {
      const float* k = sq.k.data() + ((rank_begin + i) * s.h_kv + g) * d;
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += qbar[sz(c)] * k[c];
      key[sz(i)] = dot;
    }
    std::vector<Index> ranked = rules::rank_descending(key);
    for (Index& t : ranked) t += rank_begin;
    std::vector<Index> perm(sz(n_rows));
    std::iota(perm.begin(), perm.end(), it.row0);
    if (rank_n > 0) {
      const Index top = rules::permute_guide_keys(rank_n, params.block_k);
      std::vector<double> u(sz(d), 0.0);
      for (Index i = 0; i < top; ++i) {
        const float* k = sq.k.data() + (Index{ranked[sz(i)]} * s.h_kv + g) * d;
        for (int c = 0; c < d; ++c) u[sz(c)] += k[c];
      }
      for (double& x : u) x /= static_cast<double>(top);
      std::vector<double> qkey(sz(n_rows));
      for (Index i = 0; i < n_rows; ++i) {
        const float* q = sq.q.data() + ((it.row0 + i) * s.h_q + it.h) * d;
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += q[c] * u[sz(c)];
        qkey[sz(i)] = dot;
      }
      const std::vector<Index> qorder = rules::rank_descending(qkey);
      for (Index i = 0; i < n_rows; ++i) perm[sz(i)] = it.row0 + qorder[sz(i)];
    }
    std::int32_t* slots = decisions->query_order.data() + (Index{it.b} * s.h_q + it.h) * max_s_q;
    for (Index i = 0; i < n_rows; ++i) slots[it.row0 + i] = static_cast<std::int32_t>(perm[sz(i)]);

    // Key tiles: the segment's own keys (positions ascending), then the ranked chunks, each
    // chunk's keys by descending position: a row's keys of a chunk are then its first ones (a
    // left window bound hides the lowest positions), so they run as a prefix of the tile.
    const Index seg_k0 = prefix;
    const Index seg_k1 = segs.key_end(it.segment);
    const Index own_chunks = geom::ceil_div(seg_k1 - seg_k0, params.block_k);
    // Ranked chunks must start on a chunk boundary: pad the own keys' last chunk.
    std::vector<Index> idx;
    idx.reserve(sz(own_chunks * params.block_k + rank_n));
    std::vector<int> chunk_len;
    for (Index c = 0; c < own_chunks; ++c) {
      const Index a = seg_k0 + c * params.block_k, e = std::min<Index>(a + params.block_k, seg_k1);
      for (Index t = a; t < a + params.block_k; ++t) idx.push_back(t < e ? t : seg_k0);
      chunk_len.push_back(static_cast<int>(e - a));
    }
    const Index rank_chunks = rules::permute_chunks(segs, it.segment, params.block_k);
    for (Index c = 0; c < rank_chunks; ++c) {
      const auto a = ranked.begin() + c * params.block_k;
      const auto e = ranked.begin() + std::min<Index>((c + 1) * params.block_k, rank_n);
      std::sort(a, e, std::greater<Index>());
      chunk_len.push_back(static_cast<int>(e - a));
    }
    idx.insert(idx.end(), ranked.begin(), ranked.end());
    gather_chunks(ctx, sq, g, idx.data(), static_cast<Index>(idx.size()), params.block_k, ld_k,
                  &seg_kt[sz(worker)], &seg_v[sz(worker)]);
    auto chunk = [&](Index c, Index key0) {
      KeyTile k;
      k.kt = seg_kt[sz(worker)].data() + c * d * ld_k;
      k.ld_k = ld_k;
      k.v = seg_v[sz(worker)].data() + c * params.block_k * ctx.ld_v;
      k.n = chunk_len[sz(c)];
      k.key0 = key0;
      return k;
    };

    const Index num_tiles = rules::permute_tiles(segs, it.segment, params.block_q);
    std::vector<PermuteTile>& out = tiles[sz(order[sz(n)])];
    for (Index tile = 0; tile < num_tiles; ++tile) {
      const Index e0 = tile * params.block_q, e1 = std::min<Index>(e0 + params.block_q, n_rows);
      for (Index e = e0; e < e1; ++e) w.rows[sz(e - e0)] = perm[sz(e)];
      begin_tile(ctx, sq, it.h, static_cast<int>(e1 - e0), &w);
      // Pass 1: dense and causal over the segment's own keys (within each row's window).
      for (Index c = 0; c < own_chunks; ++c) {
        const KeyTile k = chunk(c, seg_k0 + c * params.block_k);
        const bool any = prepare(k, &w);
        if (any) accumulate(ctx, k, &w);
      }
      // Pass 2: ranked chunks until a chunk adds less than tau of every row's mass. Every
      // ranked key precedes the segment, so a row reads those at or above its first key: the
      // chunk's first `limit` keys (descending positions).
      int visited = 0;
      for (Index c = 0; c < rank_chunks; ++c) {
        const KeyTile k = chunk(own_chunks + c, 0);
        const Index* pos = idx.data() + (own_chunks + c) * params.block_k;
        bool any = false;
        for (int i = 0; i < w.t.rows; ++i) {
          const Index first = w.first_key[sz(i)];
          w.begin[sz(i)] = 0;
          w.limit[sz(i)] = static_cast<int>(std::find_if(pos, pos + k.n, [first](Index t) { return t < first; }) - pos);
          any |= w.limit[sz(i)] > 0;
        }
        if (any) {
          tile_scores(w.t, k.kt, k.ld_k, w.s.data());
          tile_row_max(w.s.data(), k.ld_k, w.t.rows, w.begin.data(), w.limit.data(), w.row_max.data());
        }
        accumulate(ctx, k, &w, w.dl.data());
        ++visited;
        double max_gain = -std::numeric_limits<double>::infinity();
        for (int i = 0; i < w.t.rows; ++i) {
          max_gain = rules::nan_max(max_gain, rules::permute_gain(w.dl[sz(i)], w.t.l[i]));
        }
        if (rules::permute_stops(max_gain, params.tau)) break;
      }
      finish_tile(ctx, &sq, it.h, &w);
      PermuteTile pt;
      pt.batch = it.b;
      pt.head = it.h;
      pt.segment = static_cast<int>(it.segment);
      pt.tile = static_cast<int>(tile);
      pt.chunks_visited = visited;
      pt.chunks_total = static_cast<int>(rank_chunks);
      out.push_back(pt);
    }
  });
  for (std::vector<PermuteTile>& t : tiles) {
    decisions->tiles.insert(decisions->tiles.end(), t.begin(), t.end());
  }
  return {};
}

}  // namespace

// ------------------------------------------------------------------ estimate_select

namespace {

// Block means of [s_k, h_kv, d] into [h_kv, nkb, d] (rules::block_mean; d is d_v for values). Blocks kb < cached
// are read from `cache` (sequence b's rows of a cache of block means) instead.
void block_means(const std::vector<float>& x, const geom::BlockGeometry& g, int h_kv, int d, DType dtype,
                 const TensorView& cache, int b, Index cached, std::vector<float>* out) {
  const Index nkb = g.num_k_blocks();
  out->assign(sz(Index{h_kv} * nkb * d), 0.0f);
  std::vector<double> sum(sz(d));
  const auto round = [dtype](float v) { return round_to(dtype, v); };
  for (int hk = 0; hk < h_kv; ++hk) {
    for (Index kb = 0; kb < nkb; ++kb) {
      float* dst = out->data() + (Index{hk} * nkb + kb) * d;
      if (kb < cached) {
        detail::load_block_mean(cache, b, hk, kb, d, dst);
        continue;
      }
      rules::block_mean(g, static_cast<int>(kb), d, [&](Index t) { return x.data() + (t * h_kv + hk) * d; }, round,
                        sum.data(), dst);
    }
  }
}

}  // namespace

Status estimate_select_plan(const AttentionProblem& problem, const ProblemShape& shape,
                            const EstimateSelectParams& params, int num_threads,
                            EstimatePlan* plan) {
  Context ctx(problem, shape, num_threads);
  const int B = params.block;
  const int group = shape.group();
  const int sel_heads = params.pack_gqa ? shape.h_kv : shape.h_q;
  const int heads_per_item = params.pack_gqa ? group : 1;
  plan->kept = BlockMask::empty(shape, B, B, params.pack_gqa);
  plan->corrected = params.mean_correction ? BlockMask::empty(shape, B, B, params.pack_gqa) : BlockMask{};
  plan->k_mean.assign(sz(shape.batch), {});
  plan->v_mean.assign(sz(shape.batch), {});
  ctx.seqs.resize(sz(shape.batch));
  detail::EstimateChunks chunks;
  SP_RETURN_IF_ERROR(detail::read_estimate_chunks(params, shape, &chunks));
  // Means transposed per KV head for the scoring tile: [h_kv, d, ld_m].
  std::vector<std::vector<float>> mean_t(sz(shape.batch));
  int max_ld_m = kKeyAlign;
  std::vector<float> raw;
  for (int b = 0; b < shape.batch; ++b) {
    Sequence& sq = ctx.seqs[sz(b)];
    sq.seq = detail::sequence_geometry(shape, b);
    const Index cached = chunks.valid[sz(b)];
    detail::gather_q<float>(problem, shape, b, &sq.q);
    detail::gather_kv<float>(problem, shape, b, false, &raw);
    const geom::BlockGeometry mg{sq.seq, B, B};
    const DType mean_dtype = detail::block_mean_dtype(shape.dtype);
    block_means(raw, mg, shape.h_kv, shape.d, mean_dtype, params.k_block_means, b, cached, &plan->k_mean[sz(b)]);
    // The cache holds both means of a block (a later chunk may correct with v̄).
    if (params.mean_correction || chunks.cached) {
      detail::gather_kv<float>(problem, shape, b, true, &raw);
      block_means(raw, mg, shape.h_kv, shape.d_v, mean_dtype, params.v_block_means, b, cached, &plan->v_mean[sz(b)]);
    }
    const int nkb = mg.num_k_blocks();
    // The blocks this call completes go to the cache: each block's mean is computed once.
    if (chunks.cached) {
      for (int g = 0; g < shape.h_kv; ++g) {
        for (Index kb = cached; kb < chunks.complete[sz(b)]; ++kb) {
          detail::store_block_mean(params.k_block_means, b, g, kb, shape.d,
                                   plan->k_mean[sz(b)].data() + (Index{g} * nkb + kb) * shape.d);
          detail::store_block_mean(params.v_block_means, b, g, kb, shape.d_v,
                                   plan->v_mean[sz(b)].data() + (Index{g} * nkb + kb) * shape.d_v);
        }
      }
    }
    const int ld_m = round_up(std::max(nkb, 1), kKeyAlign);
    max_ld_m = std::max(max_ld_m, ld_m);
    std::vector<float>& mt = mean_t[sz(b)];
    mt.assign(sz(Index{shape.h_kv} * shape.d * ld_m), 0.0f);
    for (int g = 0; g < shape.h_kv; ++g) {
      for (int kb = 0; kb < nkb; ++kb) {
        for (int c = 0; c < shape.d; ++c) {
          mt[sz((Index{g} * shape.d + c) * ld_m + kb)] = plan->k_mean[sz(b)][sz((Index{g} * nkb + kb) * shape.d + c)];
        }
      }
    }
  }

  const std::vector<BlockItem> items = block_items(ctx, sel_heads, B, B);
  const int workers = worker_count(ctx, items.size());
  std::vector<Scratch> scratch = make_scratch(ctx, workers, B, max_ld_m);
  const int rows_pad_max = round_up(B, kRowGroup);
  std::vector<std::vector<float>> scores(sz(workers), std::vector<float>(sz(Index{heads_per_item} * rows_pad_max * max_ld_m)));
  std::vector<std::vector<float>> energy(sz(workers), std::vector<float>(sz(max_ld_m)));
  ErrorSlot error;
  parallel_for(static_cast<Index>(items.size()), workers, [&](Index n, int worker) {
    const BlockItem& it = items[sz(n)];
    Scratch& w = scratch[sz(worker)];
    const Sequence& sq = ctx.seqs[sz(it.b)];
    const geom::BlockGeometry g = ctx.geometry(it.b, B, B);
    const Index r0 = g.row_begin(it.qb), r1 = g.row_end(it.qb);
    const int nkb = g.num_k_blocks(), ld_m = round_up(std::max(nkb, 1), kKeyAlign);
    const int kvh = params.pack_gqa ? it.h : it.h / group;
    const rules::EstimateTile tile = rules::estimate_tile(g, it.qb, params.tail, chunks.prompt_len[sz(it.b)]);
    std::vector<float>& e = energy[sz(worker)];
    std::fill(e.begin(), e.end(), 0.0f);
    float peak = -kInf;
    if (tile.scored > tile.first) {
      // x[r, j] = capped(scale·q_r·k̄_j) for the rows of every head of the item; pair n = (head
      // u, row r), heads outermost.
      float* x = scores[sz(worker)].data();
      const Index x_stride = Index{rows_pad_max} * ld_m, rows = r1 - r0;
      for (int u = 0; u < heads_per_item; ++u) {
        const int h = params.pack_gqa ? it.h * group + u : it.h;
        set_row_range(r0, r1, &w);
        begin_tile(ctx, sq, h, static_cast<int>(rows), &w);
        tile_scores(w.t, mean_t[sz(it.b)].data() + Index{kvh} * ctx.d * ld_m, ld_m, x + u * x_stride);
      }
      peak = rules::estimate_energies(
          tile.first, tile.scored, heads_per_item * rows,
          [&](int j, Index pair) {
            const Index u = pair / rows, r = r0 + pair % rows;
            return rules::estimate_contributes(g, sq.seq.position(r), j) ? x[u * x_stride + (r - r0) * ld_m + j] : -kInf;
          },
          e.data());
    }
    for (int j = g.visible_begin(it.qb); j < g.visible_end(it.qb); ++j) {
      if (rules::estimate_keeps(tile, j, e[sz(j)], peak, params.alpha, params.sink, params.window)) {
        error.set(plan->kept.add(shape, it.b, it.h, it.qb, j));
      } else if (params.mean_correction && rules::estimate_correctable(g, tile.a_first, j)) {
        error.set(plan->corrected.add(shape, it.b, it.h, it.qb, j));
      }
    }
  });
  return error.take();
}

Status estimate_select_attend(const AttentionProblem& problem, const ProblemShape& shape,
                              const EstimateSelectParams& params, const EstimatePlan& plan,
                              const AttentionOutput& output, int num_threads) {
  Context ctx(problem, shape, num_threads);
  gather_all(&ctx, params.block, false);
  const int B = params.block, group = shape.group();
  int max_nkb = 1;
  for (const Sequence& sq : ctx.seqs) max_nkb = std::max(max_nkb, sq.num_k_blocks);
  const int max_ld = std::max(round_up(B, kKeyAlign), round_up(max_nkb, kKeyAlign));
  run_block_items(ctx, B, B, max_ld,
                  [&](const BlockItem& it, const geom::BlockGeometry& g, const Sequence& sq, Scratch& w) {
                    const int kvh = it.h / group;
                    const int sel = params.pack_gqa ? kvh : it.h;
                    std::vector<int> blocks;
                    mask_row_blocks(plan.kept, it.b, sel, it.qb, &blocks);
                    for (int kb : blocks) {
                      const KeyTile k = key_block(ctx, sq, kvh, kb);
                      const bool any = prepare(k, &w);
                      if (any) accumulate(ctx, k, &w);
                    }
                    if (!params.mean_correction) return;
                    // Mean correction: each corrected block is one pseudo-token (key k̄_j, value
                    // v̄_j, score + ln n_j), all of them in one extra key tile every row sees.
                    mask_row_blocks(plan.corrected, it.b, sel, it.qb, &blocks);
                    if (blocks.empty()) return;
                    const int nc = static_cast<int>(blocks.size());
                    const int ld_c = round_up(nc, kKeyAlign);
                    const int nkb = g.num_k_blocks(), d = ctx.d;
                    const std::vector<float>& km = plan.k_mean[sz(it.b)];
                    const std::vector<float>& vm = plan.v_mean[sz(it.b)];
                    w.kt_extra.assign(sz(Index{d} * ld_c), 0.0f);
                    w.v_extra.assign(sz(Index{nc} * ctx.ld_v), 0.0f);
                    for (int c = 0; c < nc; ++c) {
                      const Index src = (Index{kvh} * nkb + blocks[sz(c)]) * d;
                      for (int f = 0; f < d; ++f) w.kt_extra[sz(Index{f} * ld_c + c)] = km[sz(src + f)];
                      std::copy_n(vm.data() + (Index{kvh} * nkb + blocks[sz(c)]) * ctx.d_v, ctx.d_v,
                                  w.v_extra.data() + Index{c} * ctx.ld_v);
                    }
                    KeyTile k;
                    k.kt = w.kt_extra.data();
                    k.ld_k = ld_c;
                    k.v = w.v_extra.data();
                    k.n = nc;
                    k.key0 = 0;  // every row sees every corrected block in full
                    tile_scores(w.t, k.kt, k.ld_k, w.s.data());
                    for (int c = 0; c < nc; ++c) {
                      const float bias = std::log(static_cast<float>(g.key_end(blocks[sz(c)]) - g.key_begin(blocks[sz(c)])));
                      for (int i = 0; i < w.t.rows; ++i) w.s[sz(Index{i} * ld_c + c)] += bias;
                    }
                    std::fill(w.begin.begin(), w.begin.begin() + w.t.rows, 0);
                    std::fill(w.limit.begin(), w.limit.begin() + w.t.rows, nc);
                    tile_row_max(w.s.data(), ld_c, w.t.rows, w.begin.data(), w.limit.data(), w.row_max.data());
                    accumulate(ctx, k, &w);
                  });
  store_all(ctx, output);
  return {};
}

Status run_cpu(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
               const AttentionOutput& output, int num_threads, Decisions* decisions) {
  Decisions local;
  Decisions* dec = decisions != nullptr ? decisions : &local;
  *dec = Decisions{};
  dec->policy = policy_name(policy);
  if (shape.device.kind != DeviceKind::kCPU) {
    return invalid_argument("backend cpu: expected host (CPU) tensors, got CUDA tensors");
  }
  if (const auto* p = std::get_if<EstimateSelectParams>(&policy)) {
    if (!shape.causal) return unsupported("estimate_select: defined for causal attention only (causal = false given)");
    EstimatePlan plan;
    SP_RETURN_IF_ERROR(estimate_select_plan(problem, shape, *p, num_threads, &plan));
    SP_RETURN_IF_ERROR(estimate_select_attend(problem, shape, *p, plan, output, num_threads));
    dec->kept = std::move(plan.kept);
    dec->corrected = std::move(plan.corrected);
    return {};
  }
  Context ctx(problem, shape, num_threads);
  Status st;
  if (std::holds_alternative<DenseParams>(policy)) {
    run_dense(ctx);
  } else if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    st = bs->mask.validate_for(shape);
    if (!st.ok()) return invalid_argument("mask: " + st.message());
    run_block_sparse(ctx, *bs, dec);
  } else if (const auto* eg = std::get_if<ExactGateParams>(&policy)) {
    if (eg->thresholds.device.kind != DeviceKind::kCPU || eg->thresholds.dtype != DType::kFP32 ||
        eg->thresholds.rank != 2 || eg->thresholds.shape[0] != shape.h_q || eg->thresholds.shape[1] < 1) {
      return invalid_argument("thresholds: expected host fp32 [h_q = " + std::to_string(shape.h_q) +
                              ", positions >= 1], got " + describe(eg->thresholds));
    }
    st = run_exact_gate(ctx, *eg, dec);
  } else if (const auto* ss = std::get_if<SoftmaxSkipParams>(&policy)) {
    st = run_softmax_skip(ctx, *ss, dec);
  } else if (const auto* ps = std::get_if<PermuteStopParams>(&policy)) {
    if (!shape.causal) return unsupported("permute_stop: defined for causal attention only (causal = false given)");
    st = run_permute_stop(ctx, *ps, dec);
  }
  SP_RETURN_IF_ERROR(st);
  store_all(ctx, output);
  return {};
}

}  // namespace sparseprefill::cpu
