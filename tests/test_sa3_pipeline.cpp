// Stable Audio 3 text-to-audio end to end against the official generate() path on tiny
// random-weight components (tools/oracle/make_sa3_official_fixtures.py): prompt, seed and seconds
// in, samples out, through the canvas with its headroom and padding, the log-SNR schedule,
// ping-pong with torch's CPU generator and the SAME decode.
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "apus/apus.h"
#include "core/cost.h"
#include "gate/metrics.h"
#include "io/files.h"
#include "io/media/audio.h"
#include "io/media/resample.h"
#include "io/model_dir.h"
#include "io/weights/safetensors.h"
#include "pipeline/registry.h"
#include "pipeline/sa3/model_config.h"
#include "pipeline/sa3/official_checkpoint.h"
#include "sa3_fixtures.h"
#include "sampling/logsnr.h"
#include "test_util.h"

namespace apus {
namespace {

namespace fs = std::filesystem;
using test::clip_file;
using test::inputs_request;
using test::interleaved;
using test::official_dir;
using test::official_small_dir;
using test::pipeline_dir;
using test::reference_request;

std::string spoiled_copy(const std::string& name, const std::string& part) {
  const std::string d = ::testing::TempDir() + "apus_sa3_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(d);
  fs::create_directories(d);
  for (const auto& e : fs::directory_iterator(pipeline_dir())) {
    const std::string n = e.path().filename().string();
    if (n == part) fs::copy(fs::canonical(e.path()), d + "/" + n, fs::copy_options::recursive);
    else fs::create_symlink(fs::read_symlink(e.path()), d + "/" + n);
  }
  return d;
}

// The tiny official checkpoint with model.safetensors rewritten tensor by tensor through `change`
// (stored name, tensor as stored -> tensor to store); model_config.json and T5Gemma linked.
template <typename Change> std::string rewritten_checkpoint(const std::string& name, Change&& change) {
  const std::string d = ::testing::TempDir() + "apus_sa3_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(d);
  fs::create_directories(d);
  for (const char* part : {"model_config.json", "t5gemma-b-b-ul2"})
    fs::create_symlink(fs::absolute(official_dir() + "/" + part), d + "/" + part);
  const SafetensorsFile f = SafetensorsFile::open(official_dir() + "/model.safetensors");
  std::vector<NamedTensor> tensors;
  for (const std::string& n : f.names()) tensors.push_back({n, change(n, f.get(n))});
  write_safetensors(d + "/model.safetensors", tensors);
  return d;
}

// Bit for bit: the official schedule's fp32 sigmoid (torch's vectorised exp over whole pairs of
// vectors, libm's over the rest), for every step count apus takes, from full noise and from an
// audio-to-audio level (tools/oracle/make_sa3_sigmas.py); and the pipeline fixture's own schedule.
TEST(Sa3Schedule, LogSnrSigmasAreTheOfficialScheduleBitForBit) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_sigmas_ref.safetensors"));
  const Json meta = read_json(test::fixture("sa3_sigmas_ref.json"));
  for (const auto& [name, sigma_max] : meta["sigma_max"].items()) {
    const std::vector<float> all = to_f32_vector(ref.get(name));
    size_t at = 0;
    for (int steps = meta["steps"][0]; steps <= meta["steps"][1].get<int>(); ++steps) {
      const std::vector<float> got = logsnr_sigmas(steps, sigma_max.get<float>());
      ASSERT_LE(at + got.size(), all.size());
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_EQ(got[i], all[at + i]) << name << ", " << steps << " steps, sigma " << i;
      at += got.size();
    }
    EXPECT_EQ(at, all.size()) << name;
  }
  const SafetensorsFile pipeline = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const std::vector<float> want = to_f32_vector(pipeline.get("sigmas"));
  EXPECT_EQ(logsnr_sigmas(int(want.size()) - 1, 1.0f), want);
  // torch.linspace's own values, which the schedule and the DiT's Fourier frequencies start from.
  const std::vector<float> ramp = torch_linspace(0.0f, 1.0f, 128);
  EXPECT_EQ(ramp.front(), 0.0f);
  EXPECT_EQ(ramp.back(), 1.0f);
}

TEST(Sa3Pipeline, TextToAudioMatchesTheOfficialGenerate) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const auto model = AudioModel::open(pipeline_dir(), Weights::per_stage);
  const auto fp32_ref = interleaved(ref.get("fp32.audio")), bf16_ref = interleaved(ref.get("bf16.audio"));
  for (const bool fp32 : {true, false}) {
    const AudioResult r = model->generate(reference_request(fp32));
    EXPECT_EQ(r.channels, 2);
    EXPECT_EQ(r.sample_rate, 2048);
    EXPECT_EQ(r.seed, 42u);
    ASSERT_EQ(r.samples.size(), fp32_ref.size()) << "exactly int(seconds * rate) frames";
    test::expect_matches("sa3 pipeline audio", fp32 ? "fp32" : "bf16", r.samples, fp32_ref, bf16_ref);
  }
}

// ComfyUI's repackaging (Comfy-Org/stable-audio-3): the official model.safetensors keys as one file
// without model_config.json, and T5Gemma as one file under transformers' names with "model."
// (the decoder too) and Gemma's SentencePiece model as a u8 spiece_model tensor. Both give the
// official folder's clip byte for byte: the same weights and tokenizer, read from other places.
TEST(Sa3SingleFile, ComfyUiFilesGiveTheOfficialFoldersClip) {
  AudioRequest r = reference_request(false);
  const std::vector<float> want = AudioModel::open(official_dir(), Weights::per_stage)->generate(r).samples;
  ModelParts p;
  p.model = official_dir() + "/model.safetensors";
  p.config = official_dir();
  EXPECT_EQ(AudioModel::open(p, Weights::per_stage)->generate(r).samples, want);

  const SafetensorsFile t5 = SafetensorsFile::open(test::fixture("t5gemma_tiny/model.safetensors"));
  std::vector<NamedTensor> tensors;
  for (const std::string& n : t5.names()) tensors.push_back({"model." + n, t5.get(n)});
  tensors.push_back(
      {"model.decoder.layers.0.self_attn.q_proj.weight", t5.get("encoder.layers.0.self_attn.q_proj.weight")});
  const std::string spm = read_file(test::fixture("t5gemma_tok/tokenizer.model"));
  Tensor bytes = Tensor::heap({int64_t(spm.size())}, DType::u8);
  std::memcpy(bytes.data, spm.data(), spm.size());
  tensors.push_back({"spiece_model", bytes});
  p.text_encoder = test::scratch_dir.path() + "t5gemma_comfy.safetensors";
  write_safetensors(p.text_encoder, tensors);
  // The config folder's T5Gemma weights and tokenizer.model stand aside: a broken tokenizer given
  // instead is refused naming it, so the file's own is the one read.
  EXPECT_EQ(AnyModel::open(p, Weights::per_stage).audio()->generate(r).samples, want);
  p.tokenizer = p.model;
  test::expect_error([&] { AudioModel::open(p, Weights::per_stage); }, {p.model, "no 'spiece_model'"});
  p.tokenizer.clear();
  // The file's weights are the ones read: one missing is refused naming the file.
  const std::string embed = "model.encoder.embed_tokens.weight";
  std::erase_if(tensors, [&](const NamedTensor& t) { return t.name == embed; });
  const std::string partial = test::scratch_dir.path() + "t5gemma_partial.safetensors";
  write_safetensors(partial, tensors);
  ModelParts missing = p;
  missing.text_encoder = partial;
  test::expect_error([&] { AudioModel::open(missing, Weights::per_stage)->generate(r); },
                     {"t5gemma_partial", "embed_tokens"});
  // Without --config the tiny width is no published layout's.
  ModelParts bare;
  bare.model = p.model;
  test::expect_error([&] { AudioModel::open(bare, Weights::per_stage); },
                     {p.model, "none of the published", "--config"});
  // The checkpoint holds its SAME: a --vae is refused, not ignored.
  ModelParts with_vae = p;
  with_vae.vae = p.text_encoder;
  test::expect_error([&] { AudioModel::open(with_vae, Weights::per_stage); }, {p.model, "--vae", "sa3.cpp's GGUF"});
  // A folder takes no parts.
  ModelParts folder{official_dir()};
  folder.text_encoder = p.text_encoder;
  test::expect_error([&] { AudioModel::open(folder, Weights::per_stage); }, {"single-file --model"});
}

// Live previews: one after each step, numbered from 1, the clip the same with them as without
// (the decode for a preview draws no noise); the last step's estimate is the clip's final latents
// (ping-pong's last update keeps x - t v), so its peaks are the result's own, mixed and bucketed
// the same way. A model that does not hold its decoder refuses them.
TEST(Sa3Pipeline, PreviewsFollowEveryStepAndEndAtTheClip) {
  const auto model = AudioModel::open(official_dir(), Weights::resident);
  AudioRequest r = reference_request(false);
  const AudioResult plain = model->generate(r);
  std::vector<Preview> previews;
  r.preview = [&](const Preview& p) { previews.push_back(p); };
  const AudioResult shown = model->generate(r);
  EXPECT_EQ(shown.samples, plain.samples);
  ASSERT_EQ(previews.size(), size_t(*r.steps));
  const int64_t frames = int64_t(plain.samples.size()) / plain.channels, buckets = std::min<int64_t>(512, frames);
  std::vector<float> peaks;
  for (int64_t k = 0; k < buckets; ++k) {
    float lo = 1, hi = -1;
    for (int64_t f = k * frames / buckets; f < (k + 1) * frames / buckets; ++f) {
      float mixed = 0;
      for (int ch = 0; ch < plain.channels; ++ch) mixed += plain.samples[size_t(f * plain.channels + ch)];
      mixed /= float(plain.channels);
      lo = std::min(lo, mixed);
      hi = std::max(hi, mixed);
    }
    peaks.push_back(lo);
    peaks.push_back(hi);
  }
  for (size_t i = 0; i < previews.size(); ++i) {
    EXPECT_EQ(previews[i].step, int(i) + 1);
    EXPECT_EQ(previews[i].steps, r.steps);
    EXPECT_EQ(previews[i].peaks.size(), size_t(2 * buckets));
  }
  EXPECT_EQ(previews.back().peaks, peaks);
  EXPECT_NE(previews.front().peaks, peaks);
  test::expect_error([&] { AudioModel::open(official_dir(), Weights::per_stage)->generate(r); },
                     {"live previews come from a resident model"});
}

// The official layout holds the same weights under the official names (a fused projection in
// the official row order, computed duration frequencies): the same clip, which the official
// StableAudioModel.generate() made from that checkpoint (tools/oracle checks it equals the
// pipeline fixture's).
TEST(Sa3Pipeline, OfficialCheckpointLayoutGivesTheOfficialClip) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const auto model = AudioModel::open(official_dir(), Weights::per_stage);
  const auto fp32_ref = interleaved(ref.get("fp32.audio")), bf16_ref = interleaved(ref.get("bf16.audio"));
  for (const bool fp32 : {true, false}) {
    const AudioResult r = model->generate(reference_request(fp32));
    ASSERT_EQ(r.samples.size(), fp32_ref.size());
    test::expect_matches("sa3 official layout audio", fp32 ? "fp32" : "bf16", r.samples, fp32_ref, bf16_ref);
  }
  test::expect_error([&] { ImageModel::open(official_dir(), Weights::per_stage); },
                     {"model_config.json", "apus audio"});
}

// The small models' path: a plain-attention DiT and SAME-S (attention in 34-token chunks, the
// second half of blocks shifted by half a chunk, a kernel-3 mapping), chunked decode on.
TEST(Sa3Pipeline, SmallModelWithSameSGivesTheOfficialClip) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_small_ref.safetensors"));
  const auto model = AudioModel::open(official_small_dir(), Weights::per_stage);
  const AudioResult r = model->generate(reference_request(true));
  const auto want = interleaved(ref.get("fp32.audio"));
  ASSERT_EQ(r.samples.size(), want.size());
  const double err = test::rel_l2(r.samples, want);
  std::printf("[ measure ] sa3 small model (SAME-S) fp32: rel L2 %.3e\n", err);
  EXPECT_LT(err, test::kFp32Tolerance);
}

// SAME-S's decode alone, from the same checkpoint, against the official decoder in fp32 and bf16.
TEST(Sa3Pipeline, SameSDecodeMatchesTheOfficialDecoder) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_small_ref.safetensors"));
  const sa3::OfficialConfig config = sa3::read_official_config(official_small_dir() + "/model_config.json");
  EXPECT_EQ(config.same.window, 0);
  EXPECT_EQ(config.same.chunk_tokens, 34);
  EXPECT_TRUE(config.same.midpoint_shift);
  EXPECT_EQ(config.same.mapping_kernel, 3);
  const int64_t batch = ref.get("same.latents").shape[0];
  const Tensor latents = test::frames_major(ref.get("same.latents"));
  for (const char* p : {"fp32", "bf16"}) {
    const DType dt = test::precision_dtype(p);
    const auto decoder = sa3::SameDecoder::load(
        config.same,
        WeightLoader(sa3::OfficialCheckpoint::same(open_weights(official_small_dir()), "pretransform.model.",
                                                   config.same.differential)),
        dt);
    Arena arena;
    Context ctx{&arena, dt};
    const Tensor audio = decoder.decode(ctx, to_dtype(latents, dt), batch);
    test::expect_matches("same_s decode", p, to_f32_vector(audio), to_f32_vector(ref.get("same.fp32.audio")),
                         to_f32_vector(ref.get("same.bf16.audio")));
  }
}

// SAME-S's encoder (the small models'): attention within 34-token chunks, shifted by half a chunk
// for its second half, a kernel-3 mapping; whole in fp32 and bf16, and over 300 latents in the
// official 128-latent chunks as the config's `chunked` asks (the trimmed overlaps exceed its
// receptive field, so chunked equals whole there, as in the official code).
TEST(Sa3Pipeline, SameSEncoderMatchesTheOfficialEncoder) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_small_ref.safetensors"));
  const sa3::OfficialConfig config = sa3::read_official_config(official_small_dir() + "/model_config.json");
  EXPECT_EQ(config.encoder.window, 0);
  EXPECT_EQ(config.encoder.chunk_tokens, 34);
  EXPECT_TRUE(config.encoder.midpoint_shift);
  EXPECT_EQ(config.encoder.mapping_kernel, 3);
  EXPECT_EQ(config.encoder.depth, 2);
  EXPECT_TRUE(config.chunked_decode);
  const auto load = [&](DType dt) {
    return sa3::SameEncoder::load(
        config.encoder,
        WeightLoader(sa3::OfficialCheckpoint::same(open_weights(official_small_dir()), "pretransform.model.",
                                                   config.encoder.differential)),
        dt);
  };
  for (const char* p : {"fp32", "bf16"}) {
    const DType dt = test::precision_dtype(p);
    Arena arena;
    Context ctx{&arena, dt};
    const Tensor latents = load(dt).encode(ctx, ref.get("encode.audio"));
    test::expect_matches("same_s encode", p, to_f32_vector(latents),
                         to_f32_vector(test::frames_major(ref.get("encode.fp32.latents"))),
                         to_f32_vector(test::frames_major(ref.get("encode.bf16.latents"))));
  }
  Arena arena;
  Context ctx{&arena, DType::f32};
  const Tensor chunked = load(DType::f32).encode(ctx, ref.get("encode.long.audio"), /*chunked=*/true);
  const double err =
      test::rel_l2(to_f32_vector(chunked), to_f32_vector(test::frames_major(ref.get("encode.long.chunked.latents"))));
  std::printf("[ measure ] same_s chunked encode of 300 latents: rel L2 %.3e\n", err);
  EXPECT_LT(err, test::kFp32Tolerance);
}

// Audio-to-audio (a stereo clip shorter than the canvas, zero-padded; noise level 0.6: the mix
// and a schedule from 0.6) and inpainting (a mono clip longer than the canvas, cut and doubled; two
// regions generated, the clip's latents and mask in every DiT block) against the official
// generate(). bf16 is held to twice the official bf16 run's own distance from fp32 on this model.
TEST(Sa3Pipeline, AudioToAudioAndInpaintingMatchTheOfficialGenerate) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_inputs_ref.safetensors"));
  const SafetensorsFile t2a = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const double bf16_self = test::rel_l2(interleaved(t2a.get("bf16.audio")), interleaved(t2a.get("fp32.audio")));
  const auto model = AudioModel::open(official_dir(), Weights::per_stage);
  const auto text_only = interleaved(ref.get("t2a.fp32.audio"));
  for (const std::string mode : {"a2a", "inpaint"}) {
    const auto want = interleaved(ref.get(mode + ".fp32.audio"));
    // The clip changes the result: without it, the text-to-audio clip lies far off.
    EXPECT_GT(test::rel_l2(text_only, want), 100 * test::kFp32Tolerance) << mode;
    const AudioResult fp32 = model->generate(inputs_request(true, mode));
    ASSERT_EQ(fp32.samples.size(), want.size()) << mode;
    const double err = test::rel_l2(fp32.samples, want);
    const AudioResult bf16 = model->generate(inputs_request(false, mode));
    const double err_bf16 = test::rel_l2(bf16.samples, want);
    std::printf(
        "[ measure ] sa3 %s: fp32 rel L2 %.3e; bf16 %.3e (the official bf16 run's own distance on this "
        "model %.3e)\n",
        mode.c_str(), err, err_bf16, bf16_self);
    EXPECT_LT(err, test::kFp32Tolerance) << mode;
    EXPECT_LT(err_bf16, test::kBf16Factor * bf16_self) << mode;
  }
}

// Input clips at another rate go through torchaudio's Resample as the official prepare_audio
// does: the resampler alone against torchaudio (48 and 22.05 kHz to 44.1 kHz), the clips as
// generate() prepares and encodes them, and a 3000 Hz clip through the official generate() on the
// 2048 Hz tiny model. (On these random weights the sampler's output hardly depends on the init
// clip's content, 6e-4 between two different clips, so the encoded clips are checked directly.)
TEST(Sa3Pipeline, ClipsAtOtherRatesAreResampledAsTorchaudioDoes) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_inputs_ref.safetensors"));
  for (const int rate : {48000, 22050}) {
    const Tensor& in = ref.get("resample." + std::to_string(rate) + ".in");
    const Tensor& want = ref.get("resample." + std::to_string(rate) + ".out");
    std::vector<std::vector<float>> planes;
    for (int64_t c = 0; c < in.shape[0]; ++c) {
      const auto all = to_f32_vector(in);
      planes.emplace_back(all.begin() + c * in.shape[1], all.begin() + (c + 1) * in.shape[1]);
    }
    const auto out = resample(planes, rate, 44100, int64_t(1) << 40);
    std::vector<float> flat;
    for (const auto& p : out) flat.insert(flat.end(), p.begin(), p.end());
    ASSERT_EQ(int64_t(flat.size()), want.numel()) << rate;
    const double err = test::rel_l2(flat, to_f32_vector(want));
    std::printf("[ measure ] resample %d -> 44100 Hz: rel L2 to torchaudio %.3e\n", rate, err);
    EXPECT_LT(err, 1e-6) << rate;
    // Cut to the frames asked for: the same first frames.
    const auto head = resample(planes, rate, 44100, 100);
    ASSERT_EQ(head[0].size(), 100u);
    EXPECT_TRUE(std::equal(head[0].begin(), head[0].end(), out[0].begin()));
  }
  // What generate() hands the sampler: the clip prepared (resampled from 3000 Hz, or a mono clip
  // doubled and cut to the canvas) and encoded, against the official _encode_audio_input.
  const sa3::OfficialConfig config = sa3::read_official_config(official_dir() + "/model_config.json");
  const auto encoder =
      sa3::SameEncoder::load(config.encoder,
                             WeightLoader(sa3::OfficialCheckpoint::same(
                                 open_weights(official_dir()), "pretransform.model.", config.encoder.differential)),
                             DType::f32);
  for (const char* name : {"init_3000", "inpaint"}) {
    const Tensor& want = ref.get(std::string(name) + ".latents");
    const int64_t frames = want.shape[2], length = frames * config.encoder.samples_per_latent();
    Tensor clip = Tensor::heap({1, 2, length}, DType::f32);
    sa3::prepare_clip(clip_file(std::string("sa3_tiny/inputs/") + name + ".wav"), name, 2048, 2, length,
                      clip.ptr<float>());
    Arena arena;
    Context ctx{&arena, DType::f32};
    const double e = test::rel_l2(to_f32_vector(encoder.encode(ctx, clip)), to_f32_vector(test::frames_major(want)));
    std::printf("[ measure ] %s prepared and encoded: rel L2 %.3e\n", name, e);
    EXPECT_LT(e, test::kFp32Tolerance) << name;
  }
  const auto model = AudioModel::open(official_dir(), Weights::per_stage);
  AudioRequest r = reference_request(true);
  r.init_audio = clip_file("sa3_tiny/inputs/init_3000.wav");
  EXPECT_EQ(r.init_audio->sample_rate, 3000);
  r.init_noise_level = 0.6;
  const double err = test::rel_l2(model->generate(r).samples, interleaved(ref.get("a2a_resampled.fp32.audio")));
  AudioRequest inpaint = inputs_request(true, "inpaint");
  inpaint.inpaint_audio = r.init_audio;
  const double err_inpaint =
      test::rel_l2(model->generate(inpaint).samples, interleaved(ref.get("inpaint_resampled.fp32.audio")));
  std::printf("[ measure ] sa3 from a 3000 Hz clip: audio-to-audio fp32 rel L2 %.3e, inpainting %.3e\n", err,
              err_inpaint);
  EXPECT_LT(err, test::kFp32Tolerance);
  EXPECT_LT(err_inpaint, test::kFp32Tolerance);
}

TEST(Sa3Pipeline, BadAudioInputsAreRefused) {
  const auto model = AudioModel::open(official_dir(), Weights::per_stage);
  auto expect = [&](AudioRequest r, const std::vector<std::string>& fragments) {
    test::expect_error([&] { model->generate(r); }, fragments);
  };
  AudioRequest a2a = inputs_request(true, "a2a");
  for (const double level : {0.0, -0.5, 1.5, std::nan("")}) {
    AudioRequest r = a2a;
    r.init_noise_level = level;
    expect(r, {"init_noise_level", "outside (0, 1]"});
  }
  AudioRequest fine = a2a;
  fine.init_audio->sample_rate = 44101;  // 44101 : 2048 does not reduce
  expect(fine, {"44101 Hz to 2048 Hz", "filter bank"});
  AudioRequest no_rate = a2a;
  no_rate.init_audio->sample_rate = 0;
  expect(no_rate, {"init audio", "0 Hz"});
  AudioRequest empty = a2a;
  empty.init_audio->samples.clear();
  expect(empty, {"init audio: holds no audio"});
  AudioRequest ragged = a2a;
  ragged.init_audio->samples.pop_back();
  expect(ragged, {"init audio", "whole frames"});
  AudioRequest nan = a2a;
  nan.init_audio->samples[101] = std::nanf("");
  expect(nan, {"init audio", "sample 50", "finite"});
  AudioRequest inpaint = inputs_request(true, "inpaint");
  for (const auto& region : {std::pair{-0.5, 0.5}, std::pair{0.8, 0.8}, std::pair{0.9, 0.3}, std::pair{1.0, 2.0}}) {
    AudioRequest r = inpaint;
    r.inpaint_regions = {region};
    expect(r, {"inpaint region", "inside the 1.4 s clip"});
  }
  AudioRequest no_regions = inpaint;
  no_regions.inpaint_regions.clear();
  expect(no_regions, {"inpaint clip needs", "region"});
  AudioRequest no_clip = inpaint;
  no_clip.inpaint_audio.reset();
  expect(no_clip, {"inpaint regions need an inpaint clip"});
}

// The -base objective (rectified_flow) on the same weights: Euler, and classifier-free guidance
// with adaptive projected guidance as the official DiT does it: the unconditional half all-zero
// cross tokens, or the negative prompt's with its padding zeroed.
TEST(Sa3Pipeline, BaseModelGuidanceMatchesTheOfficialGenerate) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const std::string d =
      test::official_variant_dir("base", read_json(test::fixture("sa3_tiny/original_base/model_config.json")));
  const auto model = AudioModel::open(d, Weights::per_stage);
  EXPECT_EQ(model->sampler(), "Euler (rectified_flow)");
  for (const bool negative : {false, true}) {
    AudioRequest r = reference_request(true);
    r.steps = 6;
    r.cfg = 7;
    if (negative) r.negative_prompt = "noise, hiss";
    const AudioResult out = model->generate(r);
    const auto want = interleaved(ref.get(negative ? "base_cfg_negative.audio" : "base_cfg.audio"));
    ASSERT_EQ(out.samples.size(), want.size());
    const double err = test::rel_l2(out.samples, want);
    std::printf("[ measure ] sa3 base model, cfg 7%s, fp32: rel L2 %.3e\n", negative ? " with a negative prompt" : "",
                err);
    EXPECT_LT(err, test::kFp32Tolerance);
  }
  AudioRequest bad = reference_request(true);
  bad.negative_prompt = "noise";
  test::expect_error([&] { model->generate(bad); }, {"negative prompt", "cfg"});
  fs::remove_all(d);
}

// The published configs' decoder noise (noise_regularize, mask_noise 0.1): drawn after the
// sampler's, from the same generator, as the official generate() draws it.
TEST(Sa3Pipeline, OfficialDecoderNoiseContinuesTheSeededStream) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const std::string d = test::official_variant_dir("noise", test::decoder_noise_config());
  const auto model = AudioModel::open(d, Weights::per_stage);
  const AudioResult r = model->generate(reference_request(true));
  const auto want = interleaved(ref.get("fp32_decoder_noise.audio"));
  ASSERT_EQ(r.samples.size(), want.size());
  const double err = test::rel_l2(r.samples, want);
  std::printf("[ measure ] sa3 official layout with decoder noise fp32: rel L2 %.3e\n", err);
  EXPECT_LT(err, test::kFp32Tolerance);
  fs::remove_all(d);
}

TEST(Sa3Pipeline, UnsupportedOfficialSettingsAreRefusedNamingFileAndKey) {
  const Json base = read_json(test::fixture("sa3_tiny/original/model_config.json"));
  struct Case {
    std::function<void(Json&)> spoil;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {[](Json& j) { j["model"]["diffusion"]["diffusion_objective"] = "v"; }, {"diffusion_objective", "\"v\""}},
      {[](Json& j) { j["model"]["diffusion"]["config"]["norm_type"] = "layer_norm"; },
       {"model.diffusion.config", "norm_type"}},
      {[](Json& j) { j["model"]["diffusion"]["config"]["attn_kwargs"]["qk_norm"] = "l2"; }, {"attn_kwargs", "qk_norm"}},
      {[](Json& j) { j["model"]["diffusion"]["config"]["timestep_features_logsnr"] = true; },
       {"timestep_features_logsnr"}},
      {[](Json& j) { j["model"]["diffusion"]["config"]["use_sinusoidal_emb"] = true; },
       {"use_sinusoidal_emb", "not a setting"}},
      {[](Json& j) {
         j["model"]["diffusion"]["sampling_distribution_shift_options"] = {{"type", "flux"}};
       },
       {"sampling_distribution_shift_options"}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["decoder"]["config"]["chunk_midpoint_shift"] = true; },
       {"chunk_midpoint_shift"}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["decoder"]["config"]["dyt"] = false; }, {"dyt"}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["bottleneck"]["config"]["noise_augment_dim"] = 4; },
       {"noise_augment_dim"}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["decoder"]["soft_clip"] = true; }, {"soft_clip"}},
      {[](Json& j) { j["model"]["conditioning"]["configs"][0]["config"]["padding_mode"] = "zero"; }, {"padding_mode"}},
      {[](Json& j) { j["model"]["conditioning"]["configs"][0]["config"]["subfolder"] = "elsewhere"; },
       {"elsewhere", "missing"}},
      {[](Json& j) { j["model"]["conditioning"]["cond_dim"] = 64; }, {"cond_dim"}},
      // Every level of the file is walked: a key apus does not know is refused wherever it sits,
      // and the blocks' types and repeated sizes are checked, not assumed.
      {[](Json& j) {
         j["training"] = {{"learning_rate", 1e-4}};
       },
       {"'training' is not a setting"}},
      {[](Json& j) { j["model"]["ema"] = true; }, {"(model)", "'ema' is not a setting"}},
      {[](Json& j) { j["model"]["pretransform"]["scale"] = 2.0; }, {"(model.pretransform)", "'scale'"}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["bottleneck"]["type"] = "vae"; },
       {"bottleneck", "'type'", "\"vae\""}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["decoder"]["type"] = "oobleck"; },
       {"decoder", "\"oobleck\""}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["pretransform"]["type"] = "wavelet"; },
       {"pretransform.config.pretransform", "\"wavelet\""}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["pretransform"]["config"]["mode"] = "fft"; },
       {"'mode' is not a setting"}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["latent_dim"] = 7; }, {"'latent_dim' differs"}},
      {[](Json& j) { j["model"]["pretransform"]["config"]["io_channels"] = 1; }, {"'io_channels' differs"}},
      {[](Json& j) { j["audio_channels"] = 1; }, {"'audio_channels' 1 differs"}},
      {[](Json& j) { j["model"]["conditioning"]["configs"][1]["tag"] = "x"; }, {"configs[1]", "'tag'"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    Json spoiled = base;
    cases[i].spoil(spoiled);
    const std::string d = test::official_variant_dir("badcfg", spoiled);
    std::vector<std::string> expect = cases[i].expect;
    expect.push_back("model_config.json");
    if (i == 11) expect.back() = d;  // the missing folder is named by its path
    test::expect_error([&] { AudioModel::open(d, Weights::per_stage); }, expect);
    fs::remove_all(d);
  }
  // A setting without effect on the values is accepted: iterate_batch only splits the autoencoder's
  // batch into single samples.
  Json iterate = base;
  iterate["model"]["pretransform"]["iterate_batch"] = true;
  const std::string d = test::official_variant_dir("iterate", iterate);
  EXPECT_NO_THROW(AudioModel::open(d, Weights::per_stage));
  fs::remove_all(d);
}

// A checkpoint saved in bf16 throughout runs; its RoPE buffer
// holds the inverse frequencies rounded to bf16. The official bf16 run casts the model to the same
// bf16 weights, so the clip keeps the bf16 bound against the official run. A buffer holding other
// frequencies is still refused, naming the file and tensor.
TEST(Sa3Pipeline, Bf16CheckpointGivesTheOfficialBf16Clip) {
  const std::string d =
      rewritten_checkpoint("bf16", [](const std::string&, const Tensor& t) { return to_dtype(t, DType::bf16); });
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const AudioResult r = AudioModel::open(d, Weights::per_stage)->generate(reference_request(false));
  test::expect_matches("sa3 bf16 checkpoint audio", "bf16", r.samples, interleaved(ref.get("fp32.audio")),
                       interleaved(ref.get("bf16.audio")));
  fs::remove_all(d);
  // Element 1 as a bf16 copy was seen to hold it, 0.558594 for 0.562341 (one bf16 ulp below the
  // rounded 0.5625, as a buffer computed in bf16 lands): accepted, and as apus keeps the fp32
  // frequencies in bf16 runs, the very same clip.
  const std::string seen = rewritten_checkpoint("bf16_seen", [&](const std::string& n, const Tensor& t) {
    Tensor b = to_dtype(t, DType::bf16);
    if (n.ends_with("rotary_pos_emb.inv_freq")) b.ptr<uint16_t>()[1] -= 1;
    return b;
  });
  EXPECT_EQ(AudioModel::open(seen, Weights::per_stage)->generate(reference_request(false)).samples, r.samples);
  fs::remove_all(seen);
  const std::string inv_freq = "model.model.transformer.rotary_pos_emb.inv_freq";
  const std::string off = rewritten_checkpoint("bf16_off", [&](const std::string& n, const Tensor& t) {
    Tensor b = to_dtype(t, DType::bf16);
    if (n == inv_freq) b.ptr<uint16_t>()[1] += 2;  // two bf16 ulps: not a rounding of the frequency
    return b;
  });
  test::expect_error([&] { AudioModel::open(off, Weights::per_stage)->generate(reference_request(false)); },
                     {off + "/model.safetensors: tensor '" + inv_freq + "': element 1 is ", "stored as bf16"});
  fs::remove_all(off);
}

// Values the decoder would take but cannot mean: noise that pins every sample at +-1, a latent
// scale of 0, a duration span that overflows fp32. Refused where they are read, naming file and key
// or tensor, instead of rendering nonsense.
TEST(Sa3Pipeline, MeaninglessDecoderValuesAreRefusedNamingFileAndKey) {
  const Json base = read_json(test::fixture("sa3_tiny/original/model_config.json"));
  struct Case {
    std::function<void(Json&)> spoil;
    std::vector<std::string> expect;
  };
  auto decoder = [](Json& j) -> Json& { return j["model"]["pretransform"]["config"]["decoder"]["config"]; };
  auto duration = [](Json& j) -> Json& { return j["model"]["conditioning"]["configs"][1]["config"]; };
  const std::vector<Case> cases = {
      {[&](Json& j) { decoder(j)["mask_noise"] = 1e30; }, {"decoder", "'mask_noise' 1e+30 outside [0, 1]"}},
      {[&](Json& j) { decoder(j)["mask_noise"] = -0.1; }, {"decoder", "'mask_noise' -0.1 outside [0, 1]"}},
      {[&](Json& j) {
         duration(j)["min_val"] = -3e38;
         duration(j)["max_val"] = 3e38;
       },
       {"(model.conditioning.configs[1].config)", "'min_val' -3e+38 and 'max_val' 3e+38", "finite positive span"}},
      {[&](Json& j) { duration(j)["max_val"] = 0; },
       {"(model.conditioning.configs[1].config)", "'max_val' 0", "max_val must exceed min_val"}},
  };
  for (const Case& c : cases) {
    Json spoiled = base;
    c.spoil(spoiled);
    const std::string d = test::official_variant_dir("meaningless", spoiled);
    std::vector<std::string> expect = c.expect;
    expect.push_back("model_config.json");
    test::expect_error([&] { AudioModel::open(d, Weights::per_stage); }, expect);
    fs::remove_all(d);
  }
  // The bottleneck's running_std in the weights: the decoder scales the latents by it (and the
  // encoder divides by it), so text-to-audio, which loads only the decoder, must refuse it too.
  const std::string stored = "pretransform.model.bottleneck.running_std";
  for (const float bad : {0.0f, -1.0f, INFINITY}) {
    const std::string d = test::official_variant_dir("running_std", base);
    fs::remove(d + "/model.safetensors");
    {
      const SafetensorsFile f = SafetensorsFile::open(test::fixture("sa3_tiny/original/model.safetensors"));
      std::vector<NamedTensor> tensors;
      for (const std::string& n : f.names()) {
        Tensor copy = Tensor::heap(f.get(n).shape, f.get(n).dtype);
        std::memcpy(copy.data, f.get(n).data, copy.nbytes());
        if (n == stored) copy.ptr<float>()[0] = bad;
        tensors.push_back({n, copy});
      }
      write_safetensors(d + "/model.safetensors", tensors);
    }
    const auto model = AudioModel::open(d, Weights::per_stage);
    AudioRequest r = reference_request(true);
    test::expect_error([&] { model->generate(r); },
                       {d + "/model.safetensors", "tensor '" + stored + "'", "expected a finite positive number"});
    test::expect_error([&] { model->generate(inputs_request(true, "a2a")); }, {"tensor '" + stored + "'"});
    fs::remove_all(d);
  }
}

// A batch runs every stage once for all its clips, each sample with its own generator: each clip
// is the one its request gives alone.
TEST(Sa3Pipeline, BatchOfTwoEqualsTwoSingleRequests) {
  const auto model = AudioModel::open(official_dir(), Weights::per_stage);
  AudioRequest a = reference_request(true), b = reference_request(true);
  b.prompt = "a door slams shut";
  b.seed = 7;
  const std::vector<AudioResult> both = model->generate_batch({a, b});
  const AudioResult alone_a = model->generate(a), alone_b = model->generate(b);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0].seed, 42u);
  EXPECT_EQ(both[1].seed, 7u);
  EXPECT_EQ(both[0].samples, alone_a.samples);
  EXPECT_EQ(both[1].samples, alone_b.samples);
  const double apart = test::rel_l2(both[0].samples, both[1].samples);
  std::printf("[ measure ] sa3 batch: the two clips %.3e apart\n", apart);
  EXPECT_GT(apart, 1e-3);
  // Each shared setting is held, named (pipeline/batch.h).
  AudioRequest longer = a, fewer = a, guided = a, negative = a;
  longer.seconds = *a.seconds + 0.5;
  fewer.steps = *a.steps - 1;
  guided.apg = 0.5f;
  negative.negative_prompt = "hiss";
  test::expect_error([&] { model->generate_batch({a, longer}); }, {"a batch shares seconds"});
  test::expect_error([&] { model->generate_batch({a, fewer}); }, {"a batch shares steps"});
  test::expect_error([&] { model->generate_batch({a, guided}); }, {"a batch shares guidance's apg"});
  test::expect_error(
      [&] {
        model->generate_batch({a, negative});
      },
      {"a batch shares whether a negative prompt is given"});
}

// A resident model (bf16) serves two threads at once, each request its own arena and generator:
// the bytes the one-shot model gives.
TEST(Sa3Pipeline, TwoThreadsOnOneResidentModelGiveTheOneShotClips) {
  AudioRequest a = reference_request(false), b = reference_request(false);
  b.prompt = "a door slams shut";
  b.seed = 7;
  const auto one_shot = AudioModel::open(official_dir(), Weights::per_stage);
  const AudioResult want_a = one_shot->generate(a), want_b = one_shot->generate(b);
  const auto resident = AudioModel::open(official_dir(), Weights::resident);
  AudioResult got_a, got_b;
  std::string error_a, error_b;
  auto run = [&](const AudioRequest& r, AudioResult& out, std::string& error) {
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
  EXPECT_EQ(got_a.samples, want_a.samples);
  EXPECT_EQ(got_b.samples, want_b.samples);
  test::expect_error([&] { resident->generate(reference_request(true)); }, {"bf16"});
}

TEST(Sa3Pipeline, RequestsOutsideTheModelAreRefused) {
  const auto model = AudioModel::open(pipeline_dir(), Weights::per_stage);
  AudioRequest r = reference_request(true);
  for (const double seconds : {0.0, -1.0, model->max_seconds() + 1})
    test::expect_error(
        [&] {
          AudioRequest bad = r;
          bad.seconds = seconds;
          model->generate(bad);
        },
        {"seconds", "outside"});
  // Under one output frame (1 / rate s): int(seconds x rate) would be a clip of no samples.
  for (const double seconds : {1e-5, 1e-320, 0.999 / 2048})
    test::expect_error(
        [&] {
          AudioRequest bad = r;
          bad.seconds = seconds;
          model->generate(bad);
        },
        {"seconds", "outside [0.000488281,", "one output frame at 2048 Hz"});
  AudioRequest one_frame = r;
  one_frame.seconds = 1.0 / 2048;
  one_frame.steps = 1;
  EXPECT_EQ(model->generate(one_frame).samples.size(), 2u);
  AudioRequest steps = r;
  steps.steps = 0;
  test::expect_error([&] { model->generate(steps); }, {"steps 0"});
  // A level without the clip it mixes into is refused, not ignored.
  AudioRequest level = r;
  level.init_noise_level = 0.5;
  test::expect_error([&] { model->generate(level); }, {"init_noise_level 0.5", "needs an init audio clip"});
  // A prompt longer than the text encoder takes is cut to 256 tokens, and said so.
  AudioRequest long_prompt = r;
  for (int i = 0; i < 300; ++i) long_prompt.prompt += " vinyl";
  std::vector<std::string> lines;
  const AudioResult res = model->generate(long_prompt, [&](const std::string& l) { lines.push_back(l); });
  EXPECT_GT(res.prompt_tokens, 256);
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(),
                          [](const std::string& l) { return l.find("truncated to 256") != std::string::npos; }));
}

// AudioLimits and the model's own bounds are held by count() as by generate(): one message, naming
// the field.
TEST(Sa3Pipeline, CountRefusesWhatGenerateRefusesWithTheSameMessage) {
  const auto model = AudioModel::open(pipeline_dir(), Weights::per_stage);
  struct Case {
    std::function<void(AudioRequest&)> set;
    int batch;
    std::string message, field;
  };
  const std::vector<Case> cases = {
      {[](AudioRequest& r) { r.seconds = 0; }, 1, "seconds 0 outside [0.000488281, ", "seconds"},
      {[&](AudioRequest& r) { r.seconds = model->max_seconds() + 1; }, 1, "this model's sample_size", "seconds"},
      {[](AudioRequest& r) { r.steps = 201; }, 1, "steps 201 outside 1..200", "steps"},
      {[](AudioRequest& r) { r.cfg = 0; }, 1, "cfg 0 outside (0, 100]", "cfg"},
      {[](AudioRequest& r) { r.apg = 2; }, 1, "apg 2 outside [0, 1]", "apg"},
      {[](AudioRequest& r) { r.init_noise_level = 0.5; }, 1, "needs an init audio clip", "init_noise_level"},
      {[](AudioRequest& r) {
         r.inpaint_regions = {{0.1, 0.2}};
       },
       1, "inpaint regions need an inpaint clip", "inpaint_regions"},
      {[](AudioRequest& r) { r.negative_prompt = "hiss"; }, 1, "a negative prompt needs guidance", "negative_prompt"},
      {[](AudioRequest&) {}, AudioLimits::max_batch + 1, "batch 65 outside 1..64", "batch"},
  };
  for (const Case& c : cases) {
    AudioRequest r = reference_request(false);
    c.set(r);
    const test::Refusal counted = test::refusal([&] { model->count(r, c.batch); });
    const test::Refusal rendered =
        test::refusal([&] { model->generate_batch(std::vector<AudioRequest>(size_t(c.batch), r)); });
    EXPECT_NE(counted.message.find(c.message), std::string::npos) << counted.message;
    EXPECT_EQ(counted.field, c.field) << c.message;
    EXPECT_EQ(counted.message, rendered.message);
    EXPECT_EQ(counted.field, rendered.field) << c.message;
  }
}

// The published medium's layout (configs only, data/) counts every stage from the model code: the
// DiT's cost grows with the canvas, the chunked decoder's linearly in its chunks.
TEST(Sa3Pipeline, PublishedMediumIsCountedWithoutWeights) {
  const auto model = AudioModel::open("stable-audio-3-medium", Weights::none);
  EXPECT_NEAR(model->max_seconds(), 380.4, 0.1);
  auto request = [](double seconds) {
    AudioRequest r;
    r.seconds = seconds;
    return r;
  };
  const PipelineCost short_clip = model->count(request(30)), long_clip = model->count(request(120));
  ASSERT_EQ(short_clip.stages.size(), 4u);
  EXPECT_EQ(short_clip.stages[2].name, "dit_step");
  EXPECT_EQ(short_clip.stages[2].calls, 8);
  // 1.45 B DiT + 0.85 B SAME + the conditioners + 0.28 B T5Gemma, less SAME's encoder (not run).
  EXPECT_GT(short_clip.parameters, 2.0e9);
  const double dit_30 = short_clip.stages[2].per_call.flops, dit_120 = long_clip.stages[2].per_call.flops;
  const double same_30 = short_clip.stages[3].per_call.flops, same_120 = long_clip.stages[3].per_call.flops;
  // Canvases of 388 and 1292 latents (generate()'s default cap; the config's would give 1358), +64
  // memory tokens each: the DiT's linear part grows 1356 / 452 = 3.0x, its attention more; a
  // 1358-latent canvas would be 3.5x. Decoder chunks: 4 and 14.
  EXPECT_GT(dit_120 / dit_30, 3.0);
  EXPECT_LT(dit_120 / dit_30, 3.45);
  EXPECT_NEAR(same_120 / same_30, 14.0 / 4.0, 0.05);
  test::expect_error([&] { model->generate(request(30)); }, {"counting only"});
}

TEST(Sa3Cli, SeededRunWritesTheOfficialClipWithItsRequest) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const AudioRequest req = reference_request(true);
  const std::string out = ::testing::TempDir() + "sa3_cli.wav";
  const test::CliRun r = test::run_cli("audio --model " + pipeline_dir() + " --prompt " +
                                       test::shell_quote(req.prompt) + " --seconds " + std::to_string(*req.seconds) +
                                       " --seed " + std::to_string(*req.seed) + " --precision fp32 -v -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("seed 42"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 8/8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("peak memory"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("transformer step 8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\ndecode "), std::string::npos) << r.output;
  const Audio a = read_audio(out, test::kTestClipSeconds);
  EXPECT_EQ(a.rate, 2048);
  EXPECT_EQ(a.channels, 2);
  const auto want = interleaved(ref.get("fp32.audio"));
  ASSERT_EQ(a.samples.size(), want.size());
  // 16-bit PCM: the fp32 run quantised, within half a step of the reference plus its 1e-5 parity.
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(double(a.samples[i]) - want[i]));
  EXPECT_LT(worst, 1.0 / 32767 + 1e-4);
  // The default bf16 run, held by audio distances (multi-resolution STFT, log-mel) to twice the
  // official bf16 run's own distance from its fp32 run; a clip that differs for real (the same
  // request with the decoder's noise on) lies far outside that bound.
  const std::string out_bf16 = ::testing::TempDir() + "sa3_cli_bf16.wav";
  const test::CliRun b =
      test::run_cli("audio --model " + pipeline_dir() + " --prompt " + test::shell_quote(req.prompt) + " --seconds " +
                    std::to_string(*req.seconds) + " --seed 42 --format wav-float -o " + out_bf16);
  ASSERT_EQ(b.status, 0) << b.output;
  const auto ours = read_audio(out_bf16, test::kTestClipSeconds).samples;
  const auto ref_bf16 = interleaved(ref.get("bf16.audio")), other = interleaved(ref.get("fp32_decoder_noise.audio"));
  const AudioScores self = audio_scores(ref_bf16, want, 2, 2048);
  const AudioScores mine = audio_scores(ours, want, 2, 2048);
  const AudioScores far = audio_scores(other, want, 2, 2048);
  std::printf(
      "[ measure ] sa3 cli bf16 vs official fp32: STFT %.4f, log-mel %.4f; official bf16 vs fp32: STFT %.4f, "
      "log-mel %.4f; a different clip: STFT %.4f, log-mel %.4f\n",
      mine.stft, mine.log_mel, self.stft, self.log_mel, far.stft, far.log_mel);
  EXPECT_LT(mine.stft, 2 * self.stft);
  EXPECT_LT(mine.log_mel, 2 * self.log_mel);
  EXPECT_GT(far.stft, 2 * self.stft);
  EXPECT_GT(far.log_mel, 2 * self.log_mel);
  // FLAC and float WAV on request; the request rides in the metadata.
  const std::string flac = ::testing::TempDir() + "sa3_cli.flac";
  const test::CliRun f =
      test::run_cli("audio --model " + pipeline_dir() + " --prompt " + test::shell_quote(req.prompt) +
                    " --seconds 1.4 --seed 42 --steps 2 --format flac -o " + flac);
  ASSERT_EQ(f.status, 0) << f.output;
  EXPECT_EQ(read_audio(flac, test::kTestClipSeconds).frames(), int64_t(want.size() / 2));
}

// Audio-to-audio and inpainting from the command line: the official clips, the inputs named in the
// file's metadata.
TEST(Sa3Cli, InitAndInpaintAudioGiveTheOfficialClips) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_inputs_ref.safetensors"));
  const AudioRequest req = reference_request(true);
  const std::string base = "audio --model " + official_dir() + " --prompt " + test::shell_quote(req.prompt) +
                           " --seconds 1.4 --seed 42 --precision fp32 --format wav-float ";
  struct Case {
    std::string mode, args;
  };
  for (const Case& k :
       {Case{"a2a", "--init-audio " + test::fixture("sa3_tiny/inputs/init.wav") + " --init-noise-level 0.6"},
        Case{"inpaint", "--inpaint-audio " + test::fixture("sa3_tiny/inputs/inpaint.wav") +
                            " --inpaint-start 0.3 --inpaint-end 0.8 --inpaint-start 1.0 --inpaint-end 1.2"}}) {
    const std::string out = ::testing::TempDir() + "sa3_cli_" + k.mode + ".wav";
    const test::CliRun r = test::run_cli(base + k.args + " -v -o " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("\nencode "), std::string::npos) << r.output;
    const double err =
        test::rel_l2(read_audio(out, test::kTestClipSeconds).samples, interleaved(ref.get(k.mode + ".fp32.audio")));
    EXPECT_LT(err, test::kFp32Tolerance) << k.mode;
  }
}

// Under an address-space limit a clip that cannot be held is refused naming its file, before
// the allocation where the header's claim alone is impossible, at the allocation otherwise; never
// a bare "out of memory".
TEST(Sa3Cli, ClipsBeyondMemoryAreRefusedNamingTheFile) {
  if (test::kSanitized) GTEST_SKIP() << "sanitizer shadow memory cannot live under ulimit -v";
  const std::string dir = ::testing::TempDir(), flac = dir + "apus_claims.flac", big = dir + "apus_big.wav";
  const std::string out = dir + "apus_beyond.wav";
  // A few kB claiming 2^32 - 1 mono frames: a 16 GiB zero-filled buffer before this check.
  test::write_flac_claiming(flac, (int64_t(1) << 32) - 1);
  { std::ofstream(big, std::ios::binary) << "RIFF"; }
  fs::resize_file(big, uint64_t(3) << 30);  // sparse: 3 GiB that take no disk
  for (const auto& [file, expect] : {std::pair{flac, std::string(": the header claims 4294967295 frames")},
                                     std::pair{big, std::string(": its 3221225472 bytes do not fit")}}) {
    const test::CliRun r =
        test::run_cli("audio --model " + pipeline_dir() + " -p x --seconds 1 --init-audio " + file + " -o " + out,
                      "ulimit -v 1500000; ");
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("error: " + file + expect), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("out of memory"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }
  fs::remove(flac);
  fs::remove(big);
}

TEST(Sa3Cli, BadInputGivesOneLineErrorAndNonZeroExit) {
  const std::string model = pipeline_dir();
  struct Case {
    std::string args;
    std::vector<std::string> expect;
  };
  const std::string no_tokenizer = spoiled_copy("no_tokenizer", "tokenizer");
  fs::remove(no_tokenizer + "/tokenizer/tokenizer.model");
  const std::string bad_t5 = spoiled_copy("bad_t5", "text_encoder");
  { std::ofstream(bad_t5 + "/text_encoder/model.safetensors", std::ios::trunc) << "not safetensors"; }
  const std::string no_t5 = spoiled_copy("no_t5", "text_encoder");
  fs::remove_all(no_t5 + "/text_encoder");
  const std::string empty_wav = ::testing::TempDir() + "apus_empty.wav",
                    lying_flac = ::testing::TempDir() + "apus_lying.flac";
  test::write_header_only_wav(empty_wav);
  test::write_flac_claiming(lying_flac, (int64_t(1) << 32) - 1);
  const std::vector<Case> cases = {
      {"--seconds 0", {"seconds 0", "outside"}},
      {"--seconds 9000", {"seconds 9000", "outside"}},
      {"--seconds 1 --steps 0", {"steps 0", "outside"}},
      {"--seconds 1 --format mp3", {"mp3"}},
      {"--model " + no_tokenizer, {"tokenizer.model", "missing"}},
      {"--model " + bad_t5, {"model.safetensors"}},
      {"--model " + no_t5, {"text_encoder"}},
      {"--model " + test::fixture("klein_tiny_a"), {"Flux2KleinPipeline", "apus image"}},
      {"--seconds 1 --init-audio " + test::fixture("sa3_pipeline_ref.json"),
       {"sa3_pipeline_ref.json", "not an audio file"}},
      {"--seconds 1 --init-audio /nonexistent.wav", {"/nonexistent.wav"}},
      {"--seconds 1 --init-noise-level 0.5", {"init_noise_level 0.5", "needs an init audio clip"}},
      {"--seconds 1e-5", {"seconds 1e-05 outside", "one output frame"}},
      {"--seconds 1 --init-audio " + empty_wav, {empty_wav + ": holds no audio"}},
      {"--seconds 1 --init-audio " + lying_flac, {lying_flac, "claims 4294967295 frames", "can hold"}},
      {"--seconds 1 --inpaint-start 0.2 --inpaint-end 0.4", {"need --inpaint-audio"}},
      {"--seconds 1 --inpaint-audio " + test::fixture("sa3_tiny/inputs/inpaint.wav"), {"needs --inpaint-start"}},
      {"--seconds 1 --inpaint-audio " + test::fixture("sa3_tiny/inputs/inpaint.wav") + " --inpaint-start 0.2",
       {"--inpaint-start and --inpaint-end", "same number"}},
  };
  for (const Case& c : cases) {
    const bool own_model = c.args.rfind("--model", 0) == 0;
    const test::CliRun r = test::run_cli("audio " + std::string(own_model ? "--seconds 1 " : "--model " + model + " ") +
                                         "--prompt x -o " + ::testing::TempDir() + "bad.wav " + c.args);
    EXPECT_NE(r.status, 0) << c.args << ": " << r.output;
    // One error line, the last (progress such as the seed may come before a stage's weights load).
    const size_t at = r.output.find("error: ");
    ASSERT_NE(at, std::string::npos) << c.args << ": " << r.output;
    const std::string line = r.output.substr(at);
    EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1) << c.args << ": " << r.output;
    for (const std::string& e : c.expect) EXPECT_NE(line.find(e), std::string::npos) << c.args << ": " << r.output;
  }
  for (const std::string& d : {no_tokenizer, bad_t5, no_t5, empty_wav, lying_flac}) fs::remove_all(d);
}

// Broken checkpoints and prompts from the command line: exit status 1 and one error line that
// names what is wrong where it is (the file, tensor or key path, the prompt's own byte offset).
TEST(Sa3Cli, BrokenCheckpointsAndPromptsNameWhatIsWrong) {
  const std::string out = ::testing::TempDir() + "apus_sa3_broken_" + std::to_string(::getpid()) + ".wav";
  auto refused = [&](const std::string& model, const std::string& prompt, const std::string& expected) {
    const test::CliRun r = test::run_cli("audio --model " + model + " --prompt " + test::shell_quote(prompt) +
                                         " --seconds 1 --seed 1 -o " + out);
    EXPECT_EQ(r.status, 1) << r.output;
    const size_t at = r.output.rfind("error: ");
    ASSERT_NE(at, std::string::npos) << r.output;
    EXPECT_EQ(r.output.substr(at), "error: " + expected + "\n") << r.output;
    EXPECT_FALSE(fs::exists(out));
  };
  auto copy_official = [&](const std::string& name) {
    const std::string d = ::testing::TempDir() + "apus_sa3_" + name + "_" + std::to_string(::getpid());
    fs::remove_all(d);
    fs::create_directories(d + "/t5gemma-b-b-ul2");
    for (const auto& e : fs::recursive_directory_iterator(official_dir()))
      if (!e.is_directory()) {
        const std::string rel = e.path().lexically_relative(official_dir()).string();
        fs::copy_file(fs::canonical(e.path()), d + "/" + rel);
        fs::permissions(d + "/" + rel, fs::perms::owner_write, fs::perm_options::add);
      }
    return d;
  };
  // The prompt's own byte offset, not the offset in the text the tokenizer is handed.
  refused(official_dir(), "abc\xff def", "the prompt is not valid UTF-8 (byte offset 3)");

  const std::string cut = copy_official("cut");
  const std::string weights = cut + "/model.safetensors";
  const uintmax_t whole = fs::file_size(weights);
  fs::resize_file(weights, whole - 1000);
  const SafetensorsFile before = SafetensorsFile::open(official_dir() + "/model.safetensors");
  std::string last;  // the tensor whose data ends the file
  for (const std::string& n : before.names())
    if (last.empty() || before.get(n).data > before.get(last).data) last = n;
  refused(cut, "x",
          weights + ": truncated: " + std::to_string(whole - 1000) + " of " + std::to_string(whole) +
              " bytes (tensor '" + last + "' needs bytes up to " + std::to_string(whole) + ")");

  const std::string neither = copy_official("neither");
  fs::remove(neither + "/model_config.json");
  refused(
      neither, "x",
      neither + ": neither a diffusers folder (model_index.json) nor a Stable Audio 3 checkpoint (model_config.json)");

  const std::string empty_tokenizer = copy_official("empty_tokenizer");
  std::ofstream(empty_tokenizer + "/t5gemma-b-b-ul2/tokenizer.model", std::ios::trunc).close();
  refused(empty_tokenizer, "x",
          empty_tokenizer + "/t5gemma-b-b-ul2/tokenizer.model: empty file (0 bytes), not a SentencePiece model");

  const std::string weight_v = "pretransform.model.decoder.layers.3.mapping.weight_v";
  const std::string nan = rewritten_checkpoint("nan_weight_v", [&](const std::string& n, const Tensor& t) {
    Tensor c = to_dtype(t, t.dtype);
    if (n == weight_v) std::fill_n(c.ptr<float>(), c.numel(), std::nanf(""));
    return c;
  });
  refused(nan, "x", nan + "/model.safetensors: tensor '" + weight_v + "': row 0 holds a value that is not finite");

  // max_length, named by its key path, bounded by itself before any stage sees the length.
  const Json config = read_json(test::fixture("sa3_tiny/original/model_config.json"));
  const int64_t window = read_json(test::fixture("t5gemma_tiny/config.json"))["encoder"]["sliding_window"];
  for (const int64_t length : {int64_t(0), int64_t(1) << 20}) {
    Json c = config;
    c["model"]["conditioning"]["configs"][0]["config"]["max_length"] = length;
    const std::string d = test::official_variant_dir("max_length", c);
    const std::string key = d + "/model_config.json (model.conditioning.configs[0].config): 'max_length' is " +
                            std::to_string(length) + ", expected 1..";
    refused(d, "x",
            key + (length == 0 ? "16777216"
                               : std::to_string(window) + " (the sliding window of " + d +
                                     "/t5gemma-b-b-ul2/config.json; longer prompts are not supported)"));
    fs::remove_all(d);
  }
  for (const std::string& d : {cut, neither, empty_tokenizer, nan}) fs::remove_all(d);
}

}  // namespace
}  // namespace apus
