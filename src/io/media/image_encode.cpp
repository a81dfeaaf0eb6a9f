// Output images beside PNG (png.cpp): JPEG through libjpeg and WebP through libwebp, with the
// generation parameters where AUTOMATIC1111 writes them in such files, EXIF's UserComment
// ("UNICODE" and UTF-16 big-endian, as piexif's helper writes and reads it).
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include <jpeglib.h>
#include <libexif/exif-data.h>
#include <webp/encode.h>
#include <webp/mux.h>

#include "core/error.h"
#include "io/files.h"
#include "io/media/image.h"
#include "io/media/jpeg_errors.h"

namespace apus {

namespace {

// "Exif\0\0" and a TIFF structure holding one UserComment: the APP1 payload of a JPEG, the EXIF
// chunk of a WebP. Empty when there is no text.
std::vector<uint8_t> exif_user_comment(const std::string& text) {
  if (text.empty()) return {};
  std::vector<uint8_t> comment = {'U', 'N', 'I', 'C', 'O', 'D', 'E', 0};
  // UTF-8 to UTF-16BE (code points past U+FFFF as surrogate pairs; bytes that are not UTF-8 as
  // U+FFFD, as Python's 'replace').
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    uint32_t cp = 0xfffd;
    size_t len = 1;
    if (c < 0x80) cp = c;
    else if ((c >> 5) == 6 && i + 1 < text.size()) cp = (c & 0x1fu) << 6 | (text[i + 1] & 0x3fu), len = 2;
    else if ((c >> 4) == 14 && i + 2 < text.size())
      cp = (c & 0x0fu) << 12 | (text[i + 1] & 0x3fu) << 6 | (text[i + 2] & 0x3fu), len = 3;
    else if ((c >> 3) == 30 && i + 3 < text.size())
      cp = (c & 0x07u) << 18 | (text[i + 1] & 0x3fu) << 12 | (text[i + 2] & 0x3fu) << 6 | (text[i + 3] & 0x3fu),
      len = 4;
    i += len;
    auto unit = [&](uint32_t u) {
      comment.push_back(uint8_t(u >> 8));
      comment.push_back(uint8_t(u & 0xff));
    };
    if (cp >= 0x10000) {
      cp -= 0x10000;
      unit(0xd800 | (cp >> 10));
      unit(0xdc00 | (cp & 0x3ff));
    } else {
      unit(cp);
    }
  }
  ExifData* exif = exif_data_new();
  APUS_CHECK(exif, "EXIF: out of memory");
  exif_data_set_byte_order(exif, EXIF_BYTE_ORDER_INTEL);
  ExifMem* mem = exif_mem_new_default();
  ExifEntry* entry = exif_entry_new_mem(mem);
  entry->tag = EXIF_TAG_USER_COMMENT;
  entry->format = EXIF_FORMAT_UNDEFINED;
  entry->components = comment.size();
  entry->size = static_cast<unsigned int>(comment.size());
  entry->data = static_cast<unsigned char*>(exif_mem_alloc(mem, entry->size));
  std::memcpy(entry->data, comment.data(), comment.size());
  exif_content_add_entry(exif->ifd[EXIF_IFD_EXIF], entry);
  exif_entry_unref(entry);
  exif_mem_unref(mem);
  unsigned char* data = nullptr;
  unsigned int size = 0;
  exif_data_save_data(exif, &data, &size);
  std::vector<uint8_t> out(data, data + size);
  free(data);
  exif_data_unref(exif);
  APUS_CHECK(size > 6, "EXIF: the UserComment could not be written");
  return out;
}

// libjpeg's compression into `out`; fills `error` and returns false on its errors. No object with
// a destructor lives in this frame across the setjmp.
bool jpeg_compress(const Rgb8Image& image, int quality, const std::vector<uint8_t>& exif, unsigned char** out,
                   unsigned long* size, std::string& error) {
  jpeg_compress_struct info;
  JpegErrors errors;
  info.err = jpeg_errors(errors);
  if (setjmp(errors.jump)) {
    error = errors.message;
    jpeg_destroy_compress(&info);
    return false;
  }
  jpeg_create_compress(&info);
  jpeg_mem_dest(&info, out, size);
  info.image_width = JDIMENSION(image.width);
  info.image_height = JDIMENSION(image.height);
  info.input_components = 3;
  info.in_color_space = JCS_RGB;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, quality, TRUE);
  jpeg_start_compress(&info, TRUE);
  if (!exif.empty()) jpeg_write_marker(&info, JPEG_APP0 + 1, exif.data(), unsigned(exif.size()));
  while (info.next_scanline < info.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(image.rgb.data() + size_t(info.next_scanline) * size_t(image.width) * 3);
    jpeg_write_scanlines(&info, &row, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  return true;
}

void check_pixels(const Rgb8Image& image, const std::string& what) {
  APUS_CHECK(image.width > 0 && image.height > 0 && size_t(image.width) * size_t(image.height) * 3 == image.rgb.size(),
             what, ": ", image.rgb.size(), " bytes of pixels for a ", image.width, "x", image.height, " RGB image");
}

}  // namespace

std::vector<uint8_t> encode_jpeg(const Rgb8Image& image, int quality, const std::string& parameters,
                                 const std::string& what) {
  check_pixels(image, what);
  APUS_CHECK(quality >= 1 && quality <= 100, what, ": JPEG quality ", quality, " outside 1..100");
  APUS_CHECK(image.width <= 65500 && image.height <= 65500, what, ": ", image.width, "x", image.height,
             " is past JPEG's 65500-pixel sides");
  const std::vector<uint8_t> exif = exif_user_comment(parameters);
  APUS_CHECK(exif.size() <= 65533, what, ": the parameters (", parameters.size(), " bytes) do not fit a JPEG's EXIF");
  unsigned char* data = nullptr;
  unsigned long size = 0;
  std::string error;
  const bool ok = jpeg_compress(image, quality, exif, &data, &size, error);
  std::vector<uint8_t> out;
  if (ok) out.assign(data, data + size);
  free(data);
  APUS_CHECK(ok, what, ": JPEG: ", error);
  return out;
}

std::vector<uint8_t> encode_webp(const Rgb8Image& image, int quality, const std::string& parameters,
                                 const std::string& what) {
  check_pixels(image, what);
  APUS_CHECK(quality >= 0 && quality <= 100, what, ": WebP quality ", quality, " outside 0..100");
  APUS_CHECK(image.width <= WEBP_MAX_DIMENSION && image.height <= WEBP_MAX_DIMENSION, what, ": ", image.width, "x",
             image.height, " is past WebP's ", WEBP_MAX_DIMENSION, "-pixel sides");
  uint8_t* encoded = nullptr;
  // Quality 100 is lossless, as Pillow's `lossless` and OpenAI's output_compression 100 mean it.
  const size_t size =
      quality == 100
          ? WebPEncodeLosslessRGB(image.rgb.data(), image.width, image.height, image.width * 3, &encoded)
          : WebPEncodeRGB(image.rgb.data(), image.width, image.height, image.width * 3, float(quality), &encoded);
  APUS_CHECK(size > 0 && encoded, what, ": WebP encoding failed");
  std::vector<uint8_t> plain(encoded, encoded + size);
  WebPFree(encoded);
  const std::vector<uint8_t> exif = exif_user_comment(parameters);
  if (exif.empty()) return plain;
  // The EXIF chunk holds the TIFF structure without the JPEG's "Exif\0\0" header.
  WebPMux* mux = WebPMuxNew();
  const WebPData image_data{plain.data(), plain.size()};
  const WebPData exif_data{exif.data() + 6, exif.size() - 6};
  WebPData assembled{nullptr, 0};
  const bool ok = mux && WebPMuxSetImage(mux, &image_data, 1) == WEBP_MUX_OK &&
                  WebPMuxSetChunk(mux, "EXIF", &exif_data, 1) == WEBP_MUX_OK &&
                  WebPMuxAssemble(mux, &assembled) == WEBP_MUX_OK;
  std::vector<uint8_t> out;
  if (ok) out.assign(assembled.bytes, assembled.bytes + assembled.size);
  WebPDataClear(&assembled);
  WebPMuxDelete(mux);
  APUS_CHECK(ok, what, ": WebP: the parameters' EXIF chunk could not be added");
  return out;
}

ImageFormat image_format_named(const std::string& name, const std::string& what) {
  if (name == "png") return ImageFormat::png;
  if (name == "jpeg" || name == "jpg") return ImageFormat::jpeg;
  if (name == "webp") return ImageFormat::webp;
  fail(what, ": the image format '", name, "' is not one of png, jpeg, webp");
}

ImageFormat image_format_of_file(const std::string& path, const std::string& what) {
  const std::string ext = extension_of(path);
  APUS_CHECK(ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".webp", what, " ", path,
             ": apus writes images as .png, .jpg (or .jpeg) and .webp files");
  return image_format_named(ext.substr(1), what);
}

const char* image_mime_type(ImageFormat format) {
  return format == ImageFormat::jpeg ? "image/jpeg" : format == ImageFormat::webp ? "image/webp" : "image/png";
}

std::vector<uint8_t> encode_image(ImageFormat format, const Rgb8Image& image, int quality,
                                  const std::vector<std::pair<std::string, std::string>>& metadata,
                                  const std::string& what) {
  if (format == ImageFormat::png) return encode_png(image.width, image.height, image.rgb, metadata, what);
  std::string parameters;
  for (const auto& [key, value] : metadata)
    if (key == "parameters") parameters = value;
  return format == ImageFormat::jpeg ? encode_jpeg(image, quality, parameters, what)
                                     : encode_webp(image, quality, parameters, what);
}

}  // namespace apus
