#include "pipeline/klein/io.h"

#include <filesystem>

#include "pipeline/metadata_number.h"

namespace apus {

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model) {
  std::string s = request.prompt;
  if (request.negative_prompt) s += "\nNegative prompt: " + *request.negative_prompt;
  s += "\nSteps: " + std::to_string(result.steps) + ", Sampler: " + model.sampler() +
       ", CFG scale: " + metadata_number(result.cfg) + ", Seed: " + std::to_string(result.seed) +
       ", Size: " + std::to_string(result.width) + "x" + std::to_string(result.height);
  if (request.inpaint) s += ", Denoising strength: " + metadata_number(request.inpaint->strength);
  s += ", Model: " + model.label() + ", Precision: " + (request.fp32 ? "fp32" : "bf16");
  if (!request.noise_file.empty()) s += ", Noise: " + request.noise_file;
  return s + metadata_loras(request.loras);
}

std::vector<std::pair<std::string, std::string>> image_metadata(const ImageRequest& request, const ImageResult& result,
                                                                const ImageModel& model) {
  return {{"parameters", infotext(request, result, model)}, {"Software", "apus"}};
}

}  // namespace apus
