#include "io/media/png.h"

#include <png.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "io/files.h"

namespace apus {

namespace {
[[noreturn]] void png_error_fn(png_structp png, png_const_charp msg) {
  throw Error(std::string(static_cast<const char*>(png_get_error_ptr(png))) + ": " + msg);
}
void png_warning_fn(png_structp, png_const_charp) {}
}  // namespace

std::vector<uint8_t> encode_png(int width, int height, const std::vector<uint8_t>& rgb,
                                const std::vector<std::pair<std::string, std::string>>& text, const std::string& what) {
  APUS_CHECK(width > 0 && height > 0 && size_t(width) * size_t(height) * 3 == rgb.size(), what, ": ", rgb.size(),
             " bytes of pixels for a ", width, "x", height, " RGB image");
  std::vector<uint8_t> bytes;
  png_structp png =
      png_create_write_struct(PNG_LIBPNG_VER_STRING, const_cast<char*>(what.c_str()), png_error_fn, png_warning_fn);
  APUS_CHECK(png, what, ": out of memory creating the PNG writer");
  png_infop info = png_create_info_struct(png);
  // Frees both structs on every path out, the error path (a libpng error is thrown) included.
  struct Guard {
    png_structp* png;
    png_infop* info;
    ~Guard() { png_destroy_write_struct(png, info); }
  } guard{&png, &info};
  APUS_CHECK(info, what, ": out of memory creating the PNG writer");
  png_set_write_fn(
      png, &bytes,
      [](png_structp p, png_bytep data, png_size_t n) {
        auto* out = static_cast<std::vector<uint8_t>*>(png_get_io_ptr(p));
        out->insert(out->end(), data, data + n);
      },
      nullptr);
  png_set_IHDR(png, info, png_uint_32(width), png_uint_32(height), 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  std::vector<png_text> chunks(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    chunks[i].compression = PNG_TEXT_COMPRESSION_NONE;
    chunks[i].key = const_cast<char*>(text[i].first.c_str());
    chunks[i].text = const_cast<char*>(text[i].second.c_str());
    chunks[i].text_length = text[i].second.size();
  }
  if (!chunks.empty()) png_set_text(png, info, chunks.data(), int(chunks.size()));
  png_write_info(png, info);
  for (int y = 0; y < height; ++y) png_write_row(png, const_cast<uint8_t*>(rgb.data() + size_t(y) * size_t(width) * 3));
  png_write_end(png, info);
  return bytes;
}

void write_png(const std::string& path, int width, int height, const std::vector<uint8_t>& rgb,
               const std::vector<std::pair<std::string, std::string>>& text) {
  const std::vector<uint8_t> bytes = encode_png(width, height, rgb, text, path);
  write_whole_file(path, bytes.data(), bytes.size());
}

PngImage read_png(const std::string& path) { return decode_png(read_file(path), path); }

namespace {

// A PNG read from bytes in memory, its header read and checked at construction: what every read
// of the file refuses is refused before a pixel is decoded.
class PngReader {
 public:
  PngReader(const std::string& bytes, const std::string& what) : cursor_{&bytes, 0} {
    APUS_CHECK(bytes.size() >= 8 && png_sig_cmp(reinterpret_cast<png_const_bytep>(bytes.data()), 0, 8) == 0, what,
               ": not a PNG file");
    png = png_create_read_struct(PNG_LIBPNG_VER_STRING, const_cast<char*>(what.c_str()), png_error_fn, png_warning_fn);
    APUS_CHECK(png, what, ": out of memory creating the PNG reader");
    info = png_create_info_struct(png);
    if (!info) {
      png_destroy_read_struct(&png, nullptr, nullptr);
      fail(what, ": out of memory creating the PNG reader");
    }
    // Reads from the bytes in memory; running past their end is a truncated file.
    png_set_read_fn(png, &cursor_, [](png_structp p, png_bytep out, png_size_t n) {
      auto* c = static_cast<Cursor*>(png_get_io_ptr(p));
      if (n > c->bytes->size() - c->at) png_error(p, "truncated");
      std::memcpy(out, c->bytes->data() + c->at, n);
      c->at += n;
    });
    try {
      png_read_info(png, info);
      width = int(png_get_image_width(png, info));
      height = int(png_get_image_height(png, info));
      depth = png_get_bit_depth(png, info);
      APUS_CHECK(depth <= 8, what, ": ", depth, "-bit samples; expected an 8-bit (or narrower) PNG");
      APUS_CHECK(int64_t(width) * height <= kMaxDecodedPixels, what, ": ", width, "x", height, " pixels, over the ",
                 kMaxDecodedPixels, " this reader decodes");
    } catch (...) {
      png_destroy_read_struct(&png, &info, nullptr);
      throw;
    }
  }
  ~PngReader() { png_destroy_read_struct(&png, &info, nullptr); }
  PngReader(const PngReader&) = delete;
  PngReader& operator=(const PngReader&) = delete;

  png_structp png = nullptr;
  png_infop info = nullptr;
  int width = 0, height = 0, depth = 0;

 private:
  struct Cursor {
    const std::string* bytes;
    size_t at;
  } cursor_;
};

}  // namespace

ImageSize probe_png(const std::string& bytes, const std::string& what) {
  const PngReader reader(bytes, what);
  return {reader.width, reader.height};
}

PngImage decode_png(const std::string& bytes, const std::string& what, bool with_alpha) {
  PngReader reader(bytes, what);
  png_structp png = reader.png;
  png_infop info = reader.info;
  PngImage img;
  img.width = reader.width;
  img.height = reader.height;
  const int depth = reader.depth, type = png_get_color_type(png, info);
  // Every colour type as RGB the way PIL's convert("RGB") gives it: palettes looked up, grey
  // replicated (1, 2 and 4-bit grey widened to 8), alpha and transparency dropped, not composited.
  if (type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (type == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (type == PNG_COLOR_TYPE_GRAY || type == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
  if (png_get_valid(png, info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(png);
  const bool has_alpha = (type & PNG_COLOR_MASK_ALPHA) || png_get_valid(png, info, PNG_INFO_tRNS);
  if (!with_alpha) png_set_strip_alpha(png);
  else if (!has_alpha) png_set_add_alpha(png, 0xff, PNG_FILLER_AFTER);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const size_t channels = with_alpha ? 4 : 3, pixels = size_t(img.width) * size_t(img.height);
  APUS_CHECK(png_get_rowbytes(png, info) == size_t(img.width) * channels, what, ": rows of ",
             png_get_rowbytes(png, info), " bytes after conversion; expected ", size_t(img.width) * channels);
  std::vector<uint8_t> pixels_read(pixels * channels);
  std::vector<png_bytep> rows(size_t(img.height));
  for (int y = 0; y < img.height; ++y) rows[size_t(y)] = pixels_read.data() + size_t(y) * size_t(img.width) * channels;
  png_read_image(png, rows.data());
  png_read_end(png, info);
  if (with_alpha) {
    img.rgb.resize(pixels * 3);
    img.alpha.resize(pixels);
    for (size_t i = 0; i < pixels; ++i) {
      std::memcpy(&img.rgb[3 * i], &pixels_read[4 * i], 3);
      img.alpha[i] = pixels_read[4 * i + 3];
    }
  } else {
    img.rgb = std::move(pixels_read);
  }
  png_textp chunks = nullptr;
  const int n = png_get_text(png, info, &chunks, nullptr);
  for (int i = 0; i < n; ++i) img.text.emplace_back(chunks[i].key, chunks[i].text);
  return img;
}

}  // namespace apus
