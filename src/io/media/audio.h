#pragma once
// Audio files through libsndfile: 16-bit PCM WAV (the default), 32-bit float WAV and FLAC out,
// with the request in the file's metadata; any format libsndfile reads, in.
#include <cstdint>
#include <string>
#include <vector>

namespace apus {

enum class AudioFormat { wav16, wav_float, flac };
// "wav" (16-bit), "wav-float" or "flac"; anything else is refused naming the value.
AudioFormat parse_audio_format(const std::string& name);

struct AudioMetadata {
  std::string title, comment, software;  // what players show; the comment carries the request
};

struct Audio {
  int rate = 0;
  int channels = 0;
  std::vector<float> samples;  // interleaved, frames * channels, nominally in [-1, 1]
  int64_t frames() const { return channels ? int64_t(samples.size()) / channels : 0; }
};

// The file's bytes. Samples outside [-1, 1] are clipped, not wrapped, in the integer formats; a
// non-finite sample is refused. `what` names the clip in errors.
std::vector<uint8_t> encode_audio(const Audio& audio, AudioFormat format, const AudioMetadata& metadata,
                                  const std::string& what);
// encode_audio's bytes written through a temporary file renamed into place (a reader never sees
// a partial file).
void write_audio(const std::string& path, const Audio& audio, AudioFormat format, const AudioMetadata& metadata);
const char* audio_mime_type(AudioFormat format);
// Any format libsndfile reads, from a file or from its bytes; `what` names the clip in errors. A
// clip longer than max_seconds (the longest a caller can use: AudioModel::max_seconds()), one that
// holds no audio, or one whose header claims more frames than its bytes can hold or its stream
// holds, is refused; memory grows with the frames actually decoded, never with the header's claim.
Audio read_audio(const std::string& path, double max_seconds);
Audio decode_audio(const std::string& bytes, const std::string& what, double max_seconds);

// What decode_audio would give, from the header alone (no sample is decoded): the same checks,
// the header's frame count (for a stream that does not give it, the most it can hold).
struct AudioInfo {
  int rate = 0, channels = 0;
  int64_t frames = 0;
};
AudioInfo probe_audio(const std::string& bytes, const std::string& what, double max_seconds);

}  // namespace apus
