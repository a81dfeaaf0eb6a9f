// OpenAI's image routes (generations, and edits as a multipart form) and the audio route shaped
// like them.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string_view>

#include "core/error.h"
#include "io/media/audio.h"
#include "io/media/image.h"
#include "io/media/png.h"
#include "io/media/resize.h"
#include "pipeline/metadata.h"
#include "pipeline/stage.h"
#include "server/bodies.h"
#include "server/ranks.h"
#include "server/server_impl.h"

namespace apus::server {

namespace {

// OpenAI's output_compression as the encoder's quality (libjpeg's least is 1).
int output_quality(const Fields& f, ImageFormat format) {
  const int quality = int(f.integer("output_compression", 100, 0, 100));
  return format == ImageFormat::jpeg ? std::max(quality, 1) : quality;
}

// A1111's images.resize_image for img2img, LANCZOS throughout: resize_mode 0 stretches the image
// to the sides; 1 ("crop and resize") scales it to cover them keeping its aspect and pastes it
// centred on them, the overhang cut.
Rgb8Image a1111_resized(const Rgb8Image& image, int width, int height, bool crop) {
  if (!crop) return resize_lanczos(image, width, height);
  const double ratio = double(width) / height, source_ratio = double(image.width) / image.height;
  const int w = ratio > source_ratio ? width : image.width * height / image.height;
  const int h = ratio <= source_ratio ? height : image.height * width / image.width;
  return pasted(resize_lanczos(image, w, h), width, height, width / 2 - w / 2, height / 2 - h / 2);
}

// A float setting as the number the client wrote (0.7, not 0.699999988 of its float).
double as_written(float v) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, v).ptr;
  return std::strtod(std::string(text, end).c_str(), nullptr);
}

// What an image request ran with, as the jobs API takes it back ("reuse" on the page); the
// images it was given are not kept.
Json image_params(const ImageRequest& r, const ImageResult& res) {
  Json p = {{"prompt", r.prompt},
            {"size", std::to_string(res.width) + "x" + std::to_string(res.height)},
            {"steps", res.steps},
            {"seed", res.seed}};
  if (r.cfg) p["cfg"] = as_written(*r.cfg);
  if (r.negative_prompt) p["negative_prompt"] = *r.negative_prompt;
  if (r.inpaint) p["strength"] = r.inpaint->strength;
  if (!r.loras.empty()) {
    p["loras"] = Json::array();
    for (const Lora& l : r.loras)
      p["loras"].push_back(
          {{"name", std::filesystem::path(l.file).filename().string()}, {"scale", as_written(l.scale)}});
  }
  return p;
}

Json audio_params(const AudioRequest& r, const AudioResult& res) {
  Json p = {{"prompt", r.prompt},
            {"seconds", double(res.samples.size()) / std::max(1, res.channels * res.sample_rate)},
            {"seed", res.seed}};
  if (r.steps) p["steps"] = *r.steps;
  if (r.cfg) p["cfg"] = as_written(*r.cfg);
  if (r.negative_prompt) p["negative_prompt"] = *r.negative_prompt;
  return p;
}

// The bytes of a file sent as base64 in a JSON field (`what` names it in errors).
std::string base64_file(const Json& value, const std::string& what, const char* param, const char* kind) {
  const std::optional<std::string> bytes = value.is_string() ? unbase64(value.get<std::string>()) : std::nullopt;
  if (!bytes || bytes->empty()) refuse(400, "'" + what + "' must be " + kind + " file as base64", param);
  return *bytes;
}

// A request's file read (its header checked, or decoded as its job runs); a refusal names the
// field it came in, for the answer's "param".
template <typename Read> auto read_field(const std::string& field, Read read) {
  try {
    return read();
  } catch (const Error& e) {
    throw FieldError(e.what(), field);
  }
}

// OpenAI's edits mask: a PNG whose fully transparent pixels mark the area to edit, as the
// white of a diffusers mask.
Rgb8Image openai_mask(const std::string& bytes, const std::string& what) {
  PngImage png;
  try {
    png = decode_png(bytes, what, /*with_alpha=*/true);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (OpenAI's mask is a PNG with transparency)");
  }
  Rgb8Image white{png.width, png.height, std::vector<uint8_t>(png.rgb.size())};
  bool any = false;
  for (size_t i = 0; i < png.alpha.size(); ++i) {
    const uint8_t v = png.alpha[i] == 0 ? 255 : 0;
    any |= v != 0;
    std::memset(&white.rgb[3 * i], v, 3);
  }
  APUS_CHECK(any, "'mask' has no fully transparent pixel: OpenAI's mask marks the area to edit with alpha 0");
  return white;
}

// What a route calls the engine's field `field`.
std::string route_name(const FieldNames& names, const std::string& field) {
  const auto it = names.find(field);
  return it == names.end() ? field : it->second;
}

// Image files refused from their headers alone, before anything is decoded: what does not open,
// and more pixels than the decoders take.
void check_image_headers(const ImageFiles& files, const FieldNames& names) {
  const std::string images = route_name(names, "images");
  for (size_t i = 0; i < files.images.size(); ++i)
    read_field(images, [&] { return probe_image(files.images[i], images + "[" + std::to_string(i) + "]"); });
  if (files.mask) read_field("mask", [&] { return probe_image(*files.mask, "mask"); });
}

}  // namespace

std::shared_ptr<Job> Server::Impl::openai_image_job(const Json& body, ImageFiles files, bool trace) {
  const Fields f{body};
  f.only({"model",
          "prompt",
          "n",
          "size",
          "response_format",
          "seed",
          "steps",
          "cfg",
          "negative_prompt",
          "images",
          "mask",
          "strength",
          "loras",
          "user",
          "quality",
          "style",
          "output_format",
          "output_compression",
          "background",
          "moderation",
          "stream",
          "partial_images"});
  const Loaded& m = find(f, ModelKind::image);
  ImageRequest r;
  r.prompt = f.prompt();
  const int n = f.setting("n").value_or(1);
  if (f.has("images")) {
    const Json& images = body["images"];
    if (!images.is_array() || images.empty() || images.size() > kMaxReferences)
      refuse(400, "'images' must be a list of 1 to " + std::to_string(kMaxReferences) + " base64 images", "images");
    for (size_t i = 0; i < images.size(); ++i)
      files.images.push_back(base64_file(images[i], "images[" + std::to_string(i) + "]", "images", "an image"));
  }
  if (f.has("mask")) files.mask = base64_file(body["mask"], "mask", "mask", "an image");
  if (files.images.size() > kMaxReferences)
    refuse(400, "at most " + std::to_string(kMaxReferences) + " images, not " + std::to_string(files.images.size()),
           "images");
  // Inpainting: the mask (white repaints, as diffusers' mask_image) applies to the first image,
  // as OpenAI's edits apply theirs; a second image is the reference for the repainted area.
  if (files.mask) {
    if (files.images.empty()) refuse(400, "'mask' repaints the first of 'images', and there are none", "mask");
    if (files.images.size() > 2)
      refuse(400, "with 'mask', 'images' holds the image to repaint and at most one reference", "images");
    files.strength = f.number("strength", files.strength);
  } else if (f.has("strength")) {
    refuse(400, "'strength' is for inpainting, with 'mask'", "strength");
  }
  const bool sized_by_image = !files.images.empty();
  const std::string size = f.string("size", sized_by_image ? "auto" : "1024x1024");
  if (size != "auto") {
    // Two whole numbers; what they may be is the engine's to say.
    const size_t x = size.find('x');
    auto whole = [](std::string_view text, int& v) {
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      return !text.empty() && ec == std::errc() && end == text.data() + text.size();
    };
    int w = 0, h = 0;
    if (x == std::string::npos || !whole(std::string_view(size).substr(0, x), w) ||
        !whole(std::string_view(size).substr(x + 1), h))
      refuse(400, "'size' is \"" + size + "\", expected WxH (or auto: the first image's)", "size");
    r.width = w;
    r.height = h;
  } else if (!sized_by_image) {
    refuse(400, "'size' auto takes the first of 'images', and there are none", "size");
  }
  r.steps = f.setting("steps");
  r.seed = f.seed();
  if (f.has("cfg")) r.cfg = float(f.number("cfg", 0.0));
  if (f.has("negative_prompt")) r.negative_prompt = f.string("negative_prompt", "");
  if (f.has("loras")) r.loras = requested_loras(body["loras"]);
  r.trace = trace;
  const std::string format = f.string("response_format", "b64_json");
  if (format != "b64_json" && format != "url")
    refuse(400, "'response_format' is \"" + format + "\", expected b64_json or url", "response_format");
  try {
    files.format = image_format_named(f.string("output_format", "png"), "output_format");
  } catch (const Error& e) {
    refuse(400, e.what(), "output_format");
  }
  files.quality = output_quality(f, files.format);
  // OpenAI's other image fields: accepted where apus has nothing to change (quality, style,
  // moderation, a PNG's compression), refused where it would change the image.
  if (f.string("background", "auto") != "auto" && f.string("background", "auto") != "opaque")
    refuse(400, "'background' transparent is not supported (the models render opaque images)", "background");
  return image_job(m, std::move(r), n, std::move(files), kOpenAiImageFields);
}

std::vector<std::string> Server::Impl::lora_names() const {
  std::vector<std::string> names;
  if (options.lora_dir.empty()) return names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(options.lora_dir, ec))
    if (e.is_regular_file(ec) && e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<Lora> Server::Impl::requested_loras(const Json& list) const {
  if (!list.is_array() || list.size() > kMaxLoras)
    refuse(400, "'loras' must be a list of at most " + std::to_string(kMaxLoras) + " {\"name\", \"scale\"}", "loras");
  if (options.lora_dir.empty() && !list.empty())
    refuse(400, "this server offers no LoRAs (started without --lora-dir)", "loras");
  const std::vector<std::string> offered = lora_names();
  std::vector<Lora> loras;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = "loras[" + std::to_string(i) + "]";
    const Json& entry = list[i];
    if (!entry.is_object()) refuse(400, "'" + at + "' must be an object {\"name\", \"scale\"}", "loras");
    const Fields f{entry};
    f.only({"name", "scale"});
    const std::string name = f.string("name", "");
    // Only the listed file names: no path, no other folder, nothing the listing does not show.
    if (std::find(offered.begin(), offered.end(), name) == offered.end())
      refuse(400, "'" + at + ".name' is \"" + name + "\", not one of the server's LoRAs (GET /v1/loras)", "loras");
    const double scale = f.number("scale", 1.0);
    if (!std::isfinite(scale) || std::abs(scale) > 100)
      refuse(400, "'" + at + ".scale' must be a number in -100..100", "loras");
    loras.push_back({options.lora_dir + "/" + name, float(scale)});
  }
  return loras;
}

std::shared_ptr<Job> Server::Impl::image_job(const Loaded& m, ImageRequest r, int n, ImageFiles files,
                                             FieldNames names) {
  refuse_if_full(m);
  check_image_headers(files, names);
  // With image files, whose sizes decide what the request needs, the memory admission runs as
  // the job starts, once they are decoded.
  admit(names, [&] {
    const PipelineCost cost = m.model.image()->count(r, n);
    if (files.images.empty()) check_memory(cost, true, "this request");
    check_time(cost);
  });
  auto job = std::make_shared<Job>();
  job->model = m.id;
  job->kind = "image";
  job->traced = r.trace;
  const ImageModel* model = m.model.image();
  Ranks* ranks = options.ranks;
  const size_t index = size_t(&m - models.data());
  job->work = [model, ranks, index, r, n, files = std::move(files), names](Job& j) mutable {
    const std::string images = route_name(names, "images");
    for (size_t i = 0; i < files.images.size(); ++i)
      r.references.push_back(
          read_field(images, [&] { return decode_image(files.images[i], images + "[" + std::to_string(i) + "]"); }));
    files.images.clear();
    if (files.mask || files.repaint_whole) {
      const Rgb8Image& image = r.references.front();
      Rgb8Image mask{image.width, image.height, std::vector<uint8_t>(image.rgb.size(), 255)};
      if (files.mask)
        mask = read_field("mask", [&] {
          if (files.marks == MaskMarks::transparent) return openai_mask(*files.mask, "mask");
          Rgb8Image m = decode_image(*files.mask, "mask");
          if (files.marks == MaskMarks::black)
            for (uint8_t& v : m.rgb) v = uint8_t(255 - v);
          return m;
        });
      Rgb8Image image_to_paint = std::move(r.references.front());
      if (files.resize_to &&
          (image_to_paint.width != files.resize_to->first || image_to_paint.height != files.resize_to->second)) {
        image_to_paint = a1111_resized(image_to_paint, files.resize_to->first, files.resize_to->second, files.crop);
        mask = a1111_resized(mask, files.resize_to->first, files.resize_to->second, files.crop);
      }
      r.inpaint = Inpainting{std::move(image_to_paint), std::move(mask), files.strength};
      r.references.erase(r.references.begin());
    }
    r.finish_steps = &j.finish;
    std::vector<ImageRequest> batch = batch_of(r, n);
    if (j.previews)
      for (size_t i = 0; i < batch.size(); ++i) batch[i].preview = preview_sink(j, int(i));
    std::vector<JobOutput> out;
    std::string split;
    const std::vector<ImageResult> results = as_route(names, [&] {
      if (ranks)
        return ranks->image(
            index, *model, batch, [&](const std::string& l) { j.note_step(l); }, &j.cancel, split);
      return model->generate_batch(
          batch, [&](const std::string& l) { j.progress(l); }, &j.cancel);
    });
    for (const StageTime& t : results.front().stages)
      j.stages.emplace_back(t.stage.empty() ? t.name : t.stage, t.seconds);
    j.keep_trace(results.front().trace);
    {
      std::lock_guard<std::mutex> lock(j.mutex);
      j.params = image_params(batch.front(), results.front());
      j.split = split;
    }
    for (size_t i = 0; i < results.size(); ++i) {
      const ImageResult& res = results[i];
      out.push_back({encode_image(files.format, Rgb8Image{res.width, res.height, res.rgb}, files.quality,
                                  image_metadata(batch[i], res, *model), "image"),
                     image_mime_type(files.format), res.seed});
    }
    return out;
  };
  return job;
}

std::shared_ptr<Job> Server::Impl::audio_job(const Json& body, std::string& format_name, bool trace) {
  const Fields f{body};
  f.only({"model", "prompt", "seconds", "seed", "steps", "format", "negative_prompt", "cfg", "apg", "init_audio",
          "init_noise_level", "inpaint_audio", "inpaint_regions", "loras"});
  const Loaded& m = find(f, ModelKind::audio);
  AudioRequest r;
  r.prompt = f.prompt();
  if (f.has("seconds")) r.seconds = f.number("seconds", 0.0);
  r.steps = f.setting("steps");
  r.seed = f.seed();
  if (f.has("cfg")) r.cfg = float(f.number("cfg", 0.0));
  r.apg = float(f.number("apg", r.apg));
  r.trace = trace;
  if (f.has("negative_prompt")) r.negative_prompt = f.string("negative_prompt", "");
  if (f.has("loras")) r.loras = requested_loras(body["loras"]);
  // Audio-to-audio and inpainting: the clips as base64 files (any rate libsndfile reads),
  // decoded on the model's worker as the job starts.
  std::optional<std::string> init_file, inpaint_file;
  if (f.has("init_audio")) init_file = base64_file(body["init_audio"], "init_audio", "init_audio", "an audio");
  if (f.has("init_noise_level")) r.init_noise_level = f.number("init_noise_level", 0.0);
  if (f.has("inpaint_audio"))
    inpaint_file = base64_file(body["inpaint_audio"], "inpaint_audio", "inpaint_audio", "an audio");
  if (f.has("inpaint_regions")) {
    const Json& regions = body["inpaint_regions"];
    if (!regions.is_array()) refuse(400, "'inpaint_regions' must be a list of [start, end] seconds", "inpaint_regions");
    for (const Json& region : regions) {
      if (!region.is_array() || region.size() != 2 || !region[0].is_number() || !region[1].is_number())
        refuse(400, "'inpaint_regions' must be a list of [start, end] seconds", "inpaint_regions");
      r.inpaint_regions.emplace_back(region[0].get<double>(), region[1].get<double>());
    }
  }
  format_name = f.string("format", "wav");
  AudioFormat format;
  try {
    format = parse_audio_format(format_name);
  } catch (const Error& e) {
    refuse(400, e.what(), "format");
  }
  refuse_if_full(m);
  // (Not structured bindings: clang 14, the sanitizer builds' compiler, cannot capture them.)
  for (const auto& clip : {std::pair{&init_file, "init_audio"}, std::pair{&inpaint_file, "inpaint_audio"}}) {
    const auto* file = clip.first;
    const char* name = clip.second;
    if (*file) read_field(name, [&] { return probe_audio(**file, name, m.model.audio()->max_seconds()); });
  }
  // The clips' samples change nothing the engine checks or counts: empty ones stand in for the
  // files, decoded as the job starts.
  AudioRequest counted = r;
  if (init_file) counted.init_audio = AudioClip{};
  if (inpaint_file) counted.inpaint_audio = AudioClip{};
  admit(kAudioFields, [&] {
    const PipelineCost cost = m.model.audio()->count(counted);
    check_memory(cost, true, "this request");
    check_time(cost);
  });
  auto job = std::make_shared<Job>();
  job->model = m.id;
  job->kind = "audio";
  job->traced = trace;
  const AudioModel* model = m.model.audio();
  Ranks* ranks = options.ranks;
  const size_t index = size_t(&m - models.data());
  job->work = [model, ranks, index, r, format, init_file, inpaint_file](Job& j) mutable {
    auto clip = [model](const std::string& bytes, const char* name) {
      Audio a = read_field(name, [&] { return decode_audio(bytes, name, model->max_seconds()); });
      return AudioClip{a.rate, a.channels, std::move(a.samples)};
    };
    if (init_file) r.init_audio = clip(*init_file, "init_audio");
    if (inpaint_file) r.inpaint_audio = clip(*inpaint_file, "inpaint_audio");
    if (j.previews) r.preview = preview_sink(j, 0);
    std::string split;
    const AudioResult res =
        ranks ? ranks
                    ->audio(
                        index, *model, {r}, [&](const std::string& l) { j.note_step(l); }, &j.cancel, split)
                    .front()
              : model->generate(
                    r, [&](const std::string& l) { j.progress(l); }, &j.cancel);
    for (const StageTime& t : res.stages) j.stages.emplace_back(t.stage.empty() ? t.name : t.stage, t.seconds);
    j.keep_trace(res.trace);
    {
      std::lock_guard<std::mutex> lock(j.mutex);
      j.params = audio_params(r, res);
      j.split = split;
    }
    const Audio a{res.sample_rate, res.channels, res.samples};
    return std::vector<JobOutput>{{encode_audio(a, format, audio_metadata(r, res, *model, kClipsBySetting), "clip"),
                                   audio_mime_type(format), res.seed}};
  };
  return job;
}

void Server::Impl::respond_images(const http::Request& req, http::Response& res, const std::shared_ptr<Job>& j,
                                  bool urls) {
  submit(j);
  wait_for_client(req, *j);
  // With urls the job stays kept, as an asynchronous job's results are, for its files' routes.
  if (urls) fail_job(*j);
  else finish_sync(*j);
  Json data = Json::array();
  // A url names the job's kept file (GET /v1/jobs/{id}/files/{n}) on the host the client called.
  const std::string host = req.header("Host").empty() ? "127.0.0.1" : req.header("Host");
  for (size_t i = 0; i < j->outputs.size(); ++i) {
    const JobOutput& o = j->outputs[i];
    if (urls)
      data.push_back(
          {{"url", "http://" + host + "/v1/jobs/" + j->id + "/files/" + std::to_string(i)}, {"seed", o.seed}});
    else data.push_back({{"b64_json", base64(o.bytes)}, {"seed", o.seed}});
  }
  res.set_content(dump(Json{{"created", int64_t(std::time(nullptr))}, {"data", data}}), "application/json");
}

namespace {

// A live preview (a PNG at 1/8 of the image's sides, include/apus/apus.h's Preview) as OpenAI's
// partial image: at the image's size, each preview pixel an 8x8 block, in the request's format.
std::string partial_image(const std::string& preview_png, ImageFormat format, int quality) {
  const Rgb8Image preview = decode_image(unbase64(preview_png).value_or(""), "a preview");
  const Rgb8Image full = resize_nearest(preview, preview.width * 8, preview.height * 8);
  return base64(encode_image(format, full, quality, {}, "a partial image"));
}

}  // namespace

void Server::Impl::stream_image(http::Response& res, const std::shared_ptr<Job>& j, int partials,
                                const std::string& format, const std::string& size, int quality) {
  const ImageFormat image_format = image_format_named(format, "output_format");
  j->previews = partials > 0;
  submit(j);
  struct Sent {
    int previews = 0, partials = 0;
    bool over = false;
  };
  auto sent = std::make_shared<Sent>();
  res.set_header("Cache-Control", "no-cache");
  res.content_type = "text/event-stream";
  res.stream = http::Stream{
      [this, j, sent, partials, format, size, image_format, quality]() -> std::optional<std::string> {
        if (sent->over) return std::nullopt;
        std::string events;
        auto event = [&](const char* type, Json data) {
          data["type"] = type;
          data["created_at"] = int64_t(std::time(nullptr));
          data["size"] = size;
          data["output_format"] = format;
          events += std::string("event: ") + type + "\ndata: " + dump(data) + "\n\n";
        };
        {
          std::lock_guard<std::mutex> lock(j->mutex);
          // Partial i once the steps pass (i + 1) / (partials + 1) of the way: the latest live
          // preview (previews that came between two looks count once: the last step's passes
          // every mark, so all partials precede the image).
          if (j->preview_count != sent->previews && sent->partials < partials) {
            sent->previews = j->preview_count;
            const Json p = Json::parse(j->preview, nullptr, false);
            while (p.is_object() && p.contains("image") && sent->partials < partials &&
                   p.value("step", 0) * (partials + 1) >= (sent->partials + 1) * p.value("steps", 1)) {
              event("image_generation.partial_image", {{"b64_json", partial_image(p["image"], image_format, quality)},
                                                       {"partial_image_index", sent->partials}});
              ++sent->partials;
            }
          }
          if (j->state == JobState::done) {
            event("image_generation.completed",
                  {{"b64_json", base64(j->outputs.front().bytes)}, {"seed", j->outputs.front().seed}});
            sent->over = true;
          } else if (j->state == JobState::failed || j->state == JobState::cancelled) {
            const std::string message =
                j->state == JobState::failed ? public_message(j->error) : "the job was cancelled";
            events +=
                "event: error\ndata: " + dump(Json{{"type", "error"}, {"error", {{"message", message}}}}) + "\n\n";
            sent->over = true;
          }
        }
        if (sent->over) drop_kept(*j);
        return events;
      },
      [j] { j->cancel = true; }};
}

// OpenAI's edits take a multipart form: the fields as text, the images as files (image or
// image[], repeatable) in the order sent, the mask a PNG whose transparent pixels repaint.
void Server::Impl::image_edits(const http::Request& req, http::Response& res) {
  std::vector<FormPart> parts;
  try {
    parts = parse_multipart(req.header("Content-Type"), req.body);
  } catch (const Error& e) {
    refuse(400, e.what());
  }
  Json body = Json::object();
  ImageFiles files;
  for (const FormPart& file : parts) {
    const std::string& name = file.name;
    if (name == "image" || name == "image[]") {
      files.images.push_back(file.content);
    } else if (name == "n" || name == "seed" || name == "steps" || name == "output_compression") {
      int64_t v = 0;
      const auto [end, ec] = std::from_chars(file.content.data(), file.content.data() + file.content.size(), v);
      if (ec != std::errc() || end != file.content.data() + file.content.size())
        refuse(400, "'" + name + "' must be an integer", name);
      body[name] = v;
    } else if (name == "cfg" || name == "strength") {
      char* end = nullptr;
      const double v = std::strtod(file.content.c_str(), &end);
      if (file.content.empty() || end != file.content.c_str() + file.content.size())
        refuse(400, "'" + name + "' must be a number", name);
      body[name] = v;
    } else if (name == "mask") {
      files.mask = file.content;
      files.marks = MaskMarks::transparent;
    } else if (name == "images") {
      refuse(400, "the edits form sends its images as 'image' files", "images");
    } else {
      body[name] = file.content;
    }
  }
  if (files.images.empty()) refuse(400, "'image' is required: the image(s) to edit", "image");
  if (body.contains("stream")) refuse(400, "apus streams /v1/images/generations only", "stream");
  const bool urls = Fields{body}.string("response_format", "b64_json") == "url";
  respond_images(req, res, openai_image_job(body, std::move(files)), urls);
}

void Server::Impl::image_generations(const http::Request& req, http::Response& res) {
  const Json body = parse_body(req);
  const Fields f{body};
  const bool urls = f.string("response_format", "b64_json") == "url";
  if (!f.boolean("stream", false)) {
    if (f.has("partial_images"))
      refuse(400, "'partial_images' is for a streamed request (stream: true)", "partial_images");
    return respond_images(req, res, openai_image_job(body, {}), urls);
  }
  if (f.integer("n", 1, 1, ImageLimits::max_batch) != 1) refuse(400, "a streamed request makes one image ('n' 1)", "n");
  if (urls) refuse(400, "a streamed request answers b64_json", "response_format");
  const auto j = openai_image_job(body, {});  // checks every field first
  const std::string format = f.string("output_format", "png");
  stream_image(res, j, int(f.integer("partial_images", 0, 0, 3)), format, f.string("size", "auto"),
               output_quality(f, image_format_named(format, "output_format")));
}

void Server::Impl::audio_generations(const http::Request& req, http::Response& res) {
  std::string format;
  respond_audio(req, res, audio_job(parse_body(req), format));
}

// OpenAI's speech route, the audio call its SDK has (client.audio.speech.create): `input` is the
// prompt of the server's audio model (OpenAI's model names, tts-1 and the like, answer with it),
// `response_format` wav or flac. `voice`, which the SDK requires, names a speaker a text-to-audio
// model does not have: accepted, and it changes nothing, as `quality` on the image routes.
// apus's own fields (seconds, seed, steps, cfg, ...) pass through as on /v1/audio/generations.
void Server::Impl::audio_speech(const http::Request& req, http::Response& res) {
  Json body = parse_body(req);
  const Fields f{body};
  if (!f.has("input")) refuse(400, "'input' is required: what the clip should sound like", "input");
  if (f.has("prompt")) refuse(400, "the speech route takes its prompt as 'input'", "prompt");
  body["prompt"] = body["input"];
  body.erase("input");
  const std::string format = f.string("response_format", "wav");
  if (format != "wav" && format != "flac")
    refuse(400, "'response_format' is \"" + format + "\", expected wav or flac (apus writes those)", "response_format");
  body["format"] = format;
  body.erase("response_format");
  if (f.number("speed", 1.0) != 1.0) refuse(400, "'speed' other than 1 is not supported", "speed");
  if (!f.string("instructions", "").empty())
    refuse(400, "'instructions': put what the clip should sound like in 'input'", "instructions");
  if (f.has("stream_format")) refuse(400, "'stream_format': apus answers the whole clip", "stream_format");
  for (const char* k : {"voice", "speed", "instructions"}) body.erase(k);
  std::string name;
  respond_audio(req, res, audio_job(body, name));
}

void Server::Impl::respond_audio(const http::Request& req, http::Response& res, const std::shared_ptr<Job>& j) {
  run_sync(req, j);
  const JobOutput& o = j->outputs.front();
  res.set_header("X-Seed", std::to_string(o.seed));
  res.set_content(std::string(o.bytes.begin(), o.bytes.end()), o.mime);
}

}  // namespace apus::server
