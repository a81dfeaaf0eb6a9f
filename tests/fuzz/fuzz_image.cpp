// libFuzzer target for input images (klein's reference images, PNG and JPEG with EXIF): any
// bytes must decode to a consistent RGB image or raise apus::Error naming the file (libpng,
// libjpeg-turbo and libexif are not instrumented: their crashes count, the coverage is ours).
#include "fuzz_file.h"
#include "io/image.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = apus::fuzz::write_input("input.img", data, size);
  apus::fuzz::expect_only_apus_errors([&] {
    const apus::Rgb8Image image = apus::read_image(path);
    if (image.width <= 0 || image.height <= 0 ||
        image.rgb.size() != size_t(image.width) * size_t(image.height) * 3)
      __builtin_trap();
  });
  return 0;
}
