// The family seam (issue 41): a third family, written in this file and registered by its
// descriptor alone (add_family), opens from a diffusers folder and from its own single file
// through the doors every front end uses (model_kind, ImageModel::open, AnyModel) and renders;
// the engine's own families still open and refuse as before beside it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/cost.h"
#include "io/weights/safetensors.h"
#include "io/weights/single_file.h"
#include "op_inputs.h"
#include "ops/ops.h"
#include "pipeline/family.h"
#include "pipeline/registry.h"
#include "test_util.h"

namespace apus {
namespace {

constexpr const char* kToyWeight = "toy.proj.weight";  // what tells the toy's single file
constexpr int kChannels = 4;                           // latent channels per 16x16 token

// The toy: one linear "DiT" (kChannels -> 3) over a seeded latent of kChannels per 16x16 token,
// and a pass-through "decoder" painting each token's three values as its tile's colour.
class ToyModel final : public ImageModel {
 public:
  ToyModel(std::shared_ptr<SingleFile> file, std::string label) : file_(std::move(file)), label_(std::move(label)) {}

  std::vector<ImageResult> generate_batch(const std::vector<ImageRequest>& requests, const Progress&,
                                          const std::atomic<bool>*) const override {
    std::vector<ImageResult> results;
    for (const ImageRequest& r : requests) {
      ImageResult out;
      out.width = r.width.value_or(32);
      out.height = r.height.value_or(32);
      out.seed = r.seed.value_or(0);
      out.steps = out.steps_run = 1;
      const Tensor latent = toy_latent(out.width / 16 * (out.height / 16), out.seed);
      Arena arena;
      Context c{&arena, DType::f32};
      Tensor colour = Tensor::heap({latent.shape[0], 3}, DType::f32);
      ops::linear(c, latent, weight(), nullptr, colour);
      out.rgb.resize(size_t(out.width * out.height * 3));
      for (int y = 0; y < out.height; ++y)
        for (int x = 0; x < out.width; ++x)
          for (int ch = 0; ch < 3; ++ch)
            out.rgb[size_t((y * out.width + x) * 3 + ch)] =
                pixel(colour.ptr<float>()[(y / 16 * (out.width / 16) + x / 16) * 3 + ch]);
      results.push_back(std::move(out));
    }
    return results;
  }
  PipelineCost count(const ImageRequest& r, int) const override {
    PipelineCost p;
    p.width = r.width.value_or(32);
    p.height = r.height.value_or(32);
    p.parameters = double(weight().numel());
    return p;
  }
  const std::string& label() const override { return label_; }
  const std::string& sampler() const override { return sampler_; }
  int default_steps() const override { return 1; }
  float default_cfg() const override { return 1; }
  bool takes_guidance() const override { return false; }

  const Tensor& weight() const { return file_->stored(kToyWeight); }
  // The latent a seed draws: a fixed function of the seed and the element's index.
  static Tensor toy_latent(int64_t tokens, uint64_t seed) {
    Tensor t = Tensor::heap({tokens, kChannels}, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = float(std::sin(double(seed) + 0.7 * double(i)));
    return t;
  }
  static uint8_t pixel(float v) { return uint8_t(std::lround(std::clamp((v + 1.0f) * 127.5f, 0.0f, 255.0f))); }

 private:
  std::shared_ptr<SingleFile> file_;
  std::string label_, sampler_ = "toy";
};

std::unique_ptr<ImageModel> open_toy(const ModelParts& parts, const std::string& root, Weights, Backend*) {
  const std::string file = root.empty() ? parts.model : root + "/transformer/toy.safetensors";
  return std::make_unique<ToyModel>(SingleFile::open(file), std::filesystem::path(file).filename().string());
}

FamilyDescriptor toy_family() {
  return {"the toy family",
          ModelKind::image,
          {"ToyPipeline"},
          nullptr,
          "a toy transformer (toy.proj.weight)",
          [](const std::string& path) { return SingleFile::open(path)->contains(kToyWeight); },
          open_toy,
          nullptr};
}

void write_toy_weight(const std::string& path, const Tensor& w) { write_safetensors(path, {{kToyWeight, w}}); }

TEST(ThirdFamily, RegisteredByItsDescriptorAloneOpensFromAFolderAndItsSingleFile) {
  add_family(toy_family());
  test::OpInputs in(DType::f32);
  const Tensor w = in.random({3, kChannels}, 0.5f);
  const std::string dir = ::testing::TempDir() + "toy_model", single = ::testing::TempDir() + "toy.safetensors";
  std::filesystem::create_directories(dir + "/transformer");
  std::ofstream(dir + "/model_index.json") << R"({"_class_name": "ToyPipeline"})";
  write_toy_weight(dir + "/transformer/toy.safetensors", w);
  write_toy_weight(single, w);

  ImageRequest r;
  r.prompt = "a toy";
  r.width = 48;
  r.height = 32;
  r.seed = 7;
  // What the toy must paint: the linear written out, token by token.
  const Tensor latent = ToyModel::toy_latent(3 * 2, 7);
  std::vector<uint8_t> want(size_t(48 * 32 * 3));
  for (int y = 0; y < 32; ++y)
    for (int x = 0; x < 48; ++x)
      for (int ch = 0; ch < 3; ++ch) {
        double v = 0;
        for (int k = 0; k < kChannels; ++k)
          v += double(latent.ptr<float>()[(y / 16 * 3 + x / 16) * kChannels + k]) *
               double(w.ptr<float>()[ch * kChannels + k]);
        want[size_t((y * 48 + x) * 3 + ch)] = ToyModel::pixel(float(v));
      }
  for (const std::string& model : {dir, single}) {
    SCOPED_TRACE(model);
    EXPECT_EQ(model_kind(ModelParts{.model = model}), ModelKind::image);
    const auto toy = ImageModel::open(ModelParts{.model = model}, Weights::per_stage);
    const ImageResult got = toy->generate(r);
    ASSERT_EQ(got.rgb.size(), want.size());
    int64_t off = 0;
    for (size_t i = 0; i < want.size(); ++i) off += std::abs(int(got.rgb[i]) - int(want[i])) > 1;
    EXPECT_EQ(off, 0) << "pixels off by more than the f32 rounding allows";
    EXPECT_EQ(AnyModel::open(ModelParts{.model = model}, Weights::none).kind(), ModelKind::image);
    // The other kind's door refuses it: a folder naming the command that serves its class, a
    // single file by the checks of that kind's only family (Stable Audio 3's: its key missing).
    if (model == dir)
      test::expect_error([&] { AudioModel::open(ModelParts{.model = model}, Weights::none); },
                         {"ToyPipeline is served by `apus image`"});
    else
      test::expect_error([&] { AudioModel::open(ModelParts{.model = model}, Weights::none); },
                         {"toy.safetensors", "missing tensor"});
  }
  // The engine's own families beside it: a klein folder still opens as klein, and a folder of an
  // unknown class names the toy's among the supported ones.
  EXPECT_EQ(ImageModel::open(test::fixture("klein_tiny_a"), Weights::none)->sampler(), "Euler (flow match)");
  const std::string unknown = ::testing::TempDir() + "unknown_model";
  std::filesystem::create_directories(unknown);
  std::ofstream(unknown + "/model_index.json") << R"({"_class_name": "OtherPipeline"})";
  test::expect_error([&] { ImageModel::open(unknown, Weights::none); }, {"OtherPipeline", "ToyPipeline"});
}

}  // namespace
}  // namespace apus
