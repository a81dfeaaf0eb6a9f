// Audio out and in through libsndfile: every format round-trips a clip with its metadata, integer
// formats clip instead of wrapping, and bad input is refused naming the file.
#include <sndfile.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "io/audio.h"
#include "test_util.h"

namespace apus {
namespace {

Audio stereo_clip() {
  Audio a;
  a.rate = 44100;
  a.channels = 2;
  for (int64_t i = 0; i < 44100; ++i) {
    const double t = double(i) / 44100;
    a.samples.push_back(float(0.5 * std::sin(2 * M_PI * 440 * t)));
    a.samples.push_back(float(0.5 * std::sin(2 * M_PI * 660 * t)));
  }
  a.samples[10] = 1.7f;   // beyond full scale: must clip to +1, not wrap negative
  a.samples[11] = -2.5f;
  return a;
}

std::string comment_of(const std::string& path) {
  SF_INFO info{};
  SNDFILE* sf = sf_open(path.c_str(), SFM_READ, &info);
  const char* c = sf ? sf_get_string(sf, SF_STR_COMMENT) : nullptr;
  const std::string s = c ? c : "";
  if (sf) sf_close(sf);
  return s;
}

TEST(Audio, EveryFormatRoundTripsTheClipAndItsMetadata) {
  const Audio clip = stereo_clip();
  const AudioMetadata meta{"warm lo-fi", "prompt: warm lo-fi hip hop; seed 42; steps 8", "apus"};
  for (const std::string name : {"wav", "wav-float", "flac"}) {
    const std::string path = ::testing::TempDir() + "apus_clip." + (name == "flac" ? "flac" : "wav");
    write_audio(path, clip, parse_audio_format(name), meta);
    const Audio back = read_audio(path);
    ASSERT_EQ(back.rate, 44100) << name;
    ASSERT_EQ(back.channels, 2) << name;
    ASSERT_EQ(back.samples.size(), clip.samples.size()) << name;
    double worst = 0;
    const bool pcm = name != "wav-float";
    for (size_t i = 0; i < clip.samples.size(); ++i) {
      const double want = pcm ? std::clamp(double(clip.samples[i]), -1.0, 1.0) : double(clip.samples[i]);
      worst = std::max(worst, std::fabs(double(back.samples[i]) - want));
    }
    // float keeps every bit (out-of-range values too); 16-bit PCM (WAV, FLAC) is within one step
    // of 2^-15 after clipping.
    EXPECT_LE(worst, name == "wav-float" ? 0.0 : 1.0 / 32768 + 1e-9) << name;
    if (name != "wav-float") {
      EXPECT_GT(back.samples[10], 0.99f) << name << ": clipped, not wrapped";
      EXPECT_LT(back.samples[11], -0.99f) << name;
    }
    EXPECT_EQ(comment_of(path), meta.comment) << name;
    std::filesystem::remove(path);
  }
}

TEST(Audio, BadInputIsRefusedNamingTheFile) {
  test::expect_error([] { parse_audio_format("mp3"); }, {"'mp3'", "wav, wav-float, flac"});
  Audio clip = stereo_clip();
  clip.samples[3] = NAN;
  const std::string path = ::testing::TempDir() + "apus_nan.wav";
  test::expect_error([&] { write_audio(path, clip, AudioFormat::wav16, {}); }, {path, "sample 3"});
  EXPECT_FALSE(std::filesystem::exists(path));
  test::expect_error([&] { write_audio("/nonexistent_apus/x.wav", stereo_clip(), AudioFormat::wav16, {}); },
                     {"/nonexistent_apus/x.wav"});
  const std::string junk = ::testing::TempDir() + "apus_junk.wav";
  { std::ofstream(junk) << "RIFF but not really"; }
  test::expect_error([&] { read_audio(junk); }, {junk, "not an audio file"});
  std::filesystem::remove(junk);
  test::expect_error([] { read_audio(::testing::TempDir()); }, {"directory"});
}

}  // namespace
}  // namespace apus
