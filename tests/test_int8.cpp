// The int8 tier (io/weights/quant_weights.h): how weights are quantised, which tensors the
// transform takes, the linear's non-finite rows (both tiers'), and both families run with it
// against the official renders. The linear's arithmetic itself is held to the reference backend
// bit for bit in the op table (linear_int8_tier*).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>

#include "apus/apus.h"
#include "core/cost.h"
#include "core/scaled_codes.h"
#include "io/weights/quant_weights.h"
#include "io/weights/safetensors.h"
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/ops.h"
#include "pipeline/registry.h"
#include "pipeline/sa3/model_config.h"
#include "pipeline/sa3/sa3_model.h"
#include "sa3_fixtures.h"
#include "shadow_device.h"
#include "test_util.h"

namespace apus {
namespace {

// Each row's scale is its largest magnitude / 127, its largest element gets code +-127, and every
// code is the nearest: within half a step of the value (a truncating rule misses by up to a step).
TEST(Int8Weights, RowsQuantiseToTheNearestCodeOfTheirOwnScale) {
  std::mt19937 rng(test::test_seed());
  for (const DType dt : {DType::bf16, DType::f32}) {
    const int64_t n = 40, k = 300;
    Tensor w = test::random_weight(n, k, dt, rng);
    std::memset(w.row(7), 0, size_t(k) * dtype_size(dt));  // row 7 all zeros: scale 0, codes 0
    const Tensor q = quantize_int8_weight(w, "w");
    ASSERT_EQ(q.dtype, DType::i8);
    ASSERT_EQ(q.encoding.products, Products::int8);
    ASSERT_TRUE(q.encoding.block_scales);
    int64_t worst_row = -1;
    double worst = 0;
    for (int64_t r = 0; r < n; ++r) {
      float amax = 0;
      for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(load_f32(w, r * k + c)));
      const float scale = q.encoding.block_scales->at(r, 0);
      EXPECT_EQ(scale, amax / 127.0f) << "row " << r;
      int largest = 0;
      for (int64_t c = 0; c < k; ++c) {
        const int code = static_cast<const int8_t*>(q.row(r))[c];
        largest = std::max(largest, std::abs(code));
        const double miss = std::fabs(double(load_f32(w, r * k + c)) - double(code) * scale);
        if (scale > 0 && miss / scale > worst) {
          worst = miss / scale;
          worst_row = r;
        }
        EXPECT_EQ(decode_code_element(q, r, c), float(code) * scale);
      }
      EXPECT_EQ(largest, r == 7 ? 0 : 127) << "row " << r;
    }
    std::printf("[ measure ] %s: worst |w - code * scale| = %.6f steps (row %lld)\n",
                std::string(dtype_name(dt)).c_str(), worst, static_cast<long long>(worst_row));
    EXPECT_LE(worst, 0.5 + 1e-5);
  }
}

TEST(Int8Weights, NonFiniteWeightsAreRefusedNamingTheRow) {
  std::mt19937 rng(test::test_seed());
  Tensor w = test::random_weight(8, 64, DType::f32, rng);
  w.ptr<float>()[3 * 64 + 5] = std::numeric_limits<float>::infinity();
  test::expect_error([&] { quantize_int8_weight(w, "tensor 'blocks.0.to_q.weight'"); },
                     {"tensor 'blocks.0.to_q.weight'", "row 3", "NaN or an infinity"});
}

// What the transform takes: rank-2 "*.weight" tensors but the token embeddings; int8 codes with a
// scale a row are flagged as they are; weights quantised otherwise are refused, naming them.
TEST(Int8Weights, TheTransformTakesLinearWeightsOnly) {
  std::mt19937 rng(test::test_seed());
  const TierLinears t(Products::int8, TierScope{{"embed_tokens.weight"}});
  const Tensor w = test::random_weight(16, 32, DType::bf16, rng);
  const Tensor q = t.apply("layers.0.mlp.up_proj.weight", w);
  EXPECT_EQ(q.encoding.products, Products::int8);
  EXPECT_EQ(q.dtype, DType::i8);
  for (const char* kept : {"model.embed_tokens.weight", "layers.0.mlp.up_proj.bias", "memory_tokens"}) {
    const Tensor same = t.apply(kept, w);
    EXPECT_EQ(same.data, w.data) << kept;
    EXPECT_EQ(same.encoding.products, Products::decoded) << kept;
  }
  const Tensor norm = Tensor::heap({32}, DType::bf16);
  EXPECT_EQ(t.apply("norm.weight", norm).data, norm.data);
  // Counting mode: the dtype and flag without data.
  const Tensor counted = t.apply("proj_out.weight", Tensor::shape_only({16, 32}, DType::bf16));
  EXPECT_EQ(counted.dtype, DType::i8);
  EXPECT_EQ(counted.encoding.products, Products::int8);
  EXPECT_EQ(counted.data, nullptr);
  // A checkpoint's int8 codes with one scale a row: flagged, the codes untouched.
  Tensor stored = Tensor::heap({16, 32}, DType::i8);
  auto scales = std::make_shared<BlockScales>();
  scales->factors = Tensor::heap({16}, DType::f32);
  scales->block = 32;
  scales->per_row = 1;
  stored.encoding.block_scales = scales;
  const Tensor flagged = t.apply("to_out.weight", stored);
  EXPECT_EQ(flagged.encoding.products, Products::int8);
  EXPECT_EQ(flagged.data, stored.data);
  auto halves = std::make_shared<BlockScales>(*scales);
  halves->block = 16;
  halves->per_row = 2;
  stored.encoding.block_scales = halves;
  test::expect_error([&] { t.apply("to_out.weight", stored); }, {"to_out.weight", "2 scales per row"});
  test::expect_error(
      [&] {
        t.apply("to_q.weight", Tensor::heap({16, 32}, DType::q8_0));
      },
      {"tensor 'to_q.weight'", "q8_0", "quantised already"});
}

// A scope of a few names (the tier's share of SAME's decoder): those quantised, the others and any
// weight stored quantised otherwise left as stored.
TEST(Int8Weights, AScopeTakesItsNamesOnly) {
  std::mt19937 rng(test::test_seed());
  const TierLinears t(Products::int8, TierScope{{}, {"attn.to_qkv.weight", "attn.to_out.weight"}, true});
  const Tensor w = test::random_weight(16, 32, DType::bf16, rng);
  for (const char* taken : {"decoder.blocks.0.transformers.3.attn.to_qkv.weight", "transformers.0.attn.to_out.weight"})
    EXPECT_EQ(t.apply(taken, w).encoding.products, Products::int8) << taken;
  for (const char* kept : {"decoder.blocks.0.transformers.3.ff.proj_in.weight", "transformers.0.ff.proj_out.weight",
                           "decoder.proj.weight", "transformers.0.attn.to_qkv.bias"}) {
    const Tensor same = t.apply(kept, w);
    EXPECT_EQ(same.data, w.data) << kept;
    EXPECT_EQ(same.encoding.products, Products::decoded) << kept;
  }
  const Tensor q8 = Tensor::heap({16, 32}, DType::q8_0);
  EXPECT_EQ(t.apply("transformers.0.attn.to_qkv.weight", q8).data, q8.data);
}

// A row of x holding an infinity or a NaN gives a row of NaN on both backends, in both quantised
// tiers (int8 and fp8); the other rows stay finite.
TEST(QuantisedTiers, ANonFiniteInputRowGivesANanRow) {
  std::mt19937 rng(test::test_seed());
  const int64_t m = 6, k = 64, n = 20;
  for (const Products tier : {Products::int8, Products::fp8}) {
    if (tier == Products::int8 && !cpu::exact_int8_products()) continue;  // the int8 tier refuses this CPU
    const Tensor plain = test::random_weight(n, k, DType::bf16, rng);
    const Tensor w = quantize_tier_weight(plain, tier, "w");
    Tensor x = test::random_weight(m, k, DType::f32, rng);
    x.ptr<float>()[2 * k + 9] = std::numeric_limits<float>::infinity();
    x.ptr<float>()[4 * k] = std::numeric_limits<float>::quiet_NaN();
    for (Backend* b : {&cpu_backend(), &reference_backend()}) {
      Arena arena;
      Context c{&arena, DType::f32, nullptr, false, b};
      Tensor y = Tensor::heap({m, n}, DType::f32);
      ops::linear(c, x, w, nullptr, y);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < n; ++j)
          EXPECT_EQ(std::isnan(y.ptr<float>()[r * n + j]), r == 2 || r == 4)
              << b->name() << " " << dtype_name(w.dtype) << " row " << r;
    }
  }
}

// Both families with the tier, in fp32 activations from the oracle's fp32 noise: the tier moves
// the render, by less than the official code's own bf16 run is from its fp32 run.
TEST(Int8Tier, KleinRendersWithinTheOfficialBf16Disagreement) {
  if (!cpu::exact_int8_products()) GTEST_SKIP() << "this CPU has neither VNNI nor AVX2: the int8 tier refuses it";
  const test::Fp32ImageRequest r("klein_tiny_a");
  ModelParts parts{test::fixture("klein_tiny_a")};
  const std::vector<uint8_t> plain = ImageModel::open(parts, Weights::per_stage)->generate(r.request()).rgb;
  parts.quant = Quant::int8;
  const std::vector<uint8_t> int8 = ImageModel::open(parts, Weights::per_stage)->generate(r.request()).rgb;
  std::printf(
      "[ measure ] klein int8 tier (fp32 activations): mean |d| to the official fp32 image %.3f levels, "
      "the official bf16 image's %.3f\n",
      r.gap(int8), r.official_gap());
  EXPECT_NE(int8, plain) << "the tier changed nothing: is it applied?";
  EXPECT_LT(r.gap(int8), r.official_gap());
}

TEST(Int8Tier, Sa3ClipWithinTheOfficialBf16Disagreement) {
  if (!cpu::exact_int8_products()) GTEST_SKIP() << "this CPU has neither VNNI nor AVX2: the int8 tier refuses it";
  ModelParts parts{test::official_dir()};
  const AudioRequest r = test::reference_request(true);
  const std::vector<float> plain = AudioModel::open(parts, Weights::per_stage)->generate(r).samples;
  parts.quant = Quant::int8;
  const AudioResult int8 = AudioModel::open(parts, Weights::per_stage)->generate(r);
  EXPECT_NE(int8.samples, plain) << "the tier changed nothing: is it applied?";
  test::expect_within_official_bf16_disagreement("sa3 int8 tier", int8);
}

// On a device the tier's weights go up as codes with their row scales, and its linears give the
// CPU's bits (a GPU's integer sums are exact too): a klein image and an SA3 clip (with a DoRA) on
// the shadow device are the CPU's, byte for byte.
TEST(Int8Tier, OnADeviceComputesWhatTheCpuComputes) {
  if (!cpu::exact_int8_products()) GTEST_SKIP() << "this CPU has neither VNNI nor AVX2: the int8 tier refuses it";
  test::ShadowDevice& device = test::shadow_device();
  ModelParts klein{test::fixture("klein_tiny_a")};
  klein.quant = Quant::int8;
  const ImageRequest image = test::small_image_request("a red fox in the snow", 5);
  const ImageResult cpu_image = open_image_model(klein, Weights::per_stage, nullptr)->generate(image);
  const ImageResult dev_image = open_image_model(klein, Weights::per_stage, &device)->generate(image);
  EXPECT_TRUE(dev_image.rgb == cpu_image.rgb);
  ModelParts sa3{test::official_dir()};
  sa3.quant = Quant::int8;
  // With a DoRA, whose weight norms read the tier's codes back from the device with their scales.
  AudioRequest clip = test::reference_request(false);
  const Json dora = read_json(test::fixture("sa3_lora/reference.json"))["cases"].at("dora");
  for (const Json& l : dora)
    clip.loras.push_back({test::fixture("sa3_lora/" + l[0].get<std::string>()), l[1].get<float>()});
  const std::vector<float> cpu_clip = open_audio_model(sa3, Weights::per_stage, nullptr)->generate(clip).samples;
  const size_t before = device.ops_run();
  const std::vector<float> dev_clip = open_audio_model(sa3, Weights::per_stage, &device)->generate(clip).samples;
  EXPECT_GT(device.ops_run(), before + 100);
  ASSERT_EQ(dev_clip.size(), cpu_clip.size());
  EXPECT_EQ(std::memcmp(dev_clip.data(), cpu_clip.data(), cpu_clip.size() * sizeof(float)), 0);
  EXPECT_EQ(quant_linears(Quant::none, &device), nullptr);
  EXPECT_EQ(same_decoder_tier(Quant::none), nullptr);
}

TEST(Int8Tier, CountsItsWeightsAtAByte) {
  ModelParts parts{test::fixture("klein_tiny_a")};
  parts.quant = Quant::int8;
  if (!cpu::exact_int8_products()) {
    test::expect_error([&] { ImageModel::open(parts, Weights::none); }, {"--quant int8", "VNNI"});
    return;
  }
  // Counting prices the tier's weights at a byte each: the transformer's weight bytes halve.
  const auto bf16 = ImageModel::open(ModelParts{parts.model}, Weights::none);
  const auto int8 = ImageModel::open(parts, Weights::none);
  ImageRequest r;
  r.prompt = "a fox";
  r.width = 64;
  r.height = 48;
  const PipelineCost a = bf16->count(r), b = int8->count(r);
  auto dit_bytes = [](const PipelineCost& p) {
    for (const StageCost& s : p.stages)
      if (s.name == "dit_step") return s.per_call.weight_bytes;
    return 0.0;
  };
  std::printf("[ measure ] klein tiny DiT step bytes: bf16 weights %.0f, int8 tier %.0f\n", dit_bytes(a), dit_bytes(b));
  EXPECT_GT(dit_bytes(a), 0);
  EXPECT_LT(dit_bytes(b), dit_bytes(a));
}

// The tier takes SAME's attention projections and leaves its feed-forward: counted, the decoder's
// weight bytes drop by a byte for each element of to_qkv and to_out in every block, as the
// official config sizes them.
TEST(Int8Tier, TakesSameDecodersAttentionProjectionsOnly) {
  if (!cpu::exact_int8_products()) GTEST_SKIP() << "this CPU has neither VNNI nor AVX2: the int8 tier refuses it";
  const sa3::SameConfig same = sa3::read_official_config(test::official_dir() + "/model_config.json").same;
  const double projections = double(same.depth) * ((same.differential ? 5 : 3) + 1) * same.dim * same.dim;
  AudioRequest r;
  r.prompt = "rain";
  r.seconds = 1;
  auto decode_bytes = [&](const ModelParts& parts) {
    for (const StageCost& s : AudioModel::open(parts, Weights::none)->count(r).stages)
      if (s.name == "same_decode") return s.per_call.weight_bytes;
    return 0.0;
  };
  // The same tiny model in the official layout, in diffusers' and as sa3.cpp's GGUF files.
  ModelParts gguf{test::fixture("sa3_gguf/medium/stable-audio-3-medium-dit-tiny-v1.0-F32.gguf")};
  gguf.config = test::official_dir();
  for (ModelParts parts : {ModelParts{test::official_dir()}, ModelParts{test::pipeline_dir()}, gguf}) {
    const std::string dir = parts.model;
    const double bf16 = decode_bytes(parts);
    parts.quant = Quant::int8;
    const double int8 = decode_bytes(parts);
    std::printf("[ measure ] %s: SAME decode weight bytes bf16 %.0f, int8 tier %.0f; projections %.0f elements\n",
                dir.c_str(), bf16, int8, projections);
    EXPECT_EQ(bf16 - int8, projections) << dir;
  }
}

}  // namespace
}  // namespace apus
