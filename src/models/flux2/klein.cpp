#include "models/flux2/klein.h"

#include <algorithm>

#include "core/error.h"
#include "io/media/image.h"
#include "io/media/resize.h"

namespace apus {

std::vector<float> flux2::inpaint_mask(const Rgb8Image& mask, int width, int height) {
  APUS_CHECK(width % kTokenPixels == 0 && height % kTokenPixels == 0 && width > 0 && height > 0, "inpainting mask for ",
             width, "x", height, ": expected positive multiples of ", kTokenPixels);
  const Rgb8Image sized = mask.width == width && mask.height == height ? mask : resize_lanczos(mask, width, height);
  const std::vector<uint8_t> grey = luminance(sized);
  const int gh = height / kTokenPixels, gw = width / kTokenPixels;
  // torch's bilinear interpolation, align_corners false, in float: source = scale (i + 0.5) - 0.5,
  // clamped at 0, between the taps i0 and i0 + 1 (the last row or column repeating).
  struct Tap {
    int i0, i1;
    float l0, l1;
  };
  auto tap = [](int in, int out, int i) {
    const float scale = float(in) / float(out);
    const float src = std::max(scale * (float(i) + 0.5f) - 0.5f, 0.0f);
    const int i0 = int(src);
    const float l1 = src - float(i0);
    return Tap{i0, i0 + (i0 < in - 1 ? 1 : 0), 1.0f - l1, l1};
  };
  auto bit = [&](int y, int x) { return grey[size_t(y) * size_t(width) + size_t(x)] >= 128 ? 1.0f : 0.0f; };
  std::vector<float> weights;
  for (int gy = 0; gy < gh; ++gy) {
    const Tap ty = tap(height, gh, gy);
    for (int gx = 0; gx < gw; ++gx) {
      const Tap tx = tap(width, gw, gx);
      weights.push_back(ty.l0 * (tx.l0 * bit(ty.i0, tx.i0) + tx.l1 * bit(ty.i0, tx.i1)) +
                        ty.l1 * (tx.l0 * bit(ty.i1, tx.i0) + tx.l1 * bit(ty.i1, tx.i1)));
    }
  }
  return weights;
}

int flux2::inpaint_first_step(int steps, double strength) {
  const double run = std::min(double(steps) * strength, double(steps));
  return int(std::max(double(steps) - run, 0.0));
}

Tensor flux2::text_position_ids(int64_t tokens) {
  Tensor ids = Tensor::heap({tokens, 4}, DType::i64);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t a = 0; a < 4; ++a) ids.ptr<int64_t>()[4 * i + a] = a == 3 ? i : 0;
  return ids;
}

Tensor flux2::image_position_ids(int64_t h, int64_t w) { return image_and_reference_position_ids(h, w, {}); }

Tensor flux2::image_and_reference_position_ids(int64_t h, int64_t w,
                                               const std::vector<std::pair<int64_t, int64_t>>& references) {
  int64_t n = h * w;
  for (const auto& [rows, cols] : references) n += rows * cols;
  Tensor ids = Tensor::heap({n, 4}, DType::i64);
  int64_t* p = ids.ptr<int64_t>();
  auto grid = [&](int64_t t, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c, p += 4) {
        p[0] = t;
        p[1] = r;
        p[2] = c;
        p[3] = 0;
      }
  };
  grid(0, h, w);
  for (size_t k = 0; k < references.size(); ++k) grid(10 + 10 * int64_t(k), references[k].first, references[k].second);
  return ids;
}

flux2::KleinIndex flux2::check_klein_index(const ModelDir& dir) {
  const std::string index = dir.root() + "/model_index.json";
  KleinIndex k;
  k.reference_cache = dir.pipeline_class() == "Flux2KleinKVPipeline";
  APUS_CHECK(k.reference_cache || dir.pipeline_class() == "Flux2KleinPipeline", index, ": _class_name '",
             dir.pipeline_class(), "' is not supported (this build runs Flux2KleinPipeline and Flux2KleinKVPipeline)");
  const std::pair<const char*, std::vector<std::string>> components[] = {
      {"transformer", {"Flux2Transformer2DModel"}},
      {"vae", {"AutoencoderKLFlux2"}},
      {"text_encoder", {"Qwen3ForCausalLM", "Qwen3Model"}},
      {"tokenizer", {"Qwen2TokenizerFast", "Qwen2Tokenizer"}},
      {"scheduler", {"FlowMatchEulerDiscreteScheduler"}}};
  for (const auto& [name, classes] : components) {
    const std::string cls = dir.component_class(name);
    APUS_CHECK(std::find(classes.begin(), classes.end(), cls) != classes.end(), index, ": ", name, " class '", cls,
               "' is not supported (expected ", classes[0], ")");
  }
  // Absent, the pipeline's default holds.
  k.distilled = k.reference_cache;
  if (!dir.index().contains("is_distilled")) return k;
  const Json& distilled = dir.index()["is_distilled"];
  APUS_CHECK(distilled.is_boolean(), index, ": is_distilled is ", distilled.dump(), ", expected true or false");
  k.distilled = distilled.get<bool>();
  return k;
}

}  // namespace apus
