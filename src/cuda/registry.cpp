// SPDX-License-Identifier: Apache-2.0
// Lookup tables over the generated kernel instances (instances/registry.inc). Host-only: the
// instances are reached through extern declarations, never through kernel headers.
#include "cuda/registry.h"

#include <iterator>
#include <sstream>

namespace sparseprefill::cuda {
namespace {

constexpr FwdVariant kFwdVariants[] = {
#define SP_FWD_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#define SP_SELECT_VARIANT(fn, dtype, head_dim)
#define SP_PERMUTE_VARIANT(fn, dtype, head_dim)
#define SP_FWD90_VARIANT(fn, dtype, head_dim, paged)
#define SP_CALIB_VARIANT(fn, dtype, head_dim)
#include "cuda/instances/registry.inc"
#undef SP_FWD_VARIANT
#undef SP_SELECT_VARIANT
#undef SP_PERMUTE_VARIANT
#undef SP_FWD90_VARIANT
#undef SP_CALIB_VARIANT
};

constexpr SelectVariant kSelectVariants[] = {
#define SP_FWD_VARIANT(fn, dtype, head_dim)
#define SP_SELECT_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#define SP_PERMUTE_VARIANT(fn, dtype, head_dim)
#define SP_FWD90_VARIANT(fn, dtype, head_dim, paged)
#define SP_CALIB_VARIANT(fn, dtype, head_dim)
#include "cuda/instances/registry.inc"
#undef SP_FWD_VARIANT
#undef SP_SELECT_VARIANT
#undef SP_PERMUTE_VARIANT
#undef SP_FWD90_VARIANT
#undef SP_CALIB_VARIANT
};

constexpr Fwd90Variant kFwd90Variants[] = {
#define SP_FWD_VARIANT(fn, dtype, head_dim)
#define SP_SELECT_VARIANT(fn, dtype, head_dim)
#define SP_PERMUTE_VARIANT(fn, dtype, head_dim)
#define SP_FWD90_VARIANT(fn, dtype, head_dim, paged) {#fn, DType::dtype, head_dim, paged, &fn},
#define SP_CALIB_VARIANT(fn, dtype, head_dim)
#include "cuda/instances/registry.inc"
#undef SP_FWD_VARIANT
#undef SP_SELECT_VARIANT
#undef SP_PERMUTE_VARIANT
#undef SP_FWD90_VARIANT
#undef SP_CALIB_VARIANT
};

constexpr PermuteVariant kPermuteVariants[] = {
#define SP_FWD_VARIANT(fn, dtype, head_dim)
#define SP_SELECT_VARIANT(fn, dtype, head_dim)
#define SP_PERMUTE_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#define SP_FWD90_VARIANT(fn, dtype, head_dim, paged)
#define SP_CALIB_VARIANT(fn, dtype, head_dim)
#include "cuda/instances/registry.inc"
#undef SP_FWD_VARIANT
#undef SP_SELECT_VARIANT
#undef SP_PERMUTE_VARIANT
#undef SP_FWD90_VARIANT
#undef SP_CALIB_VARIANT
};

constexpr CalibVariant kCalibVariants[] = {
#define SP_FWD_VARIANT(fn, dtype, head_dim)
#define SP_SELECT_VARIANT(fn, dtype, head_dim)
#define SP_PERMUTE_VARIANT(fn, dtype, head_dim)
#define SP_FWD90_VARIANT(fn, dtype, head_dim, paged)
#define SP_CALIB_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#include "cuda/instances/registry.inc"
#undef SP_FWD_VARIANT
#undef SP_SELECT_VARIANT
#undef SP_PERMUTE_VARIANT
#undef SP_FWD90_VARIANT
#undef SP_CALIB_VARIANT
};

}  // namespace

const FwdVariant* find_fwd(DType dtype, int head_dim) {
  for (const FwdVariant& v : kFwdVariants) {
    if (v.dtype == dtype && v.head_dim == head_dim) return &v;
  }
  return nullptr;
}

const SelectVariant* find_select(DType dtype, int head_dim) {
  for (const SelectVariant& v : kSelectVariants) {
    if (v.dtype == dtype && v.head_dim == head_dim) return &v;
  }
  return nullptr;
}

const PermuteVariant* find_permute(DType dtype, int head_dim) {
  for (const PermuteVariant& v : kPermuteVariants) {
    if (v.dtype == dtype && v.head_dim == head_dim) return &v;
  }
  return nullptr;
}

const Fwd90Variant* find_fwd90(DType dtype, int head_dim, bool paged) {
  for (const Fwd90Variant& v : kFwd90Variants) {
    if (v.dtype == dtype && v.head_dim == head_dim && v.paged == paged) return &v;
  }
  return nullptr;
}

const CalibVariant* find_calib(DType dtype, int head_dim) {
  for (const CalibVariant& v : kCalibVariants) {
    if (v.dtype == dtype && v.head_dim == head_dim) return &v;
  }
  return nullptr;
}

std::string compiled_fwd_summary() {
  std::ostringstream os;
  for (std::size_t i = 0; i < std::size(kFwdVariants); ++i) {
    const FwdVariant& v = kFwdVariants[i];
    os << (i ? ", " : "") << dtype_name(v.dtype) << " d=" << v.head_dim;
  }
  return os.str();
}

std::string compiled_fwd90_summary() {
  std::ostringstream os;
  for (std::size_t i = 0; i < std::size(kFwd90Variants); ++i) {
    const Fwd90Variant& v = kFwd90Variants[i];
    os << (i ? ", " : "") << dtype_name(v.dtype) << " d=" << v.head_dim << (v.paged ? " paged" : "");
  }
  return os.str();
}

std::string compiled_instances() {
  std::ostringstream os;
  for (const FwdVariant& v : kFwdVariants) os << v.name << "\n";
  for (const SelectVariant& v : kSelectVariants) os << v.name << "\n";
  for (const PermuteVariant& v : kPermuteVariants) os << v.name << "\n";
  for (const Fwd90Variant& v : kFwd90Variants) os << v.name << "\n";
  for (const CalibVariant& v : kCalibVariants) os << v.name << "\n";
  return os.str();
}

}  // namespace sparseprefill::cuda
