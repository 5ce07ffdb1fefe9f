// SPDX-License-Identifier: Apache-2.0
// Vocabulary types: dtype helpers, TensorView, HostTensor, Status and the bf16/fp16 rounding
// every host path uses.
#include "sparseprefill/types.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace sparseprefill {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFP8E4M3: return 1;
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
    case DType::kFP8E4M3: return "fp8_e4m3";
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

float e4m3_to_float(std::uint8_t bits) {
  const bool negative = (bits & 0x80u) != 0;
  const int exp = (bits >> 3) & 0xF;
  const int mant = bits & 0x7;
  float v = 0.0f;
  if (exp == 0xF && mant == 0x7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant · 2^-9
  } else {
    v = std::ldexp(static_cast<float>(8 + mant), exp - 10);  // 1.mant · 2^(exp - 7)
  }
  return negative ? -v : v;
}

std::uint8_t float_to_e4m3(float x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80u : 0x00u;
  if (std::isnan(x)) return static_cast<std::uint8_t>(sign | 0x7Fu);
  const float a = std::fabs(x);
  // Steps are 2^-9 below 2^-6 (subnormals and the first binade share them) and 2^(e - 3) in the
  // binade [2^e, 2^(e+1)); a / step is exact, and nearbyint rounds it to nearest even.
  int e = 0;
  std::frexp(a, &e);  // a = f · 2^e, f in [0.5, 1): the binade [2^(e - 1), 2^e)
  const int step_exp = a < 0.015625f ? -9 : e - 4;
  const float q = std::nearbyint(std::ldexp(a, -step_exp));
  const float r = std::ldexp(q, step_exp);
  if (r > 448.0f) return static_cast<std::uint8_t>(sign | 0x7Fu);
  if (r < 0.015625f) return static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(q));  // subnormal or zero
  int re = 0;
  const float f = std::frexp(r, &re);  // r = f · 2^re, rounding may have carried into the next binade
  const int mant = static_cast<int>(std::ldexp(f, 4)) - 8;
  return static_cast<std::uint8_t>(sign | ((re - 1 + 7) << 3) | mant);
}

float round_to(DType dtype, float x) {
  switch (dtype) {
    case DType::kBF16: return bf16_to_float(float_to_bf16(x));
    case DType::kFP16: return fp16_to_float(float_to_fp16(x));
    case DType::kFP8E4M3: return e4m3_to_float(float_to_e4m3(x));
    default: return x;
  }
}

}  // namespace sparseprefill
