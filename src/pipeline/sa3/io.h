#pragma once
// What a clip's file carries of its request, the same from every front end: the prompt as its
// title, the request's settings as its comment ("Key: value" pairs, as an image's infotext) and
// the software's name.
#include <string>

#include "apus/apus.h"
#include "io/audio.h"

namespace apus {

// How a clip's comment names its request's input clips: the CLI by their files, the server by the
// request fields they came in (init_audio, inpaint_audio), since a client's file has no name there.
struct ClipNames {
  std::string init, inpaint;
};
std::string audio_comment(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                          const ClipNames& inputs);
AudioMetadata audio_metadata(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                             const ClipNames& inputs);

}  // namespace apus
