// LoRAs on klein: each layout users have (diffusers/PEFT with its adapter metadata, BFL /
// ai-toolkit with fused qkv, kohya with alpha), alone and two at once, renders diffusers' image
// with the same adapters and scales (tools/oracle/make_klein_lora_fixtures.py: load_lora_weights +
// set_adapters); a resident model serves adapted and plain requests from unchanged weights; what
// does not fit is refused naming the file and key.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "apus/apus.h"
#include "core/error.h"
#include "io/files.h"
#include "io/media/image.h"
#include "io/weights/safetensors.h"
#include "pipeline/metadata.h"
#include "test_util.h"

namespace apus {
namespace {

using test::expect_error;
using test::fixture;

// The oracle's images: "reference" (diffusers with each LoRA layout), "lycoris_reference" (PEFT
// with LoHa and LoKr).
struct LoraReference {
  explicit LoraReference(const std::string& name = "reference")
      : file(SafetensorsFile::open(fixture("klein_lora/" + name + ".safetensors"))),
        meta(nlohmann::json::parse(std::ifstream(fixture("klein_lora/" + name + ".json")))) {}
  SafetensorsFile file;
  nlohmann::json meta;

  ImageRequest request(const std::string& c, bool fp32) const {
    const nlohmann::json& r = meta["request"];
    ImageRequest q;
    q.prompt = r["prompt"];
    q.width = r["width"].get<int>();
    q.height = r["height"].get<int>();
    q.steps = r["steps"].get<int>();
    q.seed = r["seed"].get<uint64_t>();
    for (const nlohmann::json& a : meta["cases"][c])
      q.loras.push_back({fixture("klein_lora/" + a["file"].get<std::string>()), a["scale"].get<float>()});
    if (fp32) {
      // The fp32 reference ran from the bf16 draw: handed over as a file.
      q.fp32 = true;
      q.noise_file = test::scratch_dir.path() + "lora_noise.safetensors";
      write_safetensors(q.noise_file, {{"noise", file.get("fp32.noise")}});
    }
    return q;
  }
  const Tensor& image(const std::string& c, const char* precision) const {
    return file.get(c + "." + precision + ".image_u8");
  }
};

std::unique_ptr<ImageModel> tiny(Weights weights = Weights::per_stage) {
  return ImageModel::open(fixture("klein_tiny_a"), weights);
}

// The case's image in bf16 within the reference's own bf16/fp32 disagreement of both reference
// images and far from the adapter-free one; in fp32 within one level of the fp32 reference.
void expect_renders_reference(const LoraReference& ref, const std::string& c) {
  const auto model = tiny();
  // bf16 from the seed: the bound is the reference's own bf16-vs-fp32 disagreement on the bytes.
  const std::vector<uint8_t> bf16 = model->generate(ref.request(c, false)).rgb;
  const double disagreement = test::level_gap(ref.image(c, "bf16"), ref.image(c, "fp32")).mean;
  const double to_bf16 = test::level_gap(bf16, ref.image(c, "bf16")).mean;
  const double to_fp32 = test::level_gap(bf16, ref.image(c, "fp32")).mean;
  // Without the adapter the image is far outside that bound: the test sees a dropped adapter.
  const double moved = test::level_gap(bf16, ref.image("none", "bf16")).mean;
  std::printf(
      "[ measure ] adapter %s: mean |d| to bf16 ref %.3f, to fp32 ref %.3f, ref disagreement %.3f, "
      "to the adapter-free image %.3f\n",
      c.c_str(), to_bf16, to_fp32, disagreement, moved);
  EXPECT_LT(to_bf16, test::kBf16Factor * disagreement);
  EXPECT_LT(to_fp32, test::kBf16Factor * disagreement);
  EXPECT_GT(moved, 2 * test::kBf16Factor * disagreement);
  // fp32 from the same noise: PEFT's unmerged layers and ours differ only in fp32 rounding.
  const std::vector<uint8_t> fp32 = model->generate(ref.request(c, true)).rgb;
  EXPECT_LE(test::level_gap(fp32, ref.image(c, "fp32")).worst, 1);
}

class LoraLayout : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraLayout, RendersDiffusersImageWithTheSameAdapters) { expect_renders_reference(LoraReference(), GetParam()); }

// LyCORIS's LoHa and LoKr (w1 whole, and w1 factorised too), alone and a pair, against PEFT's
// layers of the same kind (diffusers' loaders read neither for FLUX.2).
class LycorisKind : public ::testing::TestWithParam<std::string> {};

TEST_P(LycorisKind, RendersPeftsImageWithTheSameAdapters) {
  expect_renders_reference(LoraReference("lycoris_reference"), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Klein, LycorisKind, ::testing::Values("loha", "lokr", "lokr_both", "pair"));

// LoKr and LoHa in BFL's names on the fused modules diffusers splits (img/txt qkv) or reorders (the
// final adaLN's halves), against PEFT's layer of that kind on each fused linear: a LoKr's parts
// and halves are rows of its outer Kronecker factor.
class LycorisOnFusedModules : public ::testing::TestWithParam<std::string> {};

TEST_P(LycorisOnFusedModules, RendersPeftsImageWithTheSameAdapters) {
  expect_renders_reference(LoraReference("lycoris_bfl_reference"), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Klein, LycorisOnFusedModules, ::testing::Values("bfl_lokr", "bfl_loha", "bfl_pair"));

INSTANTIATE_TEST_SUITE_P(Klein, LoraLayout, ::testing::Values("peft", "bfl", "kohya", "pair"));

TEST(Lora, AResidentModelAppliesAndDropsAdaptersPerRequest) {
  const LoraReference ref;
  const auto resident = tiny(Weights::resident);
  const std::vector<uint8_t> plain = tiny()->generate(ref.request("none", false)).rgb;
  const std::vector<uint8_t> pair = resident->generate(ref.request("pair", false)).rgb;
  EXPECT_NE(pair, plain);
  EXPECT_EQ(resident->generate(ref.request("none", false)).rgb, plain);
  EXPECT_EQ(resident->generate(ref.request("pair", false)).rgb, pair);
  // The adapters in the PNG's parameters.
  const ImageRequest request = ref.request("pair", false);
  const std::string text = infotext(request, resident->generate(request), *resident);
  EXPECT_NE(text.find("Lora: peft.safetensors:0.7, Lora: kohya.safetensors:0.5"), std::string::npos) << text;
}

// BFL's final adaLN holds (shift, scale); diffusers' norm_out.linear (scale, shift). A BFL LoRA on
// it adapts the swapped weight with its up's halves swapped (diffusers' converter leaves them
// unswapped, which adapts shift with scale's delta): the same image as the diffusers-named LoRA
// with the halves swapped by hand.
TEST(Lora, BflFinalAdaLnIsAdaptedWithItsHalvesSwapped) {
  const SafetensorsFile peft = SafetensorsFile::open(fixture("klein_lora/peft.safetensors"));
  const Tensor& down = peft.get("transformer.norm_out.linear.lora_A.weight");
  const Tensor& up = peft.get("transformer.norm_out.linear.lora_B.weight");
  Tensor swapped = Tensor::heap(up.shape, up.dtype);
  const size_t half = up.nbytes() / 2;
  std::memcpy(swapped.data, static_cast<const char*>(up.data) + half, half);
  std::memcpy(static_cast<char*>(swapped.data) + half, up.data, half);
  const std::string diffusers = test::scratch_dir.path() + "adaln_diffusers.safetensors",
                    bfl = test::scratch_dir.path() + "adaln_bfl.safetensors";
  write_safetensors(diffusers, {{"transformer.norm_out.linear.lora_A.weight", down},
                                {"transformer.norm_out.linear.lora_B.weight", up}});
  write_safetensors(bfl, {{"diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight", down},
                          {"diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight", swapped}});
  const LoraReference ref;
  ImageRequest a = ref.request("none", false), b = a;
  a.loras = {{diffusers, 1}};
  b.loras = {{bfl, 1}};
  const auto model = tiny();
  const std::vector<uint8_t> adapted = model->generate(a).rgb;
  EXPECT_NE(adapted, model->generate(ref.request("none", false)).rgb);
  EXPECT_EQ(model->generate(b).rgb, adapted);
}

// kohya-style names of diffusers' modules (lora_unet_ / lora_transformer_ + the module with _),
// with .alpha: the same adapter as PEFT's names at alpha / rank.
TEST(Lora, KohyaNamesOfDiffusersModulesAreRead) {
  const SafetensorsFile peft = SafetensorsFile::open(fixture("klein_lora/peft.safetensors"));
  const Tensor& down = peft.get("transformer.context_embedder.lora_A.weight");
  const Tensor& up = peft.get("transformer.context_embedder.lora_B.weight");
  Tensor alpha = Tensor::heap({}, DType::f32);
  alpha.ptr<float>()[0] = float(down.dim(0)) / 2;  // alpha / rank = 1/2
  const std::string named = test::scratch_dir.path() + "ctx_peft.safetensors";
  write_safetensors(named, {{"transformer.context_embedder.lora_A.weight", down},
                            {"transformer.context_embedder.lora_B.weight", up}});
  const LoraReference ref;
  ImageRequest want = ref.request("none", false);
  want.loras = {{named, 0.5f}};
  const auto model = tiny();
  const std::vector<uint8_t> expected = model->generate(want).rgb;
  EXPECT_NE(expected, model->generate(ref.request("none", false)).rgb);
  for (const char* prefix : {"lora_unet_", "lora_transformer_"}) {
    const std::string kohya = test::scratch_dir.path() + prefix + "ctx.safetensors";
    write_safetensors(kohya, {{std::string(prefix) + "context_embedder.lora_down.weight", down},
                              {std::string(prefix) + "context_embedder.lora_up.weight", up},
                              {std::string(prefix) + "context_embedder.alpha", alpha}});
    ImageRequest r = ref.request("none", false);
    r.loras = {{kohya, 1.0f}};
    EXPECT_EQ(model->generate(r).rgb, expected) << prefix;
  }
}

TEST(Lora, WhatDoesNotFitIsRefusedNamingTheFileAndKey) {
  const LoraReference ref;
  const auto model = tiny();
  const SafetensorsFile kohya = SafetensorsFile::open(fixture("klein_lora/kohya.safetensors"));
  auto with = [&](const std::string& name, std::vector<NamedTensor> tensors) {
    const std::string path = test::scratch_dir.path() + name;
    write_safetensors(path, tensors);
    ImageRequest r = ref.request("none", false);
    r.loras = {{path, 1}};
    return std::pair{path, r};
  };
  const Tensor& down = kohya.get("lora_unet_img_in.lora_down.weight");
  const Tensor& up = kohya.get("lora_unet_img_in.lora_up.weight");
  {
    const auto [path, r] = with("unknown.safetensors", {{"lora_unet_img_out.lora_down.weight", down},
                                                        {"lora_unet_img_out.lora_up.weight", up}});
    expect_error([&, req = r] { model->generate(req); }, {path, "lora_unet_img_out", "names no module"});
  }
  {
    // An adapter for a wider model: up has the wrong out features.
    const auto [path, r] =
        with("wider.safetensors",
             {{"diffusion_model.img_in.lora_A.weight", down},
              {"diffusion_model.img_in.lora_B.weight", kohya.get("lora_unet_final_layer_linear.lora_up.weight")}});
    expect_error([&, req = r] { model->generate(req); },
                 {path, "diffusion_model.img_in.lora_B.weight", "does not fit 'x_embedder.weight'"});
  }
  {
    const auto [path, r] = with("te.safetensors", {{"text_encoder.model.layers.0.mlp.up_proj.lora_A.weight", down}});
    expect_error([&, req = r] { model->generate(req); }, {path, "text_encoder.model.layers.0", "text encoder"});
  }
  {
    const auto [path, r] = with("dora.safetensors", {{"lora_unet_img_in.lora_down.weight", down},
                                                     {"lora_unet_img_in.lora_up.weight", up},
                                                     {"lora_unet_img_in.dora_scale", up}});
    expect_error([&, req = r] { model->generate(req); }, {path, "lora_unet_img_in.dora_scale", "DoRA"});
  }
  {
    // LoKr's Tucker (convolution) core, and a LoKr without its second factor.
    const SafetensorsFile lokr = SafetensorsFile::open(fixture("klein_lora/lokr.safetensors"));
    const Tensor& w1 = lokr.get("lycoris_x_embedder.lokr_w1");
    const auto [tucker, t] =
        with("tucker.safetensors", {{"lycoris_x_embedder.lokr_w1", w1}, {"lycoris_x_embedder.lokr_t2", w1}});
    expect_error([&, req = t] { model->generate(req); }, {tucker, "lycoris_x_embedder.lokr_t2", "Tucker"});
    const auto [half, h] = with("lokr_half.safetensors", {{"lycoris_x_embedder.lokr_w1", w1}});
    expect_error([&, req = h] { model->generate(req); }, {half, "lycoris_x_embedder.lokr_w1", "no lokr_w2_a"});
    // A LoHa whose second pair has another rank's shapes.
    const SafetensorsFile loha = SafetensorsFile::open(fixture("klein_lora/loha.safetensors"));
    std::vector<NamedTensor> tensors;
    for (const char* part : {"hada_w1_a", "hada_w1_b", "hada_w2_a"})
      tensors.push_back(
          {std::string("lycoris_x_embedder.") + part, loha.get(std::string("lycoris_x_embedder.") + part)});
    tensors.push_back({"lycoris_x_embedder.hada_w2_b", loha.get("lycoris_x_embedder.hada_w1_a")});
    const auto [odd, o] = with("loha_odd.safetensors", tensors);
    expect_error([&, req = o] { model->generate(req); }, {odd, "lycoris_x_embedder.hada_w2_b", "no LoHa"});
  }
  {
    const auto [path, r] = with("half.safetensors", {{"lora_unet_img_in.lora_down.weight", down}});
    expect_error([&, req = r] { model->generate(req); }, {path, "lora_unet_img_in", "no up"});
  }
  {
    // A truncated file.
    const std::string whole = read_file(fixture("klein_lora/kohya.safetensors"));
    const std::string path = test::scratch_dir.path() + "truncated.safetensors";
    std::ofstream(path, std::ios::binary) << whole.substr(0, whole.size() / 2);
    ImageRequest r = ref.request("none", false);
    r.loras = {{path, 1}};
    expect_error([&, req = r] { model->generate(req); }, {path});
  }
  {
    ImageRequest r = ref.request("none", false), other = r;
    r.loras = {{fixture("klein_lora/kohya.safetensors"), 1}};
    expect_error([&] { model->generate_batch({r, other}); }, {"LoRAs"});
  }
}

TEST(Lora, TheCliTakesLoraFileAndScale) {
  const LoraReference ref;
  const std::string out = test::scratch_dir.path() + "lora_cli.png";
  const test::CliRun r = test::run_cli("image --model " + fixture("klein_tiny_a") +
                                       " --prompt 'a red fox in tall grass' -W 64 -H 48 --seed 7 --lora " +
                                       fixture("klein_lora/peft.safetensors") + ":0.7 --lora " +
                                       fixture("klein_lora/kohya.safetensors") + ":0.5 -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  const PngImage png = read_png(out);
  EXPECT_EQ(png.rgb, tiny()->generate(ref.request("pair", false)).rgb);
  const test::CliRun bad =
      test::run_cli("image --model " + fixture("klein_tiny_a") + " --prompt x -W 64 -H 48 --lora " +
                    fixture("klein_lora/peft.safetensors") + ":inf -o " + out);
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("finite"), std::string::npos) << bad.output;
  // A scale past a float's range is a scale, not part of the file's name.
  const test::CliRun huge =
      test::run_cli("image --model " + fixture("klein_tiny_a") + " --prompt x -W 64 -H 48 --lora " +
                    fixture("klein_lora/peft.safetensors") + ":1e39 -o " + out);
  EXPECT_NE(huge.status, 0);
  EXPECT_NE(huge.output.find("the scale 1e39 is beyond a float's range"), std::string::npos) << huge.output;
}

}  // namespace
}  // namespace apus
