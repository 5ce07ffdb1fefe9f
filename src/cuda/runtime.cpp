// SPDX-License-Identifier: Apache-2.0
// runtime.h: errors, device capabilities, overrides, pools, the metadata cache and scratch.
#include "cuda/runtime.h"

#include "core/mask_faults.h"

#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace sparseprefill::cuda {

Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return {};
  return {StatusCode::kCudaError, what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"};
}

Status launch_status(int err, const char* name) {
  return cuda_status(static_cast<cudaError_t>(err), std::string("launching ") + name);
}

Status device_caps(int device, DeviceCaps* out) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceCaps> known;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = known.find(device);
    if (it != known.end()) {
      *out = it->second;
      return {};
    }
  }
  DeviceCaps caps;
  int l2 = 0;
  SP_CUDA_TRY(cudaDeviceGetAttribute(&caps.cc_major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  SP_CUDA_TRY(cudaDeviceGetAttribute(&caps.cc_minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  SP_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute");
  SP_CUDA_TRY(cudaDeviceGetAttribute(&caps.sm_count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  SP_CUDA_TRY(cudaDeviceGetAttribute(&caps.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
              "cudaDeviceGetAttribute");
  caps.l2_bytes = l2;
  std::lock_guard<std::mutex> lock(mutex);
  known.emplace(device, caps);
  *out = caps;
  return {};
}

Status environment_overrides(ExecutionOverrides* out) {
  static const auto parsed = [] {
    std::pair<Status, ExecutionOverrides> r;
    OverrideEnv env;
    env.cuda_path = std::getenv(kPathEnv);
    env.pack_gqa = std::getenv(kPackGqaEnv);
    env.kv_staging = std::getenv(kKvStagingEnv);
    env.gate_passes = std::getenv(kGatePassesEnv);
    r.first = parse_overrides(env, &r.second);
    return r;
  }();
  SP_RETURN_IF_ERROR(Status(parsed.first));
  *out = parsed.second;
  return {};
}

std::size_t metadata_cache_cap() {
  static const std::size_t cap = [] {
    constexpr auto kDefault = static_cast<std::size_t>(tuning::kMetadataCacheBytes);
    const char* v = std::getenv("SPARSEPREFILL_CUDA_CACHE_BYTES");
    if (v == nullptr || *v == '\0') return kDefault;
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    return end != nullptr && *end == '\0' ? static_cast<std::size_t>(n) : kDefault;
  }();
  return cap;
}

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
    std::uint64_t keep = kind == PoolKind::kScratch ? kScratchKeepBytes : 0;
    SP_CUDA_TRY(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
  }
  *pool = p;
  return {};
}

Status DeviceGuard::enter(int device) {
  SP_CUDA_TRY(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    SP_CUDA_TRY(cudaSetDevice(device), "cudaSetDevice");
    active_ = true;
  }
  return {};
}

DeviceGuard::~DeviceGuard() {
  if (active_) cudaSetDevice(previous_);
}

// ---------------------------------------------------------------- metadata cache

namespace {

// FNV-1a over the bytes: the cache's hash (entries are at most 64 KiB; equal hashes are
// confirmed by comparing the bytes).
std::uint64_t hash_bytes(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h ^ bytes;
}

struct Entry {
  std::string bytes;  // the host copy: the key
  void* device = nullptr;
  bool pinned = false;  // read by a captured call: never freed
};

struct PerDevice {
  std::list<Entry> lru;  // most recently used first
  std::unordered_multimap<std::uint64_t, std::list<Entry>::iterator> index;
  std::size_t total = 0;
};

std::mutex g_cache_mutex;
std::unordered_map<int, PerDevice> g_cache;

// Frees least recently used unpinned entries until `incoming` more bytes fit under the cap.
// cudaFree waits for the device's work, so a kernel still reading an entry finishes first.
void evict_for(PerDevice& d, std::size_t incoming) {
  const std::size_t cap = metadata_cache_cap();
  auto it = d.lru.end();
  while (d.total + incoming > cap && it != d.lru.begin()) {
    --it;
    if (it->pinned) continue;
    const std::uint64_t h = hash_bytes(it->bytes.data(), it->bytes.size());
    auto range = d.index.equal_range(h);
    for (auto r = range.first; r != range.second; ++r) {
      if (r->second == it) {
        d.index.erase(r);
        break;
      }
    }
    cudaFree(it->device);
    d.total -= it->bytes.size();
    it = d.lru.erase(it);
  }
}

}  // namespace

Status MetadataCache::find_or_add(int device, const void* host, std::size_t bytes, bool capturing, cudaStream_t stream,
                                  const void** out) {
  *out = nullptr;
  if (bytes == 0 || bytes > kMaxEntryBytes) return {};
  const std::uint64_t h = hash_bytes(host, bytes);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  PerDevice& d = g_cache[device];
  auto range = d.index.equal_range(h);
  for (auto r = range.first; r != range.second; ++r) {
    Entry& e = *r->second;
    if (e.bytes.size() == bytes && std::memcmp(e.bytes.data(), host, bytes) == 0) {
      e.pinned = e.pinned || capturing;
      d.lru.splice(d.lru.begin(), d.lru, r->second);
      *out = e.device;
      return {};
    }
  }
  if (capturing) return {};
  evict_for(d, bytes);
  if (d.total + bytes > metadata_cache_cap()) return {};  // the pinned entries fill it
  void* ptr = nullptr;
  SP_CUDA_TRY(cudaMalloc(&ptr, bytes), "cudaMalloc (metadata cache)");
  // Complete before the entry is published: a call on another stream may use it at once.
  cudaError_t err = cudaMemcpyAsync(ptr, host, bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    return cuda_status(err, "cudaMemcpyAsync (metadata cache)");
  }
  d.lru.push_front(Entry{std::string(static_cast<const char*>(host), bytes), ptr, false});
  d.index.emplace(h, d.lru.begin());
  d.total += bytes;
  *out = ptr;
  return {};
}

std::size_t MetadataCache::bytes_on(int device) {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  const auto it = g_cache.find(device);
  return it == g_cache.end() ? 0 : it->second.total;
}

MetadataCache& metadata_cache() {
  static MetadataCache cache;
  return cache;
}

// ---------------------------------------------------------------- mask faults

namespace {
std::mutex g_fault_mutex;
std::unordered_map<int, rules::MaskFaultRecord*> g_faults;
}  // namespace

Status mask_fault_record(int device, bool capturing, rules::MaskFaultRecord** out) {
  std::lock_guard<std::mutex> lock(g_fault_mutex);
  rules::MaskFaultRecord*& r = g_faults[device];
  if (r == nullptr) {
    if (capturing) {
      return unsupported("cuda_stream: is capturing a CUDA graph, and this device has not yet run a call with a "
                         "device block mask; run one (or make its plan) outside capture first");
    }
    SP_CUDA_TRY(cudaMalloc(&r, sizeof(rules::MaskFaultRecord)), "cudaMalloc (mask fault record)");
    SP_CUDA_TRY(cudaMemset(r, 0, sizeof(rules::MaskFaultRecord)), "cudaMemset (mask fault record)");
  }
  *out = r;
  return {};
}

Status report_mask_faults(int device) {
  rules::MaskFaultRecord* dev = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_fault_mutex);
    const auto it = g_faults.find(device);
    if (it == g_faults.end()) return {};
    dev = it->second;
  }
  DeviceGuard guard;
  SP_RETURN_IF_ERROR(guard.enter(device));
  rules::MaskFaultRecord host{};
  SP_CUDA_TRY(cudaMemcpy(&host, dev, sizeof(host), cudaMemcpyDeviceToHost), "cudaMemcpy (mask fault record)");
  if (host.fault == rules::kMaskOk) return {};
  SP_CUDA_TRY(cudaMemset(dev, 0, sizeof(rules::MaskFaultRecord)), "cudaMemset (mask fault record)");
  return invalid_argument(detail::mask_fault_message(host) + " (found on the device by an earlier call, which cut the row there)");
}

// ---------------------------------------------------------------- scratch

Scratch::~Scratch() {
  for (void* ptr : owned_) cudaFreeAsync(ptr, stream_);
}

Status Scratch::alloc_bytes(std::size_t bytes, void** out) {
  *out = nullptr;
  if (bytes == 0) return {};
  SP_CUDA_TRY(cudaMallocFromPoolAsync(out, bytes, pool_, stream_), "cudaMallocFromPoolAsync");
  owned_.push_back(*out);
  bytes_ += bytes;
  return {};
}

Status Scratch::upload_bytes(const void* host, std::size_t bytes, const void** out, bool cacheable) {
  *out = nullptr;
  if (bytes == 0) return {};
  if (cacheable) SP_RETURN_IF_ERROR(metadata_cache().find_or_add(device_, host, bytes, capturing_, stream_, out));
  if (*out != nullptr) return {};
  if (capturing_) {
    return unsupported("cuda_stream: is capturing a CUDA graph, and this call's metadata (" + std::to_string(bytes) +
                       " bytes: sequence table, block table, tensor maps, block mask or exact_gate's sums per sequence) "
                       "was not uploaded by an earlier call; run the same call once outside capture first (block "
                       "masks over 64 KiB: run through a plan, make_plan)");
  }
  std::uint8_t* dev = nullptr;
  SP_RETURN_IF_ERROR(alloc(bytes + 64, &dev));
  dev += (64 - reinterpret_cast<std::uintptr_t>(dev) % 64) % 64;
  SP_CUDA_TRY(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (upload)");
  *out = dev;
  return {};
}

int UploadContext::call(void* context, const void* host, std::size_t bytes, const void** device) {
  auto* self = static_cast<UploadContext*>(context);
  Status st = self->scratch->upload_bytes(host, bytes, device, self->cacheable);
  const int result = st.ok() ? 0 : kUploadRefused;
  std::swap(self->status, st);  // (nvcc flags an assignment of a [[nodiscard]] type as discarded)
  return result;
}

Status DeviceCall::enter(int device, void* cuda_stream) {
  SP_RETURN_IF_ERROR(guard.enter(device));
  SP_RETURN_IF_ERROR(pool_for(device, PoolKind::kScratch, &pool));
  stream = static_cast<cudaStream_t>(cuda_stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SP_CUDA_TRY(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  capturing = capture != cudaStreamCaptureStatusNone;
  return {};
}

}  // namespace sparseprefill::cuda
