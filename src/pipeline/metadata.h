#pragma once
// What a result's file carries of its request, the same from every front end (the CLI's file, the
// server's answer) and for every family: an image's "parameters" text in the form Automatic1111's
// web UI writes and reads (its infotext: the prompt, the negative prompt, then "Key: value" pairs),
// a clip's prompt as its title and its settings as its comment, and the software's name.
#include <string>
#include <utility>
#include <vector>

#include "apus/apus.h"
#include "io/media/audio.h"

namespace apus {

// A setting's value as the metadata writes it: printf's %g (4, 0.8, 3.5).
std::string metadata_number(double v);
// A request's adapters as the metadata lists them: ", Lora: detail.safetensors:0.8" each.
std::string metadata_loras(const std::vector<Lora>& loras);

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model);
// The PNG text chunks of a result: parameters (infotext) and Software.
std::vector<std::pair<std::string, std::string>> image_metadata(const ImageRequest& request, const ImageResult& result,
                                                                const ImageModel& model);

// How a clip's comment names its request's input clips: the CLI by their files, the server by the
// request fields they came in (init_audio, inpaint_audio), since a client's file has no name there.
struct ClipNames {
  std::string init, inpaint;
};
// Clips handed over in memory (the server, the C ABI, Python) are named by their settings.
inline const ClipNames kClipsBySetting{"init_audio", "inpaint_audio"};
std::string audio_comment(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                          const ClipNames& inputs);
AudioMetadata audio_metadata(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                             const ClipNames& inputs);

// A result written to `path` as `apus image -o` writes it, the format by the extension (.png,
// .jpg, .webp; quality 1..100 for the last two): the C ABI's and Python's file of an output.
void write_image_file(const std::string& path, const ImageResult& result,
                      const std::vector<std::pair<std::string, std::string>>& metadata, int quality);
// ... as `apus audio -o` writes it: .wav (16-bit PCM) or .flac by the extension.
void write_audio_file(const std::string& path, const AudioResult& result, const AudioMetadata& metadata);

}  // namespace apus
