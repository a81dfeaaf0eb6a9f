#include "io/media/image.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>

#include <jpeglib.h>
#include <libexif/exif-data.h>
#include <webp/decode.h>

#include "core/error.h"
#include "io/files.h"
#include "io/media/jpeg_errors.h"
#include "io/media/png.h"

namespace apus {

namespace {

// The EXIF orientation (1..8) of an APP1 Exif payload, 1 when absent or unreadable.
int exif_orientation(const uint8_t* data, unsigned size) {
  ExifData* exif = exif_data_new_from_data(data, size);
  if (!exif) return 1;
  int orientation = 1;
  if (ExifEntry* e = exif_data_get_entry(exif, EXIF_TAG_ORIENTATION))
    if (e->format == EXIF_FORMAT_SHORT && e->components >= 1 && e->size >= 2)
      orientation = exif_get_short(e->data, exif_data_get_byte_order(exif));
  exif_data_unref(exif);
  return orientation >= 1 && orientation <= 8 ? orientation : 1;
}

// PIL.ImageOps.exif_transpose: the transposition each orientation names, as a map from an
// output pixel to the source pixel it shows.
Rgb8Image upright(Rgb8Image src, int orientation) {
  if (orientation == 1) return src;
  const int64_t w = src.width, h = src.height;
  const bool swaps = orientation >= 5;
  Rgb8Image out{int(swaps ? h : w), int(swaps ? w : h), std::vector<uint8_t>(src.rgb.size())};
  for (int64_t oy = 0; oy < out.height; ++oy)
    for (int64_t ox = 0; ox < out.width; ++ox) {
      int64_t sx = ox, sy = oy;
      switch (orientation) {
        case 2:
          sx = w - 1 - ox;
          break;  // mirrored left to right
        case 3:
          sx = w - 1 - ox;
          sy = h - 1 - oy;
          break;  // rotated 180
        case 4:
          sy = h - 1 - oy;
          break;  // mirrored top to bottom
        case 5:
          sx = oy;
          sy = ox;
          break;  // transposed
        case 6:
          sx = oy;
          sy = h - 1 - ox;
          break;  // rotated 90 clockwise to be upright
        case 7:
          sx = w - 1 - oy;
          sy = h - 1 - ox;
          break;  // transversed
        case 8:
          sx = w - 1 - oy;
          sy = ox;
          break;  // rotated 90 counter-clockwise
      }
      std::memcpy(&out.rgb[size_t((oy * out.width + ox) * 3)], &src.rgb[size_t((sy * w + sx) * 3)], 3);
    }
  return out;
}

// Decodes with libjpeg's defaults, as Pillow does (islow DCT, fancy upsampling), into `out`;
// returns the EXIF orientation, or fills `error` (libjpeg's message) and returns 0. header_only:
// the header's checks and size (as stored, before the orientation), no pixel decoded. No object
// with a destructor lives in this frame across the setjmp.
int decode_jpeg_raw(const std::string& bytes, Rgb8Image& out, std::string& error, bool header_only) {
  jpeg_decompress_struct info;
  JpegErrors errors;
  info.err = jpeg_errors(errors);
  // Corrupt or truncated data is only a warning to libjpeg (it pads the image with grey); to
  // PIL it is an error, and here too: the last one is kept and reported after decoding.
  errors.mgr.emit_message = [](j_common_ptr c, int level) {
    if (level >= 0) return;
    auto* e = reinterpret_cast<JpegErrors*>(c->err);
    (*c->err->format_message)(c, e->message);
    ++c->err->num_warnings;
  };
  if (setjmp(errors.jump)) {
    error = errors.message;
    jpeg_destroy_decompress(&info);
    return 0;
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
  jpeg_save_markers(&info, JPEG_APP0 + 1, 0xffff);
  jpeg_read_header(&info, TRUE);
  int orientation = 1;
  for (jpeg_saved_marker_ptr m = info.marker_list; m; m = m->next)
    if (m->marker == JPEG_APP0 + 1 && m->data_length >= 6 && std::memcmp(m->data, "Exif\0\0", 6) == 0)
      orientation = exif_orientation(m->data, m->data_length);
  if (info.jpeg_color_space == JCS_CMYK || info.jpeg_color_space == JCS_YCCK) {
    std::snprintf(errors.message, sizeof errors.message, "a CMYK JPEG; expected RGB or greyscale");
    std::longjmp(errors.jump, 1);
  }
  if (int64_t(info.image_width) * int64_t(info.image_height) > kMaxDecodedPixels) {
    std::snprintf(errors.message, sizeof errors.message, "%ux%u pixels, over the %lld this reader decodes",
                  info.image_width, info.image_height, static_cast<long long>(kMaxDecodedPixels));
    std::longjmp(errors.jump, 1);
  }
  if (header_only) {
    out.width = int(info.image_width);
    out.height = int(info.image_height);
    jpeg_destroy_decompress(&info);
    return orientation;
  }
  info.out_color_space = JCS_RGB;  // greyscale replicated, as PIL's convert("RGB")
  jpeg_start_decompress(&info);
  out.width = int(info.output_width);
  out.height = int(info.output_height);
  out.rgb.resize(size_t(out.width) * size_t(out.height) * 3);
  while (info.output_scanline < info.output_height) {
    JSAMPROW row = out.rgb.data() + size_t(info.output_scanline) * size_t(out.width) * 3;
    jpeg_read_scanlines(&info, &row, 1);
  }
  jpeg_finish_decompress(&info);
  const bool damaged = errors.mgr.num_warnings > 0;
  jpeg_destroy_decompress(&info);
  if (damaged) {
    error = std::string("corrupt or truncated JPEG data (") + errors.message + ")";
    return 0;
  }
  return orientation;
}

// A still WebP's header, checked as decode_webp needs it.
WebPBitstreamFeatures webp_features(const std::string& bytes, const std::string& what) {
  WebPBitstreamFeatures features;
  APUS_CHECK(WebPGetFeatures(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &features) == VP8_STATUS_OK,
             what, ": not a readable WebP image");
  APUS_CHECK(!features.has_animation, what, ": an animated WebP; expected a still image");
  APUS_CHECK(
      features.width > 0 && features.height > 0 && int64_t(features.width) * features.height <= kMaxDecodedPixels, what,
      ": ", features.width, "x", features.height, " pixels, over the ", kMaxDecodedPixels, " this reader decodes");
  return features;
}

// libwebp's decoder, as Pillow's (fancy upsampling); alpha dropped as convert("RGB") drops it.
Rgb8Image decode_webp(const std::string& bytes, const std::string& what) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  const WebPBitstreamFeatures features = webp_features(bytes, what);
  Rgb8Image image{features.width, features.height,
                  std::vector<uint8_t>(size_t(features.width) * size_t(features.height) * 3)};
  APUS_CHECK(WebPDecodeRGBInto(data, bytes.size(), image.rgb.data(), image.rgb.size(), features.width * 3), what,
             ": corrupt or truncated WebP data");
  return image;
}

enum class ImageKind { png, webp, jpeg };

// The format by its signature; anything else is refused naming `what`.
ImageKind image_kind(const std::string& bytes, const std::string& what) {
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), "\x89PNG\r\n\x1a\n", 8) == 0) return ImageKind::png;
  if (bytes.size() >= 12 && std::memcmp(bytes.data(), "RIFF", 4) == 0 && std::memcmp(bytes.data() + 8, "WEBP", 4) == 0)
    return ImageKind::webp;
  APUS_CHECK(bytes.size() >= 3 && std::memcmp(bytes.data(), "\xff\xd8\xff", 3) == 0, what,
             ": not a PNG, JPEG or WebP image");
  return ImageKind::jpeg;
}

}  // namespace

Rgb8Image read_image(const std::string& path) { return decode_image(read_file(path), path); }

Rgb8Image decode_image(const std::string& bytes, const std::string& what) {
  switch (image_kind(bytes, what)) {
    case ImageKind::png: {
      PngImage png = decode_png(bytes, what);
      return {png.width, png.height, std::move(png.rgb)};
    }
    case ImageKind::webp:
      return decode_webp(bytes, what);
    case ImageKind::jpeg:
      break;
  }
  Rgb8Image image;
  std::string error;
  const int orientation = decode_jpeg_raw(bytes, image, error, /*header_only=*/false);
  APUS_CHECK(orientation > 0, what, ": ", error);
  return upright(std::move(image), orientation);
}

ImageSize probe_image(const std::string& bytes, const std::string& what) {
  switch (image_kind(bytes, what)) {
    case ImageKind::png:
      return probe_png(bytes, what);
    case ImageKind::webp: {
      const WebPBitstreamFeatures features = webp_features(bytes, what);
      return {features.width, features.height};
    }
    case ImageKind::jpeg:
      break;
  }
  Rgb8Image stored;
  std::string error;
  const int orientation = decode_jpeg_raw(bytes, stored, error, /*header_only=*/true);
  APUS_CHECK(orientation > 0, what, ": ", error);
  // Orientations 5 to 8 turn the image a quarter: upright, its sides swap.
  return orientation >= 5 ? ImageSize{stored.height, stored.width} : ImageSize{stored.width, stored.height};
}

std::vector<uint8_t> luminance(const Rgb8Image& image) {
  std::vector<uint8_t> grey(size_t(image.width) * size_t(image.height));
  for (size_t i = 0; i < grey.size(); ++i) {
    const uint8_t* p = image.rgb.data() + 3 * i;
    grey[i] = uint8_t((p[0] * 19595u + p[1] * 38470u + p[2] * 7471u + 0x8000u) >> 16);
  }
  return grey;
}

}  // namespace apus
