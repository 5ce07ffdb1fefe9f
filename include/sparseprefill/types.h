// SPDX-License-Identifier: Apache-2.0
// Public, host-only vocabulary types: dtypes, devices, non-owning tensor views, an owning host
// tensor, and Status. Compiles with plain g++; no CUDA or framework headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace sparseprefill {

// kFP8E4M3: OCP FP8 E4M3 ("e4m3fn", torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3
// mantissa bits; no infinities, NaN = S.1111.111, largest finite ±448. An input dtype only
// (with per-(batch, kv head) descales: AttentionProblem), never an output.
enum class DType : std::uint8_t { kBF16, kFP16, kFP32, kInt32, kFP8E4M3 };

// Bytes per element; 0 never happens for a valid enum value.
std::size_t dtype_size(DType dtype);
// "bf16", "fp16", "fp32", "int32", "fp8_e4m3".
const char* dtype_name(DType dtype);

enum class DeviceKind : std::uint8_t { kCPU, kCUDA };

struct Device {
  DeviceKind kind = DeviceKind::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

constexpr int kMaxRank = 4;

// A non-owning view: pointer, shape and strides (in elements), dtype and device. An undefined
// view (data == nullptr and rank == 0) stands for an absent optional argument.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFP32;
  Device device{};
  int rank = 0;
  std::int64_t shape[kMaxRank] = {};
  std::int64_t stride[kMaxRank] = {};

  bool defined() const { return rank > 0; }
  std::int64_t numel() const;
  bool is_contiguous() const;
  // A view of contiguous (row-major) memory.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = {});
  static TensorView contiguous(void* data, DType dtype, const std::vector<std::int64_t>& shape,
                               Device device = {});
};

// "[2, 8192, 8, 128] bf16 cpu" — used in error messages.
std::string describe(const TensorView& t);

// An owning, contiguous host tensor (CLI, tests, calibration). Zero-filled on construction;
// callers fill it before use.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape);
  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const;
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  std::size_t nbytes() const { return bytes_.size(); }
  TensorView view() const;  // the view aliases this tensor's storage
  template <class T> T* as() { return reinterpret_cast<T*>(bytes_.data()); }
  template <class T> const T* as() const { return reinterpret_cast<const T*>(bytes_.data()); }

 private:
  DType dtype_ = DType::kFP32;
  std::vector<std::int64_t> shape_;
  std::vector<unsigned char> bytes_;
};

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,  // a caller's argument is malformed; the message names it
  kUnsupported,      // well-formed, but no backend implements this combination
  kIoError,          // a file could not be opened, read or written
  kCorruptData,      // a file's contents are malformed, truncated or mismatched
  kCudaError,        // a CUDA runtime call failed
  kInternal,         // a broken invariant inside the library
};

const char* status_code_name(StatusCode code);

// Every fallible call returns a Status. Messages name the argument and what was expected,
// e.g. "k: expected shape [1, 4096, 8, 128], got [1, 4096, 8, 64]".
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok_status() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: k: expected ..."
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status corrupt_data(std::string m) { return {StatusCode::kCorruptData, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }

// Propagates a non-ok Status to the caller.
#define SP_RETURN_IF_ERROR(expr)                        \
  do {                                                  \
    ::sparseprefill::Status sp_status_ = (expr);        \
    if (!sp_status_.ok()) return sp_status_;            \
  } while (0)

// bf16/fp16 <-> fp32 conversions used by every host path (round to nearest even; NaN stays NaN).
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float x);
float fp16_to_float(std::uint16_t bits);
std::uint16_t float_to_fp16(float x);
// FP8 E4M3 (DType::kFP8E4M3) <-> fp32: decoding is exact; encoding rounds to nearest even and
// turns NaN and every magnitude that rounds above 448 into NaN (the format has no infinity).
float e4m3_to_float(std::uint8_t bits);
std::uint8_t float_to_e4m3(float x);
// Rounds x to the precision of dtype (identity for fp32).
float round_to(DType dtype, float x);

}  // namespace sparseprefill
