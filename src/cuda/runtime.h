// SPDX-License-Identifier: Apache-2.0
// The CUDA runtime as the backend's host files use it: errors, the call's device and stream,
// device capabilities and environment overrides read once, memory pools, the bounded cache of
// small metadata and a call's stream-ordered scratch. Host code (includes the CUDA runtime, no
// kernel header).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/rules/block_sparse.h"
#include "cuda/execution_plan.h"
#include "cuda/kernel/tuning.h"
#include "sparseprefill/types.h"

namespace sparseprefill::cuda {

Status cuda_status(cudaError_t err, const std::string& what);
#define SP_CUDA_TRY(expr, what) SP_RETURN_IF_ERROR(::sparseprefill::cuda::cuda_status((expr), (what)))

// A launch function's cudaError_t value as a Status naming the instance.
Status launch_status(int err, const char* name);

// The device's capabilities, read on its first use and kept (a device's do not change).
Status device_caps(int device, DeviceCaps* out);

// The environment's overrides (OverrideEnv), parsed on the first call and kept; an invalid
// variable is reported by every call.
Status environment_overrides(ExecutionOverrides* out);

// The metadata cache's byte cap per device: SPARSEPREFILL_CUDA_CACHE_BYTES (a byte count),
// default tuning::kMetadataCacheBytes; read once.
std::size_t metadata_cache_cap();

// Two memory pools per device. Per-call scratch comes from one that keeps up to
// kScratchKeepBytes (tuning.h) of freed memory for the next calls (so steady calls cost no cudaMalloc)
// and returns the rest to the device at the next synchronisation. Staged paged K/V (up to a
// layer's whole K/V) comes from one that keeps nothing, so a long prefill does not hold it.
enum class PoolKind { kScratch, kStaging };
constexpr std::uint64_t kScratchKeepBytes = tuning::kScratchKeepBytes;
Status pool_for(int device, PoolKind kind, cudaMemPool_t* pool);

// Makes `device` current and restores the caller's device when it dies.
class DeviceGuard {
 public:
  Status enter(int device);
  ~DeviceGuard();

 private:
  int previous_ = 0;
  bool active_ = false;
};

// Small metadata of calls (sequence tables, compact block tables, tensor maps of batches too
// large for kernel parameters, exact_gate's per-sequence sums, short block masks) kept in
// device memory keyed by its bytes. A call whose metadata repeats an earlier call's (as every
// layer and step of a model repeats its shapes) copies nothing, and a call under CUDA graph
// capture reads memory that outlives the graph. Bounded: past metadata_cache_cap() bytes on a
// device, the least recently used entries are freed, except those a captured call read, which
// stay for the life of the process (a graph may replay them at any time). Metadata not seen
// before cannot be added during capture (that would record a copy from transient host memory).
class MetadataCache {
 public:
  static constexpr std::size_t kMaxEntryBytes = std::size_t{64} << 10;

  // *out = the cached copy of host[0, bytes), added when allowed; nullptr when the entry is too
  // large, or new while the stream is capturing (the caller decides what then).
  Status find_or_add(int device, const void* host, std::size_t bytes, bool capturing, cudaStream_t stream,
                     const void** out);

  // Bytes held on `device` (entries and pinned ones), for tests.
  std::size_t bytes_on(int device);
};
MetadataCache& metadata_cache();

// Stream-ordered scratch of one call: allocated from the device's scratch pool on the call's
// stream and freed on it when the Scratch dies (the frees are ordered after the kernels).
// Under CUDA graph capture these become the graph's allocation and free nodes.
class Scratch {
 public:
  Scratch(cudaStream_t stream, cudaMemPool_t pool, int device, bool capturing)
      : stream_(stream), pool_(pool), device_(device), capturing_(capturing) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();

  template <class T>
  Status alloc(std::size_t count, T** out) {
    void* ptr = nullptr;
    SP_RETURN_IF_ERROR(alloc_bytes(count * sizeof(T), &ptr));
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
  Status upload_bytes(const void* host, std::size_t bytes, const void** out, bool cacheable = true);
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

  std::size_t bytes() const { return bytes_; }  // allocated so far
  bool capturing() const { return capturing_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

 private:
  Status alloc_bytes(std::size_t bytes, void** out);

  cudaStream_t stream_;
  cudaMemPool_t pool_;
  int device_;
  bool capturing_;
  std::size_t bytes_ = 0;
  std::vector<void*> owned_;
};

// The device's record of the first offence its block mask checks found (kernel/mask_check.cuh),
// in device memory made on first use (refused while `capturing`: make a plan, or run once,
// outside capture first). report_mask_faults reads it (synchronising the device) and returns
// the offence as kInvalidArgument, clearing it.
Status mask_fault_record(int device, bool capturing, rules::MaskFaultRecord** out);
Status report_mask_faults(int device);

// The HostUpload the Hopper instances call for their tensor maps of large batches: through
// `scratch` (cached when `cacheable`); a refusal's Status is kept here and the launch returns
// kUploadRefused.
struct UploadContext {
  Scratch* scratch;
  bool cacheable;
  Status status;
  static int call(void* context, const void* host, std::size_t bytes, const void** device);
};

// What every call that launches work sets up: its device made current (restored when this
// dies), the device's scratch pool, the caller's stream and whether it is capturing a graph.
struct DeviceCall {
  DeviceGuard guard;
  cudaMemPool_t pool = nullptr;
  cudaStream_t stream = nullptr;
  bool capturing = false;

  Status enter(int device, void* cuda_stream);
};

}  // namespace sparseprefill::cuda
