#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace apus {

// 8-bit RGB, rows top to bottom; `text` becomes tEXt chunks (A1111 reads "parameters"). `what`
// names the image in errors.
std::vector<uint8_t> encode_png(int width, int height, const std::vector<uint8_t>& rgb,
                                const std::vector<std::pair<std::string, std::string>>& text, const std::string& what);
// encode_png's bytes written through a temporary file renamed into place.
void write_png(const std::string& path, int width, int height, const std::vector<uint8_t>& rgb,
               const std::vector<std::pair<std::string, std::string>>& text);

struct PngImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  std::vector<uint8_t> alpha;  // with_alpha: one per pixel (255 where the file has none)
  std::vector<std::pair<std::string, std::string>> text;
};
// The most pixels an input image may decode to (64 Mi), checked before decoding it.
constexpr int64_t kMaxDecodedPixels = int64_t(1) << 26;
// Any 8-bit (or narrower) PNG as RGB, as PIL's convert("RGB") makes it; refuses 16-bit samples
// and images over kMaxDecodedPixels before decoding them.
PngImage read_png(const std::string& path);
// The same from a file's bytes in memory; `what` names it in errors.
// with_alpha also keeps the alpha channel (or tRNS transparency) apart from the RGB.
PngImage decode_png(const std::string& bytes, const std::string& what, bool with_alpha = false);

struct ImageSize {
  int width = 0, height = 0;
};
// decode_png's size from the header alone, refusing what decode_png refuses there.
ImageSize probe_png(const std::string& bytes, const std::string& what);

}  // namespace apus
