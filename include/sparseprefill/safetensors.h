// SPDX-License-Identifier: Apache-2.0
// Reading and writing safetensors files: an 8-byte little-endian header length, a JSON header
// (tensor name -> dtype, shape, data_offsets; "__metadata__" -> string map) and the raw data.
// Supported dtypes: BF16, F16, F32, I32. Every malformed, truncated or inconsistent file is a
// kCorruptData error that says what is wrong; nothing is ever read out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "sparseprefill/types.h"

namespace sparseprefill {

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, HostTensor> tensors;
};

Status parse_safetensors(const std::uint8_t* data, std::size_t size, SafetensorsFile* out);
Status read_safetensors(const std::string& path, SafetensorsFile* out);
// Writes to a temporary file beside `path` and renames it, so a failed write never leaves a
// partial file at `path`.
Status write_safetensors(const std::string& path, const SafetensorsFile& file);

}  // namespace sparseprefill
