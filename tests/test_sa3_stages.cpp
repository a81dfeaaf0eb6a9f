// Stable Audio 3's stages against the official Python code on tiny random-weight models
// (tools/oracle): the T5Gemma text encoder, two prompts as one padded batch.
#include <cstring>

#include "core/variants.h"
#include "models/sa3/dit.h"
#include "models/sa3/duration_embedder.h"
#include "models/sa3/same_decoder.h"
#include "models/sa3/same_encoder.h"
#include "models/sa3/t5gemma_encoder.h"
#include "sampling/logsnr.h"
#include "shadow_device.h"
#include "test_util.h"

namespace apus {
namespace {

// config.json of a diffusers component folder.
Config config_in(const std::string& dir) { return read_config(dir + "/config.json"); }

// SAME-L's diffusers folder, as the pipeline loads its decoder.
sa3::SameDecoder same_l_decoder(DType dt) {
  const std::string dir = test::fixture("sa3_tiny/same_l");
  return sa3::SameDecoder::load(sa3::SameConfig::read(config_in(dir)), test::weights_in(dir), dt);
}

class T5Gemma : public ::testing::TestWithParam<std::string> {};

TEST_P(T5Gemma, EncoderMatchesTransformers) {
  const std::string p = GetParam();
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("t5gemma_tiny_ref.safetensors"));
  const Tensor& ids64 = ref.get("input_ids");
  const Tensor& mask64 = ref.get("attention_mask");
  const int64_t batch = ids64.shape[0];
  std::vector<int32_t> ids(ids64.ptr<int64_t>(), ids64.ptr<int64_t>() + ids64.numel());
  std::vector<int64_t> mask(mask64.ptr<int64_t>(), mask64.ptr<int64_t>() + mask64.numel());
  ASSERT_EQ(batch, 2);
  const std::string dir = test::fixture("t5gemma_tiny");
  const auto encoder = sa3::T5GemmaEncoder::load(sa3::T5GemmaConfig::read(config_in(dir)), test::weights_in(dir));
  Arena arena;
  Context ctx{&arena, test::precision_dtype(p)};
  const Tensor out = encoder.encode(ctx, ids, mask, batch);
  ASSERT_EQ(out.shape, Shape({ids64.numel(), encoder.config().hidden}));
  const auto fp32_ref = to_f32_vector(ref.get("fp32.last_hidden_state"));
  const auto bf16_ref = to_f32_vector(ref.get("bf16.last_hidden_state"));
  test::expect_matches("t5gemma encoder", p, to_f32_vector(out), fp32_ref, bf16_ref);
  if (p == "bf16") {
    // Every rounding of the eager bf16 run is reproduced (here the bytes are equal): dropping one
    // rule (the scores' or RoPE's step-by-step rounding) moves the output 4e-3 from the bf16
    // reference, measured, against a bound of a tenth of the reference's own disagreement.
    EXPECT_LT(test::rel_l2(to_f32_vector(out), bf16_ref), 0.1 * test::rel_l2(bf16_ref, fp32_ref));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, T5Gemma, ::testing::Values("fp32", "bf16"));

class Duration : public ::testing::TestWithParam<std::string> {};

// Durations inside and beyond the clamp; the bf16 reference keeps the Fourier features fp32 with
// fp32 frequencies, as the official code does (tools/oracle/make_sa3_fixtures.py).
TEST_P(Duration, EmbedderMatchesDiffusers) {
  const std::string p = GetParam();
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_tiny_ref.safetensors"));
  const std::vector<float> seconds = to_f32_vector(ref.get("seconds"));
  const std::string dir = test::fixture("sa3_tiny/duration_embedder");
  const auto embedder = sa3::DurationEmbedder::load(sa3::DurationConfig::read(config_in(dir)), test::weights_in(dir));
  Arena arena;
  Context ctx{&arena, test::precision_dtype(p)};
  const Tensor out = embedder.embed(ctx, seconds);
  ASSERT_EQ(out.shape, Shape({int64_t(seconds.size()), embedder.config().output_dim}));
  test::expect_matches("duration embedder", p, to_f32_vector(out), to_f32_vector(ref.get("fp32.duration_embeds")),
                       to_f32_vector(ref.get("bf16.duration_embeds")));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Duration, ::testing::Values("fp32", "bf16"));

// One DiT forward of each variant (medium: differential attention; small: plain) against the
// official DiffusionTransformer, for the text-to-audio call (zero local conditioning, which the
// official code still projects) and an inpainting one, a batch of two with padded text.
class SA3Dit : public ::testing::TestWithParam<std::tuple<std::string, std::string, std::string>> {};

TEST_P(SA3Dit, ForwardMatchesTheOfficialCode) {
  const auto& [variant, cse, p] = GetParam();
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_dit_ref.safetensors"));
  const std::string v = variant + ".", c = v + cse + ".";
  const DType dt = test::precision_dtype(p);
  const std::string dir = test::fixture("sa3_tiny/" + variant);
  const auto dit = sa3::Dit::load(sa3::DitConfig::read(config_in(dir)), test::weights_in(dir), dt);
  const auto& cfg = dit.config();
  EXPECT_EQ(cfg.differential, variant == "dit_diff");
  const Tensor& x3 = ref.get(v + "x");  // (B, io, T)
  const int64_t batch = x3.shape[0], io = x3.shape[1], frames = x3.shape[2];
  const Tensor& text = ref.get(v + "text");  // (B, S, cond_dim): text tokens, then the duration's
  const Tensor& mask = ref.get(v + "text_mask");
  const std::vector<int64_t> valid(mask.ptr<int64_t>(), mask.ptr<int64_t>() + mask.numel());
  Arena arena;
  Context ctx{&arena, dt};
  auto frames_major = [&](const Tensor& t3) {  // (B, C, T) -> [B*T, C]
    const int64_t ch = t3.shape[1];
    Tensor out = Tensor::heap({batch * frames, ch}, DType::f32);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t ci = 0; ci < ch; ++ci)
        for (int64_t t = 0; t < frames; ++t)
          out.ptr<float>()[(b * frames + t) * ch + ci] = load_f32(t3, (b * ch + ci) * frames + t);
    return to_dtype(out, dt);
  };
  const auto pro = dit.prologue(ctx, to_dtype(text, dt).reshape({text.shape[0] * text.shape[1], text.shape[2]}), valid,
                                to_dtype(ref.get(v + "global"), dt), frames_major(ref.get(c + "local")));
  const Tensor x = frames_major(x3);
  Tensor velocity = Tensor::heap({batch * frames, io}, dt);
  std::memset(velocity.data, 0xff, velocity.nbytes());
  dit.forward(ctx, pro, x, load_f32(ref.get(v + "t"), 0), velocity);
  auto channels_major = [&](const std::string& name) { return to_f32_vector(frames_major(ref.get(name))); };
  const auto ours = to_f32_vector(velocity), fp32_ref = channels_major(c + "fp32.velocity");
  if (p == "fp32") {
    // The timestep's 10 kHz Fourier feature turns by ~5e4 radians: one ulp of torch's own exp
    // moves the official output by ~1e-4 (the oracle measures it). apus forms those features with
    // correctly rounded exp, cos and sin; so does the second reference.
    const auto exact = channels_major(c + "fp32_exact_features.velocity");
    const double self = test::rel_l2(exact, fp32_ref), err = test::rel_l2(ours, exact);
    std::printf(
        "[ measure ] dit %s %s fp32: rel L2 to the exact-features ref %.3e, to the plain ref %.3e "
        "(the reference's own ulp sensitivity %.3e)\n",
        variant.c_str(), cse.c_str(), err, test::rel_l2(ours, fp32_ref), self);
    EXPECT_LT(err, test::kFp32Tolerance);
    EXPECT_LT(test::rel_l2(ours, fp32_ref), std::max(test::kFp32Tolerance, 2 * self));
  } else {
    test::expect_matches("dit " + variant + " " + cse, p, ours, fp32_ref, channels_major(c + "bf16.velocity"));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SA3Dit,
                         ::testing::Combine(::testing::Values("dit_diff", "dit_plain"),
                                            ::testing::Values("t2a", "inpaint"), ::testing::Values("fp32", "bf16")));

// The SAME-L decoder against the official SAMEDecoder (whole-sequence decode, its inference noise
// off), a batch of two 40-latent sequences: band attention over 680 tokens, DyT, SiLU and sin FFs.
class SameDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(SameDecode, MatchesTheOfficialDecoder) {
  const std::string p = GetParam();
  const DType dt = test::precision_dtype(p);
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_same_ref.safetensors"));
  const auto decoder = same_l_decoder(dt);
  const auto& cfg = decoder.config();
  const Tensor& z = ref.get("latents");  // (B, C, T)
  const int64_t batch = z.shape[0];
  ASSERT_EQ(z.shape[1], cfg.latent_dim);
  const Tensor latents = test::frames_major(z);
  Arena arena;
  Context ctx{&arena, dt};
  const Tensor audio = decoder.decode(ctx, to_dtype(latents, dt), batch);
  ASSERT_EQ(audio.shape, ref.get("fp32.audio").shape);
  test::expect_matches("same_l decode", p, to_f32_vector(audio), to_f32_vector(ref.get("fp32.audio")),
                       to_f32_vector(ref.get("bf16.audio")));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SameDecode, ::testing::Values("fp32", "bf16"));

// The SAME-L encoder (diffusers' names) against the official SAMEEncoder and soft-norm bottleneck:
// two clips of 40 latents' length, band attention over 680 tokens, DyT, SiLU FFs, the summary
// token kept, the projection and (x * scale + bias) / running_std.
class SameEncode : public ::testing::TestWithParam<std::string> {};

TEST_P(SameEncode, MatchesTheOfficialEncoder) {
  const std::string p = GetParam();
  const DType dt = test::precision_dtype(p);
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_same_ref.safetensors"));
  const std::string dir = test::fixture("sa3_tiny/same_l");
  const auto encoder =
      sa3::SameEncoder::load(sa3::SameConfig::read(config_in(dir), /*encoder=*/true), test::weights_in(dir), dt);
  const Tensor& audio = ref.get("encode.audio");  // (B, C, N)
  Arena arena;
  Context ctx{&arena, dt};
  const Tensor latents = encoder.encode(ctx, to_dtype(audio, DType::f32));
  const Tensor& want = ref.get("encode.fp32.latents");
  ASSERT_EQ(latents.shape, (Shape{want.shape[0] * want.shape[2], want.shape[1]}));
  test::expect_matches("same_l encode", p, to_f32_vector(latents), to_f32_vector(test::frames_major(want)),
                       to_f32_vector(test::frames_major(ref.get("encode.bf16.latents"))));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SameEncode, ::testing::Values("fp32", "bf16"));

// The official decode_audio over 300 latents: chunked (three chunks of 128, overlap 32, the last
// anchored at the end), and with the published configs' inference noise drawn from torch's
// generator (seed 5) chunk after chunk, both chunked and whole.
TEST(SameDecodeLong, ChunkedDecodeAndInferenceNoiseMatchTheOfficialDecodeAudio) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_same_ref.safetensors"));
  const auto decoder = same_l_decoder(DType::f32);
  const Tensor latents = test::frames_major(ref.get("long.latents"));
  Arena arena;
  Context ctx{&arena, DType::f32};
  struct Case {
    const char* name;
    bool chunked, noise;
  };
  for (const Case& k :
       {Case{"chunked", true, false}, Case{"noise_chunked", true, true}, Case{"noise_whole", false, true}}) {
    std::vector<TorchGenerator> gens{TorchGenerator(5)};
    sa3::DecodeNoise noise;
    if (k.noise) noise = sa3::DecodeNoise::from(true, 0.1f, gens);
    const Tensor audio = decoder.decode(ctx, latents, 1, k.chunked, noise);
    const auto want = to_f32_vector(ref.get(std::string("long.") + k.name + ".audio"));
    const double err = test::rel_l2(to_f32_vector(audio), want);
    std::printf("[ measure ] same_l 300 latents %s: rel L2 %.3e\n", k.name, err);
    EXPECT_LT(err, test::kFp32Tolerance) << k.name;
  }
}

// On a device a rank's chunks decode together, each a sample of one pass (sa3.decode_chunks): the
// shadow device (the CPU's kernels behind device memory) decodes 300 latents' three chunks, with
// each sample's noise drawn chunk after chunk from its own generator, to the CPU's bytes (one
// chunk a pass), for one sample and a batch of two (fresh seeds, printed); apart, the same.
TEST(SameDecodeLong, ChunksTogetherOnADeviceAreTheCpusChunksApart) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_same_ref.safetensors"));
  const std::string dir = test::fixture("sa3_tiny/same_l");
  const sa3::SameConfig cfg = sa3::SameConfig::read(config_in(dir));
  const auto cpu = sa3::SameDecoder::load(cfg, test::weights_in(dir), DType::f32);
  Backend& device = test::shadow_device();
  const auto shadow = sa3::SameDecoder::load(cfg, WeightLoader(open_weights(dir), &device), DType::f32);
  const Tensor one = test::frames_major(ref.get("long.latents"));
  Tensor two = Tensor::heap({2 * one.shape[0], one.shape[1]}, one.dtype);
  std::memcpy(two.data, one.data, one.nbytes());
  for (int64_t i = 0; i < one.numel(); ++i) two.ptr<float>()[one.numel() + i] = -0.5f * one.ptr<float>()[i];
  const uint64_t seed = test::test_seed();
  for (const int64_t batch : {int64_t(1), int64_t(2)})
    for (const char* arm : {"together", "apart"}) {
      SCOPED_TRACE(std::to_string(batch) + " sample(s), " + arm);
      const Tensor& latents = batch == 1 ? one : two;
      auto noise_of = [&](std::vector<TorchGenerator>& gens) {
        for (int64_t b = 0; b < batch; ++b) gens.emplace_back(seed + uint64_t(b));
        return sa3::DecodeNoise::from(true, 0.1f, gens);
      };
      std::vector<TorchGenerator> cpu_gens, device_gens;
      Arena host_arena;
      Context host{&host_arena, DType::f32};
      const Tensor want = cpu.decode(host, latents, batch, true, noise_of(cpu_gens));
      KnobScope knob("sa3.decode_chunks", arm);
      Knob& chunks = find_knob("sa3.decode_chunks");
      chunks.clear_taken();
      Arena device_arena(size_t(256) << 20, false, device);
      Context on_device{&device_arena, DType::f32, nullptr, false, &device};
      const Tensor got =
          device.download(shadow.decode(on_device, device.upload(latents), batch, true, noise_of(device_gens)));
      ASSERT_EQ(got.shape, want.shape);
      EXPECT_EQ(0, std::memcmp(got.data, want.data, want.nbytes()));
      EXPECT_EQ(chunks.taken(chunks.index_of(arm)), 1);
    }
}

TEST(T5GemmaConfig, UnsupportedSettingsAreRefusedNamingFileAndKey) {
  const Config base = read_config(test::fixture("t5gemma_tiny/config.json"));
  struct Case {
    const char* key;
    Json value;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"hidden_activation", "relu", "hidden_activation"},
      {"attention_bias", true, "attention_bias"},
      {"rms_norm_eps", -1.0, "rms_norm_eps"},
      {"query_pre_attn_scalar", 0, "query_pre_attn_scalar"},
      {"layer_types", Json::array({"full_attention"}), "layer_types"},
  };
  for (const Case& c : cases) {
    Config bad = base;
    bad.json["encoder"][c.key] = c.value;
    test::expect_error([&] { sa3::T5GemmaConfig::read(bad); }, {"config.json", c.expect});
  }
}

// Every setting the official classes of StableAudio3Pipeline take (tools/oracle
// make_sa3_fixtures.py write_config_keys) is consulted by apus's reader of that file: honoured,
// checked and refused where unsupported, or declared to leave inference unchanged.
TEST(Sa3Configs, EveryOfficialSettingIsHonouredOrRefused) {
  const Json keys = read_json(test::fixture("sa3_config_keys.json"));
  const Config dit = read_config(test::fixture("sa3_tiny/dit_diff/config.json")),
               same = read_config(test::fixture("sa3_tiny/same_l/config.json")),
               duration = read_config(test::fixture("sa3_tiny/pipeline/duration_embedder/config.json")),
               scheduler = read_config(test::fixture("sa3_tiny/pipeline/scheduler/scheduler_config.json")),
               text = read_config(test::fixture("t5gemma_tiny/config.json"));
  sa3::DitConfig::read(dit);
  sa3::SameConfig::read(same);
  sa3::SameConfig::read(same, /*encoder=*/true);
  sa3::DurationConfig::read(duration);
  sa3_scheduler_is_euler(scheduler);
  sa3::T5GemmaConfig::read(text);
  const std::pair<const char*, const Config*> files[] = {{"transformer", &dit},
                                                         {"vae", &same},
                                                         {"duration_embedder", &duration},
                                                         {"scheduler", &scheduler},
                                                         {"text_encoder", &text}};
  for (const auto& [name, config] : files) {
    ASSERT_GE(keys[name].size(), 6u) << name;
    for (const Json& key : keys[name])
      EXPECT_TRUE(config->consulted->contains(key.get<std::string>()))
          << config->path << ": '" << key.get<std::string>() << "' is neither honoured nor refused";
  }
  // The pipeline's own: its components, whose classes the model's index check checks.
  EXPECT_EQ(keys["pipeline"],
            Json::array({"vae", "text_encoder", "tokenizer", "duration_embedder", "transformer", "scheduler"}));
}

}  // namespace
}  // namespace apus
