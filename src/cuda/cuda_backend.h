// SPDX-License-Identifier: Apache-2.0
// Test hooks of the CUDA backend (tests/cuda), per calling thread, layered over every call's
// overrides: being replaced by RunOptions::overrides and RunStats::execution, which say the
// same for any caller.
#pragma once

#include <string>

namespace sparseprefill::cuda {

// The forward instance the last successful run launched (e.g. "fwd_sm90_bf16_hd128"; "" before
// any), and a switch that sends every call to the portable kernels.
std::string last_fwd_instance_for_testing();
void set_portable_only_for_testing(bool portable_only);
// The estimate_select selector instance last chosen (e.g. "select_sm90_bf16_hd128"; "" before any).
std::string last_select_instance_for_testing();
// Paged K/V staged as plan_kv_staging decides (kAuto), always or never, and whether the last
// successful run staged.
enum class KvStagingForTesting { kAuto, kAlways, kNever };
void set_kv_staging_for_testing(KvStagingForTesting mode);
bool last_call_staged_kv_for_testing();
// Query heads per tile of the last forward launch (1, or the group when the Hopper kernel packed).
int last_q_pack_for_testing();
// Passes of the last exact_gate call (1 or 2; 0 before any), and a forced pass count (0: none).
int last_gate_passes_for_testing();
void set_gate_passes_for_testing(int passes);

}  // namespace sparseprefill::cuda
