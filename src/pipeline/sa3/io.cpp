#include "pipeline/sa3/io.h"

#include "pipeline/metadata_number.h"

namespace apus {

std::string audio_comment(const AudioRequest& request, const AudioResult& result, const AudioModel& model,
                          const ClipNames& inputs) {
  std::string s = "Seconds: " + metadata_number(request.seconds) + ", Steps: " + std::to_string(request.steps);
  if (request.cfg != 1) s += ", CFG scale: " + metadata_number(request.cfg) + ", APG: " + metadata_number(request.apg);
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

}  // namespace apus
