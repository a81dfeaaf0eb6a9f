// libFuzzer target for audio files given as input (SA3's init audio): any bytes must read as a
// clip or raise apus::Error naming the file, and a clip that reads was probed alike from its
// header (libsndfile itself is not instrumented: its crashes count, the coverage is ours).
#include "fuzz_file.h"
#include "io/files.h"
#include "io/media/audio.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr double kMaxSeconds = 400;  // the longest model's 380 s, with room
  const std::string path = apus::fuzz::write_input("input.wav", data, size);
  apus::fuzz::expect_only_apus_errors([&] {
    const apus::Audio a = apus::read_audio(path, kMaxSeconds);
    if (a.channels <= 0 || a.rate <= 0 || a.frames() <= 0 ||
        a.samples.size() != size_t(a.frames()) * size_t(a.channels))
      __builtin_trap();
    const apus::AudioInfo header = apus::probe_audio(apus::read_file(path), path, kMaxSeconds);
    if (header.rate != a.rate || header.channels != a.channels || header.frames < a.frames()) __builtin_trap();
  });
  return 0;
}
