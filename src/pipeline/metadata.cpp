#include "pipeline/metadata.h"

#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "io/files.h"
#include "io/media/image.h"

namespace apus {

std::string metadata_number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

std::string metadata_loras(const std::vector<Lora>& loras) {
  std::string s;
  for (const Lora& lora : loras)
    s += ", Lora: " + std::filesystem::path(lora.file).filename().string() + ":" + metadata_number(lora.scale);
  return s;
}

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model) {
  std::string s = request.prompt;
  if (request.negative_prompt) s += "\nNegative prompt: " + *request.negative_prompt;
  s += "\nSteps: " + std::to_string(result.steps) + ", Sampler: " + model.sampler() +
       ", CFG scale: " + metadata_number(result.cfg) + ", Seed: " + std::to_string(result.seed) +
       ", Size: " + std::to_string(result.width) + "x" + std::to_string(result.height);
  if (request.inpaint) s += ", Denoising strength: " + metadata_number(request.inpaint->strength);
  s += ", Model: " + model.label() + ", Precision: " + (request.fp32 ? "fp32" : "bf16");
  if (request.noise_index) s += ", Noise index: " + std::to_string(request.noise_index);
  if (!request.noise_file.empty()) s += ", Noise: " + request.noise_file;
  return s + metadata_loras(request.loras);
}

std::vector<std::pair<std::string, std::string>> image_metadata(const ImageRequest& request, const ImageResult& result,
                                                                const ImageModel& model) {
  return {{"parameters", infotext(request, result, model)}, {"Software", "apus"}};
}

std::string audio_comment(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                          const ClipNames& inputs) {
  const float cfg = request.cfg.value_or(model.default_cfg());
  std::string s = "Seconds: " + metadata_number(request.seconds.value_or(model.default_seconds())) +
                  ", Steps: " + std::to_string(request.steps.value_or(model.default_steps()));
  if (cfg != 1) s += ", CFG scale: " + metadata_number(cfg) + ", APG: " + metadata_number(request.apg);
  s += ", Sampler: " + model.sampler() + ", Seed: " + std::to_string(result.seed) + ", Model: " + model.label() +
       ", Precision: " + (request.fp32 ? "fp32" : "bf16");
  if (request.init_audio)
    s += ", Init audio: " + inputs.init +
         ", Init noise level: " + metadata_number(request.init_noise_level.value_or(kDefaultInitNoiseLevel));
  if (request.inpaint_audio) {
    s += ", Inpaint audio: " + inputs.inpaint + ", Inpaint:";
    for (const auto& [start, end] : request.inpaint_regions)
      s += " " + metadata_number(start) + "-" + metadata_number(end) + " s";
  }
  return s + metadata_loras(request.loras);
}

AudioMetadata audio_metadata(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                             const ClipNames& inputs) {
  return {request.prompt, audio_comment(request, result, model, inputs), "apus"};
}

void write_image_file(const std::string& path, const ImageResult& result,
                      const std::vector<std::pair<std::string, std::string>>& metadata, int quality) {
  APUS_CHECK(quality >= 1 && quality <= 100, path, ": quality ", quality, " outside 1..100");
  const std::vector<uint8_t> bytes =
      encode_image(image_format_of_file(path, "the path"), Rgb8Image{result.width, result.height, result.rgb}, quality,
                   metadata, path);
  write_whole_file(path, bytes.data(), bytes.size());
}

void write_audio_file(const std::string& path, const AudioResult& result, const AudioMetadata& metadata) {
  const std::string ext = extension_of(path);
  APUS_CHECK(ext == ".wav" || ext == ".flac", path, ": apus writes .wav or .flac files");
  write_audio(path, Audio{result.sample_rate, result.channels, result.samples},
              parse_audio_format(ext == ".flac" ? "flac" : "wav"), metadata);
}

}  // namespace apus
