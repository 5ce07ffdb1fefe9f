// SPDX-License-Identifier: Apache-2.0
// PNG encoding with stored deflate blocks (RFC 1950/1951, PNG spec chunks IHDR, IDAT, IEND).
#include "png.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>

namespace sparseprefill::cli {

namespace {

std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t n = 0; n < 256; ++n) {
    std::uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[n] = c;
  }
  return table;
}

void put_u32_be(std::vector<std::uint8_t>* out, std::uint32_t x) {
  out->push_back(static_cast<std::uint8_t>(x >> 24));
  out->push_back(static_cast<std::uint8_t>(x >> 16));
  out->push_back(static_cast<std::uint8_t>(x >> 8));
  out->push_back(static_cast<std::uint8_t>(x));
}

// A chunk: length, type, data, CRC-32 over type and data.
void put_chunk(std::vector<std::uint8_t>* out, const char type[4],
               const std::vector<std::uint8_t>& data) {
  put_u32_be(out, static_cast<std::uint32_t>(data.size()));
  const std::size_t type_at = out->size();
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<std::uint8_t>(type[i]));
  out->insert(out->end(), data.begin(), data.end());
  put_u32_be(out, crc32(out->data() + type_at, 4 + data.size()));
}

}  // namespace

std::uint32_t crc32(const std::uint8_t* data, std::size_t size, std::uint32_t crc) {
  static const std::array<std::uint32_t, 256> table = make_crc_table();
  std::uint32_t c = crc ^ 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i) c = table[(c ^ data[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t adler32(const std::uint8_t* data, std::size_t size, std::uint32_t adler) {
  constexpr std::uint32_t kMod = 65521;
  std::uint32_t a = adler & 0xFFFFu, b = adler >> 16;
  for (std::size_t i = 0; i < size; ++i) {
    a = (a + data[i]) % kMod;
    b = (b + a) % kMod;
  }
  return (b << 16) | a;
}

std::vector<std::uint8_t> encode_png(int width, int height, const std::vector<std::uint8_t>& rgb) {
  // Scanlines: filter type 0 (None) then the row's RGB bytes.
  const std::size_t row_bytes = static_cast<std::size_t>(width) * 3;
  std::vector<std::uint8_t> raw;
  raw.reserve((row_bytes + 1) * static_cast<std::size_t>(height));
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);
    const auto* row = rgb.data() + static_cast<std::size_t>(y) * row_bytes;
    raw.insert(raw.end(), row, row + row_bytes);
  }

  // zlib: CMF 0x78 (deflate, 32K window), FLG 0x01 (0x7801 % 31 == 0, no dictionary), then
  // stored blocks of at most 65535 bytes (BFINAL on the last), then Adler-32 big-endian.
  std::vector<std::uint8_t> z = {0x78, 0x01};
  constexpr std::size_t kMaxStored = 65535;
  std::size_t pos = 0;
  do {
    const std::size_t n = std::min(kMaxStored, raw.size() - pos);
    const bool last = pos + n == raw.size();
    z.push_back(last ? 1 : 0);  // BFINAL, BTYPE = 00 (stored)
    const auto len = static_cast<std::uint16_t>(n);
    const auto nlen = static_cast<std::uint16_t>(~len);
    z.push_back(static_cast<std::uint8_t>(len & 0xFF));
    z.push_back(static_cast<std::uint8_t>(len >> 8));
    z.push_back(static_cast<std::uint8_t>(nlen & 0xFF));
    z.push_back(static_cast<std::uint8_t>(nlen >> 8));
    z.insert(z.end(), raw.begin() + static_cast<std::ptrdiff_t>(pos),
             raw.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
  } while (pos < raw.size());
  put_u32_be(&z, adler32(raw.data(), raw.size()));

  std::vector<std::uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<std::uint8_t> ihdr;
  put_u32_be(&ihdr, static_cast<std::uint32_t>(width));
  put_u32_be(&ihdr, static_cast<std::uint32_t>(height));
  ihdr.push_back(8);  // bit depth
  ihdr.push_back(2);  // colour type: truecolour (RGB)
  ihdr.push_back(0);  // compression: deflate
  ihdr.push_back(0);  // filter method 0
  ihdr.push_back(0);  // no interlace
  put_chunk(&png, "IHDR", ihdr);
  put_chunk(&png, "IDAT", z);
  put_chunk(&png, "IEND", {});
  return png;
}

Status write_png(const std::string& path, int width, int height,
                 const std::vector<std::uint8_t>& rgb) {
  if (width <= 0 || height <= 0 ||
      rgb.size() != static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3) {
    return invalid_argument("png: expected a non-empty image of width x height x 3 bytes");
  }
  const std::vector<std::uint8_t> png = encode_png(width, height, rgb);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return io_error(path + ": cannot open for writing");
    out.write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      return io_error(path + ": write failed");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return io_error(path + ": cannot rename the temporary file into place");
  }
  return Status::ok_status();
}

}  // namespace sparseprefill::cli
