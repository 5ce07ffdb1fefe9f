// SPDX-License-Identifier: Apache-2.0
// Umbrella header: the whole public C++ API. Host-only; includes nothing heavy.
#pragma once

#include "sparseprefill/attention.h"
#include "sparseprefill/block_mask.h"
#include "sparseprefill/calibration.h"
#include "sparseprefill/generator.h"
#include "sparseprefill/plan.h"
#include "sparseprefill/policy.h"
#include "sparseprefill/problem.h"
#include "sparseprefill/safetensors.h"
#include "sparseprefill/types.h"
#include "sparseprefill/version.h"
