// SPDX-License-Identifier: Apache-2.0
// A small, strict JSON reader and writer (RFC 8259) for file headers: safetensors and the
// calibration files. Hostile input is expected: nesting depth is bounded, strings must be valid
// UTF-8, duplicate object keys are errors, and numbers keep their source text so integers are
// read exactly instead of through a double.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "sparseprefill/types.h"

namespace sparseprefill::json {

enum class Type : std::uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };

// "null", "boolean", "number", "string", "array", "object" (for error messages).
const char* type_name(Type type);

class Value;
using Member = std::pair<std::string, Value>;

class Value {
 public:
  Value() = default;  // null
  static Value boolean(bool b);
  static Value integer(std::int64_t n);
  static Value unsigned_integer(std::uint64_t n);
  // x must be finite (JSON has no NaN or infinity); written in the shortest form that
  // reads back to the same double.
  static Value number(double x);
  static Value string(std::string s);
  static Value array(std::vector<Value> items);
  // Keys must be unique; serialize() writes members in the given order.
  static Value object(std::vector<Member> members);

  Type type() const { return type_; }
  bool is(Type t) const { return type_ == t; }
  bool as_bool() const { return flag_; }
  // The string's decoded bytes, or a number's source text.
  const std::string& text() const { return text_; }
  const std::vector<Value>& items() const { return items_; }
  const std::vector<Member>& members() const { return members_; }
  // The member named `key`, or nullptr (objects only).
  const Value* find(std::string_view key) const;

  // Exact conversions of a number; false when the value is not a number of that kind
  // (a fraction or exponent is never an integer here; out of range is false).
  bool to_int64(std::int64_t* out) const;
  bool to_uint64(std::uint64_t* out) const;
  // False for a non-number or a magnitude beyond the range of double.
  bool to_double(double* out) const;

 private:
  friend class Parser;
  Type type_ = Type::kNull;
  bool flag_ = false;
  std::string text_;
  std::vector<Value> items_;
  std::vector<Member> members_;
};

// Objects and arrays nested deeper than this are rejected (bounded recursion on hostile input).
constexpr int kMaxDepth = 64;

// Parses one JSON value; surrounding whitespace is allowed, anything else after the value is
// an error. Errors are kCorruptData: "expected ':' after object key at byte 17".
Status parse(std::string_view text, Value* out);

// Compact serialization (no whitespace). Non-ASCII text is written as UTF-8.
std::string serialize(const Value& value);

}  // namespace sparseprefill::json
