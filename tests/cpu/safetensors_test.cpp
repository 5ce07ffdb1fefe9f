// SPDX-License-Identifier: Apache-2.0
// The JSON reader/writer and safetensors I/O: round trips of every dtype, the writer's layout,
// files written by Python's safetensors package (tests/fuzz/corpus), and every corrupt-file
// path (truncation at every byte, lying lengths, bad JSON, bad entries, overlapping or
// uncovered data) giving a kCorruptData error that says what is wrong.
#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/json.h"
#include "sparseprefill/safetensors.h"
#include "sparseprefill/types.h"

namespace sp = sparseprefill;
namespace json = sparseprefill::json;

namespace {

// ---------------------------------------------------------------- helpers

std::string temp_dir() {
  std::string tmpl = ::testing::TempDir() + "sp_safetensors_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* dir = ::mkdtemp(buf.data());
  EXPECT_NE(dir, nullptr);
  return dir ? std::string(dir) : std::string();
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  }
  return names;
}

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// An 8-byte little-endian length, the header text and `data_size` data bytes (0, 1, 2, ...).
std::vector<std::uint8_t> make_file(const std::string& header, std::size_t data_size,
                                    std::uint64_t declared_len = ~0ull) {
  const std::uint64_t len = declared_len == ~0ull ? header.size() : declared_len;
  std::vector<std::uint8_t> bytes(8 + header.size() + data_size);
  std::memcpy(bytes.data(), &len, 8);
  // Element by element: g++ 12 misreads a range insert of the header as an over-read
  // (-Wstringop-overread).
  for (std::size_t i = 0; i < header.size(); ++i) bytes[8 + i] = static_cast<std::uint8_t>(header[i]);
  for (std::size_t i = 0; i < data_size; ++i) bytes[8 + header.size() + i] = static_cast<std::uint8_t>(i);
  return bytes;
}

sp::Status parse(const std::vector<std::uint8_t>& bytes, sp::SafetensorsFile* out) {
  return sp::parse_safetensors(bytes.data(), bytes.size(), out);
}

// Deterministic, never-zero bytes for a tensor's storage.
sp::HostTensor patterned(sp::DType dtype, std::vector<std::int64_t> shape, unsigned seed) {
  sp::HostTensor t(dtype, std::move(shape));
  auto* p = static_cast<std::uint8_t*>(t.data());
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < t.nbytes(); ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<std::uint8_t>((x >> 24) | 1);
  }
  return t;
}

void expect_same(const sp::HostTensor& a, const sp::HostTensor& b) {
  EXPECT_EQ(a.dtype(), b.dtype());
  EXPECT_EQ(a.shape(), b.shape());
  ASSERT_EQ(a.nbytes(), b.nbytes());
  if (a.nbytes()) {
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  }
}

// ---------------------------------------------------------------- JSON

TEST(Json, ParsesEveryKindAndKeepsMemberOrder) {
  json::Value v;
  ASSERT_TRUE(json::parse(R"( {"b": [1, -2.5e3, true, false, null], "a": {"x": "y"}} )", &v).ok());
  ASSERT_TRUE(v.is(json::Type::kObject));
  ASSERT_EQ(v.members().size(), 2u);
  EXPECT_EQ(v.members()[0].first, "b");
  EXPECT_EQ(v.members()[1].first, "a");
  const json::Value& arr = *v.find("b");
  ASSERT_EQ(arr.items().size(), 5u);
  std::int64_t i = 0;
  EXPECT_TRUE(arr.items()[0].to_int64(&i));
  EXPECT_EQ(i, 1);
  double x = 0;
  EXPECT_FALSE(arr.items()[1].to_int64(&i));  // a fraction/exponent is never an integer
  EXPECT_TRUE(arr.items()[1].to_double(&x));
  EXPECT_EQ(x, -2500.0);
  EXPECT_TRUE(arr.items()[2].is(json::Type::kBool) && arr.items()[2].as_bool());
  EXPECT_TRUE(arr.items()[3].is(json::Type::kBool) && !arr.items()[3].as_bool());
  EXPECT_TRUE(arr.items()[4].is(json::Type::kNull));
  EXPECT_EQ(v.find("a")->find("x")->text(), "y");
  EXPECT_EQ(v.find("zzz"), nullptr);
}

TEST(Json, IntegersAreExactAtTheLimits) {
  json::Value v;
  ASSERT_TRUE(json::parse("[9223372036854775807, -9223372036854775808, 18446744073709551615, "
                          "9223372036854775808, 18446744073709551616, -0]", &v).ok());
  std::int64_t i = 0;
  std::uint64_t u = 0;
  EXPECT_TRUE(v.items()[0].to_int64(&i));
  EXPECT_EQ(i, std::numeric_limits<std::int64_t>::max());
  EXPECT_TRUE(v.items()[1].to_int64(&i));
  EXPECT_EQ(i, std::numeric_limits<std::int64_t>::min());
  EXPECT_FALSE(v.items()[1].to_uint64(&u));
  EXPECT_TRUE(v.items()[2].to_uint64(&u));
  EXPECT_EQ(u, std::numeric_limits<std::uint64_t>::max());
  EXPECT_FALSE(v.items()[3].to_int64(&i));  // 2^63 overflows int64
  EXPECT_TRUE(v.items()[3].to_uint64(&u));
  EXPECT_FALSE(v.items()[4].to_uint64(&u));  // 2^64 overflows uint64
  EXPECT_TRUE(v.items()[5].to_int64(&i));
  EXPECT_EQ(i, 0);
  double x = 0;
  ASSERT_TRUE(json::parse("1e400", &v).ok());
  EXPECT_FALSE(v.to_double(&x));  // beyond double: not a finite number
}

TEST(Json, DecodesEscapesAndUtf8) {
  json::Value v;
  ASSERT_TRUE(json::parse(R"("a\"b\\c\/d\b\f\n\r\t\u00e9\u20ac\ud83d\ude00 é€😀")", &v).ok());
  EXPECT_EQ(v.text(), "a\"b\\c/d\b\f\n\r\t\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80 \xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
  // Writing escapes what must be escaped and reads back to the same bytes.
  const std::string s = std::string("q\"\\\x01\n") + "\xC3\xA9" + std::string(1, '\0');
  json::Value back;
  ASSERT_TRUE(json::parse(json::serialize(json::Value::string(s)), &back).ok());
  EXPECT_EQ(back.text(), s);
  EXPECT_EQ(json::serialize(json::Value::string("\x01")), "\"\\u0001\"");
}

TEST(Json, WriterOutputReadsBack) {
  const json::Value v = json::Value::object(
      {{"n", json::Value::integer(-42)},
       {"u", json::Value::unsigned_integer(18446744073709551615ull)},
       {"x", json::Value::number(0.1)},
       {"list", json::Value::array({json::Value::boolean(true), json::Value()})}});
  const std::string text = json::serialize(v);
  EXPECT_EQ(text, R"({"n":-42,"u":18446744073709551615,"x":0.1,"list":[true,null]})");
  json::Value back;
  ASSERT_TRUE(json::parse(text, &back).ok());
  double x = 0;
  ASSERT_TRUE(back.find("x")->to_double(&x));
  EXPECT_EQ(x, 0.1);
}

TEST(Json, RejectsMalformedInputWithPosition) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"", "unexpected end of JSON at byte 0"},
      {"{\"a\": }", "unexpected character at byte 6"},
      {"{\"a\" 1}", "expected ':' after object key at byte 5"},
      {"{\"a\": 1,}", "expected a string key at byte 8"},
      {"{\"a\": 1, \"a\": 2}", "duplicate key \"a\" at byte 9"},
      {"[1 2]", "expected ',' or ']' in array at byte 3"},
      {"[1", "unterminated array at byte 2"},
      {"{\"a\": 1", "unterminated object at byte 7"},
      {"\"abc", "unterminated string at byte 4"},
      {"01", "unexpected data after the JSON value at byte 1"},
      {"1.", "expected digits after '.' at byte 2"},
      {"1e+", "expected digits in exponent at byte 3"},
      {"-", "invalid number at byte 1"},
      {"+1", "unexpected character at byte 0"},
      {"tru", "invalid literal at byte 0"},
      {"\"\\x\"", "invalid escape at byte 3"},
      {"\"\\u12G4\"", "invalid hex digit in \\u escape at byte 5"},
      {"\"\\ud800\"", "high surrogate without a low surrogate at byte 7"},
      {"\"\\udc00\"", "lone low surrogate in \\u escape at byte 7"},
      {"\"\\ud800\\u0041\"", "invalid low surrogate at byte 13"},
      {"\"a\x01\"", "control character in string at byte 2"},
      {"\"\xC3\"", "invalid UTF-8 continuation byte at byte 1"},
      {"\"\xC0\xAF\"", "invalid UTF-8 byte at byte 1"},              // overlong '/'
      {"\"\xED\xA0\x80\"", "invalid UTF-8 sequence at byte 1"},      // encoded surrogate
      {"\"\xF4\x90\x80\x80\"", "invalid UTF-8 sequence at byte 1"},  // above U+10FFFF
      {"\"\xE2\x82", "truncated UTF-8 at byte 1"},
      {"{} x", "unexpected data after the JSON value at byte 3"},
  };
  for (const Case& c : cases) {
    json::Value v;
    const sp::Status st = json::parse(c.text, &v);
    EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData) << c.text;
    EXPECT_EQ(st.message(), c.message) << c.text;
  }
}

TEST(Json, NestingIsBounded) {
  json::Value v;
  const std::string ok = std::string(json::kMaxDepth, '[') + std::string(json::kMaxDepth, ']');
  EXPECT_TRUE(json::parse(ok, &v).ok());
  // Deep enough to overflow the stack of an unbounded recursive parser.
  const std::string deep(100000, '[');
  const sp::Status st = json::parse(deep, &v);
  EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData);
  EXPECT_NE(st.message().find("nesting deeper than 64"), std::string::npos) << st.message();
}

// ---------------------------------------------------------------- round trips

TEST(Safetensors, RoundTripsEveryDtypeEmptyTensorsAndMetadata) {
  sp::SafetensorsFile f;
  f.tensors["bf16"] = patterned(sp::DType::kBF16, {3, 5}, 1);
  f.tensors["fp16"] = patterned(sp::DType::kFP16, {7}, 2);
  f.tensors["fp32"] = patterned(sp::DType::kFP32, {2, 3, 4}, 3);
  f.tensors["i32"] = patterned(sp::DType::kInt32, {1, 1, 1, 9}, 4);
  f.tensors["empty"] = sp::HostTensor(sp::DType::kFP32, {0, 3});
  f.tensors["scalar"] = patterned(sp::DType::kFP32, {}, 5);
  f.tensors["odd name \"quoted\" é"] = patterned(sp::DType::kBF16, {1}, 6);
  f.metadata["model"] = "llama-3.1-8b";
  f.metadata["note"] = "line1\nline2 \"quoted\" \xC3\xA9";
  f.metadata[""] = "empty key";

  const std::string dir = temp_dir();
  const std::string path = dir + "/t.safetensors";
  ASSERT_TRUE(sp::write_safetensors(path, f).ok());
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"t.safetensors"});  // no temporary left

  sp::SafetensorsFile back;
  const sp::Status st = sp::read_safetensors(path, &back);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(back.metadata, f.metadata);
  ASSERT_EQ(back.tensors.size(), f.tensors.size());
  for (const auto& [name, t] : f.tensors) {
    ASSERT_EQ(back.tensors.count(name), 1u) << name;
    expect_same(back.tensors.at(name), t);
  }
  // Reading the same bytes from memory gives the same result.
  const std::vector<std::uint8_t> bytes = read_bytes(path);
  sp::SafetensorsFile mem;
  ASSERT_TRUE(parse(bytes, &mem).ok());
  EXPECT_EQ(mem.tensors.size(), f.tensors.size());
}

TEST(Safetensors, WriterLayoutFollowsTheReferenceConventions) {
  sp::SafetensorsFile f;
  f.tensors["b"] = patterned(sp::DType::kBF16, {3}, 1);  // 6 bytes
  f.tensors["a"] = patterned(sp::DType::kFP32, {2}, 2);  // 8 bytes
  f.tensors["c"] = patterned(sp::DType::kInt32, {1}, 3);
  f.metadata["k"] = "v";
  const std::string path = temp_dir() + "/layout.safetensors";
  ASSERT_TRUE(sp::write_safetensors(path, f).ok());
  const std::vector<std::uint8_t> bytes = read_bytes(path);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "header padded to a multiple of 8";
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  // Keys sorted with __metadata__ first; larger elements first in the data section so every
  // tensor is aligned to its element size; padding is spaces.
  EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1),
            R"({"__metadata__":{"k":"v"},)"
            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[12,18]},)"
            R"("c":{"dtype":"I32","shape":[1],"data_offsets":[8,12]}})");
  EXPECT_EQ(bytes.size(), 8 + n + 18);
}

TEST(Safetensors, OverwritesAtomicallyAndReportsWriteErrors) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/x.safetensors";
  sp::SafetensorsFile f;
  f.tensors["t"] = patterned(sp::DType::kFP32, {4}, 9);
  ASSERT_TRUE(sp::write_safetensors(path, f).ok());
  f.tensors["t"] = patterned(sp::DType::kFP32, {5}, 10);
  ASSERT_TRUE(sp::write_safetensors(path, f).ok());
  sp::SafetensorsFile back;
  ASSERT_TRUE(sp::read_safetensors(path, &back).ok());
  expect_same(back.tensors.at("t"), f.tensors.at("t"));

  // A path whose directory does not exist: an I/O error naming the path, nothing written.
  sp::Status st = sp::write_safetensors(dir + "/missing/y.safetensors", f);
  EXPECT_EQ(st.code(), sp::StatusCode::kIoError);
  EXPECT_NE(st.message().find("missing/y.safetensors"), std::string::npos) << st.message();
  // Renaming onto a directory fails after the data was written: the temporary is removed.
  ASSERT_EQ(::mkdir((dir + "/adir").c_str(), 0755), 0);
  st = sp::write_safetensors(dir + "/adir", f);
  EXPECT_EQ(st.code(), sp::StatusCode::kIoError);
  EXPECT_NE(st.message().find("rename"), std::string::npos) << st.message();
  std::vector<std::string> names = list_dir(dir);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"adir", "x.safetensors"}));

  sp::SafetensorsFile reserved;
  reserved.tensors["__metadata__"] = patterned(sp::DType::kFP32, {1}, 1);
  st = sp::write_safetensors(dir + "/r.safetensors", reserved);
  EXPECT_EQ(st.code(), sp::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("reserved"), std::string::npos);

  st = sp::read_safetensors(dir + "/nope.safetensors", &back);
  EXPECT_EQ(st.code(), sp::StatusCode::kIoError);
  st = sp::read_safetensors(dir, &back);
  EXPECT_EQ(st.code(), sp::StatusCode::kIoError);
}

// Files written by Python's safetensors package (tests/fuzz/make_corpus.py; numpy has no
// bfloat16, so the package wrote F16, F32 and I32 there).
TEST(Safetensors, ReadsFilesWrittenByPythonSafetensors) {
  sp::SafetensorsFile f;
  const std::string path = std::string(SP_SOURCE_DIR) + "/tests/fuzz/corpus/python_numpy.safetensors";
  const sp::Status st = sp::read_safetensors(path, &f);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"source", "safetensors.numpy"}}));
  ASSERT_EQ(f.tensors.size(), 4u);
  const sp::HostTensor& a = f.tensors.at("a_f32");
  ASSERT_EQ(a.shape(), (std::vector<std::int64_t>{2, 3}));
  ASSERT_EQ(a.dtype(), sp::DType::kFP32);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(a.as<float>()[i], 0.5f * static_cast<float>(i) - 1.0f);
  const sp::HostTensor& h = f.tensors.at("b_f16");
  ASSERT_EQ(h.shape(), (std::vector<std::int64_t>{5}));
  ASSERT_EQ(h.dtype(), sp::DType::kFP16);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(sp::fp16_to_float(h.as<std::uint16_t>()[i]), 0.25f * static_cast<float>(i + 1));
  }
  const sp::HostTensor& n = f.tensors.at("c_i32");
  ASSERT_EQ(n.shape(), (std::vector<std::int64_t>{2, 2}));
  ASSERT_EQ(n.dtype(), sp::DType::kInt32);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(n.as<std::int32_t>()[i], (i - 2) * 1000);
  const sp::HostTensor& e = f.tensors.at("d_empty");
  EXPECT_EQ(e.shape(), (std::vector<std::int64_t>{0, 4}));
  EXPECT_EQ(e.nbytes(), 0u);
}

// ---------------------------------------------------------------- corrupt files

TEST(Safetensors, TruncationAtEveryByteIsAnError) {
  sp::SafetensorsFile f;
  f.tensors["w"] = patterned(sp::DType::kBF16, {2, 3}, 1);
  f.tensors["x"] = patterned(sp::DType::kFP32, {2}, 2);
  f.metadata["m"] = "v";
  const std::string path = temp_dir() + "/small.safetensors";
  ASSERT_TRUE(sp::write_safetensors(path, f).ok());
  std::vector<std::uint8_t> bytes = read_bytes(path);
  ASSERT_GT(bytes.size(), 50u);
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    // An exact-size copy, so ASan sees any read past the end.
    const std::vector<std::uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    sp::SafetensorsFile out;
    const sp::Status st = sp::parse_safetensors(prefix.data(), prefix.size(), &out);
    ASSERT_EQ(st.code(), sp::StatusCode::kCorruptData) << "prefix of " << n << " bytes";
    EXPECT_TRUE(out.tensors.empty());
  }
  sp::SafetensorsFile out;
  ASSERT_TRUE(parse(bytes, &out).ok());
  bytes.push_back(0);  // one trailing byte: not covered by any tensor
  const sp::Status st = parse(bytes, &out);
  EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData);
  EXPECT_NE(st.message().find("are not covered by any tensor"), std::string::npos) << st.message();
}

TEST(Safetensors, CorruptHeadersNameTheProblem) {
  struct Case {
    std::string header;
    std::size_t data;
    std::string message;
  };
  const std::string f32x4 = R"("dtype":"F32","shape":[2,2])";
  const std::vector<Case> cases = {
      {"[]", 0, "header does not start with '{'"},
      {R"({"x": })", 0, "header JSON: unexpected character at byte 6"},
      {R"({"x":{)" + f32x4 + R"(,"data_offsets":[0,16]},"x":{}})", 16, "header JSON: duplicate key \"x\" at byte 57"},
      {R"({"x":[1]})", 0, "tensor 'x': expected an object, got array"},
      {R"({"x":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 16,
       "tensor 'x': unsupported dtype 'F64' (expected BF16, F16, F32 or I32)"},
      {R"({"x":{"dtype":7,"shape":[2],"data_offsets":[0,16]}})", 16, "tensor 'x': dtype must be a string"},
      {R"({"x":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8, "tensor 'x': shape must be an array"},
      {R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", 8,
       "tensor 'x': shape entries must be non-negative integers, got -1"},
      {R"({"x":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8,
       "tensor 'x': shape entries must be non-negative integers, got 2.5"},
      {R"({"x":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8,
       "tensor 'x': shape entries must be non-negative integers, got string"},
      {R"({"x":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}})", 4,
       "tensor 'x': shape has 17 dimensions (at most 16)"},
      {R"({"x":{"dtype":"F32","shape":[2]}})", 8, "tensor 'x': missing 'data_offsets'"},
      {R"({"x":{"shape":[2],"data_offsets":[0,8]}})", 8, "tensor 'x': missing 'dtype'"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", 8,
       "tensor 'x': unexpected field 'extra'"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8,
       "tensor 'x': data_offsets must be two non-negative integers"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8,
       "tensor 'x': data_offsets must be two non-negative integers"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8,
       "tensor 'x': data_offsets [8, 0] end before they begin"},
      {R"({"x":{)" + f32x4 + R"(,"data_offsets":[0,12]}})", 12,
       "tensor 'x': data_offsets [0, 12] do not match shape [2, 2] F32 (16 bytes)"},
      {R"({"x":{"dtype":"BF16","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0,
       "tensor 'x': shape [4294967296, 4294967296] BF16 is too large"},
      {R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})", 0,
       "tensor 'x': shape [4294967296, 4294967296, 0] F32 is too large"},
      {R"({"x":{)" + f32x4 + R"(,"data_offsets":[0,16]}})", 12,
       "tensor 'x': data_offsets [0, 16] exceed the data section (12 bytes)"},
      {R"({"x":{)" + f32x4 + R"(,"data_offsets":[18446744073709551600,18446744073709551616]}})", 16,
       "tensor 'x': data_offsets must be two non-negative integers"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12,
       "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})", 8,
       "tensor 'b': data_offsets [4, 4] overlap tensor 'a' [0, 8]"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16,
       "data bytes [8, 12) are not covered by any tensor"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12,
       "data bytes [8, 12) are not covered by any tensor"},
      {R"({"__metadata__":{"n":1}})", 0, "__metadata__: value of 'n' must be a string, got number"},
      {R"({"__metadata__":["a"]})", 0, "__metadata__: expected an object of strings, got array"},
      {R"({"__metadata__":{"a":"b"},"x":[1]})", 0, "tensor 'x': expected an object, got array"},
      {"{\"\xFF\":1}", 0, "header JSON: invalid UTF-8 byte at byte 2"},
      {"{\"x\":{}}\x01", 0, "header JSON: unexpected data after the JSON value at byte 8"},
  };
  for (const Case& c : cases) {
    sp::SafetensorsFile out;
    out.metadata["stale"] = "x";
    const sp::Status st = parse(make_file(c.header, c.data), &out);
    EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData) << c.header;
    EXPECT_EQ(st.message(), c.message) << c.header;
    EXPECT_TRUE(out.metadata.empty() && out.tensors.empty()) << "never a partial result: " << c.header;
  }
  // Valid edge cases: an empty header, zero-sized tensors sharing an offset, padding spaces.
  for (const std::string& ok : {std::string("{}"), std::string("{}      "),
                               std::string(R"({"a":{"dtype":"I32","shape":[0],"data_offsets":[0,0]},)"
                                           R"("b":{"dtype":"F16","shape":[0,7],"data_offsets":[0,0]}})")}) {
    sp::SafetensorsFile out;
    const sp::Status st = parse(make_file(ok, 0), &out);
    EXPECT_TRUE(st.ok()) << ok << ": " << st.to_string();
  }
}

TEST(Safetensors, LyingHeaderLengthsAreRejectedBeforeAllocating) {
  sp::SafetensorsFile out;
  sp::Status st = parse(std::vector<std::uint8_t>(5, 0), &out);
  EXPECT_EQ(st.message(), "file is 5 bytes, shorter than the 8-byte header length");

  std::vector<std::uint8_t> lying = make_file("{}", 4086, 1000000000000ull);
  st = parse(lying, &out);
  EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData);
  EXPECT_EQ(st.message(), "header length 1000000000000 exceeds file size 4096");

  lying = make_file("{}", 0, ~0ull - 1);
  st = parse(lying, &out);
  EXPECT_EQ(st.message(), "header length 18446744073709551614 exceeds file size 10");

  // A header length within the file but above the 100 MiB limit.
  const std::size_t big = (100u << 20) + 8;
  std::vector<std::uint8_t> huge(8 + big, ' ');
  huge[8] = '{';
  const std::uint64_t n = big;
  std::memcpy(huge.data(), &n, 8);
  st = parse(huge, &out);
  EXPECT_EQ(st.message(), "header length 104857608 exceeds the limit of 104857600 bytes");

  const std::string dir = temp_dir();
  std::ofstream(dir + "/lying.safetensors", std::ios::binary)
      .write(reinterpret_cast<const char*>(make_file("{}", 0, 1u << 30).data()), 10);
  st = sp::read_safetensors(dir + "/lying.safetensors", &out);
  EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData);
  EXPECT_EQ(st.message(), dir + "/lying.safetensors: header length 1073741824 exceeds file size 10");
}

// Every committed corpus file parses or fails cleanly; the broken_* ones fail.
TEST(Safetensors, CorpusFilesParseOrFailCleanly) {
  const std::string dir = std::string(SP_SOURCE_DIR) + "/tests/fuzz/corpus";
  const std::vector<std::string> names = list_dir(dir);
  ASSERT_GE(names.size(), 10u);
  for (const std::string& name : names) {
    sp::SafetensorsFile out;
    const sp::Status st = sp::read_safetensors(dir + "/" + name, &out);
    if (name.rfind("broken_st_", 0) == 0) {
      EXPECT_EQ(st.code(), sp::StatusCode::kCorruptData) << name;
    } else if (name.rfind("broken_", 0) != 0) {
      EXPECT_TRUE(st.ok()) << name << ": " << st.to_string();
    }
  }
}

}  // namespace
