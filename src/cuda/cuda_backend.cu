// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's host side: checks, device scratch, uploads, launches through the
// registry of generated instances, and decisions copied back. Includes the CUDA runtime but
// no kernel header (kernels are reached through extern launch functions only).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "core/geometry.h"
#include "cuda/cuda_backend.h"
#include "cuda/plan.h"
#include "cuda/registry.h"

#ifndef SP_CUDA_ARCHS
#define SP_CUDA_ARCHS "unknown"
#endif

namespace sparseprefill::cuda {
namespace {

Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return {};
  return {StatusCode::kCudaError, what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"};
}

#define SP_CUDA_TRY(expr, what) SP_RETURN_IF_ERROR(cuda_status((expr), (what)))

// Two memory pools per device. Per-call scratch comes from one that keeps freed memory for the
// next call (a release threshold of "never"), so it costs no cudaMalloc after the first call.
// Staged paged K/V (plan_kv_staging: up to a layer's whole K/V) comes from one that returns
// its memory to the device at the next synchronisation (threshold 0), so that a long prefill
// does not hold it afterwards; calls between synchronisations reuse it in stream order.
enum class PoolKind { kScratch, kStaging };
Status pool_for(int device, PoolKind kind, cudaMemPool_t* pool) {
  static std::mutex mutex;
  static std::vector<cudaMemPool_t> pools[2];
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<cudaMemPool_t>& of_kind = pools[static_cast<int>(kind)];
  if (device >= static_cast<int>(of_kind.size())) of_kind.resize(static_cast<std::size_t>(device) + 1, nullptr);
  cudaMemPool_t& p = of_kind[static_cast<std::size_t>(device)];
  if (p == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    SP_CUDA_TRY(cudaMemPoolCreate(&p, &props), "cudaMemPoolCreate");
    std::uint64_t keep = kind == PoolKind::kScratch ? ~std::uint64_t{0} : 0;
    SP_CUDA_TRY(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
  }
  *pool = p;
  return {};
}

// Makes `device` current for the call and restores the caller's device afterwards.
class DeviceGuard {
 public:
  Status enter(int device) {
    SP_CUDA_TRY(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) SP_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice");
    active_ = true;
    return {};
  }
  ~DeviceGuard() {
    if (active_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool active_ = false;
};

// Small per-call metadata (the sequence table, the paged block table, the Hopper tensor maps,
// exact_gate's per-sequence sums of gated blocks)
// kept in device memory keyed by its bytes and never freed. A call whose metadata repeats an
// earlier call's (the same shapes and tensors, as every layer and step of a model repeats
// them) copies nothing, and a call under CUDA graph capture reads memory that outlives the
// graph, so replays stay valid.
// Metadata not seen before cannot be added during capture (that would record a copy from
// transient host memory): the call is refused, and a warm-up call outside capture fixes it.
class MetadataCache {
 public:
  static constexpr std::size_t kMaxEntryBytes = std::size_t{64} << 10;  // block masks are larger
  static constexpr std::size_t kMaxTotalBytes = std::size_t{64} << 20;  // per device

  // *device = the cached copy of host[0, bytes), added when allowed; nullptr when the entry is
  // too large, the cache is full, or the stream is capturing (the caller decides what then).
  Status find_or_add(int device, const void* host, std::size_t bytes, bool capturing, cudaStream_t stream,
                     const void** out) {
    *out = nullptr;
    if (bytes == 0 || bytes > kMaxEntryBytes) return {};
    std::string key(static_cast<const char*>(host), bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    PerDevice& d = devices_[device];
    const auto it = d.entries.find(key);
    if (it != d.entries.end()) {
      *out = it->second;
      return {};
    }
    if (capturing || d.total + bytes > kMaxTotalBytes) return {};
    void* ptr = nullptr;
    SP_CUDA_TRY(cudaMalloc(&ptr, bytes), "cudaMalloc (metadata cache)");
    // Complete before the entry is published: a call on another stream may use it at once.
    cudaError_t err = cudaMemcpyAsync(ptr, host, bytes, cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) {
      cudaFree(ptr);
      return cuda_status(err, "cudaMemcpyAsync (metadata cache)");
    }
    d.total += bytes;
    d.entries.emplace(std::move(key), ptr);
    *out = ptr;
    return {};
  }

 private:
  struct PerDevice {
    std::unordered_map<std::string, void*> entries;
    std::size_t total = 0;
  };
  std::mutex mutex_;
  std::unordered_map<int, PerDevice> devices_;
};

MetadataCache& metadata_cache() {
  static MetadataCache cache;
  return cache;
}

// Stream-ordered scratch of one call: allocated from the device's pool on the call's stream
// and freed on it when the call returns (the frees are ordered after the kernels). Under CUDA
// graph capture these become the graph's allocation and free nodes.
class Scratch {
 public:
  Scratch(cudaStream_t stream, cudaMemPool_t pool, int device, bool capturing)
      : stream_(stream), pool_(pool), device_(device), capturing_(capturing) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    for (void* ptr : owned_) cudaFreeAsync(ptr, stream_);
  }

  template <class T>
  Status alloc(std::size_t count, T** out) {
    *out = nullptr;
    if (count == 0) return {};
    void* ptr = nullptr;
    SP_CUDA_TRY(cudaMallocFromPoolAsync(&ptr, count * sizeof(T), pool_, stream_), "cudaMallocFromPoolAsync");
    owned_.push_back(ptr);
    *out = static_cast<T*>(ptr);
    return {};
  }
  template <class T>
  Status zeros(std::size_t count, T** out) {
    SP_RETURN_IF_ERROR(alloc(count, out));
    if (count > 0) SP_CUDA_TRY(cudaMemsetAsync(*out, 0, count * sizeof(T), stream_), "cudaMemsetAsync");
    return {};
  }
  // Host bytes in device memory, 64-byte aligned: the metadata cache's copy when it has or can
  // take one (`cacheable` false: never, for bytes that will not repeat), else a per-call copy
  // (pageable source: staged before cudaMemcpyAsync returns, so the host buffer may die
  // afterwards) — which a capturing stream cannot record.
  Status upload_bytes(const void* host, std::size_t bytes, const void** out, bool cacheable = true) {
    *out = nullptr;
    if (bytes == 0) return {};
    if (cacheable) SP_RETURN_IF_ERROR(metadata_cache().find_or_add(device_, host, bytes, capturing_, stream_, out));
    if (*out != nullptr) return {};
    if (capturing_) {
      return unsupported("cuda_stream: is capturing a CUDA graph, and this call's metadata (" + std::to_string(bytes) +
                         " bytes: sequence table, block table, tensor maps, block mask or exact_gate's sums per sequence) was not uploaded by an earlier call; run "
                         "the same call once outside capture first (block masks over 64 KiB: run through a plan, make_plan)");
    }
    std::uint8_t* dev = nullptr;
    SP_RETURN_IF_ERROR(alloc(bytes + 64, &dev));
    dev += (64 - reinterpret_cast<std::uintptr_t>(dev) % 64) % 64;
    SP_CUDA_TRY(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (upload)");
    *out = dev;
    return {};
  }
  template <class T>
  Status upload(const std::vector<T>& host, const T** out) {
    const void* dev = nullptr;
    SP_RETURN_IF_ERROR(upload_bytes(host.data(), host.size() * sizeof(T), &dev));
    *out = static_cast<const T*>(dev);
    return {};
  }
  template <class T>
  Status download(const T* dev, std::size_t count, std::vector<T>* host) {
    host->resize(count);
    if (count > 0) {
      SP_CUDA_TRY(cudaMemcpyAsync(host->data(), dev, count * sizeof(T), cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync (decisions)");
    }
    return {};
  }

 private:
  cudaStream_t stream_;
  cudaMemPool_t pool_;
  int device_;
  bool capturing_;
  std::vector<void*> owned_;
};

// The HostUpload the Hopper instances call for their tensor maps; a failure's Status is kept
// here and the launch returns kUploadRefused.
struct UploadContext {
  Scratch* scratch;
  bool cacheable;  // false: the maps describe staged K/V (run_checked)
  Status status;
  static int call(void* context, const void* host, std::size_t bytes, const void** device) {
    auto* self = static_cast<UploadContext*>(context);
    Status st = self->scratch->upload_bytes(host, bytes, device, self->cacheable);
    const int result = st.ok() ? 0 : kUploadRefused;
    std::swap(self->status, st);  // (nvcc flags an assignment of a [[nodiscard]] type as discarded)
    return result;
  }
};

Status launch_status(int err, const char* name) {
  return cuda_status(static_cast<cudaError_t>(err), std::string("launching ") + name);
}

// Test hooks (cuda_backend.h): per calling thread, the forward instance last launched and
// whether calls are sent to the portable path.
thread_local std::string t_last_fwd_instance;
thread_local std::string t_last_select_instance;
thread_local bool t_portable_only = false;
thread_local KvStagingForTesting t_kv_staging = KvStagingForTesting::kAuto;
thread_local bool t_last_staged = false;
thread_local int t_last_q_pack = 1;
thread_local int t_last_gate_passes = 0;
thread_local int t_gate_passes = 0;

// The device's compute capability (choose_fwd_path needs it).
Status compute_capability(int device, int* major, int* minor) {
  SP_CUDA_TRY(cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  SP_CUDA_TRY(cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  return {};
}

// The device's L2 size in bytes (kv_major_grid needs it).
Status l2_bytes(int device, std::int64_t* bytes) {
  int l2 = 0;
  SP_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute");
  *bytes = l2;
  return {};
}

// estimate_select's selector instance for a call on the shape's device (choose_select_path;
// the path override and the test hook send it to the portable one).
Status find_selector(const ProblemShape& shape, const SelectVariant** out) {
  int cc_major = 0, cc_minor = 0;
  SP_RETURN_IF_ERROR(compute_capability(shape.device.index, &cc_major, &cc_minor));
  bool forced = false;
  SP_RETURN_IF_ERROR(portable_forced(std::getenv(kPathEnv), &forced));
  const bool hopper = choose_select_path(shape, cc_major, cc_minor, forced || t_portable_only) == FwdPath::kHopper;
  *out = hopper ? find_select90(shape.dtype, shape.d) : find_select(shape.dtype, shape.d);
  t_last_select_instance = (*out)->name;
  return {};
}

// For a plan: the Hopper instance's tensor maps of (problem, seqs) put into the metadata cache
// now, outside capture, so that a captured first run of the plan finds them there (they hold
// the tensors' addresses, so the plan's tensors are the ones cached). The instance encodes them
// exactly as a run does and hands them to this uploader, which caches them and declines the
// launch (kUploadRefused: nothing is enqueued). Nothing to do where the plan's calls take the
// portable kernel, or for permute_stop, whose Hopper kernel gathers rows without maps.
Status cache_hopper_maps(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                         const std::vector<SeqInfo>& seqs, cudaStream_t stream) {
  if (std::holds_alternative<PermuteStopParams>(policy)) return {};
  int cc_major = 0, cc_minor = 0;
  SP_RETURN_IF_ERROR(compute_capability(shape.device.index, &cc_major, &cc_minor));
  bool forced = false;
  SP_RETURN_IF_ERROR(portable_forced(std::getenv(kPathEnv), &forced));
  if (forced || choose_fwd_path(shape, policy, tma_describable(problem), cc_major, cc_minor) != FwdPath::kHopper) {
    return {};
  }
  struct CacheOnly {
    int device;
    cudaStream_t stream;
    Status status;
    static int call(void* context, const void* host, std::size_t bytes, const void** device) {
      auto* self = static_cast<CacheOnly*>(context);
      Status st = metadata_cache().find_or_add(self->device, host, bytes, false, self->stream, device);
      std::swap(self->status, st);  // (nvcc flags an assignment of a [[nodiscard]] type as discarded)
      return kUploadRefused;
    }
  } cache_only{shape.device.index, stream, {}};
  // The maps depend on q, k, v, the sequence table and (paged K/V) the block table only: any
  // output layout and the dense mode serve (mean-correction maps are kernel parameters, not
  // cached).
  const FwdParams p = make_fwd_params(problem, shape, AttentionOutput{problem.q, TensorView{}}, hopper_block_k());
  const bool paged = shape.kv_layout == KvLayout::kPaged;
  const std::vector<std::int32_t> table = paged ? compact_block_table(problem, shape) : std::vector<std::int32_t>{};
  const int err = find_fwd90(shape.dtype, shape.d, paged)
                      ->launch(p, seqs.data(), paged ? table.data() : nullptr, {&cache_only, &CacheOnly::call}, stream);
  SP_RETURN_IF_ERROR(cache_only.status);
  // cudaErrorNotSupported: the driver cannot describe these tensors; the runs take the portable
  // kernel, which needs no maps. 0: an empty grid, nothing to map.
  if (err == kUploadRefused || err == cudaErrorNotSupported || err == 0) return {};
  return launch_status(err, "the Hopper tensor maps of a plan");
}

// Shared by the gates: a zeroed kept bitmap the kernel fills, read back after the launch.
struct KeptBits {
  std::uint32_t* dev = nullptr;
  std::size_t words = 0;
};

// permute_stop: ranking, sorts and attention enqueued by the instance (no synchronisation), the
// attention on the Hopper kernel when `path` says so; decisions copied back only when requested.
Status run_permute_stop(const ProblemShape& shape, const PermuteStopParams& pol, const FwdParams& fwd, FwdPath path,
                        Scratch& scratch, cudaStream_t stream, Decisions* decisions) {
  const PermuteVariant* variant = find_permute(shape.dtype, shape.d);
  const Permute90Variant* hopper = path == FwdPath::kHopper ? find_permute90(shape.dtype, shape.d) : nullptr;
  PermuteLayout layout;
  SP_RETURN_IF_ERROR(permute_layout(shape, pol, &layout));
  PermuteParams pp{};
  pp.fwd = fwd;
  pp.segment = pol.segment;
  pp.tau = static_cast<float>(pol.tau);
  pp.block_k = pol.block_k;
  pp.max_segments = layout.max_segments;
  pp.tiles_per_segment = layout.tiles_per_segment;
  pp.max_s_q = layout.max_s_q;
  pp.max_prefix = layout.max_prefix;
  pp.rank_items = layout.rank_offsets.back();
  pp.rank_segments = static_cast<int>(layout.rank_offsets.size()) - 1;
  pp.query_items = layout.query_offsets.back();
  pp.query_segments = static_cast<int>(layout.query_offsets.size()) - 1;
  SP_RETURN_IF_ERROR(scratch.upload(layout.rank_offsets, &pp.rank_offsets));
  SP_RETURN_IF_ERROR(scratch.upload(layout.query_offsets, &pp.query_offsets));
  const auto rank_items = static_cast<std::size_t>(pp.rank_items);
  const auto query_items = static_cast<std::size_t>(pp.query_items);
  SP_RETURN_IF_ERROR(scratch.alloc(static_cast<std::size_t>(pp.rank_segments) * static_cast<std::size_t>(shape.d), &pp.q_mean));
  for (int i = 0; i < 2; ++i) {
    SP_RETURN_IF_ERROR(scratch.alloc(rank_items, &pp.rank_keys[i]));
    SP_RETURN_IF_ERROR(scratch.alloc(rank_items, &pp.rank_index[i]));
    SP_RETURN_IF_ERROR(scratch.alloc(query_items, &pp.query_keys[i]));
    SP_RETURN_IF_ERROR(scratch.alloc(query_items, &pp.query_rows[i]));
  }
  // One temporary buffer for both sorts: the larger of their sizes (host-side queries).
  std::size_t temp = 0;
  for (const bool rank : {true, false}) {
    const SortPairs sizes{{nullptr, nullptr}, {nullptr, nullptr}, rank ? pp.rank_items : pp.query_items,
                          rank ? pp.rank_segments : pp.query_segments, nullptr, nullptr, 0};
    std::size_t bytes = 0;
    int current = 0;
    SP_RETURN_IF_ERROR(cuda_status(static_cast<cudaError_t>(permute_sort_pairs(sizes, &bytes, &current, stream)),
                                   "permute_stop sort (temporary storage size)"));
    temp = temp > bytes ? temp : bytes;
  }
  std::uint8_t* sort_temp = nullptr;
  SP_RETURN_IF_ERROR(scratch.alloc(temp, &sort_temp));
  pp.sort_temp = sort_temp;
  pp.sort_temp_bytes = temp;
  const std::size_t tiles = static_cast<std::size_t>(pp.rank_segments) * static_cast<std::size_t>(pp.tiles_per_segment);
  if (decisions != nullptr) SP_RETURN_IF_ERROR(scratch.zeros(tiles, &pp.visited));
  const char* name = hopper != nullptr ? hopper->name : variant->name;
  SP_RETURN_IF_ERROR(launch_status(variant->launch(pp, hopper != nullptr ? hopper->attend : nullptr, stream), name));
  t_last_fwd_instance = name;
  if (decisions == nullptr) return {};
  std::vector<std::int32_t> visited;
  SP_RETURN_IF_ERROR(scratch.download(pp.visited, tiles, &visited));
  SP_RETURN_IF_ERROR(scratch.download(pp.query_order, query_items, &decisions->query_order));
  SP_CUDA_TRY(cudaStreamSynchronize(stream), "cudaStreamSynchronize (decisions)");
  decisions->tiles = permute_tiles(shape, pol, layout, visited);
  return {};
}

// The call's small metadata on the device: the sequence table (`planned`, a plan's copy of the
// same bytes, when given) and, for paged K/V, the used entries of the (validated, host) block
// table, compacted (*table: the host copy, which the Hopper kernel's tensor maps need) and kept
// on the device like the other metadata: the kernels translate every K/V row through it.
Status upload_metadata(const AttentionProblem& problem, const ProblemShape& shape, const std::vector<SeqInfo>& seqs,
                       const SeqInfo* planned, Scratch* scratch, FwdParams* p, std::vector<std::int32_t>* table) {
  if (planned != nullptr) {
    p->seqs = planned;
  } else {
    SP_RETURN_IF_ERROR(scratch->upload(seqs, &p->seqs));
  }
  table->clear();
  if (shape.kv_layout == KvLayout::kPaged) {
    *table = compact_block_table(problem, shape);
    SP_RETURN_IF_ERROR(scratch->upload(*table, &p->paged.block_table));
  }
  return {};
}

// The estimate_select selector's device outputs for one call (SelectParams' output fields).
struct Selection {
  SelectParams sp{};
  std::size_t rows = 0;  // batch * units * num_q_blocks, units = h_kv with pack_gqa, else h_q
};

// Fills sel->sp from the call's parameters `p` (tensors, strides, sequence table) and `pol`,
// allocates the selector's outputs from `scratch` and launches it on `stream`.
Status launch_selection(const ProblemShape& shape, const FwdParams& p, const EstimateSelectParams& pol,
                        Scratch* scratch, cudaStream_t stream, Selection* sel) {
  SelectParams& sp = sel->sp;
  sp.q = p.q;
  sp.k = p.k;
  sp.v = p.v;
  sp.q_row_stride = p.q_row_stride;
  sp.q_head_stride = p.q_head_stride;
  sp.k_row_stride = p.k_row_stride;
  sp.k_head_stride = p.k_head_stride;
  sp.v_row_stride = p.v_row_stride;
  sp.v_head_stride = p.v_head_stride;
  sp.seqs = p.seqs;
  sp.paged = p.paged;
  sp.batch = shape.batch;
  sp.h_q = shape.h_q;
  sp.h_kv = shape.h_kv;
  sp.group = shape.group();
  sp.scale = p.scale;
  sp.block = pol.block;
  sp.num_q_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_q(), pol.block));
  sp.num_k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), pol.block));
  sp.alpha = static_cast<float>(pol.alpha);
  sp.sink = pol.sink;
  sp.window = pol.window;
  sp.tail = pol.tail;
  sp.pack_gqa = pol.pack_gqa;
  sp.mean_correction = pol.mean_correction;
  // Chunked prefill: validated and read on the host (run() has checked them already).
  detail::EstimateChunks chunks;
  SP_RETURN_IF_ERROR(detail::read_estimate_chunks(pol, shape, &chunks));
  const std::vector<SelectSeq> select_seqs = make_select_seqs(pol, chunks);
  if (!select_seqs.empty()) SP_RETURN_IF_ERROR(scratch->upload(select_seqs, &sp.select_seqs));
  sp.cache_k = mean_cache(pol.k_block_means);
  sp.cache_v = mean_cache(pol.v_block_means);
  const int units = pol.pack_gqa ? shape.h_kv : shape.h_q;
  sel->rows = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(units) *
              static_cast<std::size_t>(sp.num_q_blocks);
  const std::size_t means = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_kv) *
                            static_cast<std::size_t>(sp.num_k_blocks) * static_cast<std::size_t>(shape.d);
  std::uint16_t* k_mean = nullptr;
  std::uint16_t* v_mean = nullptr;
  SP_RETURN_IF_ERROR(scratch->alloc(means, &k_mean));
  SP_RETURN_IF_ERROR(scratch->alloc(means, &v_mean));
  sp.k_mean = k_mean;
  sp.v_mean = v_mean;
  SP_RETURN_IF_ERROR(scratch->zeros(sel->rows, &sp.full_count));
  SP_RETURN_IF_ERROR(scratch->zeros(sel->rows, &sp.partial_count));
  const std::size_t cap = sel->rows * static_cast<std::size_t>(sp.num_k_blocks);
  SP_RETURN_IF_ERROR(scratch->alloc(cap, &sp.full_index));
  SP_RETURN_IF_ERROR(scratch->alloc(cap, &sp.partial_index));
  if (pol.mean_correction) {
    sp.corrected_words = bitmap_words(sp.num_k_blocks);
    SP_RETURN_IF_ERROR(scratch->zeros(sel->rows * static_cast<std::size_t>(sp.corrected_words), &sp.corrected_bits));
  }
  const SelectVariant* select = nullptr;
  SP_RETURN_IF_ERROR(find_selector(shape, &select));
  return launch_status(select->launch(sp, stream), select->name);
}

// exact_gate's first pass (choose_gate_passes): launches the decision kernel `gate` of `path`
// for the forward call `p` (mode kExactGate; it writes the kept bitmap if p->kept_bits is set)
// and turns `p` into the block-mask call over the rows it writes: one per query head, each at
// the start it writes (gate_list_entries).
Status launch_gate_decisions(const ProblemShape& shape, FwdPath path, const GateVariant& gate, Scratch* scratch,
                             cudaStream_t stream, FwdParams* p) {
  const int k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), p->block_k));
  GateParams gp{};
  gp.fwd = *p;
  gp.fwd.mask_k_blocks = k_blocks;
  gp.heads_per_cta = path == FwdPath::kHopper ? gate_heads_per_cta(shape.group()) : 1;
  gp.words = bitmap_words(k_blocks);
  const std::size_t rows = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_q) *
                           static_cast<std::size_t>(p->num_q_blocks);
  const GateListEntries entries = gate_list_entries(shape, p->block_k, p->num_q_blocks);
  SP_RETURN_IF_ERROR(scratch->alloc(rows, &gp.full_start));
  SP_RETURN_IF_ERROR(scratch->alloc(rows, &gp.partial_start));
  SP_RETURN_IF_ERROR(scratch->alloc(rows, &gp.full_count));
  SP_RETURN_IF_ERROR(scratch->alloc(rows, &gp.partial_count));
  // At least one entry each: a call whose rows hold no block still passes valid pointers.
  SP_RETURN_IF_ERROR(scratch->alloc(static_cast<std::size_t>(entries.full > 0 ? entries.full : 1), &gp.full_index));
  SP_RETURN_IF_ERROR(scratch->alloc(static_cast<std::size_t>(entries.partial > 0 ? entries.partial : 1), &gp.partial_index));
  SP_RETURN_IF_ERROR(scratch->upload(gate_seq_gated(shape, p->block_k), &gp.seq_gated));
  SP_RETURN_IF_ERROR(launch_status(gate.launch(gp, stream), gate.name));
  p->mode = PolicyMode::kBlockMask;
  p->full_count = gp.full_count;
  p->full_index = gp.full_index;
  p->partial_count = gp.partial_count;
  p->partial_index = gp.partial_index;
  p->full_start = gp.full_start;
  p->partial_start = gp.partial_start;
  p->mask_heads = shape.h_q;
  p->mask_per_kv_head = false;
  p->mask_q_blocks = p->num_q_blocks;
  p->mask_k_blocks = k_blocks;
  p->kept_bits = nullptr;  // written by the decision kernel
  return {};
}

// Copies a launched selection back into `out` (kept, and corrected with mean correction);
// synchronises the stream.
Status read_selection(const ProblemShape& shape, const EstimateSelectParams& es, const Selection& sel,
                      Scratch* scratch, cudaStream_t stream, Decisions* out) {
  const SelectParams& sp = sel.sp;
  const std::size_t cap = sel.rows * static_cast<std::size_t>(sp.num_k_blocks);
  std::vector<std::int32_t> full_count, full_index, partial_count, partial_index;
  std::vector<std::uint32_t> corrected;
  SP_RETURN_IF_ERROR(scratch->download(sp.full_count, sel.rows, &full_count));
  SP_RETURN_IF_ERROR(scratch->download(sp.full_index, cap, &full_index));
  SP_RETURN_IF_ERROR(scratch->download(sp.partial_count, sel.rows, &partial_count));
  SP_RETURN_IF_ERROR(scratch->download(sp.partial_index, cap, &partial_index));
  if (es.mean_correction) {
    SP_RETURN_IF_ERROR(scratch->download(sp.corrected_bits, sel.rows * static_cast<std::size_t>(sp.corrected_words), &corrected));
  }
  SP_CUDA_TRY(cudaStreamSynchronize(stream), "cudaStreamSynchronize (decisions)");
  SP_RETURN_IF_ERROR(mask_from_arrays(shape, es.block, es.pack_gqa, full_count, full_index, partial_count,
                                      partial_index, &out->kept));
  if (es.mean_correction) {
    SP_RETURN_IF_ERROR(mask_from_bits(shape, es.block, es.block, es.pack_gqa, corrected, &out->corrected));
  }
  return {};
}

// Whether the stream is capturing a CUDA graph.
Status is_capturing(cudaStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SP_CUDA_TRY(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  *capturing = capture != cudaStreamCaptureStatusNone;
  return {};
}

// What every call that launches work sets up: its device made current (restored when this
// dies), the device's scratch pool, the caller's stream and whether it is capturing a graph.
struct DeviceCall {
  DeviceGuard guard;
  cudaMemPool_t pool = nullptr;
  cudaStream_t stream = nullptr;
  bool capturing = false;

  Status enter(int device, void* cuda_stream) {
    SP_RETURN_IF_ERROR(guard.enter(device));
    SP_RETURN_IF_ERROR(pool_for(device, PoolKind::kScratch, &pool));
    stream = static_cast<cudaStream_t>(cuda_stream);
    return is_capturing(stream, &capturing);
  }
};

// The output view of a plan's per-sequence table, and of the selector alone (which writes no
// output): O contiguous in q's shape, LSE contiguous ([b, h_q, s_q] or [h_q, total_q]).
std::vector<SeqInfo> contiguous_output_seqs(const AttentionProblem& problem, const ProblemShape& shape) {
  AttentionOutput out;
  out.o = problem.q;
  out.o.data = nullptr;
  std::int64_t step = 1;
  for (int i = out.o.rank - 1; i >= 0; --i) {
    out.o.stride[i] = step;
    step *= out.o.shape[i];
  }
  out.lse.dtype = DType::kFP32;
  out.lse.device = shape.device;
  out.lse.rank = shape.varlen_q ? 2 : 3;
  if (shape.varlen_q) {
    out.lse.shape[0] = shape.h_q;
    out.lse.shape[1] = shape.total_q();
    out.lse.stride[0] = shape.total_q();
    out.lse.stride[1] = 1;
  } else {
    out.lse.shape[0] = shape.batch;
    out.lse.shape[1] = shape.h_q;
    out.lse.shape[2] = shape.max_seq_q();
    out.lse.stride[0] = shape.h_q * shape.max_seq_q();
    out.lse.stride[1] = shape.max_seq_q();
    out.lse.stride[2] = 1;
  }
  return make_seq_infos(problem, shape, out);
}

bool same_bytes(const std::vector<SeqInfo>& a, const std::vector<SeqInfo>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(SeqInfo)) == 0);
}

}  // namespace

struct PlanState {
  int device = 0;
  std::vector<void*> owned;  // cudaMalloc'd, freed with the state
  bool has_mask = false;     // block_sparse: the compacted mask below
  const std::int32_t* full_count = nullptr;
  const std::int32_t* partial_count = nullptr;
  const std::int64_t* full_start = nullptr;
  const std::int64_t* partial_start = nullptr;
  const std::int32_t* full_index = nullptr;
  const std::int32_t* partial_index = nullptr;
  std::vector<SeqInfo> seqs_host;  // the table of a contiguous output ...
  const SeqInfo* seqs = nullptr;   // ... and its device copy

  PlanState() = default;
  PlanState(const PlanState&) = delete;
  PlanState& operator=(const PlanState&) = delete;
  ~PlanState() {
    DeviceGuard guard;
    if (!guard.enter(device).ok()) return;
    for (void* ptr : owned) cudaFree(ptr);  // synchronises with work that may still read it
  }

  // A device copy of host[0, count) owned by the state; null for an empty vector.
  template <class T>
  Status copy(const std::vector<T>& host, cudaStream_t stream, const T** out) {
    *out = nullptr;
    if (host.empty()) return {};
    void* ptr = nullptr;
    SP_CUDA_TRY(cudaMalloc(&ptr, host.size() * sizeof(T)), "cudaMalloc (plan)");
    owned.push_back(ptr);
    SP_CUDA_TRY(cudaMemcpyAsync(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
                "cudaMemcpyAsync (plan)");
    *out = static_cast<const T*>(ptr);
    return {};
  }
};

Status make_plan_state(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                       const RunOptions& options, std::shared_ptr<const PlanState>* out) {
  int block_k = 0;
  SP_RETURN_IF_ERROR(check_support(shape, policy, &block_k));
  DeviceGuard guard;
  SP_RETURN_IF_ERROR(guard.enter(shape.device.index));
  const auto stream = static_cast<cudaStream_t>(options.cuda_stream);
  bool capturing = false;
  SP_RETURN_IF_ERROR(is_capturing(stream, &capturing));
  if (capturing) {
    return unsupported("cuda_stream: is capturing a CUDA graph; make the plan before capture (it allocates and "
                       "uploads device memory)");
  }
  // The device's memory pool is created on its first use, which a capturing stream forbids:
  // create it here, so that the plan's first run may be captured.
  cudaMemPool_t pool = nullptr;
  SP_RETURN_IF_ERROR(pool_for(shape.device.index, PoolKind::kScratch, &pool));
  auto state = std::make_shared<PlanState>();
  state->device = shape.device.index;
  state->seqs_host = contiguous_output_seqs(problem, shape);
  SP_RETURN_IF_ERROR(state->copy(state->seqs_host, stream, &state->seqs));
  if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    const CompactMask c = compact_mask(bs->mask);
    state->has_mask = true;
    SP_RETURN_IF_ERROR(state->copy(c.full_count, stream, &state->full_count));
    SP_RETURN_IF_ERROR(state->copy(c.partial_count, stream, &state->partial_count));
    SP_RETURN_IF_ERROR(state->copy(c.full_start, stream, &state->full_start));
    SP_RETURN_IF_ERROR(state->copy(c.partial_start, stream, &state->partial_start));
    SP_RETURN_IF_ERROR(state->copy(c.full_index, stream, &state->full_index));
    SP_RETURN_IF_ERROR(state->copy(c.partial_index, stream, &state->partial_index));
  }
  SP_RETURN_IF_ERROR(cache_hopper_maps(problem, shape, policy, state->seqs_host, stream));
  // exact_gate's decision pass uploads its sequences' gated-block sums with each call
  // (launch_gate_decisions): into the metadata cache here, so that the plan's first run may be
  // captured.
  std::vector<std::int64_t> seq_gated;
  if (std::holds_alternative<ExactGateParams>(policy)) {
    seq_gated = gate_seq_gated(shape, block_k);
    const void* cached = nullptr;
    SP_RETURN_IF_ERROR(metadata_cache().find_or_add(state->device, seq_gated.data(),
                                                    seq_gated.size() * sizeof(std::int64_t), false, stream, &cached));
  }
  // The host vectors die with this call: the copies must be complete before it returns.
  SP_CUDA_TRY(cudaStreamSynchronize(stream), "cudaStreamSynchronize (plan)");
  *out = std::move(state);
  return {};
}

Status select_cuda(const AttentionProblem& problem, const ProblemShape& shape, const EstimateSelectParams& params,
                   const RunOptions& options, Decisions* decisions) {
  const Policy policy = params;
  int block_k = 0;
  SP_RETURN_IF_ERROR(check_support(shape, policy, &block_k));
  // The selector writes no output: q's layout stands in for O so the shared builders apply.
  const AttentionOutput no_output{problem.q, TensorView{}};
  SP_RETURN_IF_ERROR(check_layout(problem, no_output));
  DeviceCall call;
  SP_RETURN_IF_ERROR(call.enter(shape.device.index, options.cuda_stream));
  if (call.capturing) {
    return unsupported("cuda_stream: is capturing a CUDA graph, and select() reads its mask back to the host; "
                       "select outside capture");
  }
  const cudaStream_t stream = call.stream;
  Scratch scratch(stream, call.pool, shape.device.index, false);
  FwdParams p = make_fwd_params(problem, shape, no_output, block_k);
  const std::vector<SeqInfo> seqs = make_seq_infos(problem, shape, no_output);
  std::vector<std::int32_t> table;
  SP_RETURN_IF_ERROR(upload_metadata(problem, shape, seqs, nullptr, &scratch, &p, &table));
  Selection sel;
  SP_RETURN_IF_ERROR(launch_selection(shape, p, params, &scratch, stream, &sel));
  *decisions = Decisions{};
  decisions->policy = policy_name(policy);
  return read_selection(shape, params, sel, &scratch, stream, decisions);
}

Status can_run_cuda(const ProblemShape& shape, const Policy& policy) {
  int block_k = 0;
  return check_support(shape, policy, &block_k);
}

std::string last_fwd_instance_for_testing() { return t_last_fwd_instance; }
std::string last_select_instance_for_testing() { return t_last_select_instance; }
void set_portable_only_for_testing(bool portable_only) { t_portable_only = portable_only; }
void set_kv_staging_for_testing(KvStagingForTesting mode) { t_kv_staging = mode; }
bool last_call_staged_kv_for_testing() { return t_last_staged; }
int last_q_pack_for_testing() { return t_last_q_pack; }
int last_gate_passes_for_testing() { return t_last_gate_passes; }
void set_gate_passes_for_testing(int passes) { t_gate_passes = passes; }

std::string cuda_build_info() {
  return std::string("cuda architectures (portable path): ") + SP_CUDA_ARCHS + "; Hopper path: 90a-real\n" + "cuda kernels: " +
         support_summary() + "\n" + compiled_instances();
}

namespace {

// run_cuda after its checks, on the call's device, with K/V as the kernels read them (staged
// K/V: varlen rows in transient buffers whose addresses need not repeat, so `cache_maps` false
// keeps their Hopper tensor maps out of the metadata cache, which they would only fill).
Status run_checked(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy, int block_k,
                   const AttentionOutput& output, cudaStream_t stream, cudaMemPool_t pool, bool capturing,
                   bool cache_maps, Decisions* decisions, const PlanState* plan) {
  Scratch scratch(stream, pool, shape.device.index, capturing);

  FwdParams p = make_fwd_params(problem, shape, output, block_k);
  const std::vector<SeqInfo> seqs = make_seq_infos(problem, shape, output);
  std::vector<std::int32_t> table;  // paged K/V: the compact block table (host copy)
  SP_RETURN_IF_ERROR(upload_metadata(problem, shape, seqs,
                                     plan != nullptr && same_bytes(seqs, plan->seqs_host) ? plan->seqs : nullptr,
                                     &scratch, &p, &table));
  int cc_major = 0, cc_minor = 0;
  SP_RETURN_IF_ERROR(compute_capability(shape.device.index, &cc_major, &cc_minor));
  std::int64_t l2 = 0;
  SP_RETURN_IF_ERROR(l2_bytes(shape.device.index, &l2));
  p.kv_major = kv_major_grid(shape, l2);
  bool forced = false;
  SP_RETURN_IF_ERROR(portable_forced(std::getenv(kPathEnv), &forced));
  PackGqa pack_gqa = PackGqa::kAuto;
  SP_RETURN_IF_ERROR(pack_gqa_mode(std::getenv(kPackGqaEnv), &pack_gqa));
  const FwdPath path = t_portable_only || forced
                           ? FwdPath::kPortable
                           : choose_fwd_path(shape, policy, tma_describable(problem), cc_major, cc_minor);
  const bool fp8 = shape.dtype == DType::kFP8E4M3;
  if (fp8 && path != FwdPath::kHopper) {
    return unsupported("q: fp8_e4m3 inputs run on the Hopper kernel only: a compute capability 9.0 device (this one is " +
                       std::to_string(cc_major) + "." + std::to_string(cc_minor) +
                       ") and q, k, v whose rows and strides are multiples of 16 bytes" +
                       (forced ? std::string(", and ") + kPathEnv + "=portable sends every call to the portable kernels"
                               : std::string()));
  }
  const bool want = decisions != nullptr;
  Decisions local;
  local.policy = policy_name(policy);
  if (const auto* ps = std::get_if<PermuteStopParams>(&policy)) {
    SP_RETURN_IF_ERROR(run_permute_stop(shape, *ps, p, path, scratch, stream, want ? &local : nullptr));
    if (want) *decisions = std::move(local);
    return {};
  }
  KeptBits kept;
  const int kept_k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), block_k));

  Selection sel;  // estimate_select's device-side selection, read back for decisions

  Status st = std::visit(
      [&](const auto& pol) -> Status {
        using P = std::decay_t<decltype(pol)>;
        if constexpr (std::is_same_v<P, DenseParams>) {
          p.mode = PolicyMode::kDense;
        } else if constexpr (std::is_same_v<P, BlockSparseParams>) {
          const BlockMask& m = pol.mask;
          p.mode = PolicyMode::kBlockMask;
          if (plan != nullptr && plan->has_mask) {
            p.full_count = plan->full_count;
            p.partial_count = plan->partial_count;
            p.full_start = plan->full_start;
            p.partial_start = plan->partial_start;
            p.full_index = plan->full_index;
            p.partial_index = plan->partial_index;
          } else {
            const CompactMask c = compact_mask(m);
            SP_RETURN_IF_ERROR(scratch.upload(c.full_count, &p.full_count));
            SP_RETURN_IF_ERROR(scratch.upload(c.partial_count, &p.partial_count));
            SP_RETURN_IF_ERROR(scratch.upload(c.full_start, &p.full_start));
            SP_RETURN_IF_ERROR(scratch.upload(c.partial_start, &p.partial_start));
            SP_RETURN_IF_ERROR(scratch.upload(c.full_index, &p.full_index));
            SP_RETURN_IF_ERROR(scratch.upload(c.partial_index, &p.partial_index));
          }
          p.mask_heads = m.heads;
          p.mask_per_kv_head = m.per_kv_head;
          p.mask_q_blocks = m.num_q_blocks;
          p.mask_k_blocks = m.num_k_blocks;
          if (want) local.kept = m;
        } else if constexpr (std::is_same_v<P, ExactGateParams> || std::is_same_v<P, SoftmaxSkipParams>) {
          if constexpr (std::is_same_v<P, ExactGateParams>) {
            p.mode = PolicyMode::kExactGate;
            p.thresholds = static_cast<const float*>(pol.thresholds.data);
            p.thr_head_stride = pol.thresholds.stride[0];
            p.thr_pos_stride = pol.thresholds.stride[1];
            p.thr_positions = static_cast<int>(pol.thresholds.shape[1]);
          } else {
            p.mode = PolicyMode::kSoftmaxSkip;
            p.skip_a = static_cast<float>(pol.a);
          }
          if (want) {
            p.kept_words = bitmap_words(kept_k_blocks);
            kept.words = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_q) *
                         static_cast<std::size_t>(p.num_q_blocks) * static_cast<std::size_t>(p.kept_words);
            SP_RETURN_IF_ERROR(scratch.zeros(kept.words, &kept.dev));
            p.kept_bits = kept.dev;
          }
        } else if constexpr (std::is_same_v<P, EstimateSelectParams>) {
          SP_RETURN_IF_ERROR(launch_selection(shape, p, pol, &scratch, stream, &sel));
          const SelectParams& sp = sel.sp;
          const int units = pol.pack_gqa ? shape.h_kv : shape.h_q;
          p.mode = PolicyMode::kBlockMask;
          p.full_count = sp.full_count;
          p.full_index = sp.full_index;
          p.partial_count = sp.partial_count;
          p.partial_index = sp.partial_index;
          p.mask_heads = units;
          p.mask_per_kv_head = pol.pack_gqa;
          p.mask_q_blocks = sp.num_q_blocks;
          p.mask_k_blocks = sp.num_k_blocks;
          if (pol.mean_correction) {
            p.k_mean = sp.k_mean;
            p.v_mean = sp.v_mean;
            p.corrected_bits = sp.corrected_bits;
            p.mean_blocks = sp.num_k_blocks;
            p.mean_block = pol.block;
            p.corrected_words = sp.corrected_words;
          }
        } else {
          return unsupported(std::string(policy_name(policy)) + ": not implemented on CUDA yet");
        }
        return {};
      },
      policy);
  SP_RETURN_IF_ERROR(st);

  if (p.mode == PolicyMode::kExactGate) {
    GatePasses passes = t_gate_passes == 1 ? GatePasses::kOne : t_gate_passes == 2 ? GatePasses::kTwo : GatePasses::kAuto;
    if (t_gate_passes == 0) SP_RETURN_IF_ERROR(gate_passes_mode(std::getenv(kGatePassesEnv), &passes));
    const GateVariant* gate =
        path == FwdPath::kHopper ? find_gate90(shape.dtype, shape.d) : find_gate(shape.dtype, shape.d);
    const bool two = choose_gate_passes(shape, gate != nullptr, passes);
    if (two) SP_RETURN_IF_ERROR(launch_gate_decisions(shape, path, *gate, &scratch, stream, &p));
    t_last_gate_passes = two ? 2 : 1;
  }
  bool launched = false;
  if (path == FwdPath::kHopper) {
    const bool paged = shape.kv_layout == KvLayout::kPaged;
    const Fwd90Variant* fwd90 = find_fwd90(shape.dtype, shape.d, paged);
    if (fp8) {
      // V transposed for the e4m3 P·V ([batch, h_kv, d, vt_stride] bytes), written by the launch.
      p.vt_stride = geom::ceil_div(geom::max64(shape.max_seq_k(), 1), hopper_block_k()) * hopper_block_k();
      SP_RETURN_IF_ERROR(scratch.alloc(static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_kv) *
                                           static_cast<std::size_t>(shape.d) * static_cast<std::size_t>(p.vt_stride),
                                       &p.v_t));
    }
    p.q_pack = choose_q_pack(shape, p.mode, p.mask_per_kv_head, pack_gqa);
    UploadContext upload_context{&scratch, cache_maps, {}};
    const HostUpload upload{&upload_context, &UploadContext::call};
    const int err = fwd90->launch(p, seqs.data(), paged ? table.data() : nullptr, upload, stream);
    if (err == kUploadRefused) return upload_context.status;
    // cudaErrorNotSupported: the driver cannot encode the tensor maps; nothing was enqueued.
    if (err != cudaErrorNotSupported) {
      SP_RETURN_IF_ERROR(launch_status(err, fwd90->name));
      t_last_fwd_instance = fwd90->name;
      t_last_q_pack = p.q_pack;
      launched = true;
    }
    p.q_pack = 1;  // the portable kernel below, if the Hopper one declined, does not pack
  }
  if (!launched) {
    if (fp8) return unsupported("q: the driver cannot describe these fp8_e4m3 tensors for TMA, and fp8 has no portable kernel");
    const FwdVariant* fwd = find_fwd(shape.dtype, shape.d, gated_mode(p.mode), plain_call(p));
    if (fwd == nullptr) {
      return unsupported(std::string("no compiled portable CUDA kernel for this call (") + support_summary() + ")");
    }
    SP_RETURN_IF_ERROR(launch_status(fwd->launch(p, stream), fwd->name));
    t_last_fwd_instance = fwd->name;
    t_last_q_pack = 1;
  }
  if (!want) return {};

  // Decisions: copy the device-side selections back and convert them to BlockMasks.
  if (kept.dev != nullptr) {
    std::vector<std::uint32_t> bits;
    SP_RETURN_IF_ERROR(scratch.download(kept.dev, kept.words, &bits));
    SP_CUDA_TRY(cudaStreamSynchronize(stream), "cudaStreamSynchronize (decisions)");
    SP_RETURN_IF_ERROR(mask_from_bits(shape, kBlockQ, block_k, false, bits, &local.kept));
  } else if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    SP_RETURN_IF_ERROR(read_selection(shape, *es, sel, &scratch, stream, &local));
  }
  *decisions = std::move(local);
  return {};
}

// Paged K/V copied into contiguous varlen rows from `scratch` (kernel/stage_kv.cuh): *staged
// is `problem` with k and v viewing them, [staging.rows, h_kv, d].
Status stage_kv_rows(const AttentionProblem& problem, const ProblemShape& shape, const KvStaging& staging,
                     const AttentionOutput& output, Scratch* scratch, cudaStream_t stream, AttentionProblem* staged) {
  const ProblemShape to = staged_shape(shape, staging);
  const std::size_t elem = dtype_size(shape.dtype);
  std::uint8_t* rows[2] = {nullptr, nullptr};
  for (std::uint8_t*& r : rows) SP_RETURN_IF_ERROR(scratch->alloc(staging.bytes / 2, &r));
  *staged = problem;
  staged->k = TensorView::contiguous(rows[0], shape.dtype, {staging.rows, shape.h_kv, shape.d}, shape.device);
  staged->v = TensorView::contiguous(rows[1], shape.dtype, {staging.rows, shape.h_kv, shape.d}, shape.device);
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
  }
  SP_RETURN_IF_ERROR(scratch->upload(table, &sp.block_table));
  SP_RETURN_IF_ERROR(scratch->upload(seqs, &sp.seqs));
  sp.table_stride = block_table_stride(shape);
  sp.page_size = shape.page_size;
  sp.batch = shape.batch;
  sp.h_kv = shape.h_kv;
  sp.elem_bytes = static_cast<int>(elem);
  sp.row_chunks = static_cast<int>(static_cast<std::size_t>(shape.d) * elem / 16);
  sp.max_s_k = shape.max_seq_k();
  return launch_status(stage_paged_kv(sp, stream), "stage_kv_sm80");
}

}  // namespace

Status run_cuda(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                const AttentionOutput& output, const RunOptions& options, Decisions* decisions,
                const PlanState* plan) {
  int block_k = 0;
  SP_RETURN_IF_ERROR(check_support(shape, policy, &block_k));
  SP_RETURN_IF_ERROR(check_layout(problem, output));
  DeviceCall call;
  SP_RETURN_IF_ERROR(call.enter(shape.device.index, options.cuda_stream));
  const cudaStream_t stream = call.stream;
  const cudaMemPool_t pool = call.pool;
  // Under CUDA graph capture every device operation becomes a graph node; metadata comes from
  // the cache (Scratch::upload_bytes), and nothing may be read back to the host.
  const bool capturing = call.capturing;
  if (capturing && decisions != nullptr) {
    return unsupported("cuda_stream: is capturing a CUDA graph, so decisions and statistics cannot be read back; "
                       "request none under capture");
  }
  t_last_staged = false;
  // Paged K/V: staged into contiguous rows when plan_kv_staging finds the copy cheaper than
  // reading pages in the kernels, never under capture (a graph would own the buffers' memory).
  KvStaging staging;
  if (shape.kv_layout == KvLayout::kPaged && !capturing && t_kv_staging != KvStagingForTesting::kNever) {
    std::size_t free_bytes = 0, total_bytes = 0;
    SP_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    staging = plan_kv_staging(shape, policy, free_bytes);
    if (t_kv_staging == KvStagingForTesting::kAlways) staging.stage = staging.rows > 0;
  }
  if (!staging.stage) {
    return run_checked(problem, shape, policy, block_k, output, stream, pool, capturing, true, decisions, plan);
  }
  cudaMemPool_t staging_pool = nullptr;
  SP_RETURN_IF_ERROR(pool_for(shape.device.index, PoolKind::kStaging, &staging_pool));
  Scratch buffers(stream, staging_pool, shape.device.index, capturing);  // freed after the call's kernels
  AttentionProblem staged;
  SP_RETURN_IF_ERROR(stage_kv_rows(problem, shape, staging, output, &buffers, stream, &staged));
  SP_RETURN_IF_ERROR(run_checked(staged, staged_shape(shape, staging), policy, block_k, output, stream, pool, capturing,
                                 false, decisions, plan));
  t_last_staged = true;
  return {};
}

// ---------------------------------------------------------------- calibration statistics

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
                              const EstimateSelectParams& base, void* cuda_stream, std::vector<SelectStatistics>* out) {
  SP_RETURN_IF_ERROR(check_select_statistics_support(shape, base));
  StatisticsCall call;
  SP_RETURN_IF_ERROR(call.enter(sample, shape, cuda_stream));
  std::vector<float> ratio;
  SelectParams sp = make_select_statistics_params(sample, shape, base);
  {
    Scratch scratch(call.stream, call.pool, shape.device.index, false);
    SP_RETURN_IF_ERROR(scratch.upload(qk_seq_infos(sample, shape), &sp.seqs));
    const std::size_t means = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(shape.h_kv) *
                              static_cast<std::size_t>(sp.num_k_blocks) * static_cast<std::size_t>(shape.d);
    std::uint16_t* k_mean = nullptr;
    std::uint16_t* v_mean = nullptr;
    SP_RETURN_IF_ERROR(scratch.alloc(means, &k_mean));
    SP_RETURN_IF_ERROR(scratch.alloc(means, &v_mean));
    sp.k_mean = k_mean;
    sp.v_mean = v_mean;
    const int units = base.pack_gqa ? shape.h_kv : shape.h_q;
    const std::size_t cells = static_cast<std::size_t>(shape.batch) * static_cast<std::size_t>(units) *
                              static_cast<std::size_t>(sp.num_q_blocks) * static_cast<std::size_t>(sp.num_k_blocks);
    SP_RETURN_IF_ERROR(scratch.zeros(cells, &sp.energy_ratio));
    const SelectVariant* select = nullptr;
    SP_RETURN_IF_ERROR(find_selector(shape, &select));
    SP_RETURN_IF_ERROR(launch_status(select->launch(sp, call.stream), select->name));
    SP_RETURN_IF_ERROR(scratch.download(sp.energy_ratio, cells, &ratio));
    SP_CUDA_TRY(cudaStreamSynchronize(call.stream), "cudaStreamSynchronize (calibration statistics)");
  }
  *out = select_statistics_from_device(shape, base, sp.num_q_blocks, sp.num_k_blocks, ratio);
  return {};
}

}  // namespace sparseprefill::cuda
