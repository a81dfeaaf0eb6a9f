#pragma once
// The request a file is written with, the same from every front end: for an image the
// "parameters" text in the form Automatic1111's web UI writes and reads (its infotext: the prompt,
// the negative prompt, then "Key: value" pairs); for a clip the comment, its pairs alone.
#include <string>

#include "apus/apus.h"

namespace apus {

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model);

// How a clip's comment names its request's input clips: the CLI by their files, the server by the
// request fields they came in (init_audio, inpaint_audio), since a client's file has no name there.
struct ClipNames {
  std::string init, inpaint;
};
std::string audio_comment(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                          const ClipNames& inputs);

}  // namespace apus
