// Audio out and in through libsndfile: every format round-trips a clip with its metadata, integer
// formats clip instead of wrapping, and bad input is refused naming the file.
#include <sndfile.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "io/files.h"
#include "io/media/audio.h"
#include "sa3_fixtures.h"
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
  a.samples[10] = 1.7f;  // beyond full scale: must clip to +1, not wrap negative
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
    const Audio back = read_audio(path, test::kTestClipSeconds);
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
  test::expect_error([&] { read_audio(junk, test::kTestClipSeconds); }, {junk, "not an audio file"});
  std::filesystem::remove(junk);
  test::expect_error([] { read_audio(::testing::TempDir(), test::kTestClipSeconds); }, {"directory"});
}

TEST(Audio, NoClipOfNoFramesIsWritten) {
  // libsndfile would write a header-only WAV whose RIFF size leaves out its metadata.
  const Audio empty{44100, 2, {}};
  for (const AudioFormat format : {AudioFormat::wav16, AudioFormat::wav_float, AudioFormat::flac})
    test::expect_error(
        [&] {
          encode_audio(empty, format, {"title", "comment", "apus"}, "clip");
        },
        {"clip: no audio to write (0 frames)"});
}

TEST(Audio, AClipThatHoldsNoAudioSaysSoByEveryRoute) {
  const std::string path = ::testing::TempDir() + "apus_empty.wav";
  test::write_header_only_wav(path);
  test::expect_error([&] { read_audio(path, 60); }, {path + ": holds no audio"});
  test::expect_error([&] { probe_audio(read_file(path), "upload", 60); }, {"upload: holds no audio"});
  std::filesystem::remove(path);
  // An unknown-length stream that decodes to nothing.
  std::string no_frames = test::flac_claiming(0);
  no_frames.resize(4 + 4 + 34);                       // "fLaC" and STREAMINFO ...
  no_frames[4] = char(uint8_t(no_frames[4]) | 0x80);  // ... as the last metadata block, no audio frame
  test::expect_error([&] { decode_audio(no_frames, "upload", 60); }, {"upload: holds no audio"});
}

// What a FLAC header claims is checked against the file's bytes, the caller's longest clip and the
// stream itself; memory follows what decodes, never the claim.
TEST(Audio, AFlacHeaderThatLiesIsRefusedNamingTheFile) {
  const std::string honest = test::flac_claiming(44100);
  const Audio want = decode_audio(honest, "honest.flac", 60);
  ASSERT_EQ(want.frames(), 44100);
  struct Case {
    int64_t claim;
    double max_seconds;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      // 2^32 - 1 mono frames in a few kB: once a 16 GiB allocation.
      {(int64_t(1) << 32) - 1, 60, {"x.flac: the header claims 4294967295 frames, more than a file of", "can hold"}},
      {(int64_t(1) << 36) - 1, 1e9, {"claims 68719476735 frames", "can hold"}},
      // Within what the bytes could hold, but longer than the caller can use.
      {44100 * 120, 60, {"x.flac: 5292000 frames at 44100 Hz (120 s), longer than the 60 s"}},
      // Within every bound, but not what the stream holds.
      {44100 * 2, 60, {"x.flac: the header claims 88200 frames, the stream holds 44100", "truncated or damaged"}},
  };
  for (const Case& c : cases) {
    const std::string bytes = test::flac_claiming(c.claim);
    test::expect_error([&] { decode_audio(bytes, "x.flac", c.max_seconds); }, c.expect);
    if (c.claim != 44100 * 2)  // the header alone cannot tell what the stream holds
      test::expect_error([&] { probe_audio(bytes, "x.flac", c.max_seconds); }, c.expect);
  }
  // A truncated file: the header's count, then fewer frames.
  test::expect_error([&] { decode_audio(honest.substr(0, honest.size() / 2), "cut.flac", 60); },
                     {"cut.flac: the header claims 44100 frames, the stream holds", "truncated or damaged"});
  // A stream that does not give its length (total 0) reads whole, up to the caller's longest clip.
  const std::string unknown = test::flac_claiming(0);
  EXPECT_EQ(decode_audio(unknown, "pipe.flac", 60).samples, want.samples);
  test::expect_error([&] { decode_audio(unknown, "pipe.flac", 0.5); },
                     {"pipe.flac: more than 22050 frames at 44100 Hz, longer than the 0.5 s"});
  EXPECT_LE(probe_audio(unknown, "pipe.flac", 60).frames, 60 * 44100) << "the most it can hold";
}

TEST(Audio, AProbeReadsTheHeaderAsTheDecoderDoes) {
  for (const char* rel : {"sa3_tiny/inputs/init.wav", "sa3_tiny/inputs/init_3000.wav", "sa3_tiny/inputs/inpaint.wav"}) {
    const std::string bytes = read_file(test::fixture(rel));
    const AudioInfo header = probe_audio(bytes, rel, 60);
    const Audio a = decode_audio(bytes, rel, 60);
    EXPECT_EQ(header.rate, a.rate) << rel;
    EXPECT_EQ(header.channels, a.channels) << rel;
    EXPECT_EQ(header.frames, a.frames()) << rel;
  }
  for (const std::string name : {"wav", "wav-float", "flac"}) {
    const std::vector<uint8_t> file = encode_audio(stereo_clip(), parse_audio_format(name), {}, name);
    const std::string bytes(file.begin(), file.end());
    const AudioInfo header = probe_audio(bytes, name, 60);
    EXPECT_EQ(header.rate, 44100) << name;
    EXPECT_EQ(header.channels, 2) << name;
    EXPECT_EQ(header.frames, decode_audio(bytes, name, 60).frames()) << name;
  }
  test::expect_error([] { probe_audio("RIFF but not really", "junk", 60); }, {"junk", "not an audio file"});
}

}  // namespace
}  // namespace apus
