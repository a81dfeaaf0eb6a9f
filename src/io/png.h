#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace apus {

// 8-bit RGB, rows top to bottom; `text` becomes tEXt chunks (A1111 reads "parameters"). `what`
// names the image in errors.
std::vector<uint8_t> encode_png(int width, int height, const std::vector<uint8_t>& rgb,
                                const std::vector<std::pair<std::string, std::string>>& text,
                                const std::string& what);
// encode_png's bytes written through a temporary file renamed into place.
void write_png(const std::string& path, int width, int height, const std::vector<uint8_t>& rgb,
               const std::vector<std::pair<std::string, std::string>>& text);

struct PngImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  std::vector<std::pair<std::string, std::string>> text;
};
PngImage read_png(const std::string& path);

}  // namespace apus
