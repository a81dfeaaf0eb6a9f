#include "pipeline/infotext.h"

#include <cstdio>

namespace apus {

namespace {
std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}
}  // namespace

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model) {
  std::string s = request.prompt;
  if (request.negative_prompt) s += "\nNegative prompt: " + *request.negative_prompt;
  s += "\nSteps: " + std::to_string(result.steps) + ", Sampler: " + model.sampler() + ", CFG scale: " +
       number(result.cfg) + ", Seed: " + std::to_string(result.seed) + ", Size: " + std::to_string(result.width) +
       "x" + std::to_string(result.height);
  if (request.inpaint) s += ", Denoising strength: " + number(request.inpaint->strength);
  s += ", Model: " + model.label() + ", Precision: " + (request.fp32 ? "fp32" : "bf16");
  if (!request.noise_file.empty()) s += ", Noise: " + request.noise_file;
  return s;
}

std::string audio_comment(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                          const ClipNames& inputs) {
  std::string s = "Seconds: " + number(request.seconds) + ", Steps: " + std::to_string(request.steps);
  if (request.cfg != 1) s += ", CFG scale: " + number(request.cfg) + ", APG: " + number(request.apg);
  s += ", Sampler: " + model.sampler() + ", Seed: " + std::to_string(result.seed) + ", Model: " + model.label() +
       ", Precision: " + (request.fp32 ? "fp32" : "bf16");
  if (request.init_audio)
    s += ", Init audio: " + inputs.init +
         ", Init noise level: " + number(request.init_noise_level.value_or(kDefaultInitNoiseLevel));
  if (request.inpaint_audio) {
    s += ", Inpaint audio: " + inputs.inpaint + ", Inpaint:";
    for (const auto& [start, end] : request.inpaint_regions) s += " " + number(start) + "-" + number(end) + " s";
  }
  return s;
}

}  // namespace apus
