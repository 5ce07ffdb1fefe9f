// SPDX-License-Identifier: Apache-2.0
// A dependency-free PNG writer: 8-bit RGB, no filtering, zlib stream of stored (uncompressed)
// deflate blocks, with our own CRC-32 and Adler-32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "sparseprefill/types.h"

namespace sparseprefill::cli {

// CRC-32 (ISO-HDLC, reflected polynomial 0xEDB88320) continuing from `crc` (0 to start).
std::uint32_t crc32(const std::uint8_t* data, std::size_t size, std::uint32_t crc = 0);
// Adler-32 (RFC 1950) continuing from `adler` (1 to start).
std::uint32_t adler32(const std::uint8_t* data, std::size_t size, std::uint32_t adler = 1);

// The PNG file bytes of an image whose pixels are rgb [height, width, 3].
std::vector<std::uint8_t> encode_png(int width, int height, const std::vector<std::uint8_t>& rgb);

// Writes encode_png(...) to a temporary file beside `path` and renames it into place.
Status write_png(const std::string& path, int width, int height,
                 const std::vector<std::uint8_t>& rgb);

}  // namespace sparseprefill::cli
