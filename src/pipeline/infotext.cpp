#include "pipeline/infotext.h"

#include <cstdio>

namespace apus {

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model) {
  auto number = [](double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", v);
    return std::string(text);
  };
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

}  // namespace apus
