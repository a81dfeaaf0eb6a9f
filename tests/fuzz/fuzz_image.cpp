// libFuzzer target for input images (klein's reference images and inpainting masks, PNG, JPEG
// with EXIF and WebP; a PNG's alpha too, as OpenAI's edits mask is read): any bytes must decode
// to a consistent image or raise apus::Error naming the file (libpng,
// libjpeg-turbo and libexif are not instrumented: their crashes count, the coverage is ours).
#include <cstring>

#include "fuzz_file.h"
#include "io/files.h"
#include "io/media/image.h"
#include "io/media/png.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = apus::fuzz::write_input("input.img", data, size);
  apus::fuzz::expect_only_apus_errors([&] {
    const apus::Rgb8Image image = apus::read_image(path);
    if (image.width <= 0 || image.height <= 0 || image.rgb.size() != size_t(image.width) * size_t(image.height) * 3)
      __builtin_trap();
    // An image that decodes was probed alike from its header.
    const apus::ImageSize header = apus::probe_image(apus::read_file(path), path);
    if (header.width != image.width || header.height != image.height) __builtin_trap();
  });
  if (size >= 8 && std::memcmp(data, "\x89PNG\r\n\x1a\n", 8) == 0)
    apus::fuzz::expect_only_apus_errors([&] {
      const apus::PngImage png = apus::decode_png(apus::read_file(path), path, /*with_alpha=*/true);
      const size_t pixels = size_t(png.width) * size_t(png.height);
      if (png.rgb.size() != 3 * pixels || png.alpha.size() != pixels) __builtin_trap();
    });
  return 0;
}
