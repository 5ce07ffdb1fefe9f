// SPDX-License-Identifier: Apache-2.0
// A deliberately naive fp64 masked softmax straight from the logical inputs, written
// independently of the oracle so tests can check the oracle (and anything else) against an
// element mask.
#pragma once

#include <cstdint>
#include <functional>

#include "inputs.h"
#include "reference/reference.h"

namespace sparseprefill::test {

// keep(b, h, r, t): whether row r (call-relative) of query head h of sequence b reads key t.
using ElementMask = std::function<bool(int b, int h, std::int64_t r, std::int64_t t)>;

// Bottom-right causal visibility: key t <= r + s_k - s_q.
bool causally_visible(std::int64_t s_q, std::int64_t s_k, std::int64_t r, std::int64_t t);

// O [rows, h_q, d_v] and LSE [h_q, rows] (rows in batch order) of the softmax of
// softcap · tanh(scale · q·k / softcap) (scale · q·k when softcap is 0) over the kept keys, with
// the inputs' sink logit (if any) as one more term of each row's softmax whose value is 0; GQA
// reads kv head h / (h_q / h_kv); a row with no kept key gets O = 0 and LSE = the sink (-inf
// without one). scale 0 means 1/sqrt(d).
ref::Result masked_softmax(const Inputs& in, double scale, const ElementMask& keep, double softcap = 0.0);

// The local window (FlashAttention's window_size; -1: no bound) and causal mask of one row:
// key t at absolute position a = r + s_k - s_q is visible iff a - left <= t <= a + right and,
// causal, t <= a; with chunk C > 0 (FlashAttention's attention_chunk) t also lies in a's chunk,
// written as FlashAttention's test reference writes it (a - (a mod C), the remainder >= 0).
bool window_visible(std::int64_t s_q, std::int64_t s_k, bool causal, int left, int right, std::int64_t r,
                    std::int64_t t, int chunk = 0);

}  // namespace sparseprefill::test
