// Each FLUX.2 stage against the official diffusers pipeline's tensors (tools/oracle), fed the
// reference's own inputs for that stage.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>

#include "io/media/image.h"
#include "io/weights/safetensors.h"
#include "models/flux2/klein.h"
#include "models/flux2/text_encoder.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "sampling/flow_match.h"
#include "test_util.h"

namespace apus {
namespace {

using test::Reference;

struct Case {
  std::string variant, precision;
};

class Flux2Stages : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    ctx.arena = &arena;
    ctx.act = test::precision_dtype(GetParam().precision);
  }
  Arena arena;
  Context ctx;
};

std::vector<int> taps_of(const Reference& ref) { return ref.meta["text_encoder_out_layers"].get<std::vector<int>>(); }

// Whether the reference ran classifier-free guidance (a -base model at a scale above 1).
bool guided(const Reference& ref) {
  return !ref.meta["is_distilled"].get<bool>() && ref.meta["guidance_scale"].get<double>() > 1;
}

TEST_P(Flux2Stages, TextEncoderMatchesReference) {
  const auto& [variant, p] = GetParam();
  const Reference ref(variant);
  const ModelDir dir = ModelDir::open(test::fixture(variant));
  const auto enc = test::load_stage<flux2::TextEncoder>(dir, "text_encoder", taps_of(ref));
  const auto ids64 = ref.i64("input_ids");
  const std::vector<int32_t> ids(ids64.begin(), ids64.end());
  const Tensor out = enc.encode(ctx, ids, ref.i64("attention_mask"));
  test::expect_matches("text encoder", p, to_f32_vector(out), ref.f32("fp32.prompt_embeds"),
                       ref.f32("bf16.prompt_embeds"));
  if (!guided(ref)) return;
  // The negative prompt (the pipeline's "") through the same encoder.
  const auto neg64 = ref.i64("negative_input_ids");
  const Tensor neg =
      enc.encode(ctx, std::vector<int32_t>(neg64.begin(), neg64.end()), ref.i64("negative_attention_mask"));
  test::expect_matches("text encoder, negative prompt", p, to_f32_vector(neg), ref.f32("fp32.negative_prompt_embeds"),
                       ref.f32("bf16.negative_prompt_embeds"));
}

TEST_P(Flux2Stages, TransformerMatchesReferenceEveryStep) {
  const auto& [variant, p] = GetParam();
  const Reference ref(variant);
  const ModelDir dir = ModelDir::open(test::fixture(variant));
  const auto dit = test::load_stage<flux2::Transformer>(dir, "transformer");
  const auto& cfg = dit.config();
  const Tensor& embeds = ref.file.get(p + ".prompt_embeds");
  const int64_t t = embeds.shape[1], l = ref.file.get(p + ".latent_ids").shape[1];
  const std::string precision = p;  // a structured binding cannot be captured (before C++20 in clang)
  const auto prologue_of = [&](const std::string& embeds) {
    return dit.prologue(ctx, ref.as(precision + embeds, ctx.act, {t, cfg.joint_dim}),
                        ref.file.get(precision + ".text_ids").reshape({t, 4}),
                        ref.file.get(precision + ".latent_ids").reshape({l, 4}));
  };
  const auto pro = prologue_of(".prompt_embeds");
  std::optional<flux2::TransformerPrologue> negative;
  if (guided(ref)) negative = prologue_of(".negative_prompt_embeds");
  for (int step = 0; step < ref.meta["steps"].get<int>(); ++step) {
    const std::string s = ".dit.step" + std::to_string(step);
    const Tensor latents = ref.as(p + s + ".latents_in", ctx.act, {l, cfg.in_channels});
    Tensor velocity = Tensor::heap({l, cfg.out_channels}, ctx.act);
    std::fill_n(velocity.ptr<uint8_t>(), velocity.nbytes(), 0xff);  // poison: NaN in both dtypes
    const float timestep = ref.f32(p + ".scheduler.step" + std::to_string(step) + ".t")[0];
    dit.forward(ctx, pro, latents, timestep, velocity);
    test::expect_matches("transformer" + s, p, to_f32_vector(velocity), ref.f32("fp32" + s + ".velocity"),
                         ref.f32("bf16" + s + ".velocity"));
    if (!negative) continue;
    std::fill_n(velocity.ptr<uint8_t>(), velocity.nbytes(), 0xff);
    dit.forward(ctx, *negative, latents, timestep, velocity);
    test::expect_matches("transformer, negative prompt" + s, p, to_f32_vector(velocity),
                         ref.f32("fp32" + s + ".velocity_uncond"), ref.f32("bf16" + s + ".velocity_uncond"));
  }
}

// The guidance combination on the reference's own two velocities gives its guided velocity bit
// for bit: the same eager ops, rounded in the same order.
TEST_P(Flux2Stages, GuidanceCombinesTheBranchesAsThePipeline) {
  const auto& [variant, p] = GetParam();
  const Reference ref(variant);
  if (!guided(ref)) GTEST_SKIP() << variant << " runs without guidance";
  const int64_t l = ref.file.get(p + ".latent_ids").shape[1];
  const float scale = ref.meta["guidance_scale"].get<float>();
  for (int step = 0; step < ref.meta["steps"].get<int>(); ++step) {
    const std::string s = ".dit.step" + std::to_string(step);
    const int64_t d = ref.file.get(p + s + ".velocity").shape[2];
    Tensor cond = ref.as(p + s + ".velocity", ctx.act, {l, d}),
           uncond = ref.as(p + s + ".velocity_uncond", ctx.act, {l, d});
    classifier_free_guidance(ctx, cond, uncond, scale);
    EXPECT_EQ(to_f32_vector(uncond), ref.f32(p + ".step" + std::to_string(step) + ".guided_velocity")) << s;
  }
}

TEST_P(Flux2Stages, SamplerFollowsReferenceTrajectory) {
  const auto& [variant, p] = GetParam();
  const Reference ref(variant);
  const ModelDir dir = ModelDir::open(test::fixture(variant));
  const auto dit = test::load_stage<flux2::Transformer>(dir, "transformer");
  const auto& cfg = dit.config();
  const int64_t t = ref.file.get(p + ".prompt_embeds").shape[1];
  const int64_t l = ref.file.get(p + ".latent_ids").shape[1];
  const int steps = ref.meta["steps"].get<int>();
  const double mu = flux2_empirical_mu(l, steps);
  EXPECT_NEAR(mu, ref.meta["mu"].get<double>(), 1e-12);
  const FlowSchedule sched = flow_match_schedule(dir.config("scheduler", "scheduler_config.json"), steps, mu);
  const auto ref_sigmas = ref.meta["sigmas"].get<std::vector<float>>();
  ASSERT_EQ(sched.sigmas.size(), ref_sigmas.size());
  for (size_t i = 0; i < ref_sigmas.size(); ++i) EXPECT_EQ(sched.sigmas[i], ref_sigmas[i]) << i;
  for (int i = 0; i < steps; ++i)
    EXPECT_EQ(sched.timesteps[size_t(i)], ref.f32(p + ".scheduler.step" + std::to_string(i) + ".t")[0]);

  const auto pro =
      dit.prologue(ctx, ref.as(p + ".prompt_embeds", ctx.act, {t, cfg.joint_dim}),
                   ref.file.get(p + ".text_ids").reshape({t, 4}), ref.file.get(p + ".latent_ids").reshape({l, 4}));
  std::optional<flux2::TransformerPrologue> negative;
  if (guided(ref))
    negative =
        dit.prologue(ctx, ref.as(p + ".negative_prompt_embeds", ctx.act, {t, cfg.joint_dim}),
                     ref.file.get(p + ".text_ids").reshape({t, 4}), ref.file.get(p + ".latent_ids").reshape({l, 4}));
  Tensor x = ref.as(p + ".dit.step0.latents_in", ctx.act, {l, cfg.in_channels});
  Tensor v = Tensor::heap({l, cfg.out_channels}, ctx.act), uncond = Tensor::heap({l, cfg.out_channels}, ctx.act);
  for (int i = 0; i < steps; ++i) {
    dit.forward(ctx, pro, x, sched.timesteps[size_t(i)], v);
    if (negative) {
      dit.forward(ctx, *negative, x, sched.timesteps[size_t(i)], uncond);
      classifier_free_guidance(ctx, v, uncond, ref.meta["guidance_scale"].get<float>());
    }
    euler_step(ctx, x, negative ? uncond : v, sched.sigmas[size_t(i)], sched.sigmas[size_t(i) + 1]);
  }
  const std::string last = ".step" + std::to_string(steps - 1) + ".latents";
  test::expect_matches("sampler", p, to_f32_vector(x), ref.f32("fp32" + last), ref.f32("bf16" + last));
}

// A text encoder exactly as deep as its deepest tap (klein_tiny_a cut to 27 layers, taps 9, 18,
// 27): hidden_states[27] is then transformers' last hidden state, the final norm's output, and the
// prompt embeddings are diffusers' (tools/oracle/make_klein_last_tap_fixtures.py).
TEST(Flux2TextEncoder, TapAtTheLastLayerIsTheFinalNormOutput) {
  const Reference ref("klein_last_tap");
  const std::string d = ::testing::TempDir() + "apus_klein_last_tap_" + std::to_string(::getpid());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d + "/text_encoder");
  const std::string src = test::fixture(ref.meta["variant"].get<std::string>());
  std::filesystem::create_symlink(src + "/model_index.json", d + "/model_index.json");
  for (const auto& e : std::filesystem::directory_iterator(src + "/text_encoder"))
    if (e.path().filename() != "config.json")
      std::filesystem::create_symlink(e.path(), d + "/text_encoder/" + e.path().filename().string());
  std::ofstream(d + "/text_encoder/config.json") << ref.meta["text_encoder_config"].dump();
  const auto enc = test::load_stage<flux2::TextEncoder>(ModelDir::open(d), "text_encoder", taps_of(ref));
  EXPECT_EQ(enc.config().layers, taps_of(ref).back());
  const auto ids64 = ref.i64("input_ids");
  for (const std::string p : {"fp32", "bf16"}) {
    Arena arena;
    Context ctx{&arena, test::precision_dtype(p)};
    const Tensor out = enc.encode(ctx, std::vector<int32_t>(ids64.begin(), ids64.end()), ref.i64("attention_mask"));
    test::expect_matches("text encoder, last tap", p, to_f32_vector(out), ref.f32("fp32.prompt_embeds"),
                         ref.f32("bf16.prompt_embeds"));
  }
  std::filesystem::remove_all(d);
}

INSTANTIATE_TEST_SUITE_P(Klein, Flux2Stages,
                         ::testing::Values(Case{"klein_tiny_a", "fp32"}, Case{"klein_tiny_a", "bf16"},
                                           Case{"klein_tiny_b", "fp32"}, Case{"klein_tiny_b", "bf16"},
                                           Case{"klein_tiny_base", "fp32"}, Case{"klein_tiny_base", "bf16"},
                                           Case{"klein_tiny_9b", "fp32"}, Case{"klein_tiny_9b", "bf16"}),
                         [](const auto& info) { return info.param.variant.substr(11) + "_" + info.param.precision; });

}  // namespace
}  // namespace apus

namespace apus {
namespace {

// Config values the models do not implement are refused with the file and key named.
// Every setting the official classes take (their __init__'s parameters, tools/oracle
// write_config_keys) is consulted by apus's reader of that file: honoured, checked and refused
// where unsupported, or declared to leave inference unchanged. A setting added upstream fails here
// until it is accounted for.
TEST(Flux2Configs, EveryOfficialSettingIsHonouredOrRefused) {
  const Json keys = read_json(test::fixture("klein_config_keys.json"));
  const ModelDir dir = ModelDir::open(test::fixture("klein_tiny_a"), false);
  const Config transformer = dir.config("transformer"), vae = dir.config("vae"), text = dir.config("text_encoder"),
               scheduler = dir.config("scheduler", "scheduler_config.json");
  flux2::TransformerConfig::read(transformer);
  flux2::VaeConfig::read(vae);
  flux2::TextEncoderConfig::read(text);
  flow_match_schedule(scheduler, 4, 1.0);
  const std::pair<const char*, const Config*> files[] = {
      {"transformer", &transformer}, {"vae", &vae}, {"text_encoder", &text}, {"scheduler", &scheduler}};
  for (const auto& [name, config] : files) {
    ASSERT_GE(keys[name].size(), 10u) << name;
    for (const Json& key : keys[name])
      EXPECT_TRUE(config->consulted->contains(key.get<std::string>()))
          << config->path << ": '" << key.get<std::string>() << "' is neither honoured nor refused";
  }
  // The pipeline's own: the components, whose classes check_klein_index checks, and is_distilled.
  EXPECT_EQ(keys["pipeline"],
            Json::array({"scheduler", "vae", "text_encoder", "tokenizer", "transformer", "is_distilled"}));
}

TEST(Flux2Configs, UnsupportedSettingsAreRefused) {
  namespace fs = std::filesystem;
  const std::string dir = ::testing::TempDir() + "apus_bad_configs";
  fs::remove_all(dir);
  fs::copy(test::fixture("klein_tiny_a"), dir, fs::copy_options::recursive);
  auto patch = [&](const std::string& file, const std::string& key, const Json& value) {
    Json j = read_json(dir + "/" + file);
    j[key] = value;
    std::ofstream(dir + "/" + file) << j.dump();
  };
  patch("text_encoder/config.json", "rope_scaling", Json{{"rope_type", "yarn"}, {"factor", 4.0}});
  test::expect_error(
      [&] {
        test::load_stage<flux2::TextEncoder>(ModelDir::open(dir), "text_encoder", std::vector<int>{9, 18, 27});
      },
      {"text_encoder/config.json", "rope_scaling"});
  patch("transformer/config.json", "guidance_embeds", true);
  test::expect_error([&] { test::load_stage<flux2::Transformer>(ModelDir::open(dir), "transformer"); },
                     {"transformer/config.json", "guidance_embeds"});
  patch("transformer/config.json", "guidance_embeds", false);
  patch("transformer/config.json", "axes_dims_rope", Json::array({8, 8, 8}));
  test::expect_error([&] { test::load_stage<flux2::Transformer>(ModelDir::open(dir), "transformer"); },
                     {"transformer/config.json", "axes_dims_rope"});
  // Sizes that would divide by zero, go negative or overflow are refused, not trusted.
  patch("transformer/config.json", "num_attention_heads", 0);
  test::expect_error([&] { test::load_stage<flux2::Transformer>(ModelDir::open(dir), "transformer"); },
                     {"transformer/config.json", "num_attention_heads", "is 0"});
  patch("text_encoder/config.json", "rope_scaling", nullptr);
  const struct {
    const char* key;
    Json value;
  } text_settings[] = {{"hidden_act", "gelu"},
                       {"use_sliding_window", true},
                       {"layer_types", Json::array({"full_attention", "sliding_attention"})}};
  for (const auto& [key, value] : text_settings) {
    const Json original = read_json(dir + "/text_encoder/config.json").value(key, Json());
    patch("text_encoder/config.json", key, value);
    test::expect_error(
        [&] {
          test::load_stage<flux2::TextEncoder>(ModelDir::open(dir), "text_encoder", std::vector<int>{9, 18, 27});
        },
        {"text_encoder/config.json", key});
    patch("text_encoder/config.json", key, original);
  }
  patch("scheduler/scheduler_config.json", "stochastic_sampling", true);
  test::expect_error([&] { flow_match_schedule(read_config(dir + "/scheduler/scheduler_config.json"), 4, 1.0); },
                     {"scheduler_config.json", "stochastic_sampling"});
  patch("text_encoder/config.json", "num_key_value_heads", -3);
  test::expect_error(
      [&] {
        test::load_stage<flux2::TextEncoder>(ModelDir::open(dir), "text_encoder", std::vector<int>{9, 18, 27});
      },
      {"text_encoder/config.json", "num_key_value_heads"});
  patch("vae/config.json", "norm_num_groups", 0);
  test::expect_error([&] { test::load_stage<flux2::VaeDecoder>(ModelDir::open(dir), "vae"); },
                     {"vae/config.json", "norm_num_groups"});
  patch("vae/config.json", "norm_num_groups", 7);
  test::expect_error([&] { test::load_stage<flux2::VaeDecoder>(ModelDir::open(dir), "vae"); },
                     {"vae/config.json", "norm_num_groups 7"});
  fs::remove_all(dir);
}

// Flux2KleinKVPipeline's transformer (tools/oracle reference_kv, 9B-shaped): the references'
// keys and values computed once, then the first step (the pipeline's extract pass, the
// references' tokens in its sequence) and the second (from its cache) each give the reference's
// velocity. The plain joint sequence (references attending to everything, at the step's
// timestep) is held to be farther off, so the test sees the cache's semantics.
TEST(Flux2KvCache, TransformerWithCachedReferencesGivesTheKvPipelinesVelocities) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("klein_tiny_9b_kv_ref.safetensors"));
  const ModelDir dir = ModelDir::open(test::fixture("klein_tiny_9b_kv"));
  const auto dit = test::load_stage<flux2::Transformer>(dir, "transformer");
  const auto& cfg = dit.config();
  const Tensor& all_ids = ref.get("img_ids");
  const int64_t l = ref.get("fp32.dit.step0.latents_in").shape[0], r = all_ids.shape[0] - l;
  const int64_t t = ref.get("txt_ids").shape[0];
  auto copy_ids = [](const Tensor& ids, int64_t from, int64_t to) {
    Tensor out = Tensor::heap({to - from, 4}, DType::i64);
    std::copy_n(ids.ptr<int64_t>() + from * 4, (to - from) * 4, out.ptr<int64_t>());
    return out;
  };
  const Tensor ref_ids = copy_ids(all_ids, 0, r), latent_ids = copy_ids(all_ids, r, r + l);
  for (const std::string p : {"fp32", "bf16"}) {
    Arena arena;
    Context ctx{&arena, test::precision_dtype(p)};
    auto as_act = [&](const std::string& name, const Shape& shape) {
      Tensor out = Tensor::heap(shape, ctx.act);
      ops::copy(ctx, ref.get(name).reshape(shape), out);
      return out;
    };
    const auto pro =
        dit.prologue(ctx, as_act(p + ".prompt_embeds", {t, cfg.joint_dim}), ref.get("txt_ids"), latent_ids);
    const flux2::ReferenceKv kv =
        dit.reference_kv(ctx, as_act(p + ".reference_latents", {r, cfg.in_channels}), ref_ids);
    for (int step = 0; step < 2; ++step) {
      const std::string s = ".dit.step" + std::to_string(step);
      const Tensor latents = as_act(p + s + ".latents_in", {l, cfg.in_channels});
      const float timestep = ref.get(p + s + ".timestep").ptr<float>()[0] * 1000.0f;
      Tensor velocity = Tensor::heap({l, cfg.out_channels}, ctx.act);
      std::fill_n(velocity.ptr<uint8_t>(), velocity.nbytes(), 0xff);
      dit.forward(ctx, pro, latents, timestep, velocity, &kv);
      const std::vector<float> want32 = to_f32_vector(ref.get("fp32" + s + ".velocity"));
      test::expect_matches("kv transformer" + s, p, to_f32_vector(velocity), want32,
                           to_f32_vector(ref.get("bf16" + s + ".velocity")));
      if (p != "fp32" || step != 0) continue;
      // The references in the joint sequence instead (Flux2KleinPipeline's way).
      const Tensor joint_ids = copy_ids(all_ids, 0, r + l);
      Tensor joint_latents = Tensor::heap({r + l, cfg.in_channels}, ctx.act),
             joint_velocity = Tensor::heap({r + l, cfg.out_channels}, ctx.act);
      Tensor refs_rows = joint_latents.rows(0, r), image_rows = joint_latents.rows(r, r + l);
      ops::copy(ctx, as_act(p + ".reference_latents", {r, cfg.in_channels}), refs_rows);
      ops::copy(ctx, latents, image_rows);
      const auto joint =
          dit.prologue(ctx, as_act(p + ".prompt_embeds", {t, cfg.joint_dim}), ref.get("txt_ids"), joint_ids);
      dit.forward(ctx, joint, joint_latents, timestep, joint_velocity);
      const std::vector<float> plain = to_f32_vector(joint_velocity.rows(r, r + l));
      std::printf("[ measure ] plain joint sequence instead of the cache: rel L2 %.3e to the KV velocity\n",
                  test::rel_l2(plain, want32));
      EXPECT_GT(test::rel_l2(plain, want32), 100 * test::kFp32Tolerance);
    }
  }
}

// Position ids as the pipelines hand them to the transformer (the fixtures' first transformer
// call): the image's grid at T 0, each reference's at T 10, 20, ...; Flux2KleinPipeline and the
// inpaint pipeline put the references after the image, Flux2KleinKVPipeline before it.
TEST(Flux2References, PositionIdsAreThePipelines) {
  auto ids_of = [](const std::string& file) {
    return to_f32_vector(SafetensorsFile::open(test::fixture(file)).get("img_ids"));
  };
  // The edit: a 64x64 output, references cropped to 64x64 and 64x96 (4x4 and 6x4 tokens).
  EXPECT_EQ(to_f32_vector(flux2::image_and_reference_position_ids(4, 4, {{4, 4}, {6, 4}})),
            ids_of("klein_tiny_a_edit_ref.safetensors"));
  // Inpainting: the 96x80 image (5x6 tokens), the image again as the first reference, then the
  // 64x96 reference.
  EXPECT_EQ(to_f32_vector(flux2::image_and_reference_position_ids(5, 6, {{5, 6}, {6, 4}})),
            ids_of("klein_tiny_a_inpaint_ref.safetensors"));
  // KV: references of 80x64 and 64x80 (4x5 and 5x4 tokens) first, then the 80x64 image's 4x5.
  std::vector<float> kv = to_f32_vector(flux2::image_and_reference_position_ids(0, 0, {{4, 5}, {5, 4}}));
  const std::vector<float> image = to_f32_vector(flux2::image_position_ids(4, 5));
  kv.insert(kv.end(), image.begin(), image.end());
  EXPECT_EQ(kv, ids_of("klein_tiny_9b_kv_ref.safetensors"));
}

// Inpainting's preparation as Flux2KleinInpaintPipeline's (tools/oracle reference_inpaint): the
// 75x61 mask of colours either side of the grey threshold, resized to the 96x80 image, grey,
// thresholded and interpolated to the 6x5 latent grid, equals the pipeline's mask latents to the
// bit (they hold quarters where its edges cross the grid's sample points).
TEST(Flux2Inpainting, MaskLatentsAreThePipelines) {
  for (const std::string variant : {"klein_tiny_a", "klein_tiny_base"}) {
    const SafetensorsFile ref = SafetensorsFile::open(test::fixture(variant + "_inpaint_ref.safetensors"));
    const Json meta = read_json(test::fixture(variant + "_inpaint_ref.json"));
    const Rgb8Image mask = read_image(test::fixture(variant + "_inpaint/mask.png"));
    ASSERT_NE(mask.width, meta["width"].get<int>());
    const std::vector<float> got = flux2::inpaint_mask(mask, meta["width"], meta["height"]);
    for (const char* precision : {"fp32", "bf16"})
      EXPECT_EQ(got, to_f32_vector(ref.get(std::string(precision) + ".mask_latents"))) << variant << " " << precision;
  }
}

// The first step of a strength's schedule, for the table of steps and strengths the oracle ran
// get_timesteps on (Python's float product, then truncation).
TEST(Flux2Inpainting, FirstStepIsThePipelinesGetTimesteps) {
  const Json meta = read_json(test::fixture("klein_tiny_a_inpaint_ref.json"));
  ASSERT_GE(meta["first_steps"].size(), 8u);
  for (const Json& row : meta["first_steps"])
    EXPECT_EQ(flux2::inpaint_first_step(row[0].get<int>(), row[1].get<double>()), row[2].get<int>()) << row.dump();
  EXPECT_EQ(meta["steps"].get<int>() - flux2::inpaint_first_step(meta["steps"], meta["strength"]),
            meta["steps_run"].get<int>());
}

}  // namespace
}  // namespace apus
