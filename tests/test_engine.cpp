// The engine's public shape: a model opened once serves requests from several threads with the
// bytes one-shot runs give; directories are recognised by their pipeline class and anything else
// is refused naming it.
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "apus/apus.h"
#include "core/cost.h"
#include "io/weights/safetensors.h"
#include "models/flux2/klein.h"
#include "pipeline/metadata.h"
#include "sa3_fixtures.h"
#include "sampling/torch_rng.h"
#include "test_util.h"

namespace apus {
namespace {

namespace fs = std::filesystem;

ImageRequest request(const std::string& prompt, int width, int height, uint64_t seed) {
  ImageRequest r;
  r.prompt = prompt;
  r.width = width;
  r.height = height;
  r.seed = seed;
  return r;
}

TEST(ImageModel, TwoThreadsOnOneResidentModelGiveTheOneShotBytes) {
  const std::string dir = test::fixture("klein_tiny_a");
  const ImageRequest a = request("a red fox in tall grass", 64, 48, 7);
  const ImageRequest b = request("a lighthouse at dawn, oil painting", 48, 80, 11);
  const auto one_shot = ImageModel::open(dir, Weights::per_stage);
  const ImageResult want_a = one_shot->generate(a), want_b = one_shot->generate(b);
  ASSERT_NE(want_a.rgb, want_b.rgb);

  const auto resident = ImageModel::open(dir, Weights::resident);
  for (int round = 0; round < 3; ++round) {
    ImageResult got_a, got_b;
    std::string error_a, error_b;
    auto run = [&](const ImageRequest& r, ImageResult& out, std::string& error) {
      try {
        out = resident->generate(r);
      } catch (const std::exception& e) {
        error = e.what();
      }
    };
    std::thread ta(run, std::cref(a), std::ref(got_a), std::ref(error_a));
    std::thread tb(run, std::cref(b), std::ref(got_b), std::ref(error_b));
    ta.join();
    tb.join();
    ASSERT_EQ(error_a, "");
    ASSERT_EQ(error_b, "");
    EXPECT_EQ(got_a.rgb, want_a.rgb) << "round " << round;
    EXPECT_EQ(got_b.rgb, want_b.rgb) << "round " << round;
    EXPECT_EQ(got_a.seed, 7u);
    EXPECT_EQ(got_b.seed, 11u);
  }
}

// Two requests with different prompts (so different key masks) and seeds, rendered as one batch
// of two through every stage, give each request's own image.
// Live previews: one after each step, 2 pixels a token side, numbered from 1; the image bytes are
// the same with or without them; a model that does not hold its VAE refuses them. (How near the
// projection is: test_vae.cpp, LatentPreviewExplainsTheDecodersColours.)
// A stop set while a request runs ends it at the next op, not at the next sampler step: set
// here as soon as the seed is announced, before the text encoder, the request ends before any
// step for both families (a server's DELETE and drain reach a stage that takes minutes).
TEST(ImageModel, AStopEndsTheRequestAtItsNextOp) {
  std::atomic<bool> stop{false};
  std::vector<std::string> lines;
  auto progress = [&](const std::string& line) {
    lines.push_back(line);
    if (line.starts_with("seed")) stop = true;
  };
  ImageRequest r;
  r.prompt = "a red fox";
  r.width = 64;
  r.height = 48;
  const auto image = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  test::expect_error([&] { image->generate(r, progress, &stop); }, {"cancelled"});
  for (const std::string& line : lines) EXPECT_EQ(line.find("step"), std::string::npos) << line;
  stop = false;
  lines.clear();
  AudioRequest a;
  a.prompt = "rain";
  a.seconds = 1;
  const auto audio = AudioModel::open(test::official_dir(), Weights::per_stage);
  test::expect_error([&] { audio->generate(a, progress, &stop); }, {"cancelled"});
  for (const std::string& line : lines) EXPECT_EQ(line.find("step"), std::string::npos) << line;
  // Unset, the same requests render.
  stop = false;
  EXPECT_NO_THROW(image->generate(r, {}, &stop));
}

TEST(ImageModel, PreviewsFollowEveryStepAndFitTheDecodedImage) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::resident);
  ImageRequest r;
  r.prompt = "a red fox";
  r.width = 64;
  r.height = 48;
  r.steps = 3;
  r.seed = 11;
  const ImageResult plain = model->generate(r);
  std::vector<Preview> previews;
  r.preview = [&](const Preview& p) { previews.push_back(p); };
  const ImageResult shown = model->generate(r);
  EXPECT_EQ(shown.rgb, plain.rgb);
  ASSERT_EQ(previews.size(), 3u);
  for (size_t i = 0; i < previews.size(); ++i) {
    EXPECT_EQ(previews[i].step, int(i) + 1);
    EXPECT_EQ(previews[i].steps, 3);
    EXPECT_EQ(previews[i].image.width, 64 / 8);
    EXPECT_EQ(previews[i].image.height, 48 / 8);
  }
  test::expect_error([&] { ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage)->generate(r); },
                     {"live previews come from a resident model"});
}

// finish_steps ends the sampling after the step running when it is set (here from the progress
// line of step 2 of 4): the image is decoded from the latents as they are, and says how many ran.
TEST(ImageModel, FinishingEarlyDecodesTheLatentsAsTheyAre) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  ImageRequest r = request("a red fox", 64, 48, 7);
  r.steps = 4;
  const ImageResult full = model->generate(r);
  EXPECT_EQ(full.steps_run, 4);
  std::atomic<bool> finish{false};
  r.finish_steps = &finish;
  const ImageResult early = model->generate(r, [&](const std::string& line) {
    if (line.rfind("step 2/4", 0) == 0) finish = true;
  });
  EXPECT_EQ(early.steps_run, 2);
  EXPECT_EQ(early.rgb.size(), full.rgb.size());
  EXPECT_NE(early.rgb, full.rgb);
  // Set before the run: no step runs, the noise itself is decoded.
  EXPECT_EQ(model->generate(r).steps_run, 0);
}

TEST(ImageModel, BatchOfTwoEqualsTwoSingleRequests) {
  for (const bool fp32 : {false, true}) {
    ImageRequest a = request("a red fox in tall grass", 64, 48, 7);
    ImageRequest b = request("a lighthouse at dawn, oil painting, dramatic sky", 64, 48, 11);
    a.fp32 = b.fp32 = fp32;
    const auto model = ImageModel::open(test::fixture("klein_tiny_b"), Weights::resident);
    const std::vector<ImageResult> both = model->generate_batch({a, b});
    ASSERT_EQ(both.size(), 2u);
    const ImageResult alone_a = model->generate(a), alone_b = model->generate(b);
    EXPECT_EQ(both[0].rgb, alone_a.rgb) << (fp32 ? "fp32" : "bf16");
    EXPECT_EQ(both[1].rgb, alone_b.rgb) << (fp32 ? "fp32" : "bf16");
    EXPECT_NE(both[0].rgb, both[1].rgb);
    EXPECT_EQ(both[1].seed, 11u);
  }
  // A batch must agree on what it shares.
  const auto model = ImageModel::open(test::fixture("klein_tiny_b"), Weights::none);
  ImageRequest wide = request("x", 64, 48, 1), tall = request("y", 48, 64, 2);
  const auto rendering = ImageModel::open(test::fixture("klein_tiny_b"), Weights::per_stage);
  test::expect_error([&] { rendering->generate_batch({wide, tall}); }, {"a batch shares width"});
  // Each shared setting is held, named (pipeline/batch.h).
  {
    ImageRequest narrow = wide;
    narrow.height = 32;
    test::expect_error([&] { rendering->generate_batch({wide, narrow}); }, {"a batch shares height"});
    ImageRequest longer = wide;
    longer.steps = 3;
    wide.steps = 2;
    test::expect_error([&] { rendering->generate_batch({wide, longer}); }, {"a batch shares steps"});
    ImageRequest exact = wide;
    exact.fp32 = true;
    test::expect_error([&] { rendering->generate_batch({wide, exact}); }, {"a batch shares precision"});
    ImageRequest other_seed = wide;
    other_seed.seed = 99;
    other_seed.prompt = "another prompt";
    EXPECT_EQ(rendering->generate_batch({wide, other_seed}).size(), 2u);  // per sample: no refusal
  }
  // Counting a batch: twice the FLOPs of one request, but for the DiT step's timestep embedding
  // and modulation, computed once for the batch (one timestep).
  const PipelineCost one = model->count(wide), two = model->count(wide, 2);
  for (size_t s = 0; s < one.stages.size(); ++s) {
    if (one.stages[s].name == "dit_step") {
      EXPECT_LT(two.stages[s].per_call.flops, 2 * one.stages[s].per_call.flops);
      EXPECT_GT(two.stages[s].per_call.flops, 1.99 * one.stages[s].per_call.flops);
    } else {
      EXPECT_DOUBLE_EQ(two.stages[s].per_call.flops, 2 * one.stages[s].per_call.flops) << s;
    }
  }
}

// The -base model's defaults are the official pipeline's (50 steps, guidance 4.0); guidance runs
// the text encoder on the negative prompt too and the transformer on both branches.
TEST(ImageModel, BaseModelsDefaultToTheOfficialGuidanceAndCountBothBranches) {
  const auto base = ImageModel::open(test::fixture("klein_tiny_base"), Weights::none);
  EXPECT_EQ(base->default_steps(), 50);
  EXPECT_EQ(base->default_cfg(), 4.0f);
  const auto distilled = ImageModel::open(test::fixture("klein_tiny_a"), Weights::none);
  EXPECT_EQ(distilled->default_steps(), 4);
  EXPECT_EQ(distilled->default_cfg(), 1.0f);
  ImageRequest r;
  r.width = 64;
  r.height = 48;
  r.steps = 2;
  const PipelineCost guided = base->count(r);
  r.cfg = 1;
  const PipelineCost plain = base->count(r);
  EXPECT_EQ(guided.steps, 2);
  EXPECT_EQ(guided.cfg, 4.0);
  EXPECT_EQ(plain.cfg, 1.0);
  auto stage = [](const PipelineCost& p, const std::string& name) {
    for (const StageCost& s : p.stages)
      if (s.name == name) return s.per_call;
    ADD_FAILURE() << name;
    return OpCost{};
  };
  EXPECT_DOUBLE_EQ(stage(guided, "text_encoder").flops, 2 * stage(plain, "text_encoder").flops);
  EXPECT_DOUBLE_EQ(stage(guided, "dit_prologue").flops, 2 * stage(plain, "dit_prologue").flops);
  // The step: both branches' transformer, plus the guidance's two multiply-adds.
  EXPECT_GT(stage(guided, "dit_step").flops, 2 * stage(plain, "dit_step").flops * 0.99);
  EXPECT_LT(stage(guided, "dit_step").flops, 2 * stage(plain, "dit_step").flops * 1.01);
  r.steps.reset();
  r.cfg.reset();
  EXPECT_EQ(base->count(r).steps, 50);

  // Inpainting's defaults are Flux2KleinInpaintPipeline's (its signature, dumped by the oracle):
  // its own guidance scale, and a strength whose schedule skips its first steps.
  const Json defaults = read_json(test::fixture("klein_tiny_base_inpaint_ref.json"))["defaults"];
  r.inpaint = Inpainting{Rgb8Image{64, 48, std::vector<uint8_t>(64 * 48 * 3, 90)},
                         Rgb8Image{64, 48, std::vector<uint8_t>(64 * 48 * 3, 255)}};
  EXPECT_EQ(r.inpaint->strength, defaults["strength"].get<double>());
  const PipelineCost inpainting = base->count(r);
  EXPECT_EQ(inpainting.cfg, defaults["guidance_scale"].get<double>());
  EXPECT_EQ(inpainting.steps, 50 - flux2::inpaint_first_step(50, r.inpaint->strength));
  EXPECT_EQ(inpainting.references, 0);
}

TEST(ImageModel, GuidanceOnADistilledModelIsRefused) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  ImageRequest r;
  r.prompt = "a fox";
  r.width = r.height = 32;
  r.cfg = 3;
  test::expect_error([&] { model->generate(r); }, {"step-distilled", "is_distilled: true", "cfg 3", "-base models"});
  r.cfg.reset();
  r.negative_prompt = "blur";
  test::expect_error([&] { model->generate(r); }, {"step-distilled", "a negative prompt"});
  const auto base = ImageModel::open(test::fixture("klein_tiny_base"), Weights::none);
  r.negative_prompt.reset();
  r.cfg = -1;
  test::expect_error([&] { base->count(r); }, {"cfg -1 outside (0, 100]"});
}

// The engine, not each caller, tells an absent setting (the model's default) from a given 0 (an
// error naming the setting): the CLI and the server pass what they were given.
TEST(ImageModel, GivenZerosAreRefusedAbsentSettingsTakeTheDefaults) {
  const auto base = ImageModel::open(test::fixture("klein_tiny_base"), Weights::none);
  const auto distilled = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  const ImageRequest absent = request("x", 64, 48, 1);
  const Rgb8Image reference{64, 80, std::vector<uint8_t>(64 * 80 * 3, 128)};
  // Counting (roofline, the server's admission) and rendering each refuse it, naming the setting.
  struct Case {
    std::function<void(ImageRequest&)> set;
    std::string counted, rendered;
  };
  const std::vector<Case> cases = {
      {[](ImageRequest& r) { r.width = 0; }, "width 0 outside 16..4096", "width 0 outside 16..4096"},
      {[&](ImageRequest& r) {
         r.height = 0;
         r.references = {reference};
       },
       "height 0 outside 16..4096", "height 0 outside 16..4096"},
      {[](ImageRequest& r) { r.steps = 0; }, "steps 0 outside 1..200", "steps 0 outside 1..200"},
      {[](ImageRequest& r) { r.cfg = 0; }, "cfg 0 outside (0, 100]", "cfg 0 outside (0, 100]"},
  };
  for (const Case& c : cases) {
    ImageRequest r = absent;
    c.set(r);
    test::expect_error([&] { base->count(r); }, {c.counted});
    test::expect_error([&] { distilled->generate(r); }, {c.rendered});
  }
  ImageRequest defaults;
  defaults.references = {reference};
  const PipelineCost cost = base->count(defaults);
  EXPECT_EQ(cost.width, 64) << "the reference's width";
  EXPECT_EQ(cost.height, 80);
  EXPECT_EQ(cost.steps, base->default_steps());
  EXPECT_EQ(cost.cfg, base->default_cfg());
  defaults.references.clear();
  EXPECT_EQ(base->count(defaults).width, 1024);
}

// Every bound of ImageLimits is held by count() as by generate(): one message, naming the field,
// whoever asks (the CLI's roofline and -v, the server's admission, the bench).
TEST(ImageModel, CountRefusesWhatGenerateRefusesWithTheSameMessage) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  struct Case {
    std::function<void(ImageRequest&)> set;
    int batch;
    std::string message, field;
  };
  const std::vector<Case> cases = {
      {[](ImageRequest& r) { r.width = 8; }, 1, "width 8 outside 16..4096", "width"},
      {[](ImageRequest& r) { r.height = 4112; }, 1, "height 4112 outside 16..4096", "height"},
      {[](ImageRequest& r) { r.height = 100; }, 1, "width 64 and height 100 must be multiples of 16", "height"},
      {[](ImageRequest& r) { r.steps = 201; }, 1, "steps 201 outside 1..200", "steps"},
      {[](ImageRequest& r) { r.cfg = 101; }, 1, "cfg 101 outside (0, 100]", "cfg"},
      {[](ImageRequest& r) { r.cfg = 3; }, 1, "cfg 3 is for the -base models", "cfg"},
      {[](ImageRequest& r) { r.negative_prompt = "blur"; }, 1, "a negative prompt is for the -base models",
       "negative_prompt"},
      {[](ImageRequest&) {}, ImageLimits::max_batch + 1, "batch 65 outside 1..64", "batch"},
  };
  for (const Case& c : cases) {
    ImageRequest r = request("x", 64, 48, 1);
    c.set(r);
    const test::Refusal counted = test::refusal([&] { model->count(r, c.batch); });
    const test::Refusal rendered =
        test::refusal([&] { model->generate_batch(std::vector<ImageRequest>(size_t(c.batch), r)); });
    EXPECT_NE(counted.message.find(c.message), std::string::npos) << counted.message;
    EXPECT_EQ(counted.field, c.field) << c.message;
    EXPECT_EQ(counted.message, rendered.message);
    EXPECT_EQ(counted.field, rendered.field) << c.message;
  }
}

// The batch rule every front end's n takes: seed, seed + 1, ..., or each drawn where none is given;
// a size generate_batch would refuse is refused with its message.
TEST(ImageModel, BatchOfNumbersTheSeedsAndRefusesWhatGenerateBatchRefuses) {
  const std::vector<ImageRequest> seeded = batch_of(request("x", 64, 48, 7), 3);
  ASSERT_EQ(seeded.size(), 3u);
  for (size_t i = 0; i < seeded.size(); ++i) {
    EXPECT_EQ(seeded[i].seed, 7 + i);
    EXPECT_EQ(seeded[i].prompt, "x");
  }
  AudioRequest clip;
  for (const AudioRequest& r : batch_of(clip, 2)) EXPECT_FALSE(r.seed);
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::none);
  for (const int n : {0, ImageLimits::max_batch + 1}) {
    const test::Refusal refused = test::refusal([&] { batch_of(request("x", 64, 48, 7), n); });
    EXPECT_EQ(refused.message, test::refusal([&] { model->count(request("x", 64, 48, 7), n); }).message);
    EXPECT_EQ(refused.field, "batch");
  }
  EXPECT_EQ(test::refusal([&] { batch_of(clip, 0); }).message, "batch 0 outside 1..64");
}

// diffusers' num_images_per_prompt with one torch.Generator draws the whole batch's noise in one
// torch.randn: output i (noise_index) is the i-th part of that draw, made here independently and
// handed in as a noise file, in both precisions.
TEST(ImageModel, NoiseIndexIsThatOutputsPartOfOneDrawForTheBatch) {
  const uint32_t seed = test::test_seed();
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::resident);
  const int64_t channels = 128, n = channels * 2 * 3;  // in_channels, 32x48 pixels: 2x3 tokens
  for (const bool fp32 : {false, true}) {
    ImageRequest indexed = request("x", 48, 32, seed);
    indexed.steps = 2;
    indexed.fp32 = fp32;
    const std::vector<uint8_t> first = model->generate(indexed).rgb;
    indexed.noise_index = 2;
    const ImageResult third = model->generate(indexed);
    TorchGenerator gen(seed);
    Tensor draw = Tensor::heap({3 * n}, fp32 ? DType::f32 : DType::bf16);
    if (fp32) gen.randn(draw.ptr<float>(), draw.numel());
    else gen.randn_bf16(draw.ptr<uint16_t>(), draw.numel());
    const std::string file = ::testing::TempDir() + "noise_index_" + std::to_string(fp32) + ".safetensors";
    write_safetensors(file, {{"noise", draw.rows(2 * n, 3 * n).reshape({1, channels, 2, 3})}});
    ImageRequest from_file = indexed;
    from_file.noise_index = 0;
    from_file.noise_file = file;
    EXPECT_EQ(third.rgb, model->generate(from_file).rgb) << "fp32 " << fp32;
    EXPECT_NE(third.rgb, first) << "fp32 " << fp32;
    EXPECT_NE(infotext(indexed, third, *model).find(", Noise index: 2"), std::string::npos);
    from_file.noise_index = 1;
    EXPECT_EQ(test::refusal([&] { model->generate(from_file); }).field, "noise_index");
  }
  ImageRequest beyond = request("x", 48, 32, seed);
  beyond.noise_index = ImageLimits::max_batch;
  const test::Refusal refused = test::refusal([&] { model->count(beyond); });
  EXPECT_EQ(refused.message, "noise_index 64 outside 0..63");
  EXPECT_EQ(refused.field, "noise_index");
}

TEST(ImageModel, CountingOnlyModelCountsButDoesNotRender) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_b"), Weights::none);
  const PipelineCost cost = model->count(request("x", 48, 80, 4));
  ASSERT_EQ(cost.stages.size(), 4u);
  EXPECT_EQ(cost.stages[2].name, "dit_step");
  EXPECT_EQ(cost.stages[2].calls, 4);
  test::expect_error([&] { model->generate(request("x", 48, 80, 4)); }, {"counting only"});
}

TEST(ImageModel, DirectoriesOfUnknownClassesAreRefusedNamingTheClass) {
  const std::string dir = ::testing::TempDir() + "apus_engine_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  { std::ofstream(dir + "/model_index.json") << R"({"_class_name": "StableDiffusionPipeline"})"; }
  for (Weights w : {Weights::per_stage, Weights::none}) {
    test::expect_error([&] { ImageModel::open(dir, w); },
                       {dir + "/model_index.json", "'StableDiffusionPipeline'", "not supported", "Flux2KleinPipeline"});
    test::expect_error([&] { AudioModel::open(dir, w); }, {dir + "/model_index.json", "'StableDiffusionPipeline'",
                                                           "not supported", "StableAudio3Pipeline"});
  }
  // A model of the other family is pointed at the command that serves it.
  { std::ofstream(dir + "/model_index.json") << R"({"_class_name": "StableAudio3Pipeline"})"; }
  test::expect_error([&] { ImageModel::open(dir, Weights::none); },
                     {dir + "/model_index.json", "StableAudio3Pipeline", "apus audio"});
  fs::remove(dir + "/model_index.json");
  { std::ofstream(dir + "/model_config.json") << R"({"model_type": "diffusion_cond"})"; }
  test::expect_error([&] { ImageModel::open(dir, Weights::per_stage); },
                     {dir + "/model_config.json", "Stable Audio 3", "apus audio"});
  fs::remove_all(dir);
  test::expect_error([&] { ImageModel::open("/nonexistent/model", Weights::per_stage); },
                     {"/nonexistent/model", "does not exist"});
}

TEST(ImageModel, LabelsNameTheRepository) {
  // A Hugging Face cache snapshot is labelled with its repository id.
  const std::string cache =
      ::testing::TempDir() + "apus_hub/models--black-forest-labs--FLUX.2-klein-4B/snapshots/0123abc";
  fs::create_directories(cache);
  fs::copy(test::fixture("klein_tiny_a"), cache, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  EXPECT_EQ(ImageModel::open(cache, Weights::none)->label(), "black-forest-labs/FLUX.2-klein-4B");
  EXPECT_EQ(ImageModel::open(test::fixture("klein_tiny_a") + "/", Weights::none)->label(), "klein_tiny_a");
  fs::remove_all(::testing::TempDir() + "apus_hub");
}

}  // namespace
}  // namespace apus
