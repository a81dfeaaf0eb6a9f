#pragma once
// The tiny Stable Audio 3 checkpoints the tests run, assembled from the fixtures by links, once
// per test process: diffusers' folders and the official single-checkpoint layout.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "apus/apus.h"
#include "gate/metrics.h"
#include "io/media/audio.h"
#include "test_util.h"

namespace apus::test {

// A folder for this test process, filled once by `fill` and removed when the process exits.
class ProcessDir {
 public:
  template <typename Fill> ProcessDir(const std::string& name, Fill&& fill)
      : path_(::testing::TempDir() + name + "_" + std::to_string(::getpid())) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
    fill(path_);
  }
  ~ProcessDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ProcessDir(const ProcessDir&) = delete;
  ProcessDir& operator=(const ProcessDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The diffusers layout of the tiny pipeline: its own folder plus the stage fixtures linked in,
// made once per test process.
inline const std::string& pipeline_dir() {
  static const ProcessDir dir("apus_sa3_pipeline", [](const std::string& d) {
    const std::pair<const char*, const char*> parts[] = {{"model_index.json", "sa3_tiny/pipeline/model_index.json"},
                                                         {"scheduler", "sa3_tiny/pipeline/scheduler"},
                                                         {"duration_embedder", "sa3_tiny/pipeline/duration_embedder"},
                                                         {"transformer", "sa3_tiny/dit_diff"},
                                                         {"vae", "sa3_tiny/same_l"},
                                                         {"text_encoder", "t5gemma_tiny"},
                                                         {"tokenizer", "t5gemma_tok"}};
    for (const auto& [name, part] : parts)
      std::filesystem::create_symlink(std::filesystem::absolute(fixture(part)), d + "/" + name);
  });
  return dir.path();
}

// The same tiny model in the official single-checkpoint layout: model_config.json and
// model.safetensors, the T5Gemma folder beside them.
inline const std::string& official_dir() {
  static const ProcessDir dir("apus_sa3_official", [](const std::string& d) {
    std::filesystem::create_directories(d + "/t5gemma-b-b-ul2");
    const std::pair<const char*, const char*> parts[] = {
        {"model_config.json", "sa3_tiny/original/model_config.json"},
        {"model.safetensors", "sa3_tiny/original/model.safetensors"},
        {"t5gemma-b-b-ul2/config.json", "t5gemma_tiny/config.json"},
        {"t5gemma-b-b-ul2/model.safetensors", "t5gemma_tiny/model.safetensors"},
        {"t5gemma-b-b-ul2/tokenizer.model", "t5gemma_tok/tokenizer.model"},
        {"t5gemma-b-b-ul2/tokenizer_config.json", "t5gemma_tok/tokenizer_config.json"}};
    for (const auto& [name, part] : parts)
      std::filesystem::create_symlink(std::filesystem::absolute(fixture(part)), d + "/" + name);
  });
  return dir.path();
}

// A small model (plain-attention DiT, SAME-S) in the official layout.
inline const std::string& official_small_dir() {
  static const ProcessDir dir("apus_sa3_small", [](const std::string& d) {
    for (const char* file : {"model_config.json", "model.safetensors"})
      std::filesystem::create_symlink(
          std::filesystem::absolute(fixture(std::string("sa3_tiny/original_small/") + file)), d + "/" + file);
    std::filesystem::create_symlink(std::filesystem::absolute(official_dir() + "/t5gemma-b-b-ul2"),
                                    d + "/t5gemma-b-b-ul2");
  });
  return dir.path();
}

// The tiny model in the official layout under another model_config.json (the -base objective,
// decoder noise): a folder named `name` for this process, the weights and T5Gemma linked.
inline std::string official_variant_dir(const std::string& name, const Json& model_config) {
  const std::string d = ::testing::TempDir() + "apus_sa3_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  for (const char* part : {"model.safetensors", "t5gemma-b-b-ul2"})
    std::filesystem::create_symlink(std::filesystem::absolute(official_dir() + "/" + part), d + "/" + part);
  std::ofstream(d + "/model_config.json") << model_config.dump();
  return d;
}

// The tiny model's official config with the published decoder noise turned on (noise_regularize,
// mask_noise 0.1).
inline Json decoder_noise_config() {
  Json config = read_json(fixture("sa3_tiny/original/model_config.json"));
  auto& ae = config["model"]["pretransform"]["config"];
  ae["decoder"]["config"]["mask_noise"] = 0.1;
  ae["bottleneck"]["config"]["noise_regularize"] = true;
  return config;
}

// (1, channels, n) planar -> interleaved, as AudioResult holds samples.
inline std::vector<float> interleaved(const Tensor& audio) {
  const int64_t ch = audio.shape[1], n = audio.shape[2];
  std::vector<float> out(size_t(ch * n));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < ch; ++c) out[size_t(i * ch + c)] = load_f32(audio, c * n + i);
  return out;
}

// The request the oracle rendered (sa3_pipeline_ref.json): prompt, seconds, seed, steps.
inline AudioRequest reference_request(bool fp32) {
  const Json meta = read_json(fixture("sa3_pipeline_ref.json"));
  AudioRequest r;
  r.prompt = meta["prompt"].get<std::string>();
  r.seconds = meta["seconds"].get<double>();
  r.seed = meta["seed"].get<uint64_t>();
  r.steps = meta["steps"].get<int>();
  r.fp32 = fp32;
  return r;
}

// A clip of the oracle's fp32 request (reference_request(true)) held to the official code's own
// disagreement: its MR-STFT and log-mel distances from the official fp32 clip below the official
// bf16 clip's, printed under `what`. How a tier (int8, q8_0) is judged on the tiny model.
inline void expect_within_official_bf16_disagreement(const std::string& what, const AudioResult& clip) {
  const SafetensorsFile ref = SafetensorsFile::open(fixture("sa3_pipeline_ref.safetensors"));
  const auto fp32 = interleaved(ref.get("fp32.audio")), bf16 = interleaved(ref.get("bf16.audio"));
  const AudioScores official = audio_scores(bf16, fp32, 2, clip.sample_rate);
  const AudioScores ours = audio_scores(clip.samples, fp32, 2, clip.sample_rate);
  std::printf(
      "[ measure ] %s (fp32 activations) to the official fp32 clip: MR-STFT %.4f, log-mel %.4f; "
      "the official bf16 clip's %.4f, %.4f\n",
      what.c_str(), ours.stft, ours.log_mel, official.stft, official.log_mel);
  EXPECT_LT(ours.stft, official.stft) << what;
  EXPECT_LT(ours.log_mel, official.log_mel) << what;
}

inline AudioClip clip_file(const std::string& rel) {
  Audio a = read_audio(fixture(rel), test::kTestClipSeconds);
  return {a.rate, a.channels, std::move(a.samples)};
}

// The reference request with the official generate()'s init_audio (audio-to-audio, mode "a2a") or
// inpaint_audio and its regions (inpainting, "inpaint"), from the WAVs the oracle wrote.
inline AudioRequest inputs_request(bool fp32, const std::string& mode) {
  const Json meta = read_json(fixture("sa3_inputs_ref.json"));
  AudioRequest r = reference_request(fp32);
  if (mode == "a2a") {
    r.init_audio = clip_file("sa3_tiny/inputs/init.wav");
    r.init_noise_level = meta["init_noise_level"].get<double>();
  } else {
    r.inpaint_audio = clip_file("sa3_tiny/inputs/inpaint.wav");
    for (size_t i = 0; i < meta["inpaint_starts"].size(); ++i)
      r.inpaint_regions.emplace_back(meta["inpaint_starts"][i].get<double>(), meta["inpaint_ends"][i].get<double>());
  }
  return r;
}

// Audio files that lie or hold nothing, made by the tests that refuse them.

// A WAV of 2 channels at 2048 Hz whose data chunk is empty (what a writer leaves when it is given
// no samples).
inline void write_header_only_wav(const std::string& path) {
  auto u32 = [](uint32_t v) { return std::string{char(v), char(v >> 8), char(v >> 16), char(v >> 24)}; };
  auto u16 = [](uint16_t v) { return std::string{char(v), char(v >> 8)}; };
  const std::string bytes = "RIFF" + u32(36) + "WAVE" + "fmt " + u32(16) + u16(1) + u16(2) + u32(2048) + u32(2048 * 4) +
                            u16(4) + u16(16) + "data" + u32(0);
  std::ofstream(path, std::ios::binary) << bytes;
}

// The bytes of a real 1 s mono FLAC at 44100 Hz (a short file: a few kB) whose STREAMINFO claims
// `frames` frames (0: "unknown", as a FLAC written to a pipe says).
inline std::string flac_claiming(int64_t frames) {
  Audio clip{44100, 1, std::vector<float>(44100)};
  for (size_t i = 0; i < clip.samples.size(); ++i) clip.samples[i] = 0.25f * float(std::sin(0.05 * double(i)));
  const std::vector<uint8_t> flac = encode_audio(clip, AudioFormat::flac, {}, "flac");
  std::string bytes(flac.begin(), flac.end());
  // "fLaC", then STREAMINFO's block header (type 0) and body; its 36-bit total-samples field
  // starts at the low nibble of byte 21.
  EXPECT_EQ(bytes.substr(0, 4), "fLaC");
  EXPECT_EQ(bytes[4] & 0x7f, 0) << "the first metadata block is not STREAMINFO";
  bytes[21] = char((uint8_t(bytes[21]) & 0xf0) | uint8_t(frames >> 32));
  for (int i = 0; i < 4; ++i) bytes[size_t(22 + i)] = char(uint8_t(frames >> (24 - 8 * i)));
  return bytes;
}

inline void write_flac_claiming(const std::string& path, int64_t frames) {
  std::ofstream(path, std::ios::binary) << flac_claiming(frames);
}

}  // namespace apus::test
