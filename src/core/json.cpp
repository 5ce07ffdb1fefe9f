// SPDX-License-Identifier: Apache-2.0
// The strict JSON reader and writer of json.h: a recursive-descent parser over bytes with a
// depth bound, UTF-8 validation and duplicate-key detection, and a compact writer.
#include "core/json.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <system_error>

namespace sparseprefill::json {

const char* type_name(Type type) {
  switch (type) {
    case Type::kNull: return "null";
    case Type::kBool: return "boolean";
    case Type::kNumber: return "number";
    case Type::kString: return "string";
    case Type::kArray: return "array";
    case Type::kObject: return "object";
  }
  return "unknown";
}

Value Value::boolean(bool b) {
  Value v;
  v.type_ = Type::kBool;
  v.flag_ = b;
  return v;
}

Value Value::integer(std::int64_t n) {
  Value v;
  v.type_ = Type::kNumber;
  v.text_ = std::to_string(n);
  return v;
}

Value Value::unsigned_integer(std::uint64_t n) {
  Value v;
  v.type_ = Type::kNumber;
  v.text_ = std::to_string(n);
  return v;
}

Value Value::number(double x) {
  Value v;
  v.type_ = Type::kNumber;
  char buf[64];
  // Shortest round-trip form; the caller guarantees x is finite.
  const auto r = std::to_chars(buf, buf + sizeof(buf), x);
  v.text_.assign(buf, r.ptr);
  return v;
}

Value Value::string(std::string s) {
  Value v;
  v.type_ = Type::kString;
  v.text_ = std::move(s);
  return v;
}

Value Value::array(std::vector<Value> items) {
  Value v;
  v.type_ = Type::kArray;
  v.items_ = std::move(items);
  return v;
}

Value Value::object(std::vector<Member> members) {
  Value v;
  v.type_ = Type::kObject;
  v.members_ = std::move(members);
  return v;
}

const Value* Value::find(std::string_view key) const {
  for (const Member& m : members_) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

namespace {

// Integer text: an optional '-' and digits only (the grammar already excluded leading zeros).
bool is_integer_text(const std::string& t) {
  if (t.empty()) return false;
  for (std::size_t i = (t[0] == '-' ? 1 : 0); i < t.size(); ++i) {
    if (t[i] < '0' || t[i] > '9') return false;
  }
  return t.size() > (t[0] == '-' ? 1u : 0u);
}

}  // namespace

bool Value::to_int64(std::int64_t* out) const {
  if (type_ != Type::kNumber || !is_integer_text(text_)) return false;
  const char* end = text_.data() + text_.size();
  const auto r = std::from_chars(text_.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end;
}

bool Value::to_uint64(std::uint64_t* out) const {
  if (type_ != Type::kNumber || !is_integer_text(text_) || text_[0] == '-') return false;
  const char* end = text_.data() + text_.size();
  const auto r = std::from_chars(text_.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end;
}

bool Value::to_double(double* out) const {
  if (type_ != Type::kNumber) return false;
  const char* end = text_.data() + text_.size();
  // from_chars is locale-independent, unlike strtod.
  const auto r = std::from_chars(text_.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end && std::isfinite(*out);
}

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Status parse_document(Value* out) {
    skip_whitespace();
    SP_RETURN_IF_ERROR(parse_value(out, 0));
    skip_whitespace();
    if (pos_ != text_.size()) return error("unexpected data after the JSON value");
    return {};
  }

 private:
  Status error(const std::string& what) const {
    return corrupt_data(what + " at byte " + std::to_string(pos_));
  }

  bool at_end() const { return pos_ >= text_.size(); }
  unsigned char peek() const { return static_cast<unsigned char>(text_[pos_]); }

  void skip_whitespace() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) {
      ++pos_;
    }
  }

  bool consume_literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Status parse_value(Value* out, int depth) {
    if (at_end()) return error("unexpected end of JSON");
    switch (peek()) {
      case '{': return parse_object(out, depth + 1);
      case '[': return parse_array(out, depth + 1);
      case '"':
        out->type_ = Type::kString;
        return parse_string(&out->text_);
      case 't':
      case 'f':
      case 'n': {
        if (consume_literal("true")) {
          *out = Value::boolean(true);
        } else if (consume_literal("false")) {
          *out = Value::boolean(false);
        } else if (consume_literal("null")) {
          *out = Value();
        } else {
          return error("invalid literal");
        }
        return {};
      }
      default: return parse_number(out);
    }
  }

  Status parse_object(Value* out, int depth) {
    if (depth > kMaxDepth) return error("nesting deeper than " + std::to_string(kMaxDepth));
    out->type_ = Type::kObject;
    ++pos_;  // '{'
    std::set<std::string> keys;
    skip_whitespace();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return {};
    }
    while (true) {
      skip_whitespace();
      if (at_end() || peek() != '"') return error("expected a string key");
      const std::size_t key_pos = pos_;
      std::string key;
      SP_RETURN_IF_ERROR(parse_string(&key));
      if (!keys.insert(key).second) {
        return corrupt_data("duplicate key \"" + key + "\" at byte " + std::to_string(key_pos));
      }
      skip_whitespace();
      if (at_end() || peek() != ':') return error("expected ':' after object key");
      ++pos_;
      skip_whitespace();
      out->members_.emplace_back(std::move(key), Value());
      SP_RETURN_IF_ERROR(parse_value(&out->members_.back().second, depth));
      skip_whitespace();
      if (at_end()) return error("unterminated object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return {};
      }
      return error("expected ',' or '}' in object");
    }
  }

  Status parse_array(Value* out, int depth) {
    if (depth > kMaxDepth) return error("nesting deeper than " + std::to_string(kMaxDepth));
    out->type_ = Type::kArray;
    ++pos_;  // '['
    skip_whitespace();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return {};
    }
    while (true) {
      skip_whitespace();
      out->items_.emplace_back();
      SP_RETURN_IF_ERROR(parse_value(&out->items_.back(), depth));
      skip_whitespace();
      if (at_end()) return error("unterminated array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return {};
      }
      return error("expected ',' or ']' in array");
    }
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  Status parse_number(Value* out) {
    const std::size_t begin = pos_;
    auto digits = [&]() {
      const std::size_t start = pos_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
      return pos_ - start;
    };
    if (!at_end() && peek() == '-') ++pos_;
    if (at_end()) return error("invalid number");
    if (peek() == '0') {
      ++pos_;
    } else if (peek() >= '1' && peek() <= '9') {
      digits();
    } else {
      return error("unexpected character");
    }
    if (!at_end() && peek() == '.') {
      ++pos_;
      if (digits() == 0) return error("expected digits after '.'");
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (digits() == 0) return error("expected digits in exponent");
    }
    out->type_ = Type::kNumber;
    out->text_.assign(text_.substr(begin, pos_ - begin));
    return {};
  }

  Status parse_hex4(std::uint32_t* out) {
    if (text_.size() - pos_ < 4) return error("truncated \\u escape");
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const unsigned char c = peek();
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= c - '0';
      } else if (c >= 'a' && c <= 'f') {
        v |= c - 'a' + 10u;
      } else if (c >= 'A' && c <= 'F') {
        v |= c - 'A' + 10u;
      } else {
        return error("invalid hex digit in \\u escape");
      }
      ++pos_;
    }
    *out = v;
    return {};
  }

  static void append_utf8(std::uint32_t cp, std::string* s) {
    if (cp < 0x80) {
      s->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      s->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      s->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  // One raw UTF-8 sequence starting at pos_ (first byte >= 0x80): rejects overlong forms,
  // surrogates and code points above U+10FFFF.
  Status copy_utf8_sequence(std::string* s) {
    const unsigned char c0 = peek();
    int extra = 0;
    std::uint32_t cp = 0, min_cp = 0;
    if (c0 >= 0xC2 && c0 <= 0xDF) {
      extra = 1, cp = c0 & 0x1Fu, min_cp = 0x80;
    } else if (c0 >= 0xE0 && c0 <= 0xEF) {
      extra = 2, cp = c0 & 0x0Fu, min_cp = 0x800;
    } else if (c0 >= 0xF0 && c0 <= 0xF4) {
      extra = 3, cp = c0 & 0x07u, min_cp = 0x10000;
    } else {
      return error("invalid UTF-8 byte");
    }
    if (text_.size() - pos_ <= static_cast<std::size_t>(extra)) return error("truncated UTF-8");
    for (int i = 1; i <= extra; ++i) {
      const unsigned char c = static_cast<unsigned char>(text_[pos_ + i]);
      if ((c & 0xC0) != 0x80) return error("invalid UTF-8 continuation byte");
      cp = (cp << 6) | (c & 0x3Fu);
    }
    if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return error("invalid UTF-8 sequence");
    }
    s->append(text_.substr(pos_, extra + 1));
    pos_ += extra + 1;
    return {};
  }

  Status parse_string(std::string* s) {
    ++pos_;  // opening quote
    s->clear();
    while (true) {
      if (at_end()) return error("unterminated string");
      const unsigned char c = peek();
      if (c == '"') {
        ++pos_;
        return {};
      }
      if (c < 0x20) return error("control character in string");
      if (c >= 0x80) {
        SP_RETURN_IF_ERROR(copy_utf8_sequence(s));
        continue;
      }
      if (c != '\\') {
        s->push_back(static_cast<char>(c));
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) return error("unterminated escape");
      const unsigned char e = peek();
      ++pos_;
      switch (e) {
        case '"': s->push_back('"'); break;
        case '\\': s->push_back('\\'); break;
        case '/': s->push_back('/'); break;
        case 'b': s->push_back('\b'); break;
        case 'f': s->push_back('\f'); break;
        case 'n': s->push_back('\n'); break;
        case 'r': s->push_back('\r'); break;
        case 't': s->push_back('\t'); break;
        case 'u': {
          std::uint32_t cp = 0;
          SP_RETURN_IF_ERROR(parse_hex4(&cp));
          if (cp >= 0xDC00 && cp <= 0xDFFF) return error("lone low surrogate in \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!consume_literal("\\u")) return error("high surrogate without a low surrogate");
            std::uint32_t low = 0;
            SP_RETURN_IF_ERROR(parse_hex4(&low));
            if (low < 0xDC00 || low > 0xDFFF) return error("invalid low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(cp, s);
          break;
        }
        default: return error("invalid escape");
      }
    }
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

Status parse(std::string_view text, Value* out) {
  *out = Value();
  Parser parser(text);
  return parser.parse_document(out);
}

namespace {

void write_string(const std::string& s, std::string* out) {
  static const char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      default:
        if (c < 0x20) {
          out->append("\\u00");
          out->push_back(kHex[c >> 4]);
          out->push_back(kHex[c & 0xF]);
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

void write_value(const Value& v, std::string* out) {
  switch (v.type()) {
    case Type::kNull: out->append("null"); break;
    case Type::kBool: out->append(v.as_bool() ? "true" : "false"); break;
    case Type::kNumber: out->append(v.text()); break;
    case Type::kString: write_string(v.text(), out); break;
    case Type::kArray: {
      out->push_back('[');
      for (std::size_t i = 0; i < v.items().size(); ++i) {
        if (i) out->push_back(',');
        write_value(v.items()[i], out);
      }
      out->push_back(']');
      break;
    }
    case Type::kObject: {
      out->push_back('{');
      for (std::size_t i = 0; i < v.members().size(); ++i) {
        if (i) out->push_back(',');
        write_string(v.members()[i].first, out);
        out->push_back(':');
        write_value(v.members()[i].second, out);
      }
      out->push_back('}');
      break;
    }
  }
}

}  // namespace

std::string serialize(const Value& value) {
  std::string out;
  write_value(value, &out);
  return out;
}

}  // namespace sparseprefill::json
