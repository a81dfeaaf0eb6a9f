// A Stable Audio 3 request checked and planned for a batch: the canvas, the schedule, guidance and
// the inputs of audio-to-audio and inpainting.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "pipeline/batch.h"
#include "pipeline/sa3/sa3_model.h"
#include "sampling/logsnr.h"

namespace apus {

namespace {

constexpr double kHeadroomSeconds = 6.0;          // generate()'s duration_padding_sec
constexpr int64_t kGenerateSampleSize = 5292032;  // generate()'s sample_size default

}  // namespace

Sa3Model::Work Sa3Model::plan(const AudioRequest& r, int64_t batch) const {
  const double seconds = *r.seconds;  // resolved: present
  const int steps = *r.steps;
  const float cfg = *r.cfg;
  const double limit = max_seconds();
  const int64_t rate = same_cfg_.sample_rate, spl = same_cfg_.samples_per_latent();
  // The output holds int(seconds x rate) frames, as the official code cuts it: at least one.
  APUS_CHECK_FIELD(std::isfinite(seconds) && int64_t(seconds * double(rate)) >= 1 && seconds <= limit, "seconds",
                   "seconds ", seconds, " outside [", 1.0 / double(rate), ", ", limit, "] (one output frame at ", rate,
                   " Hz .. this model's sample_size)");
  APUS_CHECK_FIELD(steps >= 1 && steps <= AudioLimits::max_steps, "steps", "steps ", steps, " outside 1..",
                   AudioLimits::max_steps);
  check_batch(batch, AudioLimits::max_batch);
  const int64_t align = std::max<int64_t>(1, layout_.encoder_chunk / same_cfg_.stride);
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  Work w;
  w.batch = batch;
  w.seconds.assign(size_t(batch), float(seconds));  // a batch agrees on its length
  const int64_t padded = int64_t((seconds + kHeadroomSeconds) * double(rate));
  w.canvas.samples = int64_t(seconds * double(rate));
  // The official generate() caps the canvas at its sample_size argument, 5292032 samples by
  // default (the config's larger value reaches it only through the official UI): clips up to that
  // length get generate()'s canvas; longer ones (medium, to 380 s) the config's.
  const int64_t cap = w.canvas.samples <= kGenerateSampleSize ? std::min(kGenerateSampleSize, layout_.sample_size)
                                                              : layout_.sample_size;
  w.canvas.frames = std::min(ceil_div(ceil_div(padded, spl), align) * align, cap / spl);
  w.canvas.valid =
      std::min(ceil_div(w.canvas.samples, spl) + int64_t(kHeadroomSeconds * double(rate)) / spl, w.canvas.frames);
  w.init = r.init_audio.has_value();
  w.inpaint = r.inpaint_audio.has_value();
  APUS_CHECK_FIELD(w.init || !r.init_noise_level, "init_noise_level", "init_noise_level ",
                   r.init_noise_level.value_or(0), " is for audio-to-audio: it needs an init audio clip");
  w.init_level = w.init ? r.init_noise_level.value_or(kDefaultInitNoiseLevel) : 1.0;
  APUS_CHECK_FIELD(std::isfinite(w.init_level) && w.init_level > 0 && w.init_level <= 1, "init_noise_level",
                   "init_noise_level ", w.init_level, " outside (0, 1]");
  APUS_CHECK_FIELD(w.inpaint || r.inpaint_regions.empty(), "inpaint_regions", "inpaint regions need an inpaint clip");
  APUS_CHECK_FIELD(!w.inpaint || !r.inpaint_regions.empty(), "inpaint_regions",
                   "an inpaint clip needs at least one region to generate (inpaint start and end)");
  for (const auto& [start, end] : r.inpaint_regions)
    APUS_CHECK_FIELD(std::isfinite(start) && std::isfinite(end) && start >= 0 && end > start && end <= seconds,
                     "inpaint_regions", "inpaint region ", start, " .. ", end, " s is not a span inside the ", seconds,
                     " s clip");
  APUS_CHECK(!(w.init || w.inpaint) || layout_.encoder_mask_noise == 0, layout_.root,
             "/model_config.json: the encoder's 'mask_noise' ", layout_.encoder_mask_noise,
             " is not supported (audio-to-audio and inpainting encode without noise)");
  // The official ones mask by latent: the region's samples [int(start * rate), int(end * rate))
  // and everything past int(seconds * rate) are generated; each latent takes its first sample's.
  if (w.inpaint) {
    w.keep.assign(size_t(w.canvas.frames), 1.0f);
    for (int64_t i = 0; i < w.canvas.frames; ++i) {
      const int64_t sample = i * spl;
      bool generated = sample >= w.canvas.samples;
      for (const auto& [start, end] : r.inpaint_regions)
        generated = generated || (sample >= int64_t(start * double(rate)) && sample < int64_t(end * double(rate)));
      if (generated) w.keep[size_t(i)] = 0.0f;
    }
  }
  w.sigmas = logsnr_sigmas(steps, float(w.init_level));
  w.tokens = layout_.max_tokens;
  APUS_CHECK_FIELD(std::isfinite(cfg) && cfg > 0 && cfg <= 100, "cfg", "cfg ", cfg, " outside (0, 100]");
  APUS_CHECK_FIELD(std::isfinite(r.apg) && r.apg >= 0 && r.apg <= 1, "apg", "apg ", r.apg, " outside [0, 1]");
  // The official DiT guides whenever cfg is not 1, whatever the sampler.
  w.guided = cfg != 1;
  w.negative = w.guided && r.negative_prompt.has_value();
  APUS_CHECK_FIELD(w.guided || !r.negative_prompt, "negative_prompt",
                   "a negative prompt needs guidance (cfg other than 1)");
  w.cfg = cfg;
  w.apg = r.apg;
  w.chunked = r.chunked_decode.value_or(layout_.chunked_decode);
  // A model opened split runs every request over its ranks: none is tensor over them.
  const ProcessGroup* held = layout_.tensor_ranks;
  w.parallel = held && r.parallel.strategy == Parallel::none ? Parallelism{Parallel::tensor, held} : r.parallel;
  check_parallelism(w.parallel, (w.guided ? 2 : 1) * w.batch, device(), label_, held);
  if (!r.loras.empty()) {
    auto adapters = std::make_shared<Adapters>();
    for (const Lora& lora : r.loras) sa3::read_lora(lora, lora_targets_, *adapters);
    // Split over ranks, each linear holds some rows of its weight: so do their adapters.
    for (const auto& [weight, rows] : sa3::held_rows(dit_cfg_, sa3::tensor_split(dit_cfg_, held)))
      adapters->keep_rows(weight, rows);
    if (device()) adapters->upload(*device());
    w.adapters = std::move(adapters);
  }
  return w;
}

// The request with the model's defaults for what it leaves absent; plan() checks every setting.
AudioRequest Sa3Model::resolved(const AudioRequest& given) const {
  AudioRequest r = given;
  if (!r.seconds) r.seconds = default_seconds();
  if (!r.steps) r.steps = default_steps();
  if (!r.cfg) r.cfg = default_cfg();
  APUS_CHECK(weights_ != Weights::resident || compute(r) == resident_dtype_,
             "this resident model serves bf16 requests only");
  APUS_CHECK(!r.preview || weights_ == Weights::resident, label_,
             ": live previews come from a resident model (apus serve), whose decoder stays loaded beside the DiT");
  return r;
}

namespace {

// What a batch of audio requests shares; per sample: the prompt, seed, trace and preview sink,
// and the negative prompt's and input clips' contents (their presence is shared).
constexpr std::size_t kPerSample = 4;
constexpr std::array<SharedSetting<AudioRequest>, 14> kShared = {{
    {"seconds", [](const AudioRequest& a, const AudioRequest& b) { return a.seconds == b.seconds; }},
    {"steps", [](const AudioRequest& a, const AudioRequest& b) { return a.steps == b.steps; }},
    {"precision", [](const AudioRequest& a, const AudioRequest& b) { return a.fp32 == b.fp32; }},
    {"decode", [](const AudioRequest& a, const AudioRequest& b) { return a.chunked_decode == b.chunked_decode; }},
    {"guidance", [](const AudioRequest& a, const AudioRequest& b) { return a.cfg == b.cfg; }},
    {"guidance's apg", [](const AudioRequest& a, const AudioRequest& b) { return a.apg == b.apg; }},
    {"whether a negative prompt is given",
     [](const AudioRequest& a, const AudioRequest& b) {
       return a.negative_prompt.has_value() == b.negative_prompt.has_value();
     }},
    {"whether an init clip is given",
     [](const AudioRequest& a, const AudioRequest& b) { return a.init_audio.has_value() == b.init_audio.has_value(); }},
    {"init noise level",
     [](const AudioRequest& a, const AudioRequest& b) { return a.init_noise_level == b.init_noise_level; }},
    {"whether an inpainting clip is given",
     [](const AudioRequest& a, const AudioRequest& b) {
       return a.inpaint_audio.has_value() == b.inpaint_audio.has_value();
     }},
    {"inpainting regions",
     [](const AudioRequest& a, const AudioRequest& b) { return a.inpaint_regions == b.inpaint_regions; }},
    {"LoRAs", [](const AudioRequest& a, const AudioRequest& b) { return same_loras(a.loras, b.loras); }},
    {"finish flag", [](const AudioRequest& a, const AudioRequest& b) { return a.finish_steps == b.finish_steps; }},
    {"parallelism",
     [](const AudioRequest& a, const AudioRequest& b) { return same_parallelism(a.parallel, b.parallel); }},
}};
static_assert(field_count<AudioRequest>() == kShared.size() + kPerSample,
              "AudioRequest has a field kShared does not list: list it there, or count it per sample");

}  // namespace

void Sa3Model::check_batch_agrees(const std::vector<AudioRequest>& requests) const {
  check_batch_shares(requests, kShared);
}

PipelineCost Sa3Model::cost_header(const AudioRequest& r, const Work& w, int) const {
  PipelineCost p;
  p.model = label_;
  p.seconds = *r.seconds;  // r resolved
  p.steps = *r.steps;
  p.cfg = w.guided ? *r.cfg : 1.0;
  p.samples = int((w.guided ? 2 : 1) * w.batch);
  return p;
}

}  // namespace apus
