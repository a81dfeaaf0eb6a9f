#include "gate/gate.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>

#include "core/error.h"
#include "core/variants.h"
#include "gate/metrics.h"
#include "io/weights/quant_weights.h"
#include "pipeline/registry.h"

namespace apus {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The candidate's knob choice for the length of its renders.
class KnobChoice {
 public:
  explicit KnobChoice(const std::string& spec) {
    if (spec.empty()) return;
    const size_t eq = spec.find('=');
    APUS_CHECK(eq != std::string::npos, "--knob ", spec, ": expected NAME=CHOICE (apus bench --list-variants)");
    knob_ = &find_knob(spec.substr(0, eq));
    choice_ = knob_->index_of(spec.substr(eq + 1));
  }
  template <typename F> auto with(F&& f) const {
    if (!knob_) return f();
    const KnobScope scope(*knob_, choice_);
    return f();
  }

 private:
  Knob* knob_ = nullptr;
  int choice_ = 0;
};

std::string change_of(const GateOptions& o) {
  std::string c;
  auto add = [&](const std::string& s) { c += (c.empty() ? "" : ", ") + s; };
  if (o.candidate.quant != Quant::none) add(std::string("--quant ") + quant_name(o.candidate.quant));
  if (o.candidate.model != o.reference.model) add("weights " + o.candidate.model);
  if (!o.knob.empty()) add(o.knob);
  return c;
}

}  // namespace

const std::vector<std::string>& gate_prompts(bool audio) {
  static const std::vector<std::string> images = {
      "A photograph of a red fox sitting in tall grass at sunrise, soft golden light",
      "A bowl of ramen on a wooden table, steam rising, shallow depth of field",
      "An isometric illustration of a tiny island with a lighthouse and a harbour",
      "A portrait of an elderly fisherman with a weathered face, black and white film",
      "A neon-lit street in Tokyo at night in the rain, reflections on the asphalt",
      "A watercolour painting of a mountain lake with pine trees and a canoe",
      "A close-up of a hummingbird drinking from a purple flower, high-speed photography",
      "A cosy reading nook with a cat asleep on a stack of books, warm lamp light",
      "A sign that says \"OPEN LATE\" above the door of a small bakery, morning light",
      "An astronaut riding a horse across a desert under a starry sky, cinematic",
  };
  static const std::vector<std::string> clips = {
      "A warm acoustic guitar melody with soft fingerpicking, 90 BPM",
      "Rain falling on a tin roof with distant thunder",
      "An upbeat electronic dance track with a punchy kick and bright synth chords, 128 BPM",
      "A solo cello playing a slow, melancholic theme in a large hall",
      "Birdsong in a forest at dawn with a gentle breeze through the leaves",
      "A jazz trio with brushed drums, walking upright bass and a mellow piano",
      "Footsteps on gravel, then a wooden door creaking open",
      "A lo-fi hip hop beat with vinyl crackle and a dusty Rhodes piano",
      "Ocean waves breaking on a pebble beach, seagulls far away",
      "An orchestral fanfare with brass and timpani building to a climax",
  };
  return audio ? clips : images;
}

GateMetric judge(std::string name, bool higher_is_better, std::vector<double> floor, std::vector<double> candidate) {
  APUS_CHECK(!floor.empty() && floor.size() == candidate.size(), "gate: ", floor.size(), " floor scores for ",
             candidate.size(), " candidate scores");
  GateMetric m;
  m.name = std::move(name);
  m.higher_is_better = higher_is_better;
  const auto [lo, hi] = std::minmax_element(floor.begin(), floor.end());
  const auto [clo, chi] = std::minmax_element(candidate.begin(), candidate.end());
  m.threshold = higher_is_better ? *lo : *hi;
  m.candidate_worst = higher_is_better ? *clo : *chi;
  m.floor_median = median(floor);
  m.candidate_median = median(candidate);
  m.pass = higher_is_better ? m.candidate_median >= m.threshold : m.candidate_median <= m.threshold;
  m.floor = std::move(floor);
  m.candidate = std::move(candidate);
  return m;
}

GateReport run_gate(const GateOptions& o, const std::function<void(const std::string&)>& progress) {
  APUS_CHECK(o.prompts >= 1 && o.prompts <= 10, "--prompts ", o.prompts, ": expected 1..10 (the set holds 10)");
  APUS_CHECK(o.seeds >= 1 && o.seeds <= 100, "--seeds ", o.seeds, ": expected 1..100");
  GateReport r;
  r.change = change_of(o);
  APUS_CHECK(!r.change.empty(), "gate: no change to judge (give --quant int8, --candidate FILE or --knob NAME=CHOICE)");
  const KnobChoice knob(o.knob);
  const bool audio = model_kind(o.reference) == ModelKind::audio;
  r.kind = audio ? "audio" : "image";
  APUS_CHECK(!audio || (!o.width && !o.height), o.reference.model, ": --width and --height are for image models");
  APUS_CHECK(audio || !o.seconds, o.reference.model, ": --seconds is for audio models");
  if (o.candidate.model != o.reference.model) {
    const bool candidate_audio = model_kind(o.candidate) == ModelKind::audio;
    APUS_CHECK(candidate_audio == audio, "--candidate ", o.candidate.model, " is ",
               candidate_audio ? "an audio" : "an image", " model's file, and --model ", o.reference.model, " is ",
               audio ? "an audio" : "an image", " model: the candidate must be the same model's weights");
  }
  auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  // The reference loads its stages per request; a candidate of other weights (the int8 tier's
  // quantisation, another file) is made resident once, and a knob alone renders with the reference.
  const AnyModel reference = AnyModel::open(o.reference, Weights::per_stage, o.device);
  const bool own_weights = o.candidate.model != o.reference.model || o.candidate.quant != o.reference.quant;
  const std::optional<AnyModel> other =
      own_weights ? std::optional<AnyModel>(AnyModel::open(o.candidate, Weights::resident, o.device)) : std::nullopt;
  const AnyModel& candidate = other ? *other : reference;
  r.model = reference.label();
  r.device = o.device;
  std::vector<std::vector<double>> floor(3), cand(3);
  for (int p = 0; p < o.prompts; ++p)
    for (int s = 0; s < o.seeds; ++s) {
      const std::string pair = "prompt #" + std::to_string(p + 1) + ", seed " + std::to_string(s);
      r.pairs.push_back(pair);
      const std::string& prompt = gate_prompts(audio)[size_t(p)];
      if (audio) {
        AudioRequest q;
        q.prompt = prompt;
        q.seconds = o.seconds.value_or(10.0);
        q.seed = uint64_t(s);
        if (o.steps) q.steps = *o.steps;
        q.fp32 = true;
        say(pair + ": fp32");
        const AudioResult fp32 = reference.audio()->generate(q);
        q.fp32 = false;
        say(pair + ": bf16");
        const AudioResult bf16 = reference.audio()->generate(q);
        say(pair + ": candidate");
        const AudioResult c = knob.with([&] { return candidate.audio()->generate(q); });
        const AudioScores a = audio_scores(bf16.samples, fp32.samples, fp32.channels, fp32.sample_rate),
                          b = audio_scores(c.samples, fp32.samples, fp32.channels, fp32.sample_rate);
        floor[0].push_back(a.stft);
        cand[0].push_back(b.stft);
        floor[1].push_back(a.log_mel);
        cand[1].push_back(b.log_mel);
      } else {
        ImageRequest q;
        q.prompt = prompt;
        q.width = o.width.value_or(512);
        q.height = o.height.value_or(512);
        q.steps = o.steps;
        q.seed = uint64_t(s);
        q.fp32 = true;
        auto image = [](const ImageResult& x) { return Rgb8Image{x.width, x.height, x.rgb}; };
        say(pair + ": fp32");
        const Rgb8Image fp32 = image(reference.image()->generate(q));
        q.fp32 = false;
        say(pair + ": bf16");
        const Rgb8Image bf16 = image(reference.image()->generate(q));
        say(pair + ": candidate");
        const Rgb8Image c = image(knob.with([&] { return candidate.image()->generate(q); }));
        const ImageScores a = image_scores(bf16, fp32), b = image_scores(c, fp32);
        floor[0].push_back(a.psnr);
        cand[0].push_back(b.psnr);
        floor[1].push_back(a.ssim);
        cand[1].push_back(b.ssim);
        floor[2].push_back(a.gmsd);
        cand[2].push_back(b.gmsd);
      }
    }
  if (audio) {
    r.metrics.push_back(judge("MR-STFT", false, floor[0], cand[0]));
    r.metrics.push_back(judge("log-mel L1", false, floor[1], cand[1]));
  } else {
    r.metrics.push_back(judge("PSNR dB", true, floor[0], cand[0]));
    r.metrics.push_back(judge("SSIM", true, floor[1], cand[1]));
    r.metrics.push_back(judge("GMSD", false, floor[2], cand[2]));
  }
  r.pass = std::all_of(r.metrics.begin(), r.metrics.end(), [](const GateMetric& m) { return m.pass; });
  return r;
}

nlohmann::json GateReport::json() const {
  nlohmann::json j;
  j["model"] = model;
  j["change"] = change;
  j["kind"] = kind;
  j["device"] = device;
  j["pairs"] = pairs;
  j["rule"] = "each metric: the candidate's median against fp32 no worse than the bf16 renders' worst pair";
  for (const GateMetric& m : metrics)
    j["metrics"].push_back({{"name", m.name},
                            {"higher_is_better", m.higher_is_better},
                            {"threshold", m.threshold},
                            {"bf16_median", m.floor_median},
                            {"candidate_median", m.candidate_median},
                            {"candidate_worst", m.candidate_worst},
                            {"bf16", m.floor},
                            {"candidate", m.candidate},
                            {"pass", m.pass}});
  j["pass"] = pass;
  return j;
}

std::string GateReport::table() const {
  std::string t = "gate: " + change + " on " + model + " (" + device + "), " + std::to_string(pairs.size()) +
                  " pairs, against fp32\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-11s %12s %12s %14s %14s  %s\n", "metric", "bf16 median", "threshold",
                "cand. median", "cand. worst", "verdict");
  t += line;
  for (const GateMetric& m : metrics) {
    std::snprintf(line, sizeof line, "  %-11s %12.5g %12.5g %14.5g %14.5g  %s\n", m.name.c_str(), m.floor_median,
                  m.threshold, m.candidate_median, m.candidate_worst, m.pass ? "pass" : "FAIL");
    t += line;
  }
  return t + (pass ? "PASS" : "FAIL") + " (threshold: the bf16 renders' worst pair; " + (pass ? "every" : "not every") +
         " metric's candidate median within it)\n";
}

}  // namespace apus
