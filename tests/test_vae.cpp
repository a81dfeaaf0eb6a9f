// The FLUX.2 VAE against the official pipeline (tools/oracle): the decoder path (the sampler's
// final packed latents through de-normalisation, unpatchify, vae.decode and the uint8
// postprocessing) and the encoder path (a reference image to packed, normalised tokens).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>

#include "io/weights/safetensors.h"
#include "models/flux2/latent_preview.h"
#include "models/flux2/vae_decoder.h"
#include "models/flux2/vae_encoder.h"
#include "test_util.h"

namespace apus {
namespace {

using test::Reference;

struct Case {
  std::string variant, precision;
};

class Flux2Vae : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    ctx.arena = &arena;
    ctx.act = test::precision_dtype(GetParam().precision);
  }
  // The pipeline hands vae the latents after its last scheduler step.
  std::string final_latents(const Reference& ref) const {
    return GetParam().precision + ".step" + std::to_string(ref.meta["steps"].get<int>() - 1) + ".latents";
  }
  Tensor packed(const Reference& ref, const flux2::VaeDecoder& vae, int64_t h, int64_t w) const {
    return ref.as(final_latents(ref), ctx.act, {h * w, vae.config().packed_channels()});
  }
  // The pipeline's postprocess: image [1, 3, H, W] -> H*W*3 interleaved bytes.
  std::vector<uint8_t> to_rgb8(const Tensor& image) {
    Tensor rgb = Tensor::heap({image.shape[2], image.shape[3], 3}, DType::u8);
    ops::image_to_rgb8(ctx, image, rgb);
    return {rgb.ptr<uint8_t>(), rgb.ptr<uint8_t>() + rgb.numel()};
  }
  Arena arena;
  Context ctx;
};

Tensor poisoned(Shape s, DType dt) {
  Tensor t = Tensor::heap(std::move(s), dt);
  std::fill_n(t.ptr<uint8_t>(), t.nbytes(), 0xff);  // NaN in both dtypes
  return t;
}

int max_abs_diff(const std::vector<uint8_t>& a, const Tensor& b) {
  EXPECT_EQ(int64_t(a.size()), b.numel());
  int most = 0;
  for (size_t i = 0; i < a.size() && int64_t(i) < b.numel(); ++i)
    most = std::max(most, std::abs(int(a[i]) - int(b.ptr<uint8_t>()[i])));
  return most;
}

TEST_P(Flux2Vae, UnpackMatchesPipelineVaeInput) {
  const auto& [variant, p] = GetParam();
  const Reference ref(variant);
  const auto vae = test::load_stage<flux2::VaeDecoder>(ModelDir::open(test::fixture(variant)), "vae");
  const auto grid = ref.meta["latent_grid_hw"].get<std::vector<int64_t>>();
  const int64_t h = grid[0], w = grid[1], pt = vae.config().patch;
  Tensor latents = poisoned({1, vae.config().latent_channels, pt * h, pt * w}, ctx.act);
  vae.unpack_latents(ctx, packed(ref, vae, h, w), h, w, latents);
  const double err = test::rel_l2(to_f32_vector(latents), ref.f32(p + ".vae.latents_in"));
  // Not bit-exact in fp32: torch's CPU float sqrt (MKL VML) is off by an ulp in a few of the
  // sqrt(running_var + eps) channels, where ours is correctly rounded.
  EXPECT_LT(err, 1e-6) << variant << " " << p;
  std::printf("[ measure ] vae latents_in %s rel L2 vs %s ref: %.3e\n", p.c_str(), p.c_str(), err);
}

TEST_P(Flux2Vae, DecodeMatchesReference) {
  const auto& [variant, p] = GetParam();
  const Reference ref(variant);
  const auto vae = test::load_stage<flux2::VaeDecoder>(ModelDir::open(test::fixture(variant)), "vae");
  const auto grid = ref.meta["latent_grid_hw"].get<std::vector<int64_t>>();
  const int64_t h = grid[0], w = grid[1], s = vae.config().pixels_per_token();
  ASSERT_EQ(h * s, ref.meta["height"].get<int64_t>());
  ASSERT_EQ(w * s, ref.meta["width"].get<int64_t>());
  Tensor image = poisoned({1, vae.config().out_channels, h * s, w * s}, ctx.act);
  vae.decode(ctx, packed(ref, vae, h, w), h, w, image);
  const std::vector<float> ours = to_f32_vector(image);
  test::expect_matches("vae image", p, ours, ref.f32("fp32.vae.image"), ref.f32("bf16.vae.image"));
  if (p == "bf16") {
    // The bound above includes the two runs' different sampler trajectories. For the decoder
    // alone, measure both bf16 decodes of the same bf16 latents against an fp32 decode of
    // them; ours stands in for the reference's, as the fp32 test pins it to it.
    Context f32_ctx{&arena, DType::f32};
    Tensor exact = poisoned(image.shape, DType::f32);
    vae.decode(f32_ctx, to_dtype(packed(ref, vae, h, w), DType::f32), h, w, exact);
    const std::vector<float> truth = to_f32_vector(exact);
    const double err = test::rel_l2(ours, truth), ref_err = test::rel_l2(ref.f32("bf16.vae.image"), truth);
    EXPECT_LT(err, test::kBf16Factor * ref_err)
        << variant << " decoder-only bf16 rel L2 " << err << ", reference's " << ref_err;
    std::printf("[ measure ] vae decoder-only bf16 rel L2 vs fp32 decode: ours %.3e, reference %.3e\n", err, ref_err);
  }

  const std::vector<uint8_t> rgb = to_rgb8(image);
  const int diff = max_abs_diff(rgb, ref.file.get(p + ".image_u8"));
  // Only fp32 has a byte bound: two bf16 decodes differ by bf16 noise (~1e-2 relative), which
  // moves some pixels by several levels.
  if (p == "fp32") EXPECT_LE(diff, 1) << variant;
  std::printf("[ measure ] vae rgb8 %s max |diff| vs %s image_u8: %d\n", p.c_str(), p.c_str(), diff);
}

// Fed the reference's own decoder output, the postprocessing must reproduce its bytes exactly.
TEST_P(Flux2Vae, PostprocessMatchesPipelineBytes) {
  const auto& [variant, p] = GetParam();
  const Reference ref(variant);
  const Tensor& ref_image = ref.file.get(p + ".vae.image");
  const std::vector<uint8_t> rgb = to_rgb8(to_dtype(ref_image, ctx.act));
  EXPECT_EQ(max_abs_diff(rgb, ref.file.get(p + ".image_u8")), 0) << variant << " " << p;
}

// A reference image through the encoder and the pipeline's normalisation and packing
// (tools/oracle: <variant>_refimage_ref.safetensors), fed the pipeline's own [-1, 1] input.
TEST_P(Flux2Vae, EncoderPacksAReferenceImageAsThePipeline) {
  const auto& [variant, p] = GetParam();
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture(variant + "_refimage_ref.safetensors"));
  const auto enc = test::load_stage<flux2::VaeEncoder>(ModelDir::open(test::fixture(variant)), "vae");
  const Tensor& in = ref.get(p + ".image_in");
  const Tensor image = to_dtype(in, ctx.act);
  const Tensor& want = ref.get("fp32.image_latents");
  Tensor packed = poisoned({want.shape[1], want.shape[2]}, ctx.act);
  enc.encode(ctx, image, packed);
  test::expect_matches("vae encoder", p, to_f32_vector(packed), to_f32_vector(want),
                       to_f32_vector(ref.get("bf16.image_latents")));
  // The processor's input is u8 / 255 * 2 - 1 in fp32, every value of the reference's.
  const Tensor& u8 = ref.get("image_u8");
  const int64_t hh = u8.shape[0], ww = u8.shape[1];
  for (int64_t ch = 0; ch < 3; ++ch)
    for (int64_t i = 0; i < hh * ww; ++i)
      ASSERT_EQ(in.ptr<float>()[ch * hh * ww + i], float(u8.ptr<uint8_t>()[i * 3 + ch]) / 255.0f * 2.0f - 1.0f) << i;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Flux2Vae,
                         ::testing::Values(Case{"klein_tiny_a", "fp32"}, Case{"klein_tiny_a", "bf16"},
                                           Case{"klein_tiny_b", "fp32"}, Case{"klein_tiny_b", "bf16"},
                                           Case{"klein_tiny_9b", "fp32"}, Case{"klein_tiny_9b", "bf16"}),
                         [](const auto& info) { return info.param.variant + "_" + info.param.precision; });

// The preview projection's fit and its image agree on the layout: colours planted as an exact
// affine map of random tokens (a different map for each quarter of a token's pixels and each
// colour) come back within half a level; fitted to the tiny VAE's own decode of random tokens, it
// is nearer those colours than their mean is (least squares with a bias always is, unless the fit
// and the image read the tokens, quarters or colours differently).
TEST(Vae, LatentPreviewFitsWhatItIsShownInItsLayout) {
  const int64_t side = 4, ch = 8, s = 4, px = side * s;
  std::mt19937 rng(test::test_seed());
  std::normal_distribution<float> normal;
  Tensor tokens = Tensor::heap({side * side, ch}, DType::f32);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.ptr<float>()[i] = normal(rng);
  std::vector<float> gains(12 * ch), image(size_t(3 * px * px));
  for (float& g : gains) g = 0.05f * normal(rng);
  for (int64_t t = 0; t < side * side; ++t)
    for (int q = 0; q < 4; ++q)
      for (int colour = 0; colour < 3; ++colour) {
        float v = 0.1f * float(colour) - 0.05f * float(q);
        for (int64_t k = 0; k < ch; ++k)
          v += gains[size_t((q * 3 + colour) * ch + k)] * tokens.ptr<float>()[t * ch + k];
        const int64_t y0 = (t / side) * s + (q / 2) * (s / 2), x0 = (t % side) * s + (q % 2) * (s / 2);
        for (int64_t y = y0; y < y0 + s / 2; ++y)
          for (int64_t x = x0; x < x0 + s / 2; ++x) image[size_t((colour * px + y) * px + x)] = v;
      }
  const Rgb8Image shown = flux2::LatentPreview::fit_to(tokens, image, side, s).image(tokens.ptr<float>(), side, side);
  ASSERT_EQ(shown.width, 2 * side);
  for (int64_t y = 0; y < 2 * side; ++y)
    for (int64_t x = 0; x < 2 * side; ++x)
      for (int colour = 0; colour < 3; ++colour) {
        const float planted = image[size_t((colour * px + y * (s / 2)) * px + x * (s / 2))];
        const double level = std::clamp((double(planted) + 1) * 127.5, 0.0, 255.0);
        EXPECT_LE(std::fabs(shown.rgb[size_t((y * 2 * side + x) * 3 + colour)] - level), 0.5 + 1e-3)
            << "pixel " << x << "," << y << " colour " << colour;
      }

  const auto vae = test::load_stage<flux2::VaeDecoder>(ModelDir::open(test::fixture("klein_tiny_a")), "vae");
  const int64_t vch = vae.config().latent_channels * 4, vs = vae.config().pixels_per_token(), vside = 16;
  Tensor random = Tensor::heap({vside * vside, vch}, DType::f32);
  for (int64_t i = 0; i < random.numel(); ++i) random.ptr<float>()[i] = normal(rng);
  Arena arena;
  Context c{&arena, DType::f32};
  Tensor decoded = ops::empty(c, {1, vae.config().out_channels, vside * vs, vside * vs}, DType::f32);
  vae.decode(c, random, vside, vside, decoded);
  const std::vector<float> pixels = to_f32_vector(decoded);
  const Rgb8Image fitted =
      flux2::LatentPreview::fit_to(random, pixels, vside, vs).image(random.ptr<float>(), vside, vside);
  const int64_t block = vs / 2, W = vside * vs, cells = 4 * vside * vside;
  double err = 0, flat = 0;
  for (int colour = 0; colour < 3; ++colour) {
    std::vector<double> truth;
    double mean = 0;
    for (int64_t y = 0; y < 2 * vside; ++y)
      for (int64_t x = 0; x < 2 * vside; ++x) {
        double sum = 0;
        for (int64_t dy = 0; dy < block; ++dy)
          for (int64_t dx = 0; dx < block; ++dx)
            sum += pixels[size_t((colour * W + y * block + dy) * W + x * block + dx)];
        truth.push_back((sum / double(block * block) + 1) * 127.5);
        mean += truth.back() / double(cells);
      }
    for (size_t i = 0; i < truth.size(); ++i) {
      err += std::pow(fitted.rgb[i * 3 + size_t(colour)] - truth[i], 2);
      flat += std::pow(mean - truth[i], 2);
    }
  }
  std::printf(
      "[ measure ] latent preview on the tiny VAE's own decode: squared error %.1f levels^2 (the mean colour's "
      "%.1f)\n",
      err / double(3 * cells), flat / double(3 * cells));
  EXPECT_LT(err, flat);
}

}  // namespace
}  // namespace apus
