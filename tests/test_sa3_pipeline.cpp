// Stable Audio 3 text-to-audio end to end against the official generate() path on tiny
// random-weight components (tools/oracle/make_sa3_official_fixtures.py): prompt, seed and seconds
// in, samples out, through the canvas with its headroom and padding, the log-SNR schedule,
// ping-pong with torch's CPU generator and the SAME decode.
#include <filesystem>
#include <unistd.h>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "io/safetensors.h"
#include "sampling/logsnr.h"
#include "test_util.h"

namespace apus {
namespace {

namespace fs = std::filesystem;

// The diffusers layout of the tiny pipeline: its own folder plus the stage fixtures linked in.
class Sa3Pipeline : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = ::testing::TempDir() + "apus_sa3_pipeline_" + std::to_string(::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::pair<const char*, const char*> parts[] = {
        {"model_index.json", "sa3_tiny/pipeline/model_index.json"},
        {"scheduler", "sa3_tiny/pipeline/scheduler"},
        {"duration_embedder", "sa3_tiny/pipeline/duration_embedder"},
        {"transformer", "sa3_tiny/dit_diff"},
        {"vae", "sa3_tiny/same_l"},
        {"text_encoder", "t5gemma_tiny"},
        {"tokenizer", "t5gemma_tok"}};
    for (const auto& [name, fixture] : parts)
      fs::create_symlink(fs::absolute(test::fixture(fixture)), dir_ + "/" + name);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string dir_;
};
std::string Sa3Pipeline::dir_;

AudioRequest reference_request(bool fp32) {
  const Json meta = read_json(test::fixture("sa3_pipeline_ref.json"));
  AudioRequest r;
  r.prompt = meta["prompt"].get<std::string>();
  r.seconds = meta["seconds"].get<double>();
  r.seed = meta["seed"].get<uint64_t>();
  r.steps = meta["steps"].get<int>();
  r.fp32 = fp32;
  return r;
}

// (1, channels, n) planar -> interleaved.
std::vector<float> interleaved(const Tensor& audio) {
  const int64_t ch = audio.shape[1], n = audio.shape[2];
  std::vector<float> out(size_t(ch * n));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < ch; ++c) out[size_t(i * ch + c)] = load_f32(audio, c * n + i);
  return out;
}

TEST(Sa3Schedule, LogSnrSigmasMatchTheOfficialSchedule) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const std::vector<float> want = to_f32_vector(ref.get("sigmas"));
  const std::vector<float> got = logsnr_sigmas(int(want.size()) - 1, 1.0f);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 4e-7 * std::max(1.0f, want[i])) << "sigma " << i;
  // torch.linspace's own values, which the schedule and the DiT's Fourier frequencies start from.
  const std::vector<float> ramp = torch_linspace(0.0f, 1.0f, 128);
  EXPECT_EQ(ramp.front(), 0.0f);
  EXPECT_EQ(ramp.back(), 1.0f);
}

TEST_F(Sa3Pipeline, TextToAudioMatchesTheOfficialGenerate) {
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const auto model = AudioModel::open(dir_, Weights::per_stage);
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

TEST_F(Sa3Pipeline, RequestsOutsideTheModelAreRefused) {
  const auto model = AudioModel::open(dir_, Weights::per_stage);
  AudioRequest r = reference_request(true);
  for (const double seconds : {0.0, -1.0, model->max_seconds() + 1})
    test::expect_error([&] {
      AudioRequest bad = r;
      bad.seconds = seconds;
      model->generate(bad);
    }, {"seconds", "outside"});
  AudioRequest steps = r;
  steps.steps = 0;
  test::expect_error([&] { model->generate(steps); }, {"steps 0"});
  // A prompt longer than the text encoder takes is cut to 256 tokens, and said so.
  AudioRequest long_prompt = r;
  for (int i = 0; i < 300; ++i) long_prompt.prompt += " vinyl";
  std::vector<std::string> lines;
  const AudioResult res = model->generate(long_prompt, [&](const std::string& l) { lines.push_back(l); });
  EXPECT_GT(res.prompt_tokens, 256);
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(),
                          [](const std::string& l) { return l.find("truncated to 256") != std::string::npos; }));
}

}  // namespace
}  // namespace apus
