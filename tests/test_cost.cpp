// The cost model: op counts against hand-computed numbers, the klein pipeline's counted
// parameters against the published layout, scaling with resolution, collective formulas,
// and counting without weight files.
#include <gtest/gtest.h>

#include <filesystem>

#include "apus/apus.h"

#include "core/error.h"
#include "cost/roofline.h"
#include "io/model_dir.h"
#include "io/weights/synth.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/ops.h"
#include "pipeline/stage.h"
#include "sa3_fixtures.h"
#include "test_util.h"

namespace apus {
namespace {

PipelineCost count_request(const std::string& model, int width, int height, int steps) {
  ImageRequest r;
  r.width = width;
  r.height = height;
  r.steps = steps;
  return ImageModel::open(model, Weights::none)->count(r);
}

struct Counter {
  CostLog log;
  Arena arena;
  Context c{&arena, DType::bf16, &log, true};
  Tensor t(Shape s) {
    Tensor x;
    x.dtype = DType::bf16;
    x.shape = std::move(s);
    return x;  // no data: counting mode never touches it
  }
};

TEST(Cost, GemmCountedByHand) {
  Counter k;
  Tensor x = k.t({7, 5}), w = k.t({3, 5}), y = k.t({7, 3});
  ops::linear(k.c, x, w, nullptr, y);
  const OpCost c = k.log.total();
  EXPECT_EQ(c.flops, 2.0 * 7 * 5 * 3);
  EXPECT_EQ(c.weight_bytes, 3 * 5 * 2);
  EXPECT_EQ(c.bytes_fused, (7 * 5 + 7 * 3) * 2);
  EXPECT_EQ(c.bytes_unfused, c.bytes_fused);
}

// A quantised tier's linear counts its products as the tier's operations (int8, fp8), and the
// roofline prices them at the chip's rate for the tier (the bias add and every other FLOP at the
// bf16 rate); a chip without a rate for the tier prices them as bf16.
TEST(Cost, TierProductsPricedAtTheTiersRate) {
  struct Tier {
    Products products;
    DType codes;
    double OpCost::*ops;
    double Chip::*rate;
    const char* key;
  };
  for (const Tier t : {Tier{Products::int8, DType::i8, &OpCost::int8_ops, &Chip::int8_ops, "int8_ops"},
                       Tier{Products::fp8, DType::fp8_e4m3, &OpCost::fp8_ops, &Chip::fp8_flops, "fp8_ops"}}) {
    SCOPED_TRACE(t.key);
    Counter k;
    Tensor x = k.t({7, 5}), w = k.t({3, 5}), b = k.t({3}), y = k.t({7, 3});
    ops::linear(k.c, x, w, &b, y);
    EXPECT_EQ(k.log.total().*t.ops, 0) << "a bf16 weight runs no tier's products";
    w.dtype = t.codes;
    w.encoding.products = t.products;
    ops::linear(k.c, x, w, &b, y);
    const OpCost both = k.log.total();
    EXPECT_EQ(both.*t.ops, 2.0 * 7 * 5 * 3);
    EXPECT_EQ(both.int8_ops + both.fp8_ops, 2.0 * 7 * 5 * 3) << "one tier's products only";
    EXPECT_EQ(both.flops, 2 * (2.0 * 7 * 5 * 3 + 7 * 3));

    PipelineCost p;
    p.stages.push_back({"dit", 2, both, {{"dit/linear", both, 2}}});
    Chip chip = find_chip("cpu");
    chip.bf16_flops = 1e9;
    chip.int8_ops = chip.fp8_flops = 3e9;
    chip.*t.rate = 4e9;
    chip.memory_bps = 1e15;  // compute-bound
    const double bf16_part = (both.flops - both.*t.ops) / 1e9;
    const nlohmann::json with_rate = roofline_json(p, {chip, 1});
    EXPECT_DOUBLE_EQ(with_rate["stages"][0]["per_call"]["floor_s"].get<double>(), bf16_part + both.*t.ops / 4e9);
    EXPECT_DOUBLE_EQ(with_rate["total"]["floor_s"].get<double>(), 2 * (bf16_part + both.*t.ops / 4e9));
    EXPECT_EQ(with_rate["total"][t.key].get<double>(), 2 * both.*t.ops);
    chip.*t.rate = 0;
    const nlohmann::json without = roofline_json(p, {chip, 1});
    EXPECT_DOUBLE_EQ(without["stages"][0]["per_call"]["floor_s"].get<double>(), both.flops / 1e9);
  }
}

TEST(Cost, AttentionCountedByHand) {
  Counter k;
  const int64_t s = 10, heads = 3, d = 8;
  Tensor q = k.t({s, heads * d}), kk = k.t({s, heads * d}), v = k.t({s, heads * d}), o = k.t({s, heads * d});
  ops::attention(k.c, q, kk, v, o, d, 0.1f, {true, nullptr});  // causal: still the full square
  const OpCost c = k.log.total();
  EXPECT_EQ(c.flops, (4.0 * d + 5) * heads * s * s);
  EXPECT_EQ(c.bytes_fused, 4.0 * s * heads * d * 2);
  EXPECT_EQ(c.bytes_unfused, c.bytes_fused + 2.0 * heads * s * s * (4 + 2));
}

TEST(Cost, ConvAndNormsCountedByHand) {
  Counter k;
  Tensor x = k.t({1, 4, 6, 6}), w = k.t({8, 4, 3, 3}), b = k.t({8}), y = k.t({1, 8, 6, 6});
  ops::conv2d(k.c, x, w, &b, y, 1, 1, 1);
  EXPECT_EQ(k.log.total().flops, 2.0 * 4 * 9 * 8 * 36 + 8 * 36);
  EXPECT_EQ(k.log.total().weight_bytes, (8 * 4 * 9 + 8) * 2);

  Counter n;
  Tensor a = n.t({5, 16}), sh = n.t({1, 16}), sc = n.t({1, 16}), out = n.t({5, 16}), g = n.t({16});
  ops::layer_norm_modulate(n.c, a, sh, sc, out, 1e-6f, ops::Rounding::each_step);
  EXPECT_EQ(n.log.total().flops, (6.0 + 2) * 80);
  EXPECT_EQ(n.log.total().bytes_unfused, n.log.total().bytes_fused + 2 * 80 * 2);
  ops::rms_norm(n.c, a, g, out, 1e-6f, 16, ops::Rounding::once);
  EXPECT_EQ(n.log.total().flops, (6.0 + 2) * 80 + 4 * 80);
}

TEST(Cost, CollectiveFormulas) {
  EXPECT_DOUBLE_EQ(allgather_wire_bytes(100, 4), 75);
  EXPECT_DOUBLE_EQ(all_to_all_wire_bytes(100, 4), 18.75);
  EXPECT_DOUBLE_EQ(allgather_wire_bytes(100, 1), 0);
}

// The parameters the pipeline's loaders fetch, summed from the published manifest.
double manifest_parameters(const std::string& model,
                           const std::function<bool(const std::string&, const std::string&)>& used) {
  const Json m = read_json(published_layout_dir(model) + "/manifest.json");
  double n = 0;
  for (const auto& f : m["files"])
    for (const auto& t : f["tensors"])
      if (used(f["path"].get<std::string>(), t["name"].get<std::string>())) {
        double e = 1;
        for (const auto& d : t["shape"]) e *= d.get<double>();
        n += e;
      }
  return n;
}

TEST(Cost, KleinParametersMatchThePublishedLayouts) {
  for (const std::string model : {"flux2-klein-4b", "flux2-klein-9b", "flux2-klein-9b-kv"}) {
    const PipelineCost p = count_request(model, 512, 512, 4);
    const double want = manifest_parameters(model, [](const std::string& file, const std::string& name) {
      if (file.rfind("transformer/", 0) == 0) return true;
      if (file.rfind("vae/", 0) == 0)
        return name.rfind("decoder.", 0) == 0 || name.rfind("post_quant_conv.", 0) == 0 || name == "bn.running_mean" ||
               name == "bn.running_var";
      // The text encoder runs 27 of its 36 layers; the final norm is never read.
      if (name == "model.embed_tokens.weight") return true;
      const std::string prefix = "model.layers.";
      if (name.rfind(prefix, 0) != 0) return false;
      return std::stoi(name.substr(prefix.size())) < 27;
    });
    EXPECT_EQ(p.parameters, want) << model;
  }
  // The transformers alone: the published 3.8755e9 and 9.08e9 (the public record's figure for
  // 9B, whose sizes data/flux2-klein-9b reconstructs).
  for (const auto& [model, published] : {std::pair<std::string, double>{"flux2-klein-4b", 3875544576.0},
                                         std::pair<std::string, double>{"flux2-klein-9b", 9.08e9}}) {
    const double dit = manifest_parameters(
        model, [](const std::string& file, const std::string&) { return file.rfind("transformer/", 0) == 0; });
    EXPECT_NEAR(dit, published, published == 9.08e9 ? 0.005e9 : 0.0) << model;
  }
}

// Each part's weights as it holds them (WeightLoader::held_bytes): the published 4B's in bf16,
// two bytes a parameter; through the int8 tier the transformer's block linears hold a byte a
// weight and a scale a row. A stage's memory need is its part's weights (every part's when
// resident) plus twice its activations.
TEST(Cost, HeldBytesAreThePartsWeightsAsHeldInTheRequestsPrecision) {
  ImageRequest r;
  r.width = r.height = 512;
  r.steps = 4;
  ModelParts parts;
  parts.model = "flux2-klein-4b";
  const PipelineCost bf16 = ImageModel::open(parts, Weights::none)->count(r);
  auto dit_step = [](const PipelineCost& p) {
    for (const StageCost& s : p.stages)
      if (s.name == "dit_step") return s;
    ADD_FAILURE() << "no dit_step stage";
    return StageCost{};
  };
  // All but what a model reads to derive values at load (the VAE's 256 batch-norm statistics).
  EXPECT_LE(bf16.held_bytes, 2 * bf16.parameters);
  EXPECT_GE(bf16.held_bytes, 2 * bf16.parameters - 2 * 256);
  // An fp32 request is counted in fp32: klein holds its weights as stored (each linear converts
  // its weight as it runs), its activations twice as wide; Stable Audio 3 converts its weights to
  // the request's precision at load. The memory admission weighs what the request holds.
  r.fp32 = true;
  const PipelineCost fp32 = ImageModel::open(parts, Weights::none)->count(r);
  r.fp32 = false;
  EXPECT_EQ(fp32.held_bytes, bf16.held_bytes);
  EXPECT_GT(dit_step(fp32).activation_bytes, 1.9 * dit_step(bf16).activation_bytes);
  AudioRequest clip;
  clip.seconds = 30;
  ModelParts audio;
  audio.model = "stable-audio-3-medium";
  const PipelineCost clip_bf16 = AudioModel::open(audio, Weights::none)->count(clip);
  clip.fp32 = true;
  const PipelineCost clip_fp32 = AudioModel::open(audio, Weights::none)->count(clip);
  EXPECT_EQ(clip_fp32.parameters, clip_bf16.parameters);
  // Its DiT (1.45e9 of 2.2e9 parameters) and SAME converted; T5Gemma runs in bf16 either way.
  EXPECT_GT(clip_bf16.held_bytes, 1.99 * clip_bf16.parameters);
  EXPECT_GT(clip_fp32.held_bytes, 1.8 * clip_bf16.held_bytes);
  EXPECT_GT(peak_memory_need(clip_fp32, false).first, 1.9 * peak_memory_need(clip_bf16, false).first);
  if (!cpu::exact_int8_products()) GTEST_SKIP() << "this CPU has no int8 tier";
  parts.quant = Quant::int8;
  const PipelineCost int8 = ImageModel::open(parts, Weights::none)->count(r);
  EXPECT_EQ(int8.parameters, bf16.parameters);
  const StageCost whole = dit_step(bf16), coded = dit_step(int8);
  // 3.88e9 parameters, ~98 % of them in the blocks' linears: a byte each instead of two.
  EXPECT_GT(whole.model_bytes, 7.6e9);
  EXPECT_LT(coded.model_bytes, 0.53 * whole.model_bytes);
  EXPECT_GT(coded.model_bytes, 0.5 * whole.model_bytes);
  EXPECT_EQ(memory_need(bf16, whole, false), whole.model_bytes + 2 * whole.activation_bytes);
  EXPECT_EQ(memory_need(bf16, whole, true), bf16.held_bytes + 2 * whole.activation_bytes);
  EXPECT_EQ(peak_memory_need(bf16, false).second, "dit_step");
}

// The -kv model counts its references once, in the prologue (their own pass), and its steps
// without their tokens; the same model through Flux2KleinPipeline carries them every step.
TEST(Cost, KvModelCountsReferencesOnceAndStepsWithoutThem) {
  ImageRequest r;
  r.width = 512;
  r.height = 512;
  r.steps = 4;
  r.references.push_back(Rgb8Image{512, 512, std::vector<uint8_t>(512 * 512 * 3, 80)});
  auto stage = [](const PipelineCost& p, const std::string& name) {
    for (const StageCost& s : p.stages)
      if (s.name == name) return s.per_call.flops;
    ADD_FAILURE() << name;
    return 0.0;
  };
  const PipelineCost kv = ImageModel::open("flux2-klein-9b-kv", Weights::none)->count(r);
  const PipelineCost plain = ImageModel::open("flux2-klein-9b", Weights::none)->count(r);
  r.references.clear();
  const PipelineCost none = ImageModel::open("flux2-klein-9b", Weights::none)->count(r);
  // A step attends to the cached keys (more than none, far less than the references' tokens).
  EXPECT_GT(stage(kv, "dit_step"), stage(none, "dit_step"));
  EXPECT_LT(stage(kv, "dit_step"), 0.6 * stage(plain, "dit_step"));
  // The prologue runs the 1024 reference tokens through every block once, on their own: less
  // than they add to a step of the joint sequence (no attention with the text and image), but
  // the same linears.
  const double own = stage(kv, "dit_prologue") - stage(none, "dit_prologue");
  const double joint = stage(plain, "dit_step") - stage(none, "dit_step");
  EXPECT_LT(own, joint);
  EXPECT_GT(own, 0.5 * joint);
}

double module_flops(const PipelineCost& p, const std::string& stage, const std::string& path) {
  for (const auto& s : p.stages)
    if (s.name == stage)
      for (const auto& m : s.modules)
        if (m.path == path) return m.cost.flops;
  ADD_FAILURE() << "no module " << path;
  return 0;
}

TEST(Cost, LinearsScaleWithTokensAttentionWithTheirSquare) {
  const PipelineCost small = count_request("flux2-klein-4b", 512, 512, 4);
  const PipelineCost large = count_request("flux2-klein-4b", 1024, 1024, 4);
  const double tokens_ratio = double(512 + 4096) / double(512 + 1024);
  EXPECT_DOUBLE_EQ(
      module_flops(large, "dit_step", "dit/single.3/linear1") / module_flops(small, "dit_step", "dit/single.3/linear1"),
      tokens_ratio);
  const double attn =
      module_flops(large, "dit_step", "dit/single.3/attn") / module_flops(small, "dit_step", "dit/single.3/attn");
  EXPECT_GT(attn, 0.99 * tokens_ratio * tokens_ratio);  // norms and rope are linear: slightly under
  EXPECT_LE(attn, tokens_ratio * tokens_ratio);
  // The text encoder does not depend on the image size.
  EXPECT_EQ(small.stages[0].per_call.flops, large.stages[0].per_call.flops);
}

// A cfg split (issue 43) gathers every step's velocities, [samples x tokens, channels] in bf16,
// and halves the steps' work on two chips; Ulysses divides them over every chip and also exchanges
// each attention's q, k, v and o; the text encoder and the VAE stay whole under both.
// What cfg and Ulysses save on the stages they deal out in parts (klein's text encoder and VAE),
// and the outputs they gather there, over n chips.
struct Parted {
  double saved = 0, wire = 0;
};
Parted parted(const PipelineCost& p, const nlohmann::json& one_chip, int n) {
  Parted out;
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const StageCost& s = p.stages[i];
    if (s.parts == 0) continue;
    const double share = double((s.parts + n - 1) / n) / double(s.parts);
    out.saved += one_chip["stages"][i]["floor_s"].get<double>() * (1 - share);
    out.wire += double(s.calls) * s.gather_bytes * (n - 1) / n;
  }
  return out;
}

TEST(Cost, SplitsGatherEachStepsVelocitiesAndDivideTheSteps) {
  ImageRequest r;
  r.width = 512;
  r.height = 256;
  r.steps = 5;
  // The tiny -base model: 128 latent channels in and out, as the published ones.
  const PipelineCost guided = ImageModel::open(test::fixture("klein_tiny_base"), Weights::none)->count(r);
  ASSERT_EQ(guided.samples, 2);
  const StageCost* step = nullptr;
  double steps_floor = 0, all_floor = 0;
  std::vector<std::string> dealt;
  const Chip chip = find_chip("h200");
  const auto one = roofline_json(guided, {chip, 1});
  for (size_t i = 0; i < guided.stages.size(); ++i) {
    const double f = one["stages"][i]["floor_s"].get<double>();
    all_floor += f;
    if (guided.stages[i].name == "dit_step") step = &guided.stages[i], steps_floor = f;
    if (guided.stages[i].parts > 0) {
      dealt.push_back(guided.stages[i].name);
      // Their outputs gathered: the VAE's include the image (3 channels of 512x256 in bf16).
      EXPECT_GT(guided.stages[i].gather_bytes, 3.0 * 512 * 256 * 2) << guided.stages[i].name;
    }
  }
  ASSERT_TRUE(step);
  EXPECT_EQ(dealt, std::vector<std::string>({"text_encoder", "vae_decode"}));
  const double velocities = 2.0 * (32 * 16) * 128 * 2;  // samples x tokens x channels x bf16
  EXPECT_EQ(step->gather_bytes, velocities);
  for (const int n : {2, 3}) {
    const Parted d = parted(guided, one, n);
    const auto cfg = roofline_json(guided, {chip, n})["collectives"]["cfg"];
    EXPECT_DOUBLE_EQ(cfg["wire_bytes_per_chip"].get<double>(), 5 * velocities * (n - 1) / n + d.wire) << n;
    // Two samples over 2 or 3 chips: the busiest runs one of them.
    EXPECT_NEAR(cfg["floor_s"].get<double>(), all_floor - steps_floor / 2 - d.saved + cfg["seconds"].get<double>(),
                1e-12 * all_floor)
        << n;
    const auto ulysses = roofline_json(guided, {chip, n})["collectives"]["ulysses"];
    EXPECT_DOUBLE_EQ(ulysses["wire_bytes_per_chip"].get<double>(),
                     5 * (all_to_all_wire_bytes(step->per_call.ulysses_bytes, n) + velocities * (n - 1) / n) + d.wire)
        << n;
    EXPECT_NEAR(ulysses["floor_s"].get<double>(),
                all_floor - steps_floor + steps_floor / n - d.saved + ulysses["seconds"].get<double>(),
                1e-12 * all_floor)
        << n;
  }
  // A distilled model's request has one sample: nothing for cfg to divide in the steps, their
  // gather for nothing; the text encoder and the VAE still divide.
  const PipelineCost single = count_request(test::fixture("klein_tiny_b"), 512, 256, 5);
  EXPECT_EQ(single.samples, 1);
  const auto single_one = roofline_json(single, {chip, 1});
  const Parted d = parted(single, single_one, 2);
  EXPECT_GT(d.saved, 0);
  const auto cfg = roofline_json(single, {chip, 2})["collectives"]["cfg"];
  EXPECT_DOUBLE_EQ(cfg["wire_bytes_per_chip"].get<double>(), 5 * velocities / 4 + d.wire);
  EXPECT_NEAR(cfg["floor_s"].get<double>(),
              single_one["total"]["floor_s"].get<double>() - d.saved + cfg["seconds"].get<double>(), 1e-12);
}

TEST(Cost, SplitsDealOutSamesChunks) {
  AudioRequest r;
  r.seconds = 20;  // on the tiny model (2048 Hz, 128 samples a latent) a canvas of 416 latents
  r.steps = 2;
  r.chunked_decode = true;
  const PipelineCost p = AudioModel::open(test::official_dir(), Weights::none)->count(r);
  const Chip chip = find_chip("h200");
  const auto one = roofline_json(p, {chip, 1});
  double steps_floor = 0, all_floor = 0, steps_wire = 0;
  const StageCost* decode = nullptr;
  std::vector<std::string> dealt;
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const double f = one["stages"][i]["floor_s"].get<double>();
    all_floor += f;
    if (p.stages[i].divisible) {
      steps_floor += f;
      steps_wire += double(p.stages[i].calls) * p.stages[i].gather_bytes;
    }
    if (p.stages[i].parts > 0) dealt.push_back(p.stages[i].name);
    if (p.stages[i].name == "same_decode") decode = &p.stages[i];
  }
  // The text encoder's linears by their features, SAME's chunks.
  EXPECT_EQ(dealt, std::vector<std::string>({"text_encoder", "same_decode"}));
  ASSERT_TRUE(decode);
  EXPECT_EQ(decode->parts, 4) << "416 latents in 128-latent chunks overlapping by 32";
  EXPECT_EQ(decode->gather_bytes, 2.0 * 416 * 128 * 2) << "the canvas' audio: two channels in bf16";
  for (const int n : {2, 3, 4}) {
    // The busiest chip decodes ceil(4 / n) of the four chunks (parted() holds that share); the
    // chunks' audio is gathered.
    const Parted d = parted(p, one, n);
    const auto ulysses = roofline_json(p, {chip, n})["collectives"]["ulysses"];
    EXPECT_NEAR(ulysses["floor_s"].get<double>(),
                all_floor - steps_floor + steps_floor / n - d.saved + ulysses["seconds"].get<double>(),
                1e-12 * all_floor)
        << n;
    const auto cfg = roofline_json(p, {chip, n})["collectives"]["cfg"];
    EXPECT_DOUBLE_EQ(cfg["wire_bytes_per_chip"].get<double>(), allgather_wire_bytes(steps_wire, n) + d.wire) << n;
  }
}

TEST(Cost, CountingReadsConfigsOnly) {
  // A copy of a fixture model with every weight file removed still counts.
  namespace fs = std::filesystem;
  const std::string dir = ::testing::TempDir() + "apus_configs_only";
  fs::remove_all(dir);
  fs::copy(test::fixture("klein_tiny_b"), dir, fs::copy_options::recursive);
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().extension() == ".safetensors") fs::remove(e.path());
  const PipelineCost p = count_request(dir, 48, 80, 4);
  EXPECT_GT(p.stages[2].per_call.flops, 0);
  const auto j = roofline_json(p, {find_chip("h200"), 8});
  EXPECT_EQ(j["stages"].size(), 4u);
  EXPECT_EQ(j["collectives"]["chips"], 8);
  for (const char* k : {"fsdp", "tensor_parallel", "ulysses", "cfg", "depth"})
    EXPECT_TRUE(j["collectives"][k].contains("wire_bytes_per_chip")) << k;
  // ...and the same directory cannot render: the weights really are gone.
  EXPECT_THROW(open_weights(dir + "/transformer"), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace apus
