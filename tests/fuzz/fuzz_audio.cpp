// libFuzzer target for audio files given as input (SA3's init audio): any bytes must read as a
// clip or raise apus::Error naming the file (libsndfile itself is not instrumented: its crashes
// count, the coverage is ours).
#include "fuzz_file.h"
#include "io/audio.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = apus::fuzz::write_input("input.wav", data, size);
  apus::fuzz::expect_only_apus_errors([&] {
    const apus::Audio a = apus::read_audio(path);
    if (a.channels <= 0 || a.rate <= 0 || a.samples.size() != size_t(a.frames()) * size_t(a.channels))
      __builtin_trap();
  });
  return 0;
}
