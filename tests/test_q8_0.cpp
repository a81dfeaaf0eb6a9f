// `--quant q8_0` (io/weights/quant_weights.h): weights quantised at load into GGUF's Q8_0 blocks as
// llama.cpp's reference quantiser writes them, which tensors the transform takes, and both
// families rendered with it against the official renders. The blocks' decoding is GgufBlocks'
// (bit for bit gguf-py's, test_gguf.cpp), the linears' use of them the op table's stored-weight
// cases.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "apus/apus.h"
#include "core/cost.h"
#include "io/weights/gguf.h"
#include "io/weights/quant_weights.h"
#include "pipeline/registry.h"
#include "sa3_fixtures.h"
#include "test_util.h"

namespace apus {
namespace {

// A Q8_0 block's scale as fp32 (its f16 field).
float block_scale(const Tensor& q, int64_t r, int64_t b) {
  uint16_t d;
  std::memcpy(&d, static_cast<const uint8_t*>(q.row(r)) + b * dtype_block_bytes(DType::q8_0), 2);
  return f16_to_f32(d);
}
int8_t block_code(const Tensor& q, int64_t r, int64_t i) {
  const int64_t per = dtype_block(DType::q8_0);
  return int8_t(static_cast<const uint8_t*>(q.row(r))[i / per * dtype_block_bytes(DType::q8_0) + 2 + i % per]);
}

// gguf-py's quantiser (tools/oracle/make_gguf_fixtures.py: f32.values as q8_0.quantized) bit for
// bit: the layout (the f16 scale, then 32 codes), the scale from each block's largest magnitude and
// the codes from it; and gguf-py's blocks of another tensor, decoded and quantised again, are their
// own bytes.
TEST(Q8_0Weights, QuantisesAsGgufPyQuantises) {
  const GgufFile g = GgufFile::open(test::fixture("gguf/blocks.gguf"));
  const Tensor& values = g.get("f32.values");
  const Tensor& theirs = g.get("q8_0.quantized");
  const Tensor mine = quantize_q8_0_weight(values, "f32.values");
  ASSERT_EQ(mine.dtype, DType::q8_0);
  ASSERT_EQ(mine.nbytes(), theirs.nbytes());
  EXPECT_EQ(std::memcmp(mine.data, theirs.data, theirs.nbytes()), 0);

  const Tensor& cube = g.get("q8_0.cube");
  const int64_t cols = cube.shape.back(), rows = cube.numel() / cols;
  Tensor decoded = Tensor::heap({rows, cols}, DType::f32);
  const std::vector<float> v = to_f32_vector(cube);
  std::memcpy(decoded.data, v.data(), v.size() * sizeof(float));
  const Tensor again = quantize_q8_0_weight(decoded, "q8_0.cube");
  ASSERT_EQ(again.nbytes(), cube.nbytes());
  EXPECT_EQ(std::memcmp(again.data, cube.data, cube.nbytes()), 0);
}

// Codes are roundf(x / d) with d = max |x| / 127 in fp32 (llama.cpp's quantize_row_q8_0_ref):
// halves round away from zero, where a round-to-even rule would not; every code of random rows
// within half a step of x / d; an all-zero block has the scale 0 and codes 0.
TEST(Q8_0Weights, CodesRoundHalfAwayFromZeroAgainstTheFp32Scale) {
  Tensor ties = Tensor::heap({1, 64}, DType::f32);
  std::fill_n(ties.ptr<float>(), 64, 0.0f);
  const float row[] = {127.0f, 2.5f, -2.5f, 3.5f, -0.5f, 0.5f, 126.5f};
  std::copy(std::begin(row), std::end(row), ties.ptr<float>());
  const Tensor q = quantize_q8_0_weight(ties, "ties");
  EXPECT_EQ(block_scale(q, 0, 0), 1.0f);
  const int want[] = {127, 3, -3, 4, -1, 1, 127};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(block_code(q, 0, i), want[i]) << "element " << i;
  EXPECT_EQ(block_scale(q, 0, 1), 0.0f);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(block_code(q, 0, i), 0);

  const unsigned seed = test::test_seed();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  Tensor w = Tensor::heap({8, 256}, DType::f32);
  for (int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = normal(rng);
  const Tensor r = quantize_q8_0_weight(w, "random");
  for (int64_t row_i = 0; row_i < 8; ++row_i)
    for (int64_t b = 0; b < 8; ++b) {
      float amax = 0;
      for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(w.ptr<float>()[row_i * 256 + b * 32 + i]));
      const float d = amax / 127.0f;
      EXPECT_EQ(block_scale(r, row_i, b), f16_to_f32(f32_to_f16(d))) << "seed " << seed;
      for (int64_t i = 0; i < 32; ++i) {
        const float x = w.ptr<float>()[row_i * 256 + b * 32 + i] * (1.0f / d);
        EXPECT_LE(std::fabs(x - float(block_code(r, row_i, b * 32 + i))), 0.5f) << "seed " << seed;
      }
    }
}

// A NaN or an infinity, or a block whose scale f16 cannot hold, is refused naming the tensor and
// the row; rows that are not whole blocks are refused by the quantiser (the transform leaves them).
TEST(Q8_0Weights, WhatQ8_0CannotHoldIsRefusedNamingTheRow) {
  Tensor w = Tensor::heap({4, 64}, DType::f32);
  std::fill_n(w.ptr<float>(), w.numel(), 0.25f);
  w.ptr<float>()[2 * 64 + 40] = std::numeric_limits<float>::quiet_NaN();
  test::expect_error([&] { quantize_q8_0_weight(w, "tensor 'blocks.0.to_q.weight'"); },
                     {"tensor 'blocks.0.to_q.weight'", "row 2", "NaN"});
  w.ptr<float>()[2 * 64 + 40] = 0.25f;
  w.ptr<float>()[1 * 64 + 3] = 1e7f;  // d = 78740: past f16's 65504
  test::expect_error([&] { quantize_q8_0_weight(w, "tensor 'x.weight'"); }, {"tensor 'x.weight'", "row 1", "f16"});
  test::expect_error(
      [&] {
        quantize_q8_0_weight(Tensor::heap({2, 48}, DType::f32), "tensor 'y.weight'");
      },
      {"tensor 'y.weight'", "48", "whole Q8_0 blocks"});
}

// What the transform takes: rank-2 "*.weight" tensors whose rows are whole 32-blocks, the token
// table among them; a bias, a norm, rows of 17 values and weights stored quantised already stay as
// they are; counting mode gets the Q8_0 shape without data.
TEST(Q8_0Weights, TheTransformTakesWholeBlockMatricesOnly) {
  const Q8Linears t;
  Tensor w = Tensor::heap({16, 64}, DType::bf16);
  std::fill_n(w.ptr<uint16_t>(), w.numel(), f32_to_bf16(0.5f));
  for (const char* taken : {"layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"})
    EXPECT_EQ(t.apply(taken, w).dtype, DType::q8_0) << taken;
  for (const char* kept : {"layers.0.mlp.up_proj.bias", "memory_tokens"}) EXPECT_EQ(t.apply(kept, w).data, w.data);
  const Tensor norm = Tensor::heap({64}, DType::bf16), narrow = Tensor::heap({16, 17}, DType::bf16),
               stored = Tensor::heap({16, 256}, DType::q4_k);
  EXPECT_EQ(t.apply("norm.weight", norm).data, norm.data);
  EXPECT_EQ(t.apply("local.0.weight", narrow).data, narrow.data);
  EXPECT_EQ(t.apply("to_q.weight", stored).data, stored.data);
  const Tensor counted = t.apply("proj_out.weight", Tensor::shape_only({16, 64}, DType::bf16));
  EXPECT_EQ(counted.dtype, DType::q8_0);
  EXPECT_EQ(counted.data, nullptr);
  EXPECT_EQ(quant_linears(Quant::none, nullptr), nullptr);
}

// Both families with q8_0 from the oracle's fp32 noise in fp32 activations: the blocks move the
// render, by less than the official code's own bf16 run is from its fp32 run.
TEST(Q8_0, KleinAndSa3RenderWithinTheOfficialBf16Disagreement) {
  const test::Fp32ImageRequest image("klein_tiny_a");
  ModelParts klein{test::fixture("klein_tiny_a")};
  const std::vector<uint8_t> plain = ImageModel::open(klein, Weights::per_stage)->generate(image.request()).rgb;
  klein.quant = Quant::q8_0;
  const std::vector<uint8_t> q8 = ImageModel::open(klein, Weights::per_stage)->generate(image.request()).rgb;
  std::printf(
      "[ measure ] klein q8_0 (fp32 activations): mean |d| to the official fp32 image %.3f levels, "
      "the official bf16 image's %.3f\n",
      image.gap(q8), image.official_gap());
  EXPECT_NE(q8, plain) << "q8_0 changed nothing: is it applied?";
  EXPECT_LT(image.gap(q8), image.official_gap());

  ModelParts sa3{test::official_dir()};
  const AudioRequest r = test::reference_request(true);
  const std::vector<float> as_stored = AudioModel::open(sa3, Weights::per_stage)->generate(r).samples;
  sa3.quant = Quant::q8_0;
  const AudioResult clip = AudioModel::open(sa3, Weights::per_stage)->generate(r);
  EXPECT_NE(clip.samples, as_stored) << "q8_0 changed nothing: is it applied?";
  test::expect_within_official_bf16_disagreement("sa3 q8_0", clip);
}

// Counting prices q8_0's weights at 34 bytes a block of 32: klein 4B's DiT step weights 0.53 of
// bf16's (~98 % of its parameters are in the blocks' linears).
TEST(Q8_0, CountsItsWeightsAtTheirBlocksBytes) {
  ModelParts parts;
  parts.model = "flux2-klein-4b";
  ImageRequest r;
  r.width = 512;
  r.height = 512;
  auto dit_bytes = [&](Quant quant) {
    parts.quant = quant;
    for (const StageCost& s : ImageModel::open(parts, Weights::none)->count(r).stages)
      if (s.name == "dit_step") return s.model_bytes;
    return 0.0;
  };
  const double bf16 = dit_bytes(Quant::none), q8 = dit_bytes(Quant::q8_0);
  std::printf("[ measure ] klein 4B DiT step weight bytes: bf16 %.4g, q8_0 %.4g\n", bf16, q8);
  EXPECT_GT(q8, 0.52 * bf16);
  EXPECT_LT(q8, 0.54 * bf16);
}

}  // namespace
}  // namespace apus
