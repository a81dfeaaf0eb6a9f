// Stable Audio 3 adapters against the official code (tools/oracle/make_sa3_lora_fixtures.py): LoRA
// and DoRA files the official trainer's helpers saved, loaded by the official load_lora and
// set_lora_strength on the tiny official checkpoint, and one of them in PEFT's layout.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "core/cost.h"
#include "io/media/audio.h"
#include "io/model_dir.h"
#include "io/weights/safetensors.h"
#include "pipeline/metadata.h"
#include "sa3_fixtures.h"
#include "test_util.h"

namespace apus {
namespace {

namespace fs = std::filesystem;
using test::interleaved;
using test::official_dir;
using test::reference_request;

std::string lora_file(const std::string& name) { return fs::absolute(test::fixture("sa3_lora/" + name)).string(); }

// The oracle's request with a case's adapters (reference.json).
AudioRequest lora_request(const std::string& c, bool fp32) {
  AudioRequest r = reference_request(fp32);
  const Json cases = read_json(test::fixture("sa3_lora/reference.json"))["cases"];
  for (const Json& l : cases.at(c)) r.loras.push_back({lora_file(l[0].get<std::string>()), l[1].get<float>()});
  return r;
}

std::vector<float> reference(const std::string& c) {
  static const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_lora/reference.safetensors"));
  return interleaved(ref.get(c + ".fp32.audio"));
}

// The official bf16 run's own distance from its fp32 run on this model, without adapters.
double bf16_self() {
  const SafetensorsFile t2a = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  return test::rel_l2(interleaved(t2a.get("bf16.audio")), interleaved(t2a.get("fp32.audio")));
}

class Sa3LoraCase : public ::testing::TestWithParam<const char*> {};

// Each case's clip within fp32 parity of the official one, bf16 within twice the official bf16
// run's own distance from fp32; the adapters move the clip beyond twice that bound (and a strength
// apart, far from each other), so a dropped adapter, a wrong scale or unpermuted fused rows fail.
TEST_P(Sa3LoraCase, GivesTheOfficialClip) {
  const std::string c = GetParam();
  const auto model = AudioModel::open(official_dir(), Weights::per_stage);
  const std::vector<float> want = reference(c), plain = reference("none");
  const double self = bf16_self();
  ASSERT_GT(test::rel_l2(want, plain), 2 * test::kBf16Factor * self) << c << ": the adapters barely change the clip";
  const AudioResult fp32 = model->generate(lora_request(c, true));
  ASSERT_EQ(fp32.samples.size(), want.size());
  const double err = test::rel_l2(fp32.samples, want);
  const double err_bf16 = test::rel_l2(model->generate(lora_request(c, false)).samples, want);
  std::printf(
      "[ measure ] sa3 lora %s: fp32 rel L2 %.3e, bf16 %.3e (official bf16's own %.3e); adapters move it %.3e\n",
      c.c_str(), err, err_bf16, self, test::rel_l2(want, plain));
  EXPECT_LT(err, test::kFp32Tolerance) << c;
  EXPECT_LT(err_bf16, test::kBf16Factor * self) << c;
}

INSTANTIATE_TEST_SUITE_P(Official, Sa3LoraCase,
                         ::testing::Values("official", "strength", "layer1", "pair", "dora", "dora_strength"));

TEST(Sa3Lora, StrengthsApartGiveClipsApart) {
  for (const auto& [a, b] : {std::pair{"official", "strength"}, std::pair{"dora", "dora_strength"}})
    EXPECT_GT(test::rel_l2(reference(a), reference(b)), 100 * test::kFp32Tolerance) << a << " vs " << b;
}

// PEFT's save_pretrained of layer1's factors on diffusers' transformer (its module names, fused rows
// in diffusers' order, the config beside the file): the same adapters, so the same clip bit for bit.
TEST(Sa3Lora, PeftLayoutGivesTheOfficialFilesClip) {
  const auto model = AudioModel::open(official_dir(), Weights::per_stage);
  for (const bool fp32 : {true, false}) {
    AudioRequest peft = reference_request(fp32);
    peft.loras = {{lora_file("peft/adapter_model.safetensors"), 1.0f}};
    EXPECT_EQ(model->generate(peft).samples, model->generate(lora_request("layer1", fp32)).samples) << fp32;
  }
}

// diffusers' folder holds the same weights under other names: the official file adapts it alike.
TEST(Sa3Lora, DiffusersLayoutTakesTheOfficialFormat) {
  const auto model = AudioModel::open(test::pipeline_dir(), Weights::per_stage);
  const double err = test::rel_l2(model->generate(lora_request("pair", true)).samples, reference("pair"));
  EXPECT_LT(err, test::kFp32Tolerance);
}

TEST(Sa3Lora, AResidentModelAppliesAndDropsAdaptersPerRequest) {
  const auto resident = AudioModel::open(official_dir(), Weights::resident);
  const std::vector<float> plain = resident->generate(reference_request(false)).samples;
  const AudioRequest pair = lora_request("pair", false), dora = lora_request("dora", false);
  const std::vector<float> with_pair = resident->generate(pair).samples;
  EXPECT_NE(with_pair, plain);
  EXPECT_EQ(resident->generate(reference_request(false)).samples, plain);
  EXPECT_EQ(resident->generate(dora).samples,
            AudioModel::open(official_dir(), Weights::per_stage)->generate(dora).samples);
  EXPECT_EQ(resident->generate(pair).samples, with_pair);
  EXPECT_EQ(resident->generate(reference_request(false)).samples, plain);
  const std::string comment = audio_comment(pair, resident->generate(pair), *resident, {});
  EXPECT_NE(comment.find("Lora: official.safetensors:0.7, Lora: layer1.safetensors:0.5"), std::string::npos) << comment;
}

// official.safetensors rewritten: its tensors through `change` (name, tensor -> kept?), its
// lora_config replaced when `config` is given.
template <typename Change>
std::string rewritten(const std::string& name, Change&& change, const std::string& config = "") {
  const SafetensorsFile f = SafetensorsFile::open(lora_file("official.safetensors"));
  std::vector<NamedTensor> tensors;
  for (const std::string& n : f.names()) {
    NamedTensor t{n, f.get(n)};
    if (change(t)) tensors.push_back(t);
  }
  std::map<std::string, std::string> metadata = f.metadata();
  if (!config.empty()) metadata["lora_config"] = config;
  const std::string path =
      ::testing::TempDir() + "sa3_lora_" + name + "_" + std::to_string(::getpid()) + ".safetensors";
  write_safetensors(path, tensors, metadata);
  return path;
}

TEST(Sa3Lora, WhatDoesNotFitIsRefusedNamingTheFileAndKey) {
  const auto model = AudioModel::open(official_dir(), Weights::none);
  auto refused = [&](const std::string& file, std::initializer_list<std::string> fragments, float scale = 1) {
    AudioRequest r = reference_request(false);
    r.loras = {{file, scale}};
    test::expect_error([&] { model->count(r, 1); }, fragments);
  };
  const std::string qkv = "model.transformer.layers.0.self_attn.to_qkv.parametrizations.weight.0.lora_A";
  refused(rewritten(
              "bora", [](NamedTensor&) { return true; }, R"({"rank": 4, "alpha": 8, "adapter_type": "bora"})"),
          {"sa3_lora_bora", "adapter_type 'bora'"});
  refused(rewritten(
              "rank", [](NamedTensor&) { return true; }, R"({"rank": 3, "adapter_type": "lora"})"),
          {"sa3_lora_rank", "rank 4", "lora_config rank is 3"});
  refused(rewritten(
              "exclude", [](NamedTensor&) { return true; }, R"({"exclude": ["layers.[0-0].self_attn"]})"),
          {"sa3_lora_exclude", "model.transformer.layers.0.self_attn", "include / exclude"});
  refused(rewritten(
              "config_key", [](NamedTensor&) { return true; }, R"({"rank": 4, "svd": true})"),
          {"lora_config", "'svd'"});
  refused(rewritten("unknown",
                    [](NamedTensor& t) {
                      if (t.name.starts_with("model.transformer.layers.0.self_attn.to_qkv."))
                        t.name.replace(0, 26, "model.transformer.layers.7");
                      return true;
                    }),
          {"model.transformer.layers.7.self_attn.to_qkv.parametrizations.weight.0", "names no Linear"});
  refused(rewritten("stacked",
                    [&](NamedTensor& t) {
                      if (t.name == qkv) t.name.replace(t.name.find(".0.lora_A"), 9, ".1.lora_A");
                      return true;
                    }),
          {"weight.1.lora_A", "index 1"});
  refused(rewritten("xs",
                    [&](NamedTensor& t) {
                      if (t.name == qkv) t.name.replace(t.name.size() - 6, 6, "M_xs");
                      return true;
                    }),
          {"weight.0.M_xs", "'M_xs'"});
  refused(rewritten("half", [&](NamedTensor& t) { return t.name != qkv; }), {"to_qkv", "lacks its lora_A"});
  // A shape that does not fit its weight (the fused rows cut by one block).
  refused(rewritten("shape",
                    [&](NamedTensor& t) {
                      if (t.name == "model.transformer.layers.0.self_attn.to_qkv.parametrizations.weight.0.lora_B")
                        t.tensor = t.tensor.rows(0, t.tensor.dim(0) / 5 * 4);
                      return true;
                    }),
          {"to_qkv.parametrizations.weight.0.lora_B", "does not fit"});
  // Another model's adapters: klein's PEFT LoRA; and PEFT's file without its config.
  refused(fs::absolute(test::fixture("klein_lora/peft.safetensors")).string(),
          {"klein_lora/peft.safetensors", "transformer.context_embedder", "names no linear of this Stable Audio 3"});
  const std::string bare = ::testing::TempDir() + "sa3_lora_bare_" + std::to_string(::getpid()) + ".safetensors";
  fs::copy_file(lora_file("peft/adapter_model.safetensors"), bare, fs::copy_options::overwrite_existing);
  refused(bare, {"sa3_lora_bare", "lora_alpha", "adapter_config.json"});
  // A DoRA after another adapter of the same weight, and a file refused even at strength 0.
  AudioRequest stacked = reference_request(false);
  stacked.loras = {{lora_file("official.safetensors"), 1}, {lora_file("dora.safetensors"), 1}};
  test::expect_error([&] { model->count(stacked, 1); }, {"dora.safetensors", "first adapter only"});
  refused(rewritten(
              "zero", [](NamedTensor&) { return true; }, R"({"adapter_type": "bora"})"),
          {"'bora'"}, 0.0f);
}

// A SA3 file on klein is no klein LoRA: klein's reader names its first key.
TEST(Sa3Lora, KleinRefusesAStableAudioLora) {
  const auto klein = ImageModel::open(test::fixture("klein_tiny_a"), Weights::none);
  ImageRequest r;
  r.prompt = "x";
  r.width = r.height = 64;
  r.loras = {{lora_file("official.safetensors"), 1}};
  test::expect_error([&] { klein->count(r, 1); },
                     {"official.safetensors", "parametrizations.weight.0", "no adapter tensor"});
}

TEST(Sa3Lora, TheCliTakesLoraFileAndStrength) {
  const AudioRequest req = lora_request("strength", true);
  const std::string out = ::testing::TempDir() + "sa3_lora_cli.wav";
  const test::CliRun r =
      test::run_cli("audio --model " + official_dir() + " --prompt " + test::shell_quote(req.prompt) + " --seconds " +
                    std::to_string(*req.seconds) + " --seed " + std::to_string(*req.seed) +
                    " --precision fp32 --format wav-float --lora " + req.loras[0].file + ":0.6 -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  const Audio a = read_audio(out, test::kTestClipSeconds);
  EXPECT_LT(test::rel_l2(a.samples, reference("strength")), test::kFp32Tolerance);
  const test::CliRun bad = test::run_cli("audio --model " + official_dir() + " --prompt x --seconds 1 --lora " +
                                         fs::absolute(test::fixture("klein_lora/peft.safetensors")).string());
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("names no linear of this Stable Audio 3"), std::string::npos) << bad.output;
  // klein's kohya LoRA: named for what it is not (once "a PEFT adapter needs its lora_alpha").
  const std::string kohya = fs::absolute(test::fixture("klein_lora/kohya.safetensors")).string();
  const test::CliRun image_lora =
      test::run_cli("audio --model " + official_dir() + " --prompt x --seconds 1 --lora " + kohya);
  EXPECT_NE(image_lora.status, 0);
  EXPECT_NE(image_lora.output.find(kohya + ": not a Stable Audio 3 adapter"), std::string::npos) << image_lora.output;
  EXPECT_NE(image_lora.output.find("kohya's layout"), std::string::npos) << image_lora.output;
}

}  // namespace
}  // namespace apus
