// The FLUX.2 VAE against the official pipeline (tools/oracle): the decoder path (the sampler's
// final packed latents through de-normalisation, unpatchify, vae.decode and the uint8
// postprocessing) and the encoder path (a reference image to packed, normalised tokens).
#include <algorithm>
#include <cstdlib>

#include "io/safetensors.h"
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

}  // namespace
}  // namespace apus
