#pragma once
// Input images as the official pipelines receive them from diffusers' load_image: PIL decodes the
// file (PNG through libpng, JPEG through libjpeg-turbo, WebP through libwebp, here as in Pillow),
// ImageOps.exif_transpose
// turns a JPEG upright by its EXIF orientation, and convert("RGB") drops alpha and expands grey
// and palettes. Bad input is an apus::Error naming the file.
#include <string>
#include <vector>

#include "apus/apus.h"
#include "io/png.h"

namespace apus {

Rgb8Image read_image(const std::string& path);
// The same from a file's bytes in memory (a server's upload); `what` names it in errors.
Rgb8Image decode_image(const std::string& bytes, const std::string& what);
// decode_image's width and height (upright, as it returns them) from the header alone: what the
// header shows decode_image would refuse (format, pixel count, bit depth, CMYK, animation) is
// refused alike, naming `what`; damage in the pixel data is found only by decoding.
ImageSize probe_image(const std::string& bytes, const std::string& what);

// PIL's convert("L") of an RGB image: (299 R + 587 G + 114 B) / 1000 in its 16-bit fixed point,
// rounded. One byte per pixel.
std::vector<uint8_t> luminance(const Rgb8Image& image);

}  // namespace apus
