// SPDX-License-Identifier: Apache-2.0
// Vocabulary types: dtype helpers, TensorView, HostTensor, Status and the bf16/fp16 rounding
// every host path uses.
#include "sparseprefill/types.h"

#include <cmath>
#include <cstring>
#include <sstream>

namespace sparseprefill {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16: return 2;
    case DType::kFP32:
    case DType::kInt32: return 4;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kInt32: return "int32";
  }
  return "?";
}

std::int64_t TensorView::numel() const {
  if (rank == 0) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<std::int64_t>& shape,
                                  Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = static_cast<int>(shape.size());
  std::int64_t s = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[static_cast<std::size_t>(i)];
    t.stride[i] = s;
    s *= t.shape[i];
  }
  return t;
}

TensorView TensorView::contiguous(void* data, DType dtype,
                                  std::initializer_list<std::int64_t> shape, Device device) {
  return contiguous(data, dtype, std::vector<std::int64_t>(shape), device);
}

std::string describe(const TensorView& t) {
  if (!t.defined()) return "(undefined)";
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < t.rank; ++i) os << (i ? ", " : "") << t.shape[i];
  os << "] " << dtype_name(t.dtype) << ' '
     << (t.device.kind == DeviceKind::kCPU ? "cpu" : "cuda:" + std::to_string(t.device.index));
  return os.str();
}

HostTensor::HostTensor(DType dtype, std::vector<std::int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  bytes_.assign(static_cast<std::size_t>(numel()) * dtype_size(dtype_), 0);
}

std::int64_t HostTensor::numel() const {
  std::int64_t n = 1;
  for (std::int64_t s : shape_) n *= s;
  return n;
}

TensorView HostTensor::view() const {
  // A view is non-const by design (outputs are written through views); HostTensor owns the
  // bytes, so handing out a mutable pointer from a const tensor is the caller's contract.
  return TensorView::contiguous(const_cast<unsigned char*>(bytes_.data()), dtype_, shape_);
}

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kIoError: return "I/O error";
    case StatusCode::kCorruptData: return "corrupt data";
    case StatusCode::kCudaError: return "CUDA error";
    case StatusCode::kInternal: return "internal error";
  }
  return "?";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

namespace {
std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
}  // namespace

float bf16_to_float(std::uint16_t bits) { return bits_float(static_cast<std::uint32_t>(bits) << 16); }

std::uint16_t float_to_bf16(float x) {
  std::uint32_t u = float_bits(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // keep NaN quiet
  // Round to nearest even on the 16 dropped bits.
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal: value = mant · 2^-24, exact in fp32.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

std::uint16_t float_to_fp16(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(x)) return static_cast<std::uint16_t>(sign | 0x7E00u);
  const float a = std::fabs(x);
  if (a >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (a < 6.103515625e-05f) {
    // Subnormal range: quantise to multiples of 2^-24 with round-to-nearest-even.
    const float q = a * 16777216.0f;  // exact scaling by 2^24
    const float r = std::nearbyint(q);  // default rounding mode: nearest even
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(r));
  }
  std::uint32_t v = float_bits(a);
  const std::uint32_t exp = ((v >> 23) & 0xFFu) - 112u;
  std::uint32_t mant = v & 0x7FFFFFu;
  std::uint32_t h = (exp << 10) | (mant >> 13);
  const std::uint32_t rest = mant & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // nearest even; may carry into exp
  return static_cast<std::uint16_t>(sign | h);
}

float round_to(DType dtype, float x) {
  switch (dtype) {
    case DType::kBF16: return bf16_to_float(float_to_bf16(x));
    case DType::kFP16: return fp16_to_float(float_to_fp16(x));
    default: return x;
  }
}

}  // namespace sparseprefill
