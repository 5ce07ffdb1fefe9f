// SPDX-License-Identifier: Apache-2.0
// Gives sp_test_common one translation unit of its own, so the target exists (and links)
// whatever tests/common/ holds.
