// A program embedding the engine as an installed package gives it: apus/apus.h and libapus.so
// through pkg-config, nothing of the sources. It renders a fixture model's image twice from one
// seed and checks the two agree and the image is not blank.
#include <apus/apus.h>

#include <algorithm>
#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR\n", argv[0]);
    return 2;
  }
  try {
    const auto model = apus::ImageModel::open(argv[1], apus::Weights::resident);
    const apus::ImageRequest request{.prompt = "a lighthouse", .width = 32, .height = 32, .steps = 2, .seed = 7};
    const apus::ImageResult a = model->generate(request), b = model->generate(request);
    const auto [lo, hi] = std::minmax_element(a.rgb.begin(), a.rgb.end());
    if (a.rgb != b.rgb || a.width != 32 || *lo == *hi) {
      std::fprintf(stderr, "error: the renders differ or are blank\n");
      return 1;
    }
    std::printf("apus %s rendered %dx%d from %s\n", apus::version(), a.width, a.height, model->label().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
