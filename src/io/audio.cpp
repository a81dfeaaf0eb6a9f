#include "io/audio.h"

#include <sndfile.h>

#include <cmath>

#include "core/error.h"
#include "io/files.h"

namespace apus {

AudioFormat parse_audio_format(const std::string& name) {
  if (name == "wav") return AudioFormat::wav16;
  if (name == "wav-float") return AudioFormat::wav_float;
  if (name == "flac") return AudioFormat::flac;
  fail("audio format '", name, "' is not one of wav, wav-float, flac");
}

void write_audio(const std::string& path, const Audio& audio, AudioFormat format,
                 const AudioMetadata& metadata) {
  APUS_CHECK(audio.rate > 0 && audio.channels > 0 && audio.samples.size() % size_t(audio.channels) == 0,
             path, ": ", audio.samples.size(), " samples for ", audio.channels, " channels at ",
             audio.rate, " Hz");
  for (size_t i = 0; i < audio.samples.size(); ++i)
    APUS_CHECK(std::isfinite(audio.samples[i]), path, ": sample ", i, " is not finite");
  SF_INFO info{};
  info.samplerate = audio.rate;
  info.channels = audio.channels;
  info.format = format == AudioFormat::flac        ? SF_FORMAT_FLAC | SF_FORMAT_PCM_16
                : format == AudioFormat::wav_float ? SF_FORMAT_WAV | SF_FORMAT_FLOAT
                                                   : SF_FORMAT_WAV | SF_FORMAT_PCM_16;
  APUS_CHECK(sf_format_check(&info), path, ": libsndfile cannot write this format at ", audio.rate,
             " Hz, ", audio.channels, " channels");
  AtomicFile file(path);
  std::fflush(file.stream());
  SNDFILE* sf = sf_open_fd(::fileno(file.stream()), SFM_WRITE, &info, /*close_desc=*/0);
  APUS_CHECK(sf, path, ": cannot write audio: ", sf_strerror(nullptr));
  struct Closer {
    SNDFILE* sf;
    ~Closer() {
      if (sf) sf_close(sf);
    }
  } closer{sf};
  sf_command(sf, SFC_SET_CLIPPING, nullptr, SF_TRUE);  // clip, do not wrap, in integer formats
  for (const auto& [key, value] : {std::pair{SF_STR_TITLE, &metadata.title},
                                   std::pair{SF_STR_COMMENT, &metadata.comment},
                                   std::pair{SF_STR_SOFTWARE, &metadata.software}})
    if (!value->empty()) sf_set_string(sf, key, value->c_str());
  const sf_count_t frames = sf_count_t(audio.frames());
  APUS_CHECK(sf_writef_float(sf, audio.samples.data(), frames) == frames, path, ": write failed: ",
             sf_strerror(sf));
  APUS_CHECK(sf_close(sf) == 0, path, ": write failed: ", sf_strerror(nullptr));
  closer.sf = nullptr;
  file.commit();
}

Audio read_audio(const std::string& path) {
  size_t size = 0;
  const int fd = open_regular(path, size);  // refuses FIFOs and directories without blocking
  SF_INFO info{};
  SNDFILE* sf = sf_open_fd(fd, SFM_READ, &info, /*close_desc=*/1);
  APUS_CHECK(sf, path, ": not an audio file libsndfile reads: ", sf_strerror(nullptr));
  struct Closer {
    SNDFILE* sf;
    ~Closer() { sf_close(sf); }
  } closer{sf};
  APUS_CHECK(info.channels > 0 && info.channels <= 64 && info.samplerate > 0 && info.frames >= 0 &&
                 info.frames <= (int64_t(1) << 32) / info.channels,
             path, ": ", info.channels, " channels at ", info.samplerate, " Hz, ", info.frames,
             " frames: not an audio clip apus reads");
  Audio a;
  a.rate = info.samplerate;
  a.channels = info.channels;
  a.samples.resize(size_t(info.frames) * size_t(info.channels));
  const sf_count_t got = sf_readf_float(sf, a.samples.data(), info.frames);
  APUS_CHECK(got == info.frames, path, ": read ", got, " of ", info.frames, " frames: ",
             sf_strerror(sf));
  return a;
}

}  // namespace apus
