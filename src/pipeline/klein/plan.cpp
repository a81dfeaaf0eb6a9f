// A klein request resolved (the model's defaults in place, every bound checked) and planned for a
// batch: the latent grid, the schedule, the references' crops and inpainting's mask.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "io/media/resize.h"
#include "pipeline/batch.h"
#include "pipeline/klein/klein_model.h"
#include "pipeline/klein/lora.h"

namespace apus {

namespace {

using Crop = KleinModel::Crop;

void check_pixels(const Rgb8Image& image, const std::string& what) {
  const int64_t iw = image.width, ih = image.height;
  APUS_CHECK(iw > 0 && ih > 0 && int64_t(image.rgb.size()) == iw * ih * 3, what, ": ", iw, "x", ih, " with ",
             image.rgb.size(), " bytes; expected width x height x 3");
}

// The pipeline's check_image_input, on the image as given.
void check_reference(const Rgb8Image& image, size_t index) {
  const std::string what = "reference image " + std::to_string(index + 1);
  check_pixels(image, what);
  const int64_t iw = image.width, ih = image.height;
  APUS_CHECK(iw >= 64 && ih >= 64, what, " is ", iw, "x", ih, ": both sides must be at least 64 pixels");
  APUS_CHECK(std::max(iw, ih) <= 8 * std::min(iw, ih), what, " is ", iw, "x", ih,
             ": the aspect ratio must be at most 8:1");
}

// Flux2ImageProcessor._resize_to_target_area: over 1024x1024 pixels, the sides scaled to that
// area (truncated), resampled with PIL's Lanczos filter.
Rgb8Image within_target_area(Rgb8Image image) {
  constexpr double kArea = 1024.0 * 1024.0;
  if (int64_t(image.width) * image.height <= int64_t(kArea)) return image;
  const double scale = std::sqrt(kArea / (double(image.width) * double(image.height)));
  return resize_lanczos(image, int(image.width * scale), int(image.height * scale));
}

Crop crop_of(const Rgb8Image& image) {
  const int64_t iw = image.width, ih = image.height;
  const int64_t w = iw / flux2::kTokenPixels * flux2::kTokenPixels, h = ih / flux2::kTokenPixels * flux2::kTokenPixels;
  return {(iw - w) / 2, (ih - h) / 2, w, h};
}

}  // namespace

// Flux2KleinInpaintPipeline's preprocessing, without the check_image_input of references the
// editing pipeline makes: the image scaled within 1024x1024 pixels and resized to its sides
// floored to multiples of 16, which the output takes; the mask resized to that.
void KleinModel::resolve_inpainting(ImageRequest& r) const {
  Inpainting& in = *r.inpaint;
  check_pixels(in.image, "the image to inpaint");
  check_pixels(in.mask, "the inpainting mask");
  APUS_CHECK_FIELD(in.strength >= 0 && in.strength <= 1, "strength", "strength ", in.strength, " outside [0, 1]");
  APUS_CHECK(r.references.size() <= 1, "inpainting takes one reference image (the pipeline's image_reference), not ",
             r.references.size());
  Rgb8Image image = within_target_area(std::move(in.image));
  const int side = flux2::kTokenPixels;
  const int w = image.width / side * side, h = image.height / side * side;
  APUS_CHECK(w >= side && h >= side, "the image to inpaint is ", image.width, "x", image.height,
             ": both sides must be at least ", side, " pixels");
  APUS_CHECK(r.width.value_or(w) == w && r.height.value_or(h) == h, "inpainting renders at the image's size, ", w, "x",
             h, ", not the ", r.width.value_or(w), "x", r.height.value_or(h), " asked");
  r.width = w;
  r.height = h;
  if (image.width != w || image.height != h) image = resize_lanczos(image, w, h);
  in.image = std::move(image);
  if (in.mask.width != w || in.mask.height != h) in.mask = resize_lanczos(in.mask, w, h);
  for (Rgb8Image& reference : r.references) {
    check_pixels(reference, "the reference image");
    reference = within_target_area(std::move(reference));
    APUS_CHECK(reference.width >= side && reference.height >= side, "the reference image is ", reference.width, "x",
               reference.height, ": both sides must be at least ", side, " pixels");
  }
}

ImageRequest KleinModel::resolved(const ImageRequest& request) const {
  ImageRequest r = request;
  APUS_CHECK(!r.preview || weights_ == Weights::resident, label_,
             ": live previews come from a resident model (apus serve), whose VAE stays loaded beside the transformer");
  APUS_CHECK(!reference_cache_ || !r.inpaint, label_, " is a Flux2KleinKVPipeline model (model_index.json), which ",
             "has no inpainting (Flux2KleinInpaintPipeline's)");
  if (r.inpaint) {
    resolve_inpainting(r);
  } else {
    for (size_t k = 0; k < r.references.size(); ++k) {
      check_reference(r.references[k], k);
      r.references[k] = within_target_area(std::move(r.references[k]));
    }
  }
  // The pipeline's output size: as asked, else the first reference's (cropped), else 1024. Only
  // an absent setting takes a default; a given one (0 included) is checked as given.
  const std::optional<Crop> first = r.references.empty() ? std::nullopt : std::optional<Crop>(crop_of(r.references[0]));
  if (!r.width) r.width = first ? int(first->width) : 1024;
  if (!r.height) r.height = first ? int(first->height) : 1024;
  if (!r.steps) r.steps = default_steps();
  if (!r.cfg) r.cfg = r.inpaint && takes_guidance() ? flux2::kInpaintGuidance : default_cfg();
  APUS_CHECK_FIELD(std::isfinite(*r.cfg) && *r.cfg > 0 && *r.cfg <= 100, "cfg", "cfg ", *r.cfg, " outside (0, 100]");
  // The official pipelines warn and ignore guidance on a distilled model (the KV pipeline has
  // none at all); a request for it is refused instead of rendered differently than asked.
  const char* why_not = reference_cache_
                            ? " is a Flux2KleinKVPipeline model (model_index.json), which runs without guidance: "
                            : " is step-distilled (model_index.json is_distilled: true) and runs without guidance: ";
  APUS_CHECK_FIELD(
      takes_guidance() || (*r.cfg <= 1 && !r.negative_prompt), r.negative_prompt ? "negative_prompt" : "cfg", label_,
      why_not, r.negative_prompt ? "a negative prompt" : detail::concat("cfg ", *r.cfg), " is for the -base models");
  using L = ImageLimits;
  for (const auto& [name, side] : {std::pair{"width", *r.width}, std::pair{"height", *r.height}})
    APUS_CHECK_FIELD(side >= L::min_side && side <= L::max_side, name, name, " ", side, " outside ", L::min_side, "..",
                     L::max_side);
  const int side = flux2::kTokenPixels;
  APUS_CHECK_FIELD(*r.width % side == 0 && *r.height % side == 0, *r.width % side ? "width" : "height", "width ",
                   *r.width, " and height ", *r.height, " must be multiples of ", side);
  APUS_CHECK_FIELD(*r.steps >= 1 && *r.steps <= L::max_steps, "steps", "steps ", *r.steps, " outside 1..",
                   L::max_steps);
  APUS_CHECK_FIELD(r.noise_index >= 0 && r.noise_index < L::max_batch, "noise_index", "noise_index ", r.noise_index,
                   " outside 0..", L::max_batch - 1);
  APUS_CHECK_FIELD(r.noise_index == 0 || r.noise_file.empty(), "noise_index", "noise_index ", r.noise_index,
                   " with a noise file: the file is the noise");
  return r;
}

KleinModel::Work KleinModel::plan(const ImageRequest& r, int64_t batch) const {
  const int width = *r.width, height = *r.height, steps = *r.steps;  // resolved: all present and checked
  check_batch(batch, ImageLimits::max_batch);
  Work w;
  w.batch = batch;
  w.guided = *r.cfg > 1;
  w.samples = w.guided ? 2 * batch : batch;
  // A model opened split runs every request over its ranks: none is tensor over them.
  w.parallel = tensor_ranks_ && r.parallel.strategy == Parallel::none ? Parallelism{Parallel::tensor, tensor_ranks_}
                                                                      : r.parallel;
  check_parallelism(w.parallel, w.samples, device(), label_, tensor_ranks_);
  w.cfg = *r.cfg;
  w.steps = steps;
  w.h = height / flux2::kTokenPixels;
  w.w = width / flux2::kTokenPixels;
  w.schedule = flow_match_schedule(scheduler_cfg_, steps, flux2_empirical_mu(w.h * w.w, steps));
  if (r.inpaint) {
    w.inpainting = true;
    w.first_step = flux2::inpaint_first_step(steps, r.inpaint->strength);
    APUS_CHECK_FIELD(w.first_step < steps, "strength", "strength ", r.inpaint->strength, " of ", steps,
                     " steps runs no step (the pipeline refuses it too): raise the strength or the steps");
    w.sources.push_back(&r.inpaint->image);
    w.crops.push_back({0, 0, width, height});
    const int64_t l = w.h * w.w;
    w.inpaint_mask = Tensor::heap({batch * l}, DType::f32);
    const std::vector<float> mask = flux2::inpaint_mask(r.inpaint->mask, width, height);
    for (int64_t b = 0; b < batch; ++b) std::copy(mask.begin(), mask.end(), w.inpaint_mask.ptr<float>() + b * l);
  }
  for (const Rgb8Image& reference : r.references) {
    w.sources.push_back(&reference);
    w.crops.push_back(crop_of(reference));
  }
  for (const Crop& crop : w.crops) w.ref_tokens += crop.tokens();
  w.reference_cache = reference_cache_ && w.ref_tokens > 0;
  if (!r.loras.empty()) {
    auto adapters = std::make_shared<Adapters>();
    for (const Lora& lora : r.loras)
      flux2::read_lora(lora, dit_weights_, dit_cfg_.num_double, dit_cfg_.num_single, *adapters);
    // Split over ranks, each linear holds some rows of its weight: so do their adapters.
    for (const auto& [weight, rows] : flux2::held_rows(dit_cfg_, flux2::tensor_split(dit_cfg_, tensor_ranks_)))
      adapters->keep_rows(weight, rows);
    if (device()) adapters->upload(*device());
    w.adapters = std::move(adapters);
  }
  return w;
}

namespace {

bool same_image(const Rgb8Image& a, const Rgb8Image& b) {
  return a.width == b.width && a.height == b.height && a.rgb == b.rgb;
}

// What a batch of image requests shares; per sample: the prompt, negative prompt, seed, noise
// index, noise file, trace and preview sink.
constexpr std::size_t kPerSample = 7;
constexpr std::array<SharedSetting<ImageRequest>, 10> kShared = {{
    {"width", [](const ImageRequest& a, const ImageRequest& b) { return a.width == b.width; }},
    {"height", [](const ImageRequest& a, const ImageRequest& b) { return a.height == b.height; }},
    {"steps", [](const ImageRequest& a, const ImageRequest& b) { return a.steps == b.steps; }},
    {"guidance", [](const ImageRequest& a, const ImageRequest& b) { return a.cfg == b.cfg; }},
    {"precision", [](const ImageRequest& a, const ImageRequest& b) { return a.fp32 == b.fp32; }},
    {"reference images",
     [](const ImageRequest& a, const ImageRequest& b) {
       return std::equal(a.references.begin(), a.references.end(), b.references.begin(), b.references.end(),
                         same_image);
     }},
    {"inpainting",
     [](const ImageRequest& a, const ImageRequest& b) {
       return bool(a.inpaint) == bool(b.inpaint) && (!a.inpaint || (a.inpaint->strength == b.inpaint->strength &&
                                                                    same_image(a.inpaint->image, b.inpaint->image) &&
                                                                    same_image(a.inpaint->mask, b.inpaint->mask)));
     }},
    {"LoRAs", [](const ImageRequest& a, const ImageRequest& b) { return same_loras(a.loras, b.loras); }},
    {"finish flag", [](const ImageRequest& a, const ImageRequest& b) { return a.finish_steps == b.finish_steps; }},
    {"parallelism",
     [](const ImageRequest& a, const ImageRequest& b) { return same_parallelism(a.parallel, b.parallel); }},
}};
static_assert(field_count<ImageRequest>() == kShared.size() + kPerSample,
              "ImageRequest has a field kShared does not list: list it there, or count it per sample");

}  // namespace

void KleinModel::check_batch_agrees(const std::vector<ImageRequest>& requests) const {
  check_batch_shares(requests, kShared);
}

PipelineCost KleinModel::cost_header(const ImageRequest& r, const Work& w, int) const {
  PipelineCost p;
  p.model = label_;
  p.width = *r.width;
  p.height = *r.height;
  p.steps = *r.steps - w.first_step;
  p.references = int(r.references.size());
  p.cfg = w.guided ? *r.cfg : 1.0;
  p.samples = int(w.samples);
  return p;
}

std::string KleinModel::describe(const ImageRequest& r) const {
  return std::to_string(*r.width) + "x" + std::to_string(*r.height);
}

}  // namespace apus
