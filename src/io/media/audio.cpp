#include "io/media/audio.h"

#include <sndfile.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>

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

// libsndfile's virtual I/O over bytes in memory, read in place.
struct View {
  const std::string* bytes;
  sf_count_t at = 0;
  sf_count_t size() const { return sf_count_t(bytes->size()); }
};

SF_VIRTUAL_IO view_io() {
  SF_VIRTUAL_IO io{};
  io.get_filelen = [](void* v) { return static_cast<View*>(v)->size(); };
  io.seek = [](sf_count_t offset, int whence, void* p) {
    auto* v = static_cast<View*>(p);
    const sf_count_t base = whence == SEEK_CUR ? v->at : whence == SEEK_END ? v->size() : 0;
    v->at = std::max<sf_count_t>(0, base + offset);
    return v->at;
  };
  io.read = [](void* dst, sf_count_t n, void* p) {
    auto* v = static_cast<View*>(p);
    const sf_count_t got = std::max<sf_count_t>(0, std::min<sf_count_t>(n, v->size() - v->at));
    std::memcpy(dst, v->bytes->data() + v->at, size_t(got));
    v->at += got;
    return got;
  };
  io.write = [](const void*, sf_count_t, void*) { return sf_count_t(0); };
  io.tell = [](void* v) { return static_cast<View*>(v)->at; };
  return io;
}

// The most frames `bytes` bytes of audio can hold, in any format libsndfile reads. FLAC is the
// densest: a frame of up to 65536 samples per channel takes at least 12 bytes (an 8-byte header
// with a 16-bit block size, a 2-byte CONSTANT subframe, the CRC-16), so no valid FLAC holds more
// than 65536 frames per 12 bytes. Ogg Vorbis and Opus hold under 3000 frames per byte (a 27-byte
// page header per at most 255 packets of at most 4096 / 5760 new frames), MP3 and ADPCM far
// fewer, PCM at most one frame per byte.
int64_t most_frames_in(size_t bytes) { return (int64_t(bytes) / 12 + 1) * 65536; }

// The highest sample rate read (DXD's 384 kHz): with max_seconds it bounds what a clip decodes to.
constexpr int kMaxRate = 384000;

// A clip opened for reading, its header checked against what it can hold and what the caller
// can use: at most max_seconds at its rate, within what its bytes can hold.
class OpenClip {
 public:
  OpenClip(const std::string& bytes, const std::string& what, double max_seconds) : view_{&bytes} {
    io_ = view_io();
    // Owned before the header's checks: a refused file is closed as the constructor throws.
    sf_.reset(sf_open_virtual(&io_, SFM_READ, &info_, &view_));
    APUS_CHECK(sf_, what, ": not an audio file libsndfile reads: ", sf_strerror(nullptr));
    APUS_CHECK(info_.channels > 0 && info_.channels <= 64 && info_.samplerate > 0 && info_.samplerate <= kMaxRate, what,
               ": ", info_.channels, " channels at ", info_.samplerate,
               " Hz: not an audio clip apus reads (1 to 64 channels, up to ", kMaxRate, " Hz)");
    limit_ = int64_t(max_seconds * double(info_.samplerate));
    // libsndfile's count for a stream that does not give its length (a FLAC written to a pipe).
    known_ = info_.frames != SF_COUNT_MAX;
    if (!known_) return;
    APUS_CHECK(info_.frames > 0, what, ": holds no audio");
    APUS_CHECK(info_.frames <= most_frames_in(bytes.size()), what, ": the header claims ", info_.frames,
               " frames, more than a file of ", bytes.size(), " bytes can hold (at most ", most_frames_in(bytes.size()),
               ")");
    APUS_CHECK(info_.frames <= limit_, what, ": ", info_.frames, " frames at ", info_.samplerate, " Hz (",
               double(info_.frames) / info_.samplerate, " s), longer than the ", max_seconds, " s this model can use");
  }
  SNDFILE* sf() const { return sf_.get(); }
  const SF_INFO& info() const { return info_; }
  bool known_length() const { return known_; }
  int64_t limit() const { return limit_; }  // the most frames the caller can use

 private:
  View view_;
  SF_VIRTUAL_IO io_;
  SF_INFO info_{};
  std::unique_ptr<SNDFILE, int (*)(SNDFILE*)> sf_{nullptr, sf_close};
  int64_t limit_ = 0;
  bool known_ = true;
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
  APUS_CHECK(audio.rate > 0 && audio.channels > 0 && audio.samples.size() % size_t(audio.channels) == 0, what, ": ",
             audio.samples.size(), " samples for ", audio.channels, " channels at ", audio.rate, " Hz");
  // libsndfile writes a header-only WAV whose RIFF size does not count its metadata.
  APUS_CHECK(audio.frames() > 0, what, ": no audio to write (0 frames)");
  for (size_t i = 0; i < audio.samples.size(); ++i)
    APUS_CHECK(std::isfinite(audio.samples[i]), what, ": sample ", i, " is not finite");
  SF_INFO info{};
  info.samplerate = audio.rate;
  info.channels = audio.channels;
  info.format = format == AudioFormat::flac        ? SF_FORMAT_FLAC | SF_FORMAT_PCM_16
                : format == AudioFormat::wav_float ? SF_FORMAT_WAV | SF_FORMAT_FLOAT
                                                   : SF_FORMAT_WAV | SF_FORMAT_PCM_16;
  APUS_CHECK(sf_format_check(&info), what, ": libsndfile cannot write this format at ", audio.rate, " Hz, ",
             audio.channels, " channels");
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
  for (const auto& [key, value] :
       {std::pair{SF_STR_TITLE, &metadata.title}, std::pair{SF_STR_COMMENT, &metadata.comment},
        std::pair{SF_STR_SOFTWARE, &metadata.software}})
    if (!value->empty()) sf_set_string(sf, key, value->c_str());
  const sf_count_t frames = sf_count_t(audio.frames());
  APUS_CHECK(sf_writef_float(sf, audio.samples.data(), frames) == frames, what, ": write failed: ", sf_strerror(sf));
  APUS_CHECK(sf_close(sf) == 0, what, ": write failed: ", sf_strerror(nullptr));
  closer.sf = nullptr;
  return std::move(buffer.bytes);
}

void write_audio(const std::string& path, const Audio& audio, AudioFormat format, const AudioMetadata& metadata) {
  const std::vector<uint8_t> bytes = encode_audio(audio, format, metadata, path);
  write_whole_file(path, bytes.data(), bytes.size());
}

Audio read_audio(const std::string& path, double max_seconds) {
  return decode_audio(read_file(path), path, max_seconds);
}

AudioInfo probe_audio(const std::string& bytes, const std::string& what, double max_seconds) {
  const OpenClip clip(bytes, what, max_seconds);
  const SF_INFO& info = clip.info();
  return {info.samplerate, info.channels,
          clip.known_length() ? int64_t(info.frames) : std::min(clip.limit(), most_frames_in(bytes.size()))};
}

Audio decode_audio(const std::string& bytes, const std::string& what, double max_seconds) {
  const OpenClip clip(bytes, what, max_seconds);
  const SF_INFO& info = clip.info();
  Audio a;
  a.rate = info.samplerate;
  a.channels = info.channels;
  // Block by block, never the claimed length up front: a header may claim more than the stream
  // holds. A stream of unknown length is read one frame past the limit, to tell it is too long.
  const int64_t wanted = clip.known_length() ? int64_t(info.frames) : clip.limit() + 1;
  constexpr int64_t kBlock = int64_t(1) << 16;
  int64_t got = 0;
  try {
    while (got < wanted) {
      const int64_t n = std::min(kBlock, wanted - got);
      a.samples.resize(size_t(got + n) * size_t(a.channels));
      const sf_count_t read = sf_readf_float(clip.sf(), a.samples.data() + got * a.channels, n);
      got += std::max<sf_count_t>(read, 0);
      if (read < n) break;
    }
  } catch (const std::bad_alloc&) {
    fail(what, ": ", got, " frames of ", a.channels, " channels decoded, and more do not fit in this process's memory");
  }
  a.samples.resize(size_t(got) * size_t(a.channels));
  APUS_CHECK(got <= clip.limit(), what, ": more than ", clip.limit(), " frames at ", a.rate, " Hz, longer than the ",
             max_seconds, " s this model can use");
  APUS_CHECK(!clip.known_length() || got == info.frames, what, ": the header claims ", info.frames,
             " frames, the stream holds ", got, " (a truncated or damaged file)");
  APUS_CHECK(got > 0, what, ": holds no audio");
  return a;
}

}  // namespace apus
