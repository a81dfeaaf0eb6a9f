#pragma once
// Input images as the official pipelines receive them from diffusers' load_image: PIL decodes the
// file (PNG through libpng, JPEG through libjpeg-turbo, WebP through libwebp, here as in Pillow),
// ImageOps.exif_transpose
// turns a JPEG upright by its EXIF orientation, and convert("RGB") drops alpha and expands grey
// and palettes. Bad input is an apus::Error naming the file.
#include <string>
#include <vector>

#include "apus/apus.h"
#include "io/media/png.h"

namespace apus {

Rgb8Image read_image(const std::string& path);
// The same from a file's bytes in memory (a server's upload); `what` names it in errors.
Rgb8Image decode_image(const std::string& bytes, const std::string& what);
// decode_image's width and height (upright, as it returns them) from the header alone: what the
// header shows decode_image would refuse (format, pixel count, bit depth, CMYK, animation) is
// refused alike, naming `what`; damage in the pixel data is found only by decoding.
ImageSize probe_image(const std::string& bytes, const std::string& what);

// The formats apus writes images in: by a file's extension (.png, .jpg/.jpeg, .webp, any case) or
// by name (png, jpeg, webp), refused naming `what` otherwise.
enum class ImageFormat { png, jpeg, webp };
ImageFormat image_format_of_file(const std::string& path, const std::string& what);
ImageFormat image_format_named(const std::string& name, const std::string& what);
const char* image_mime_type(ImageFormat format);
// The image in `format`, its `metadata` as encode_png's text (PNG) or the "parameters" entry's
// text in EXIF (JPEG, WebP, below); quality for JPEG and WebP.
std::vector<uint8_t> encode_image(ImageFormat format, const Rgb8Image& image, int quality,
                                  const std::vector<std::pair<std::string, std::string>>& metadata,
                                  const std::string& what);

// An image as JPEG (libjpeg's baseline at `quality`, 1..100, 4:2:0 as Pillow's default) or WebP
// (libwebp, lossy at `quality`, 0..99, lossless at 100), with `parameters` (the generation
// parameters, as image_metadata gives them) in EXIF's UserComment where AUTOMATIC1111 writes and
// reads them in such files (none when empty). `what` names the image in errors.
std::vector<uint8_t> encode_jpeg(const Rgb8Image& image, int quality, const std::string& parameters,
                                 const std::string& what);
std::vector<uint8_t> encode_webp(const Rgb8Image& image, int quality, const std::string& parameters,
                                 const std::string& what);

// PIL's convert("L") of an RGB image: (299 R + 587 G + 114 B) / 1000 in its 16-bit fixed point,
// rounded. One byte per pixel.
std::vector<uint8_t> luminance(const Rgb8Image& image);

}  // namespace apus
