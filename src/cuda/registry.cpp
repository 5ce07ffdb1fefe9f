// SPDX-License-Identifier: Apache-2.0
// Lookup tables over the generated kernel instances (instances/registry.inc). Host-only: the
// instances are reached through extern declarations, never through kernel headers.
#include "cuda/registry.h"

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <sstream>
#include <vector>

namespace sparseprefill::cuda {
namespace {

// Each table takes its kind's lines of registry.inc (which leaves the other kinds empty).
constexpr FwdVariant kFwdVariants[] = {
#define SP_FWD_VARIANT(fn, dtype, head_dim, head_dim_v, gated, plain) \
  {#fn, DType::dtype, head_dim, head_dim_v, gated, plain, &fn, &fn##_smem_bytes},
#include "cuda/instances/registry.inc"
};

constexpr SelectVariant kSelectVariants[] = {
#define SP_SELECT_VARIANT(fn, dtype, head_dim, head_dim_v) \
  {#fn, DType::dtype, head_dim, head_dim_v, &fn, &fn##_smem_bytes},
#include "cuda/instances/registry.inc"
};

constexpr SelectVariant kSelect90Variants[] = {
#define SP_SELECT90_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, head_dim, &fn, &fn##_smem_bytes},
#include "cuda/instances/registry.inc"
};

constexpr Fwd90Variant kFwd90Variants[] = {
#define SP_FWD90_VARIANT(fn, dtype, head_dim, head_dim_v, paged) {#fn, DType::dtype, head_dim, head_dim_v, paged, &fn},
#include "cuda/instances/registry.inc"
};

constexpr PermuteVariant kPermuteVariants[] = {
#define SP_PERMUTE_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#include "cuda/instances/registry.inc"
};

constexpr Permute90Variant kPermute90Variants[] = {
#define SP_PERMUTE90_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#include "cuda/instances/registry.inc"
};

constexpr CalibVariant kCalibVariants[] = {
#define SP_CALIB_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#include "cuda/instances/registry.inc"
};

constexpr GateVariant kGateVariants[] = {
#define SP_GATE_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#include "cuda/instances/registry.inc"
};

constexpr GateVariant kGate90Variants[] = {
#define SP_GATE90_VARIANT(fn, dtype, head_dim) {#fn, DType::dtype, head_dim, &fn},
#include "cuda/instances/registry.inc"
};

// The first entry of `table` that `match` accepts, or nullptr.
template <class V, std::size_t N, class Match>
const V* find_in(const V (&table)[N], const Match& match) {
  for (const V& v : table) {
    if (match(v)) return &v;
  }
  return nullptr;
}

// "a", "a and b", "a, b and c": a list in a message.
std::string join_and(const std::vector<std::string>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) out += (i == 0 ? "" : i + 1 == items.size() ? " and " : ", ") + items[i];
  return out;
}

}  // namespace

const FwdVariant* find_fwd(DType dtype, int head_dim, int head_dim_v, bool gated, bool plain) {
  return find_in(kFwdVariants, [&](const FwdVariant& v) {
    return v.dtype == dtype && v.head_dim == head_dim && v.head_dim_v == head_dim_v && v.gated == gated &&
           v.plain == plain;
  });
}

const SelectVariant* find_select(DType dtype, int head_dim, int head_dim_v) {
  return find_in(kSelectVariants, [&](const SelectVariant& v) {
    return v.dtype == dtype && v.head_dim == head_dim && v.head_dim_v == head_dim_v;
  });
}

const SelectVariant* find_select90(DType dtype, int head_dim) {
  return find_in(kSelect90Variants, [&](const SelectVariant& v) { return v.dtype == dtype && v.head_dim == head_dim; });
}

const PermuteVariant* find_permute(DType dtype, int head_dim) {
  return find_in(kPermuteVariants, [&](const PermuteVariant& v) { return v.dtype == dtype && v.head_dim == head_dim; });
}

const Permute90Variant* find_permute90(DType dtype, int head_dim) {
  return find_in(kPermute90Variants,
                 [&](const Permute90Variant& v) { return v.dtype == dtype && v.head_dim == head_dim; });
}

const Fwd90Variant* find_fwd90(DType dtype, int head_dim, int head_dim_v, bool paged) {
  return find_in(kFwd90Variants, [&](const Fwd90Variant& v) {
    return v.dtype == dtype && v.head_dim == head_dim && v.head_dim_v == head_dim_v && v.paged == paged;
  });
}

const CalibVariant* find_calib(DType dtype, int head_dim) {
  return find_in(kCalibVariants, [&](const CalibVariant& v) { return v.dtype == dtype && v.head_dim == head_dim; });
}

const GateVariant* find_gate(DType dtype, int head_dim) {
  return find_in(kGateVariants, [&](const GateVariant& v) { return v.dtype == dtype && v.head_dim == head_dim; });
}

const GateVariant* find_gate90(DType dtype, int head_dim) {
  return find_in(kGate90Variants, [&](const GateVariant& v) { return v.dtype == dtype && v.head_dim == head_dim; });
}

CompiledPolicies compiled_policies(DType dtype, int head_dim, int head_dim_v) {
  CompiledPolicies c;
  c.gates = find_fwd(dtype, head_dim, head_dim_v, true, false) != nullptr;
  c.select = find_select(dtype, head_dim, head_dim_v) != nullptr;
  c.permute = head_dim_v == head_dim && find_permute(dtype, head_dim) != nullptr;
  return c;
}

std::string CompiledPolicies::describe() const {
  if (all()) return "every policy";
  std::vector<std::string> names = {"dense", "block_sparse"};
  if (gates) names.insert(names.end(), {"exact_gate", "softmax_skip"});
  if (select) names.emplace_back("estimate_select");
  if (permute) names.emplace_back("permute_stop");
  return join_and(names);
}

std::string compiled_fwd_summary() {
  std::ostringstream os;
  for (std::size_t i = 0; i < std::size(kFwdVariants); ++i) {
    const FwdVariant& v = kFwdVariants[i];
    if (!v.plain) continue;  // every (dtype, head_dim) has a plain instance
    os << (i ? ", " : "") << dtype_name(v.dtype) << " d=" << v.head_dim;
    if (v.head_dim_v != v.head_dim) os << " d_v=" << v.head_dim_v;
    const CompiledPolicies policies = compiled_policies(v.dtype, v.head_dim, v.head_dim_v);
    if (!policies.all()) os << " (" << policies.describe() << ")";
  }
  return os.str();
}

std::string compiled_fwd90_summary() {
  std::ostringstream os;
  for (std::size_t i = 0; i < std::size(kFwd90Variants); ++i) {
    const Fwd90Variant& v = kFwd90Variants[i];
    os << (i ? ", " : "") << dtype_name(v.dtype) << " d=" << v.head_dim;
    if (v.head_dim_v != v.head_dim) os << " d_v=" << v.head_dim_v;
    os << (v.paged ? " paged" : "");
  }
  return os.str();
}

namespace {

// The distinct head dims of `dtype`'s variants in `table`, in table order, as a list for messages.
template <class V, std::size_t N>
std::string head_dims_in(const V (&table)[N], DType dtype) {
  std::vector<std::string> dims;
  for (const V& v : table) {
    const std::string d = std::to_string(v.head_dim);
    if (v.dtype == dtype && std::find(dims.begin(), dims.end(), d) == dims.end()) dims.push_back(d);
  }
  return join_and(dims);
}

}  // namespace

std::string fwd90_head_dims(DType dtype) { return head_dims_in(kFwd90Variants, dtype); }

std::string select90_head_dims(DType dtype) { return head_dims_in(kSelect90Variants, dtype); }

std::string compiled_instances() {
  std::ostringstream os;
  for (const FwdVariant& v : kFwdVariants) os << v.name << "\n";
  for (const SelectVariant& v : kSelectVariants) os << v.name << "\n";
  for (const PermuteVariant& v : kPermuteVariants) os << v.name << "\n";
  for (const Fwd90Variant& v : kFwd90Variants) os << v.name << "\n";
  for (const Permute90Variant& v : kPermute90Variants) os << v.name << "\n";
  for (const SelectVariant& v : kSelect90Variants) os << v.name << "\n";
  for (const CalibVariant& v : kCalibVariants) os << v.name << "\n";
  for (const GateVariant& v : kGateVariants) os << v.name << "\n";
  for (const GateVariant& v : kGate90Variants) os << v.name << "\n";
  return os.str();
}

}  // namespace sparseprefill::cuda
