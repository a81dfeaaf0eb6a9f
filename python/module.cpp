// apus._apus: the C++ API (include/apus/apus.h) for Python, through nanobind. The pipelines with
// diffusers' signatures are python/apus/*.py over it; this layer only moves requests in and
// results out, releases the GIL while the engine computes and maps the engine's errors.
//
// Python objects never travel inside the engine's requests (their copies are made and dropped
// without the GIL): the callbacks are borrowed for one generate() call, called with the GIL taken,
// and what one raises stops the run and is raised again when generate() returns.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apus/apus.h"
#include "core/cost.h"
#include "core/error.h"
#include "pipeline/metadata.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A flag Python sets from any thread (Ctrl-C's handler, another thread, a callback): the engine
// reads it between ops.
struct Flag {
  std::atomic<bool> value{false};
};

apus::Rgb8Image rgb_image(int width, int height, const nb::bytes& rgb, const char* what) {
  APUS_CHECK(width > 0 && height > 0 && rgb.size() == size_t(width) * size_t(height) * 3, what, ": ", rgb.size(),
             " bytes for ", width, "x", height, " RGB (expected width * height * 3)");
  const auto* p = static_cast<const uint8_t*>(rgb.data());
  return {width, height, std::vector<uint8_t>(p, p + rgb.size())};
}

apus::AudioClip audio_clip(int sample_rate, int channels, const nb::bytes& samples, const char* what) {
  const size_t count = samples.size() / sizeof(float);
  APUS_CHECK(sample_rate > 0 && channels > 0 && samples.size() % sizeof(float) == 0 && count % size_t(channels) == 0,
             what, ": ", samples.size(), " bytes of float32 samples, ", channels, " channels at ", sample_rate, " Hz");
  std::vector<float> values(count);
  std::memcpy(values.data(), samples.data(), samples.size());
  return {sample_rate, channels, std::move(values)};
}

// The first Python exception a callback raised during one generate(): it sets the stop flag, and
// generate() raises it instead of the engine's "cancelled".
struct Raised {
  std::unique_ptr<nb::python_error> error;
  std::atomic<bool>* stop;
  template <typename Call> void guard(Call&& call) {
    if (error) return;
    try {
      call();
    } catch (nb::python_error& e) {
      error = std::make_unique<nb::python_error>(std::move(e));
      *stop = true;
    }
  }
};

// Runs one batch with the GIL released; the callbacks (None or callables, borrowed for the call)
// take it back. progress(line: str); previews[i](step, steps, payload) for output i.
template <typename Model, typename Request, typename Payload>
auto generate(const Model& model, std::vector<Request> requests, nb::object progress, nb::list previews, Flag* stop,
              Flag* finish, Payload&& payload) {
  std::atomic<bool> own{false};
  Raised raised{nullptr, stop ? &stop->value : &own};
  APUS_CHECK(previews.size() == 0 || previews.size() == requests.size(), "previews: ", previews.size(), " for ",
             requests.size(), " requests");
  for (size_t i = 0; i < previews.size(); ++i) {
    PyObject* fn = previews[i].ptr();
    if (fn == Py_None) continue;
    requests[i].preview = [fn, &raised, &payload](const apus::Preview& p) {
      nb::gil_scoped_acquire gil;
      raised.guard([&] { nb::handle{fn}(p.step, p.steps, payload(p)); });
    };
  }
  for (auto& r : requests) r.finish_steps = finish ? &finish->value : nullptr;
  apus::Progress say;
  if (!progress.is_none())
    say = [fn = progress.ptr(), &raised](const std::string& line) {
      nb::gil_scoped_acquire gil;
      raised.guard([&] { nb::handle{fn}(line); });
    };
  using Results = decltype(model.generate_batch(requests, say, raised.stop));
  std::optional<Results> results;
  {
    nb::gil_scoped_release released;
    try {
      results = model.generate_batch(requests, say, raised.stop);
    } catch (const apus::Cancelled&) {
      if (!raised.error) throw;
    }
  }
  if (raised.error) throw std::move(*raised.error);
  return std::make_pair(std::move(requests), std::move(*results));
}

// One batch's outputs with what their files record (the requests' settings), as the CLI writes them.
struct ImageOutputs {
  std::vector<apus::ImageResult> results;
  std::vector<std::vector<std::pair<std::string, std::string>>> metadata;
};
struct AudioOutputs {
  std::vector<apus::AudioResult> results;
  std::vector<apus::AudioMetadata> metadata;
};

template <typename Outputs> const auto& output(const Outputs& o, size_t i) {
  APUS_CHECK(i < o.results.size(), "output ", i, " of ", o.results.size());
  return o.results[i];
}

nb::list stage_times(const std::vector<apus::StageTime>& stages) {
  nb::list out;
  for (const auto& s : stages) out.append(nb::make_tuple(s.name, s.stage, s.seconds));
  return out;
}

// A request's counted cost per stage: what `apus count` and the roofline start from.
nb::dict cost_dict(const apus::PipelineCost& cost) {
  nb::list stages;
  for (const auto& s : cost.stages) {
    nb::dict d;
    d["name"] = s.name;
    d["calls"] = s.calls;
    d["flops"] = s.per_call.flops * double(s.calls);
    d["weight_bytes"] = s.per_call.weight_bytes * double(s.calls);
    d["activation_bytes"] = s.per_call.bytes_fused * double(s.calls);
    d["peak_activation_bytes"] = s.activation_bytes;
    stages.append(d);
  }
  nb::dict d;
  d["model"] = cost.model;
  d["parameters"] = cost.parameters;
  d["samples"] = cost.samples;
  d["stages"] = stages;
  return d;
}

apus::Weights weights_named(const std::string& name) {
  if (name == "resident") return apus::Weights::resident;
  if (name == "per_stage") return apus::Weights::per_stage;
  if (name == "none") return apus::Weights::none;
  apus::fail("weights=\"", name, "\": expected \"resident\", \"per_stage\" or \"none\"");
}

apus::Quant quant_named(const std::optional<std::string>& name) {
  if (!name) return apus::Quant::none;
  if (*name == "int8") return apus::Quant::int8;
  if (*name == "q8_0") return apus::Quant::q8_0;
  if (*name == "fp8") return apus::Quant::fp8;
  apus::fail("quant=\"", *name, "\": expected None, \"int8\", \"q8_0\" or \"fp8\"");
}

apus::ModelParts parts(const std::string& model, const std::string& text_encoder, const std::string& vae,
                       const std::string& tokenizer, const std::string& config,
                       const std::optional<std::string>& quant) {
  return {model, text_encoder, vae, tokenizer, config, quant_named(quant)};
}

// What both families' models and outputs bind alike: opening (the CLI's --model and its parts),
// the model's names and defaults and its count; each output's seed, stage times and trace.
template <typename Model, typename Request>
nb::class_<Model> bind_model(nb::module_& m, const char* name, const char* doc) {
  return nb::class_<Model>(m, name, doc)
      .def_static(
          "open",
          [](const std::string& model, const std::string& text_encoder, const std::string& vae,
             const std::string& tokenizer, const std::string& config, std::optional<std::string> quant,
             const std::string& weights, const std::string& device) {
            const auto p = parts(model, text_encoder, vae, tokenizer, config, quant);
            const apus::Weights w = weights_named(weights);
            nb::gil_scoped_release released;
            return Model::open(p, w, device);
          },
          "model"_a, "text_encoder"_a = "", "vae"_a = "", "tokenizer"_a = "", "config"_a = "", "quant"_a = nb::none(),
          "weights"_a = "resident", "device"_a = "cpu")
      .def_prop_ro("label", &Model::label)
      .def_prop_ro("sampler", &Model::sampler)
      .def_prop_ro("default_steps", &Model::default_steps)
      .def_prop_ro("default_cfg", &Model::default_cfg)
      .def(
          "count", [](const Model& model, const Request& r, int batch) { return cost_dict(model.count(r, batch)); },
          "request"_a, "batch"_a = 1, "The request's counted FLOPs and bytes per stage, without computing it.");
}

template <typename Outputs> nb::class_<Outputs> bind_outputs(nb::module_& m, const char* name, const char* doc) {
  return nb::class_<Outputs>(m, name, doc)
      .def("__len__", [](const Outputs& o) { return o.results.size(); })
      .def(
          "seed", [](const Outputs& o, size_t i) { return output(o, i).seed; }, "index"_a)
      .def(
          "stages", [](const Outputs& o, size_t i) { return stage_times(output(o, i).stages); }, "index"_a,
          "(name, counted stage, seconds) of what ran.")
      .def(
          "trace", [](const Outputs& o, size_t i) { return output(o, i).trace; }, "index"_a);
}

void bind_image(nb::module_& m) {
  nb::class_<apus::ImageRequest>(m, "ImageRequest", "One image request; unset settings take the model's defaults.")
      .def(nb::init<>())
      .def_rw("prompt", &apus::ImageRequest::prompt)
      .def_rw("width", &apus::ImageRequest::width)
      .def_rw("height", &apus::ImageRequest::height)
      .def_rw("steps", &apus::ImageRequest::steps)
      .def_rw("cfg", &apus::ImageRequest::cfg)
      .def_rw("negative_prompt", &apus::ImageRequest::negative_prompt)
      .def_rw("seed", &apus::ImageRequest::seed)
      .def_rw("noise_index", &apus::ImageRequest::noise_index)
      .def_rw("noise_file", &apus::ImageRequest::noise_file)
      .def_rw("fp32", &apus::ImageRequest::fp32)
      .def_rw("trace", &apus::ImageRequest::trace)
      .def(
          "add_reference",
          [](apus::ImageRequest& r, int width, int height, nb::bytes rgb) {
            r.references.push_back(rgb_image(width, height, rgb, "image"));
          },
          "width"_a, "height"_a, "rgb"_a, "A reference image (editing), 8-bit RGB rows top to bottom.")
      .def(
          "set_inpaint",
          [](apus::ImageRequest& r, int width, int height, nb::bytes rgb, int mask_width, int mask_height,
             nb::bytes mask, double strength) {
            r.inpaint = apus::Inpainting{rgb_image(width, height, rgb, "image"),
                                         rgb_image(mask_width, mask_height, mask, "mask_image"), strength};
          },
          "width"_a, "height"_a, "rgb"_a, "mask_width"_a, "mask_height"_a, "mask_rgb"_a, "strength"_a,
          "Repaints the image where the mask is white (Flux2KleinInpaintPipeline).")
      .def(
          "add_lora",
          [](apus::ImageRequest& r, std::string file, float scale) {
            r.loras.push_back({file, scale});
          },
          "file"_a, "scale"_a = 1.0f);

  bind_outputs<ImageOutputs>(m, "ImageOutputs", "A batch's images.")
      .def(
          "rgb",
          [](const ImageOutputs& o, size_t i) {
            const auto& r = output(o, i);
            return nb::make_tuple(r.width, r.height, nb::bytes(r.rgb.data(), r.rgb.size()));
          },
          "index"_a, "(width, height, RGB bytes) of output `index`.")
      .def(
          "steps_run", [](const ImageOutputs& o, size_t i) { return output(o, i).steps_run; }, "index"_a)
      .def(
          "write",
          [](const ImageOutputs& o, size_t i, const std::string& path, int quality) {
            apus::write_image_file(path, output(o, i), o.metadata[i], quality);
          },
          "index"_a, "path"_a, "quality"_a = 90,
          "Writes output `index` as `apus image -o` does (.png, .jpg, .webp; the settings in its metadata).");

  bind_model<apus::ImageModel, apus::ImageRequest>(m, "ImageModel",
                                                   "A FLUX.2 [klein] model, open for requests from any thread.")
      .def_prop_ro("takes_guidance", &apus::ImageModel::takes_guidance)
      .def(
          "generate",
          [](const apus::ImageModel& model, std::vector<apus::ImageRequest> requests, nb::object progress,
             nb::list previews, Flag* stop, Flag* finish) {
            auto [asked, results] =
                generate(model, std::move(requests), progress, previews, stop, finish, [](const apus::Preview& p) {
                  return nb::make_tuple(p.image.width, p.image.height,
                                        nb::bytes(p.image.rgb.data(), p.image.rgb.size()));
                });
            auto out = std::make_unique<ImageOutputs>();
            for (size_t i = 0; i < asked.size(); ++i)
              out->metadata.push_back(apus::image_metadata(asked[i], results[i], model));
            out->results = std::move(results);
            return out;
          },
          "requests"_a, "progress"_a = nb::none(), "previews"_a = nb::list(), "stop"_a = nb::none(),
          "finish"_a = nb::none(),
          "Renders the requests as one batch with the GIL released. progress(line) after each stage and step; "
          "previews[i](step, steps, (width, height, rgb)) after each step of output i; stop ends the run between "
          "two ops (apus.Cancelled), finish ends the sampling after the current step.");
}

void bind_audio(nb::module_& m) {
  nb::class_<apus::AudioRequest>(m, "AudioRequest", "One audio request; unset settings take the model's defaults.")
      .def(nb::init<>())
      .def_rw("prompt", &apus::AudioRequest::prompt)
      .def_rw("seconds", &apus::AudioRequest::seconds)
      .def_rw("steps", &apus::AudioRequest::steps)
      .def_rw("seed", &apus::AudioRequest::seed)
      .def_rw("fp32", &apus::AudioRequest::fp32)
      .def_rw("chunked_decode", &apus::AudioRequest::chunked_decode)
      .def_rw("cfg", &apus::AudioRequest::cfg)
      .def_rw("apg", &apus::AudioRequest::apg)
      .def_rw("negative_prompt", &apus::AudioRequest::negative_prompt)
      .def_rw("init_noise_level", &apus::AudioRequest::init_noise_level)
      .def_rw("inpaint_regions", &apus::AudioRequest::inpaint_regions)
      .def_rw("trace", &apus::AudioRequest::trace)
      .def(
          "set_init_audio",
          [](apus::AudioRequest& r, int sample_rate, int channels, nb::bytes samples) {
            r.init_audio = audio_clip(sample_rate, channels, samples, "init_audio");
          },
          "sample_rate"_a, "channels"_a, "samples"_a,
          "Interleaved frames x channels float32 samples in [-1, 1], as bytes.")
      .def(
          "set_inpaint_audio",
          [](apus::AudioRequest& r, int sample_rate, int channels, nb::bytes samples) {
            r.inpaint_audio = audio_clip(sample_rate, channels, samples, "inpaint_audio");
          },
          "sample_rate"_a, "channels"_a, "samples"_a)
      .def(
          "add_lora",
          [](apus::AudioRequest& r, std::string file, float scale) {
            r.loras.push_back({file, scale});
          },
          "file"_a, "scale"_a = 1.0f);

  bind_outputs<AudioOutputs>(m, "AudioOutputs", "A batch's clips.")
      .def(
          "samples",
          [](const AudioOutputs& o, size_t i) {
            const auto& r = output(o, i);
            return nb::make_tuple(
                r.sample_rate, r.channels,
                nb::bytes(reinterpret_cast<const char*>(r.samples.data()), r.samples.size() * sizeof(float)));
          },
          "index"_a, "(sample rate, channels, interleaved float32 samples as bytes) of output `index`.")
      .def(
          "write",
          [](const AudioOutputs& o, size_t i, const std::string& path) {
            apus::write_audio_file(path, output(o, i), o.metadata[i]);
          },
          "index"_a, "path"_a, "Writes output `index` as `apus audio -o` does (.wav 16-bit or .flac).");

  bind_model<apus::AudioModel, apus::AudioRequest>(m, "AudioModel",
                                                   "A Stable Audio 3 model, open for requests from any thread.")
      .def_prop_ro("max_seconds", &apus::AudioModel::max_seconds)
      .def_prop_ro("default_seconds", &apus::AudioModel::default_seconds)
      .def(
          "generate",
          [](const apus::AudioModel& model, std::vector<apus::AudioRequest> requests, nb::object progress,
             nb::list previews, Flag* stop, Flag* finish) {
            auto [asked, results] = generate(model, std::move(requests), progress, previews, stop, finish,
                                             [](const apus::Preview& p) { return std::vector<float>(p.peaks); });
            auto out = std::make_unique<AudioOutputs>();
            for (size_t i = 0; i < asked.size(); ++i)
              out->metadata.push_back(apus::audio_metadata(asked[i], results[i], model, apus::kClipsBySetting));
            out->results = std::move(results);
            return out;
          },
          "requests"_a, "progress"_a = nb::none(), "previews"_a = nb::list(), "stop"_a = nb::none(),
          "finish"_a = nb::none(), "As ImageModel.generate; previews[i](step, steps, peaks) with (min, max) pairs.");
}

}  // namespace

NB_MODULE(_apus, m) {
  m.doc() = "apus's engine (include/apus/apus.h); the pipelines are in the apus package.";
  m.def("version", [] { return std::string(apus::version()); });
  m.def("peak_rss_bytes", &apus::peak_rss_bytes);

  // apus.Error carries the engine's one-line message; Cancelled is a stop flag's end.
  // Held for the interpreter's life (never released: a static object would be released after it).
  static PyObject* error = PyErr_NewExceptionWithDoc(
      "apus.Error", "A request, a file or the model was wrong: the message says what.", PyExc_ValueError, nullptr);
  static PyObject* cancelled =
      PyErr_NewExceptionWithDoc("apus.Cancelled", "A stop flag ended the run.", error, nullptr);
  m.attr("Error") = nb::handle(error);
  m.attr("Cancelled") = nb::handle(cancelled);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const apus::Cancelled& e) {
      PyErr_SetString(cancelled, e.what());
    } catch (const apus::Error& e) {
      PyErr_SetString(error, e.what());
    }
  });

  nb::class_<Flag>(m, "Flag", "A flag the engine reads between ops; set it from any thread.")
      .def(nb::init<>())
      .def("set", [](Flag& f) { f.value = true; })
      .def("is_set", [](const Flag& f) { return f.value.load(); });

  bind_image(m);
  bind_audio(m);
}
