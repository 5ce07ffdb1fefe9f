// SPDX-License-Identifier: Apache-2.0
// The compiled backends. The only file that names them all.
#include "cpu/backend.h"
#include "dispatch/dispatch.h"
#include "reference/backend.h"
#if defined(SP_WITH_CUDA)
#include "cuda/backend.h"
#endif

namespace sparseprefill::detail {

const BackendImpl* backend_impl(Backend kind) {
  switch (kind) {
    case Backend::kReference: return &ref::reference_backend();
    case Backend::kCPU: return &cpu::cpu_backend();
    case Backend::kCUDA:
#if defined(SP_WITH_CUDA)
      return &cuda::cuda_backend();
#else
      return nullptr;
#endif
    case Backend::kAuto: break;
  }
  return nullptr;
}

}  // namespace sparseprefill::detail

namespace sparseprefill {

int cuda_device_count() {
#if defined(SP_WITH_CUDA)
  return cuda::device_count();
#else
  return 0;
#endif
}

}  // namespace sparseprefill
