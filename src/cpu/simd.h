// SPDX-License-Identifier: Apache-2.0
// Portable SIMD for the CPU backend: a 16-lane fp32 vector (GCC/Clang vector extension; the
// compiler lowers it to SSE2, AVX2 or AVX-512 per target clone), loads/stores and exp.
// Internal to src/cpu; include only from src/cpu/*.cpp.
#pragma once

#include <cstdint>
#include <cstring>

// The hot loops are compiled once per instruction set and picked at load time (ifunc), so a
// default x86-64 build still runs AVX2/AVX-512 code where the CPU has it. Elsewhere one plain
// version is built.
// Clang checks the ABI of vector values before inlining and rejects 64-byte vectors in code
// built for a wider ISA than its callees, so Clang builds (the fuzzers) get the baseline only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__ELF__)
#define SP_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SP_CPU_CLONES
#endif

// Vector arguments wider than the baseline ISA change the calling convention between target
// clones; every helper below is always inlined, so no such call is ever made.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace sparseprefill::cpu::simd {

constexpr int kLanes = 16;
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef std::int32_t VecI __attribute__((vector_size(kLanes * sizeof(std::int32_t))));

#define SP_CPU_INLINE inline __attribute__((always_inline))

SP_CPU_INLINE VecF splat(float x) { return VecF{} + x; }
SP_CPU_INLINE VecF load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
SP_CPU_INLINE void store(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }
SP_CPU_INLINE float reduce_add(VecF v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
// Lane indices 0 .. kLanes-1.
SP_CPU_INLINE VecI iota() {
  VecI v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// e^x in fp32, lane-wise, within ~2 ulp. Numerics (docs/numerics.md): x < -87.5 gives 0 exactly
// (so exp(-inf) = 0 and masked scores contribute nothing; results below FLT_MIN flush to 0),
// x > 88.5 gives +inf, NaN stays NaN. Cody-Waite reduction x = n·ln2 + f, |f| <= ln2/2, then
// e^f by its Taylor series to degree 7 (truncation error < 3e-9) and 2^n from exponent bits.
SP_CPU_INLINE VecF exp(VecF x) {
  const VecF lo = splat(-87.5f), hi = splat(88.5f);
  VecF xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  xc = xc == xc ? xc : VecF{};  // NaN -> 0 so the integer conversion below stays defined
  const VecF round = splat(12582912.0f);  // 1.5·2^23: adding it rounds to an integer
  const VecF n = (xc * 1.44269504088896341f + round) - round;
  const VecF f = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  VecF p = splat(1.0f / 5040.0f);
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  // n is in [-127, 128]: build 2^n as two halves so neither leaves the normal range.
  const VecI ni = __builtin_convertvector(n, VecI);
  const VecI n1 = ni >> 1, n2 = ni - n1;
  VecF s1, s2;
  const VecI b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  VecF r = p * s1 * s2;
  r = x < lo ? VecF{} : r;
  r = x > hi ? splat(__builtin_inff()) : r;
  return x == x ? r : x;
}

}  // namespace sparseprefill::cpu::simd

#pragma GCC diagnostic pop
