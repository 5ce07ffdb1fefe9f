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

// O [rows, h_q, d] and LSE [h_q, rows] (rows in batch order) of softmax(scale · q·k) over the
// kept keys; GQA reads kv head h / (h_q / h_kv); a row with no kept key gets O = 0, LSE = -inf.
// scale 0 means 1/sqrt(d).
ref::Result masked_softmax(const Inputs& in, double scale, const ElementMask& keep);

}  // namespace sparseprefill::test
