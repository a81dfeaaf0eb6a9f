// The C ABI (include/apus/apus_c.h) over the C++ API: each handle wraps its C++ object, each call
// turns every exception into a status and this thread's message.
#include "apus/apus_c.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "apus/apus.h"
#include "core/error.h"
#include "pipeline/metadata.h"

struct apus_stop {
  std::atomic<bool> now{false};
};
struct apus_image_model {
  std::unique_ptr<apus::ImageModel> model;
};
struct apus_audio_model {
  std::unique_ptr<apus::AudioModel> model;
};
// The preview callbacks are bound to each output's index as a batch is made.
struct apus_image_request {
  apus::ImageRequest request;
  apus_image_preview_fn preview = nullptr;
  void* preview_user = nullptr;
};
struct apus_audio_request {
  apus::AudioRequest request;
  apus_audio_preview_fn preview = nullptr;
  void* preview_user = nullptr;
};
// What a result writes needs nothing of the model: its metadata is made with the results.
struct apus_image_result {
  std::vector<apus::ImageResult> results;
  std::vector<std::vector<std::pair<std::string, std::string>>> metadata;
};
struct apus_audio_result {
  std::vector<apus::AudioResult> results;
  std::vector<apus::AudioMetadata> metadata;
};

namespace {

thread_local std::string last_error;

// Runs `body`, mapping what it throws to a status and this thread's message.
template <typename Body> apus_status guarded(Body&& body) {
  try {
    body();
    last_error.clear();
    return APUS_OK;
  } catch (const apus::Cancelled& e) {
    last_error = e.what();
    return APUS_CANCELLED;
  } catch (const std::bad_alloc&) {
    last_error = "out of memory (an allocation failed)";
    return APUS_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    last_error = e.what();
    return APUS_ERROR;
  }
}

template <typename T> T& held(T* handle, const char* what) {
  APUS_CHECK(handle, what, ": a null handle");
  return *handle;
}
const char* text(const char* s, const char* what) {
  APUS_CHECK(s, what, ": a null string");
  return s;
}

apus::ModelParts parts_of(const char* model, const char* text_encoder, const char* vae, const char* tokenizer,
                          const char* config, apus_quant quant) {
  apus::ModelParts p{text(model, "the model")};
  p.text_encoder = text_encoder ? text_encoder : "";
  p.vae = vae ? vae : "";
  p.tokenizer = tokenizer ? tokenizer : "";
  p.config = config ? config : "";
  APUS_CHECK(
      quant == APUS_QUANT_NONE || quant == APUS_QUANT_INT8 || quant == APUS_QUANT_Q8_0 || quant == APUS_QUANT_FP8,
      "quant ", int(quant), ": expected APUS_QUANT_NONE, APUS_QUANT_INT8, APUS_QUANT_Q8_0 or APUS_QUANT_FP8");
  p.quant = quant == APUS_QUANT_INT8   ? apus::Quant::int8
            : quant == APUS_QUANT_Q8_0 ? apus::Quant::q8_0
            : quant == APUS_QUANT_FP8  ? apus::Quant::fp8
                                       : apus::Quant::none;
  return p;
}

apus::Weights weights_of(apus_weights w) {
  APUS_CHECK(w == APUS_WEIGHTS_RESIDENT || w == APUS_WEIGHTS_PER_STAGE, "weights ", int(w),
             ": expected APUS_WEIGHTS_RESIDENT or APUS_WEIGHTS_PER_STAGE");
  return w == APUS_WEIGHTS_RESIDENT ? apus::Weights::resident : apus::Weights::per_stage;
}

apus::Rgb8Image image_of(int width, int height, const uint8_t* rgb, const char* what) {
  APUS_CHECK(
      width > 0 && height > 0 && width <= apus::ImageLimits::max_side * 4 && height <= apus::ImageLimits::max_side * 4,
      what, ": ", width, "x", height, " pixels");
  APUS_CHECK(rgb, what, ": no pixels");
  return {width, height, std::vector<uint8_t>(rgb, rgb + size_t(width) * size_t(height) * 3)};
}

apus::AudioClip clip_of(int rate, int channels, size_t frames, const float* samples, const char* what) {
  APUS_CHECK(rate > 0 && channels > 0 && frames > 0 && samples, what, ": ", frames, " frames of ", channels,
             " channels at ", rate, " Hz");
  return {rate, channels, std::vector<float>(samples, samples + frames * size_t(channels))};
}

// The batch rendered with the caller's callbacks: the progress callback's cancel and the caller's
// stop flag (when given) are the one flag the engine reads.
template <typename Model, typename Request>
auto generate_batch(const Model& model, const std::vector<Request>& requests, apus_progress_fn progress, void* user,
                    apus_stop* stop) {
  std::atomic<bool> own{false};
  std::atomic<bool>& flag = stop ? stop->now : own;
  apus::Progress say;
  if (progress)
    say = [progress, user, &flag](const std::string& line) {
      if (progress(user, line.c_str()) != 0) flag = true;
    };
  return model.generate_batch(requests, say, &flag);
}

void check_batch(int batch) { APUS_CHECK(batch >= 1, "batch ", batch, ": expected 1 or more"); }

}  // namespace

extern "C" {

int apus_c_abi_version(void) { return APUS_C_ABI_VERSION; }
const char* apus_version(void) { return apus::version(); }
const char* apus_last_error(void) { return last_error.c_str(); }

apus_stop* apus_stop_new(void) { return new (std::nothrow) apus_stop; }
void apus_stop_now(apus_stop* stop) {
  if (stop) stop->now = true;
}
void apus_stop_free(apus_stop* stop) { delete stop; }

// ---- Images ----

apus_status apus_image_model_open_parts(const char* model, const char* text_encoder, const char* vae,
                                        const char* tokenizer, const char* config, apus_quant quant,
                                        apus_weights weights, const char* device, apus_image_model** out) {
  return guarded([&] {
    APUS_CHECK(out, "apus_image_model_open: a null out-pointer");
    *out = nullptr;
    auto m = std::make_unique<apus_image_model>();
    m->model = apus::ImageModel::open(parts_of(model, text_encoder, vae, tokenizer, config, quant), weights_of(weights),
                                      device ? device : "cpu");
    *out = m.release();
  });
}
apus_status apus_image_model_open(const char* dir, apus_weights weights, const char* device, apus_image_model** out) {
  return apus_image_model_open_parts(dir, nullptr, nullptr, nullptr, nullptr, APUS_QUANT_NONE, weights, device, out);
}
void apus_image_model_free(apus_image_model* model) { delete model; }
const char* apus_image_model_label(const apus_image_model* model) { return model ? model->model->label().c_str() : ""; }

apus_image_request* apus_image_request_new(const char* prompt) {
  if (!prompt) return nullptr;
  auto* r = new (std::nothrow) apus_image_request;
  if (r) r->request.prompt = prompt;
  return r;
}
void apus_image_request_free(apus_image_request* request) { delete request; }

apus_status apus_image_request_set_size(apus_image_request* request, int width, int height) {
  return guarded([&] {
    apus::ImageRequest& r = held(request, "apus_image_request_set_size").request;
    r.width = width;
    r.height = height;
  });
}
apus_status apus_image_request_set_steps(apus_image_request* request, int steps) {
  return guarded([&] { held(request, "apus_image_request_set_steps").request.steps = steps; });
}
apus_status apus_image_request_set_seed(apus_image_request* request, uint64_t seed) {
  return guarded([&] { held(request, "apus_image_request_set_seed").request.seed = seed; });
}
apus_status apus_image_request_set_cfg(apus_image_request* request, float cfg) {
  return guarded([&] { held(request, "apus_image_request_set_cfg").request.cfg = cfg; });
}
apus_status apus_image_request_set_negative_prompt(apus_image_request* request, const char* negative) {
  return guarded([&] {
    held(request, "apus_image_request_set_negative_prompt").request.negative_prompt =
        text(negative, "apus_image_request_set_negative_prompt");
  });
}
apus_status apus_image_request_set_fp32(apus_image_request* request, int on) {
  return guarded([&] { held(request, "apus_image_request_set_fp32").request.fp32 = on != 0; });
}
apus_status apus_image_request_set_noise_file(apus_image_request* request, const char* path) {
  return guarded([&] {
    held(request, "apus_image_request_set_noise_file").request.noise_file =
        text(path, "apus_image_request_set_noise_file");
  });
}
apus_status apus_image_request_set_noise_index(apus_image_request* request, int index) {
  return guarded([&] { held(request, "apus_image_request_set_noise_index").request.noise_index = index; });
}
apus_status apus_image_request_add_lora(apus_image_request* request, const char* file, float scale) {
  return guarded([&] {
    held(request, "apus_image_request_add_lora")
        .request.loras.push_back({text(file, "apus_image_request_add_lora"), scale});
  });
}
apus_status apus_image_request_add_reference(apus_image_request* request, int width, int height, const uint8_t* rgb) {
  return guarded([&] {
    held(request, "apus_image_request_add_reference")
        .request.references.push_back(image_of(width, height, rgb, "apus_image_request_add_reference"));
  });
}
apus_status apus_image_request_set_inpaint(apus_image_request* request, int width, int height, const uint8_t* rgb,
                                           int mask_width, int mask_height, const uint8_t* mask_rgb, double strength) {
  return guarded([&] {
    held(request, "apus_image_request_set_inpaint").request.inpaint = apus::Inpainting{
        image_of(width, height, rgb, "apus_image_request_set_inpaint: the image"),
        image_of(mask_width, mask_height, mask_rgb, "apus_image_request_set_inpaint: the mask"), strength};
  });
}
apus_status apus_image_request_set_preview(apus_image_request* request, apus_image_preview_fn preview, void* user) {
  return guarded([&] {
    apus_image_request& r = held(request, "apus_image_request_set_preview");
    r.preview = preview;
    r.preview_user = user;
  });
}

apus_status apus_image_generate(const apus_image_model* model, const apus_image_request* request, int batch,
                                apus_progress_fn progress, void* user, apus_stop* stop, apus_image_result** out) {
  return guarded([&] {
    APUS_CHECK(out, "apus_image_generate: a null out-pointer");
    *out = nullptr;
    const apus::ImageModel& m = *held(model, "apus_image_generate: the model").model;
    check_batch(batch);
    const apus_image_request& asked = held(request, "apus_image_generate");
    std::vector<apus::ImageRequest> requests = apus::batch_of(asked.request, batch);
    if (asked.preview)
      for (size_t i = 0; i < requests.size(); ++i)
        requests[i].preview = [fn = asked.preview, user = asked.preview_user, i](const apus::Preview& p) {
          fn(user, int(i), p.step, p.steps, p.image.width, p.image.height, p.image.rgb.data());
        };
    auto result = std::make_unique<apus_image_result>();
    result->results = generate_batch(m, requests, progress, user, stop);
    for (size_t i = 0; i < requests.size(); ++i)
      result->metadata.push_back(apus::image_metadata(requests[i], result->results[i], m));
    *out = result.release();
  });
}
int apus_image_result_count(const apus_image_result* result) { return result ? int(result->results.size()) : 0; }
apus_status apus_image_result_get(const apus_image_result* result, int index, int* width, int* height,
                                  const uint8_t** rgb, uint64_t* seed) {
  return guarded([&] {
    const apus_image_result& r = held(result, "apus_image_result_get");
    APUS_CHECK(index >= 0 && size_t(index) < r.results.size(), "apus_image_result_get: output ", index, " of ",
               r.results.size());
    const apus::ImageResult& o = r.results[size_t(index)];
    if (width) *width = o.width;
    if (height) *height = o.height;
    if (rgb) *rgb = o.rgb.data();
    if (seed) *seed = o.seed;
  });
}
apus_status apus_image_result_write(const apus_image_result* result, int index, const char* path, int quality) {
  return guarded([&] {
    const apus_image_result& r = held(result, "apus_image_result_write");
    APUS_CHECK(index >= 0 && size_t(index) < r.results.size(), "apus_image_result_write: output ", index, " of ",
               r.results.size());
    apus::write_image_file(text(path, "apus_image_result_write"), r.results[size_t(index)], r.metadata[size_t(index)],
                           quality);
  });
}
void apus_image_result_free(apus_image_result* result) { delete result; }

// ---- Audio ----

apus_status apus_audio_model_open_parts(const char* model, const char* text_encoder, const char* vae,
                                        const char* tokenizer, const char* config, apus_quant quant,
                                        apus_weights weights, const char* device, apus_audio_model** out) {
  return guarded([&] {
    APUS_CHECK(out, "apus_audio_model_open: a null out-pointer");
    *out = nullptr;
    auto m = std::make_unique<apus_audio_model>();
    m->model = apus::AudioModel::open(parts_of(model, text_encoder, vae, tokenizer, config, quant), weights_of(weights),
                                      device ? device : "cpu");
    *out = m.release();
  });
}
apus_status apus_audio_model_open(const char* dir, apus_weights weights, const char* device, apus_audio_model** out) {
  return apus_audio_model_open_parts(dir, nullptr, nullptr, nullptr, nullptr, APUS_QUANT_NONE, weights, device, out);
}
void apus_audio_model_free(apus_audio_model* model) { delete model; }
const char* apus_audio_model_label(const apus_audio_model* model) { return model ? model->model->label().c_str() : ""; }

apus_audio_request* apus_audio_request_new(const char* prompt) {
  if (!prompt) return nullptr;
  auto* r = new (std::nothrow) apus_audio_request;
  if (r) r->request.prompt = prompt;
  return r;
}
void apus_audio_request_free(apus_audio_request* request) { delete request; }

apus_status apus_audio_request_set_seconds(apus_audio_request* request, double seconds) {
  return guarded([&] { held(request, "apus_audio_request_set_seconds").request.seconds = seconds; });
}
apus_status apus_audio_request_set_steps(apus_audio_request* request, int steps) {
  return guarded([&] { held(request, "apus_audio_request_set_steps").request.steps = steps; });
}
apus_status apus_audio_request_set_seed(apus_audio_request* request, uint64_t seed) {
  return guarded([&] { held(request, "apus_audio_request_set_seed").request.seed = seed; });
}
apus_status apus_audio_request_set_cfg(apus_audio_request* request, float cfg, float apg) {
  return guarded([&] {
    apus::AudioRequest& r = held(request, "apus_audio_request_set_cfg").request;
    r.cfg = cfg;
    r.apg = apg;
  });
}
apus_status apus_audio_request_set_negative_prompt(apus_audio_request* request, const char* negative) {
  return guarded([&] {
    held(request, "apus_audio_request_set_negative_prompt").request.negative_prompt =
        text(negative, "apus_audio_request_set_negative_prompt");
  });
}
apus_status apus_audio_request_set_fp32(apus_audio_request* request, int on) {
  return guarded([&] { held(request, "apus_audio_request_set_fp32").request.fp32 = on != 0; });
}
apus_status apus_audio_request_set_chunked_decode(apus_audio_request* request, int chunked) {
  return guarded([&] { held(request, "apus_audio_request_set_chunked_decode").request.chunked_decode = chunked != 0; });
}
apus_status apus_audio_request_add_lora(apus_audio_request* request, const char* file, float scale) {
  return guarded([&] {
    held(request, "apus_audio_request_add_lora")
        .request.loras.push_back({text(file, "apus_audio_request_add_lora"), scale});
  });
}
apus_status apus_audio_request_set_init_audio(apus_audio_request* request, int sample_rate, int channels, size_t frames,
                                              const float* samples, double noise_level) {
  return guarded([&] {
    apus::AudioRequest& r = held(request, "apus_audio_request_set_init_audio").request;
    r.init_audio = clip_of(sample_rate, channels, frames, samples, "apus_audio_request_set_init_audio");
    r.init_noise_level = noise_level;
  });
}
apus_status apus_audio_request_set_inpaint_audio(apus_audio_request* request, int sample_rate, int channels,
                                                 size_t frames, const float* samples) {
  return guarded([&] {
    held(request, "apus_audio_request_set_inpaint_audio").request.inpaint_audio =
        clip_of(sample_rate, channels, frames, samples, "apus_audio_request_set_inpaint_audio");
  });
}
apus_status apus_audio_request_add_inpaint_region(apus_audio_request* request, double start, double end) {
  return guarded(
      [&] { held(request, "apus_audio_request_add_inpaint_region").request.inpaint_regions.emplace_back(start, end); });
}
apus_status apus_audio_request_set_preview(apus_audio_request* request, apus_audio_preview_fn preview, void* user) {
  return guarded([&] {
    apus_audio_request& r = held(request, "apus_audio_request_set_preview");
    r.preview = preview;
    r.preview_user = user;
  });
}

apus_status apus_audio_generate(const apus_audio_model* model, const apus_audio_request* request, int batch,
                                apus_progress_fn progress, void* user, apus_stop* stop, apus_audio_result** out) {
  return guarded([&] {
    APUS_CHECK(out, "apus_audio_generate: a null out-pointer");
    *out = nullptr;
    const apus::AudioModel& m = *held(model, "apus_audio_generate: the model").model;
    check_batch(batch);
    const apus_audio_request& asked = held(request, "apus_audio_generate");
    std::vector<apus::AudioRequest> requests = apus::batch_of(asked.request, batch);
    if (asked.preview)
      for (size_t i = 0; i < requests.size(); ++i)
        requests[i].preview = [fn = asked.preview, user = asked.preview_user, i](const apus::Preview& p) {
          fn(user, int(i), p.step, p.steps, p.peaks.data(), p.peaks.size());
        };
    auto result = std::make_unique<apus_audio_result>();
    result->results = generate_batch(m, requests, progress, user, stop);
    for (size_t i = 0; i < requests.size(); ++i)
      result->metadata.push_back(apus::audio_metadata(requests[i], result->results[i], m, apus::kClipsBySetting));
    *out = result.release();
  });
}
int apus_audio_result_count(const apus_audio_result* result) { return result ? int(result->results.size()) : 0; }
apus_status apus_audio_result_get(const apus_audio_result* result, int index, int* sample_rate, int* channels,
                                  size_t* frames, const float** samples, uint64_t* seed) {
  return guarded([&] {
    const apus_audio_result& r = held(result, "apus_audio_result_get");
    APUS_CHECK(index >= 0 && size_t(index) < r.results.size(), "apus_audio_result_get: output ", index, " of ",
               r.results.size());
    const apus::AudioResult& o = r.results[size_t(index)];
    if (sample_rate) *sample_rate = o.sample_rate;
    if (channels) *channels = o.channels;
    if (frames) *frames = o.samples.size() / size_t(std::max(o.channels, 1));
    if (samples) *samples = o.samples.data();
    if (seed) *seed = o.seed;
  });
}
apus_status apus_audio_result_write(const apus_audio_result* result, int index, const char* path) {
  return guarded([&] {
    const apus_audio_result& r = held(result, "apus_audio_result_write");
    APUS_CHECK(index >= 0 && size_t(index) < r.results.size(), "apus_audio_result_write: output ", index, " of ",
               r.results.size());
    apus::write_audio_file(text(path, "apus_audio_result_write"), r.results[size_t(index)], r.metadata[size_t(index)]);
  });
}
void apus_audio_result_free(apus_audio_result* result) { delete result; }

}  // extern "C"
