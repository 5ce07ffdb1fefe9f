// SPDX-License-Identifier: Apache-2.0
// safetensors reading and writing (include/sparseprefill/safetensors.h). Every number in a
// header is checked before it is used, in the order a reader needs them: the header length
// against the file, the JSON, each entry's fields, each byte range against its dtype and shape
// (overflow-checked), and the ranges against each other (they must tile the data section).
#include "sparseprefill/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

#include "core/json.h"

namespace sparseprefill {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian and is copied without byte swapping");

namespace {

// The reference implementation refuses headers above 100 MB; so do we, before allocating.
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;
// Far beyond any real tensor; bounds the shape loop on hostile input.
constexpr std::size_t kMaxRank = 16;
constexpr const char* kMetadataKey = "__metadata__";
// Byte counts and element counts stay below 2^63 (signed 64-bit everywhere downstream).
constexpr std::uint64_t kMaxBytes = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

const char* dtype_tag(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "BF16";
    case DType::kFP16: return "F16";
    case DType::kFP32: return "F32";
    case DType::kInt32: return "I32";
    case DType::kFP8E4M3: return "F8_E4M3";
  }
  return "?";
}

bool dtype_from_tag(const std::string& tag, DType* out) {
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kInt32, DType::kFP8E4M3}) {
    if (tag == dtype_tag(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string range_string(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

struct Entry {
  std::string name;
  DType dtype = DType::kFP32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;
};

// A tensor entry: {"dtype": str, "shape": [non-negative ints], "data_offsets": [begin, end]},
// nothing else; the byte count must equal numel × element size.
Status parse_entry(const std::string& name, const json::Value& v, Entry* e) {
  const std::string where = "tensor '" + name + "'";
  if (!v.is(json::Type::kObject)) {
    return corrupt_data(where + ": expected an object, got " + json::type_name(v.type()));
  }
  for (const json::Member& m : v.members()) {
    if (m.first != "dtype" && m.first != "shape" && m.first != "data_offsets") {
      return corrupt_data(where + ": unexpected field '" + m.first + "'");
    }
  }
  const json::Value* dtype = v.find("dtype");
  const json::Value* shape = v.find("shape");
  const json::Value* offsets = v.find("data_offsets");
  if (!dtype || !shape || !offsets) {
    return corrupt_data(where + ": missing '" +
                        (!dtype ? "dtype" : !shape ? "shape" : "data_offsets") + "'");
  }
  e->name = name;
  if (!dtype->is(json::Type::kString)) {
    return corrupt_data(where + ": dtype must be a string");
  }
  if (!dtype_from_tag(dtype->text(), &e->dtype)) {
    return corrupt_data(where + ": unsupported dtype '" + dtype->text() +
                        "' (expected BF16, F16, F32 or I32)");
  }
  if (!shape->is(json::Type::kArray)) return corrupt_data(where + ": shape must be an array");
  if (shape->items().size() > kMaxRank) {
    return corrupt_data(where + ": shape has " + std::to_string(shape->items().size()) +
                        " dimensions (at most " + std::to_string(kMaxRank) + ")");
  }
  // Product of the non-zero dimensions, kept within int64 so that every partial product a
  // consumer computes (HostTensor::numel, strides) is defined; a zero dimension empties it.
  std::uint64_t nonzero = 1;
  bool overflow = false, has_zero = false;
  for (const json::Value& dim : shape->items()) {
    std::int64_t n = 0;
    if (!dim.to_int64(&n) || n < 0) {
      return corrupt_data(where + ": shape entries must be non-negative integers, got " +
                          (dim.is(json::Type::kNumber) ? dim.text() : json::type_name(dim.type())));
    }
    e->shape.push_back(n);
    if (n == 0) {
      has_zero = true;
      continue;
    }
    const auto un = static_cast<std::uint64_t>(n);
    if (nonzero > kMaxBytes / un) overflow = true;
    if (!overflow) nonzero *= un;
  }
  if (!offsets->is(json::Type::kArray) || offsets->items().size() != 2 ||
      !offsets->items()[0].to_uint64(&e->begin) || !offsets->items()[1].to_uint64(&e->end)) {
    return corrupt_data(where + ": data_offsets must be two non-negative integers");
  }
  if (e->end < e->begin) {
    return corrupt_data(where + ": data_offsets " + range_string(e->begin, e->end) +
                        " end before they begin");
  }
  const std::uint64_t elem = dtype_size(e->dtype);
  if (overflow || nonzero > kMaxBytes / elem) {
    return corrupt_data(where + ": shape " + shape_string(e->shape) + " " + dtype_tag(e->dtype) +
                        " is too large");
  }
  const std::uint64_t bytes = has_zero ? 0 : nonzero * elem;
  if (e->end - e->begin != bytes) {
    return corrupt_data(where + ": data_offsets " + range_string(e->begin, e->end) +
                        " do not match shape " + shape_string(e->shape) + " " +
                        dtype_tag(e->dtype) + " (" + std::to_string(bytes) + " bytes)");
  }
  return {};
}

Status parse_metadata(const json::Value& v, std::map<std::string, std::string>* out) {
  if (!v.is(json::Type::kObject)) {
    return corrupt_data(std::string(kMetadataKey) + ": expected an object of strings, got " +
                        json::type_name(v.type()));
  }
  for (const json::Member& m : v.members()) {
    if (!m.second.is(json::Type::kString)) {
      return corrupt_data(std::string(kMetadataKey) + ": value of '" + m.first +
                          "' must be a string, got " + json::type_name(m.second.type()));
    }
    (*out)[m.first] = m.second.text();
  }
  return {};
}

Status parse_into(const std::uint8_t* data, std::size_t size, SafetensorsFile* out) {
  if (size < 8) {
    return corrupt_data("file is " + std::to_string(size) +
                        " bytes, shorter than the 8-byte header length");
  }
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);
  if (header_len > size - 8) {
    return corrupt_data("header length " + std::to_string(header_len) + " exceeds file size " +
                        std::to_string(size));
  }
  if (header_len > kMaxHeaderBytes) {
    return corrupt_data("header length " + std::to_string(header_len) + " exceeds the limit of " +
                        std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_len < 2 || data[8] != '{') {
    return corrupt_data("header does not start with '{'");
  }
  const std::string_view header(reinterpret_cast<const char*>(data + 8),
                                static_cast<std::size_t>(header_len));
  json::Value root;
  Status st = json::parse(header, &root);
  if (!st.ok()) return corrupt_data("header JSON: " + st.message());
  if (!root.is(json::Type::kObject)) return corrupt_data("header JSON is not an object");

  const std::uint64_t data_size = size - 8 - header_len;
  std::vector<Entry> entries;
  for (const json::Member& m : root.members()) {
    if (m.first == kMetadataKey) {
      SP_RETURN_IF_ERROR(parse_metadata(m.second, &out->metadata));
      continue;
    }
    Entry e;
    SP_RETURN_IF_ERROR(parse_entry(m.first, m.second, &e));
    if (e.end > data_size) {
      return corrupt_data("tensor '" + e.name + "': data_offsets " + range_string(e.begin, e.end) +
                          " exceed the data section (" + std::to_string(data_size) + " bytes)");
    }
    entries.push_back(std::move(e));
  }

  // The ranges must tile [0, data_size) exactly: no overlap, no hole, nothing trailing.
  std::vector<const Entry*> order;
  for (const Entry& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* e : order) {
    if (e->begin < covered) {
      return corrupt_data("tensor '" + e->name + "': data_offsets " +
                          range_string(e->begin, e->end) + " overlap tensor '" +
                          previous->name + "' " + range_string(previous->begin, previous->end));
    }
    if (e->begin > covered) {
      return corrupt_data("data bytes [" + std::to_string(covered) + ", " +
                          std::to_string(e->begin) + ") are not covered by any tensor");
    }
    covered = e->end;
    previous = e;
  }
  if (covered != data_size) {
    return corrupt_data("data bytes [" + std::to_string(covered) + ", " +
                        std::to_string(data_size) + ") are not covered by any tensor");
  }

  const std::uint8_t* base = data + 8 + header_len;
  for (const Entry& e : entries) {
    HostTensor t(e.dtype, e.shape);
    if (t.nbytes() != e.end - e.begin) {
      return Status(StatusCode::kInternal, "tensor '" + e.name + "': size mismatch");
    }
    if (t.nbytes()) std::memcpy(t.data(), base + e.begin, t.nbytes());
    out->tensors.emplace(e.name, std::move(t));
  }
  return {};
}

}  // namespace

Status parse_safetensors(const std::uint8_t* data, std::size_t size, SafetensorsFile* out) {
  // Parsed aside so that a failure never leaves a partial result in *out.
  SafetensorsFile file;
  const Status st = parse_into(data, size, &file);
  *out = st.ok() ? std::move(file) : SafetensorsFile();
  return st;
}

Status read_safetensors(const std::string& path, SafetensorsFile* out) {
  *out = SafetensorsFile();
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return io_error(path + ": cannot open: " + std::strerror(errno));
  struct stat info {};
  if (fstat(fileno(f), &info) != 0 || !S_ISREG(info.st_mode)) {
    std::fclose(f);
    return io_error(path + ": not a regular file");
  }
  // The buffer is as large as the file really is; header lengths are checked against it
  // before anything else is allocated.
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(info.st_size));
  const std::size_t got = bytes.empty() ? 0 : std::fread(bytes.data(), 1, bytes.size(), f);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed || got != bytes.size()) return io_error(path + ": read failed");
  Status st = parse_safetensors(bytes.data(), bytes.size(), out);
  if (!st.ok()) return Status(st.code(), path + ": " + st.message());
  return {};
}

namespace {

Status write_all(int fd, const void* data, std::size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(std::string("write failed: ") + std::strerror(errno));
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return {};
}

}  // namespace

Status write_safetensors(const std::string& path, const SafetensorsFile& file) {
  // Data order: larger elements first, then by name, so that every tensor starts at an
  // offset aligned to its element size (the data section itself starts 8-aligned).
  std::vector<const std::pair<const std::string, HostTensor>*> order;
  for (const auto& kv : file.tensors) {
    if (kv.first == kMetadataKey) {
      return invalid_argument("file.tensors: the name '__metadata__' is reserved");
    }
    const HostTensor& t = kv.second;
    if (t.nbytes() != static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype())) {
      return invalid_argument("file.tensors['" + kv.first + "']: storage does not match shape");
    }
    order.push_back(&kv);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return dtype_size(a->second.dtype()) > dtype_size(b->second.dtype());
  });
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> offsets;
  std::uint64_t offset = 0;
  for (const auto* kv : order) {
    offsets[kv->first] = {offset, offset + kv->second.nbytes()};
    offset += kv->second.nbytes();
  }

  // Header keys sorted: "__metadata__" first, then the tensors by name (std::map order).
  std::vector<json::Member> members;
  if (!file.metadata.empty()) {
    std::vector<json::Member> meta;
    for (const auto& kv : file.metadata) meta.emplace_back(kv.first, json::Value::string(kv.second));
    members.emplace_back(kMetadataKey, json::Value::object(std::move(meta)));
  }
  for (const auto& kv : file.tensors) {
    std::vector<json::Value> shape;
    for (std::int64_t n : kv.second.shape()) shape.push_back(json::Value::integer(n));
    const auto& [begin, end] = offsets[kv.first];
    std::vector<json::Member> entry;
    entry.emplace_back("dtype", json::Value::string(dtype_tag(kv.second.dtype())));
    entry.emplace_back("shape", json::Value::array(std::move(shape)));
    entry.emplace_back("data_offsets", json::Value::array({json::Value::unsigned_integer(begin),
                                                           json::Value::unsigned_integer(end)}));
    members.emplace_back(kv.first, json::Value::object(std::move(entry)));
  }
  std::string header = json::serialize(json::Value::object(std::move(members)));
  // Pad with spaces (valid JSON whitespace) so the data section starts 8-aligned.
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::uint64_t header_len = header.size();

  static std::atomic<unsigned> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error(tmp + ": cannot create: " + std::strerror(errno));
  Status st = write_all(fd, &header_len, 8);
  if (st.ok()) st = write_all(fd, header.data(), header.size());
  for (const auto* kv : order) {
    if (!st.ok()) break;
    st = write_all(fd, kv->second.data(), kv->second.nbytes());
  }
  if (st.ok() && ::fsync(fd) != 0) st = io_error(std::string("fsync failed: ") + std::strerror(errno));
  if (::close(fd) != 0 && st.ok()) st = io_error(std::string("close failed: ") + std::strerror(errno));
  if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    st = io_error(path + ": cannot rename the temporary file into place: " + std::strerror(errno));
  }
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    if (st.message().rfind(path, 0) != 0) return io_error(path + ": " + st.message());
  }
  return st;
}

}  // namespace sparseprefill
