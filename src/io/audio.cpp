#include "io/audio.h"

#include <sndfile.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "io/files.h"

namespace apus {

AudioFormat parse_audio_format(const std::string& name) {
  if (name == "wav") return AudioFormat::wav16;
  if (name == "wav-float") return AudioFormat::wav_float;
  if (name == "flac") return AudioFormat::flac;
  fail("audio format '", name, "' is not one of wav, wav-float, flac");
}

namespace {

// libsndfile's virtual I/O over a growing byte vector.
struct Buffer {
  std::vector<uint8_t> bytes;
  sf_count_t at = 0;
};

SF_VIRTUAL_IO buffer_io() {
  SF_VIRTUAL_IO io{};
  io.get_filelen = [](void* b) { return sf_count_t(static_cast<Buffer*>(b)->bytes.size()); };
  io.seek = [](sf_count_t offset, int whence, void* p) {
    auto* b = static_cast<Buffer*>(p);
    const sf_count_t base = whence == SEEK_CUR ? b->at : whence == SEEK_END ? sf_count_t(b->bytes.size()) : 0;
    b->at = std::max<sf_count_t>(0, base + offset);
    return b->at;
  };
  io.read = [](void* dst, sf_count_t n, void* p) {
    auto* b = static_cast<Buffer*>(p);
    const sf_count_t got = std::max<sf_count_t>(0, std::min<sf_count_t>(n, sf_count_t(b->bytes.size()) - b->at));
    std::memcpy(dst, b->bytes.data() + b->at, size_t(got));
    b->at += got;
    return got;
  };
  io.write = [](const void* src, sf_count_t n, void* p) {
    auto* b = static_cast<Buffer*>(p);
    if (size_t(b->at + n) > b->bytes.size()) b->bytes.resize(size_t(b->at + n));
    std::memcpy(b->bytes.data() + b->at, src, size_t(n));
    b->at += n;
    return n;
  };
  io.tell = [](void* b) { return static_cast<Buffer*>(b)->at; };
  return io;
}

}  // namespace

const char* audio_mime_type(AudioFormat format) { return format == AudioFormat::flac ? "audio/flac" : "audio/wav"; }

std::vector<uint8_t> encode_audio(const Audio& audio, AudioFormat format, const AudioMetadata& metadata,
                                  const std::string& what) {
  APUS_CHECK(audio.rate > 0 && audio.channels > 0 && audio.samples.size() % size_t(audio.channels) == 0,
             what, ": ", audio.samples.size(), " samples for ", audio.channels, " channels at ",
             audio.rate, " Hz");
  for (size_t i = 0; i < audio.samples.size(); ++i)
    APUS_CHECK(std::isfinite(audio.samples[i]), what, ": sample ", i, " is not finite");
  SF_INFO info{};
  info.samplerate = audio.rate;
  info.channels = audio.channels;
  info.format = format == AudioFormat::flac        ? SF_FORMAT_FLAC | SF_FORMAT_PCM_16
                : format == AudioFormat::wav_float ? SF_FORMAT_WAV | SF_FORMAT_FLOAT
                                                   : SF_FORMAT_WAV | SF_FORMAT_PCM_16;
  APUS_CHECK(sf_format_check(&info), what, ": libsndfile cannot write this format at ", audio.rate,
             " Hz, ", audio.channels, " channels");
  Buffer buffer;
  SF_VIRTUAL_IO io = buffer_io();
  SNDFILE* sf = sf_open_virtual(&io, SFM_WRITE, &info, &buffer);
  APUS_CHECK(sf, what, ": cannot write audio: ", sf_strerror(nullptr));
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
  APUS_CHECK(sf_writef_float(sf, audio.samples.data(), frames) == frames, what, ": write failed: ",
             sf_strerror(sf));
  APUS_CHECK(sf_close(sf) == 0, what, ": write failed: ", sf_strerror(nullptr));
  closer.sf = nullptr;
  return std::move(buffer.bytes);
}

void write_audio(const std::string& path, const Audio& audio, AudioFormat format,
                 const AudioMetadata& metadata) {
  const std::vector<uint8_t> bytes = encode_audio(audio, format, metadata, path);
  write_whole_file(path, bytes.data(), bytes.size());
}

Audio read_audio(const std::string& path) { return decode_audio(read_file(path), path); }

Audio decode_audio(const std::string& bytes, const std::string& what) {
  Buffer buffer;
  buffer.bytes.assign(bytes.begin(), bytes.end());
  SF_VIRTUAL_IO io = buffer_io();
  SF_INFO info{};
  SNDFILE* sf = sf_open_virtual(&io, SFM_READ, &info, &buffer);
  APUS_CHECK(sf, what, ": not an audio file libsndfile reads: ", sf_strerror(nullptr));
  struct Closer {
    SNDFILE* sf;
    ~Closer() { sf_close(sf); }
  } closer{sf};
  APUS_CHECK(info.channels > 0 && info.channels <= 64 && info.samplerate > 0 && info.frames >= 0 &&
                 info.frames <= (int64_t(1) << 32) / info.channels,
             what, ": ", info.channels, " channels at ", info.samplerate, " Hz, ", info.frames,
             " frames: not an audio clip apus reads");
  Audio a;
  a.rate = info.samplerate;
  a.channels = info.channels;
  a.samples.resize(size_t(info.frames) * size_t(info.channels));
  const sf_count_t got = sf_readf_float(sf, a.samples.data(), info.frames);
  APUS_CHECK(got == info.frames, what, ": read ", got, " of ", info.frames, " frames: ", sf_strerror(sf));
  return a;
}

}  // namespace apus
