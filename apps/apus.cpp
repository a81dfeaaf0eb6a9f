// apus command line: `apus image` renders a prompt, `apus audio` generates a clip, `apus roofline`
// counts a request's cost, `apus synth` writes a random-weight checkpoint in the published layout.
#include <pthread.h>
#include <signal.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <tuple>

#include "apus/apus.h"
#include "bench.h"
#include "core/cost.h"
#include "core/error.h"
#include "core/variants.h"
#include "cost/ceiling.h"
#include "cost/roofline.h"
#include "dist/link.h"
#include "dist/memory_check.h"
#include "dist/strategy.h"
#include "dist/world.h"
#include "gate/gate.h"
#include "hub/hf_pull.h"
#include "io/files.h"
#include "io/media/audio.h"
#include "io/media/image.h"
#include "io/media/png.h"
#include "io/weights/quant_weights.h"
#include "io/weights/synth.h"
#include "pipeline/metadata.h"
#include "pipeline/registry.h"
#include "pipeline/split.h"
#include "server/ranks.h"
#include "server/server.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#endif

namespace {

// Lines of progress, as the engine reports them, on stderr.
void say(const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }

// out.png for one image; out-1.png, out-2.png, ... for a batch.
std::string output_name(const std::string& out, int i, int n) {
  if (n == 1) return out;
  const size_t dot = apus::extension_at(out);
  return out.substr(0, dot) + "-" + std::to_string(i + 1) + (dot == std::string::npos ? "" : out.substr(dot));
}

// -v: each stage against its floor on the device that ran it, counted from the same stage code,
// priced at the GEMM rate and bandwidth calibrated there; then the output write and peak memory.
void report_stages(const apus::PipelineCost& cost, const std::vector<apus::StageTime>& stages, const char* write_name,
                   double write_s, const std::string& device) {
  bool cached = false;
  const apus::Chip here = apus::device_ceiling(device, false, &cached);
  const nlohmann::json roof = apus::roofline_json(cost, {here, 1});
  auto floor_of = [&](const std::string& stage) -> double {
    for (const auto& s : roof["stages"])
      if (s["name"] == stage) return s["per_call"]["floor_s"].get<double>();
    return 0;
  };
  std::fprintf(stderr, "floors at %s, this machine's calibration (%s)\n", apus::describe_rates(here).c_str(),
               apus::calibration_file().c_str());
  std::fprintf(stderr, "%-20s %10s %10s %6s\n", "stage", "measured", "floor", "ratio");
  double fastest = 1e30;
  for (const auto& s : stages) {
    const double f = s.stage.empty() ? 0 : floor_of(s.stage);
    if (f > 0) std::fprintf(stderr, "%-20s %8.3f s %8.3f s %5.2fx\n", s.name.c_str(), s.seconds, f, s.seconds / f);
    else std::fprintf(stderr, "%-20s %8.3f s\n", s.name.c_str(), s.seconds);
    if (f > 0 && s.seconds > 0.05) fastest = std::min(fastest, s.seconds / f);
  }
  // A stage can not beat a true floor: a cached calibration this run beat by over 10 % understated
  // the machine (measured while it was busy or throttled) and is measured again next time.
  if (cached && fastest < 0.9) {
    apus::forget_device_ceiling(device);
    std::fprintf(stderr,
                 "a stage ran at %.2fx its floor: the cached calibration understates this machine and is dropped "
                 "(the next run measures again; or `apus calibrate --refresh`)\n",
                 fastest);
  }
  std::fprintf(stderr, "%-20s %8.3f s\n", write_name, write_s);
  std::fprintf(stderr, "peak memory %.2f GiB\n", double(apus::peak_rss_bytes()) / double(1u << 30));
}

// auto under mpirun or srun (dist/strategy.h), rank 0 deciding for every rank at the link rate
// between them (dist/link.h).
template <typename Model, typename Request>
std::string auto_strategy(const Model& model, const Request& r, int batch, const std::string& device, bool verbose) {
  const apus::dist::World& world = apus::dist::World::get();
  const int n = world.size();
  const double link = apus::dist::link_rates(world, apus::backend_for(device)).bps();
  if (world.rank() != 0) return world.broadcast("", "auto's choice");
  apus::Chip here = apus::device_ceiling(device);
  here.link_bps = link;
  const apus::dist::SplitChoice choice =
      apus::dist::cheapest_split(model, r, batch, here, world, "batch", (batch + n - 1) / n);
  if (verbose) std::fprintf(stderr, "--parallel auto: %s\n", choice.describe(n, link).c_str());
  return world.broadcast(choice.best, "auto's choice");
}

// How this process takes part in a command (issue 43): the outputs it renders, how each of its
// requests splits over the ranks, and whether it writes them. One process renders and writes all.
struct RankPlan {
  apus::Share outputs;
  apus::Parallelism split;
  bool writes = true;
};

template <typename Model, typename Request> RankPlan rank_plan(const std::string& parallel, const Model& model,
                                                               const Request& r, int batch, const std::string& device,
                                                               bool verbose) {
  const apus::dist::World& world = apus::dist::World::get();
  if (world.size() == 1) return {{0, batch}, {}, true};
  const std::string strategy = parallel == "auto" ? auto_strategy(model, r, batch, device, verbose) : parallel;
  if (strategy == "none") return world.rank() == 0 ? RankPlan{{0, batch}, {}, true} : RankPlan{{0, 0}, {}, false};
  if (strategy == "batch") return {apus::share_of(batch, world.rank(), world.size()), {}, true};
  // cfg, ulysses and tensor: every rank runs the whole batch, its share of the samples, the tokens
  // or the transformer's features; rank 0 writes.
  const apus::Parallel split = strategy == "cfg"       ? apus::Parallel::cfg
                               : strategy == "ulysses" ? apus::Parallel::ulysses
                                                       : apus::Parallel::tensor;
  return {{0, batch}, {split, &world}, world.rank() == 0};
}

// --parallel as the model opens: under auto over several ranks, "tensor" when one process could
// not hold the request (memory_shortfall), so that each rank loads its share of the weights;
// otherwise as given (auto then picks a split per request: rank_plan).
template <typename Model, typename Request>
std::string fitting_parallel(const std::string& parallel, double rank_memory_gib, const apus::ModelParts& parts,
                             const Request& r, int batch, const std::string& device, bool verbose) {
  const apus::dist::World& world = apus::dist::World::get();
  if (parallel != "auto" || world.size() == 1) return parallel;
  const int here = world.ranks_here();
  if (world.rank() != 0) return world.broadcast("", "auto's memory check");
  const std::string shortfall =
      apus::dist::memory_shortfall(Model::open(parts, apus::Weights::none, device)->count(r, batch), false,
                                   rank_memory_gib, here, apus::backend_for(device));
  if (verbose && !shortfall.empty()) std::fprintf(stderr, "--parallel auto: tensor (%s)\n", shortfall.c_str());
  return world.broadcast(shortfall.empty() ? "auto" : "tensor", "auto's memory check");
}

// serve --parallel auto over several ranks: each model one process could not hold resident (its
// default request's count: memory_shortfall) opens split over the ranks, named on stderr; returns
// which did, in ServeOptions::models' order.
std::vector<bool> open_split_where_needed(std::vector<apus::ModelParts>& models, double rank_memory_gib,
                                          const std::string& device) {
  const apus::dist::World& world = apus::dist::World::get();
  const int here = world.ranks_here();
  std::string flags;
  if (world.rank() == 0)
    for (const apus::ModelParts& parts : models) {
      const apus::AnyModel m = apus::AnyModel::open(parts, apus::Weights::none, device);
      const apus::PipelineCost cost = m.image() ? m.image()->count(apus::ImageRequest{}) : m.audio()->count({});
      const std::string shortfall =
          apus::dist::memory_shortfall(cost, true, rank_memory_gib, here, apus::backend_for(device));
      if (!shortfall.empty())
        std::fprintf(stderr, "serve: %s opens with its weights split over the %d ranks (tensor): %s\n",
                     m.label().c_str(), world.size(), shortfall.c_str());
      flags += shortfall.empty() ? '0' : '1';
    }
  flags = world.broadcast(flags, "auto's memory check");
  std::vector<bool> split;
  for (size_t i = 0; i < models.size(); ++i) {
    split.push_back(flags[i] == '1');
    if (split.back()) models[i].tensor_ranks = &world;
  }
  return split;
}

// The parts as --parallel opens them: under tensor over several ranks, the transformer's weights
// split over them.
apus::ModelParts split_parts(apus::ModelParts parts, const std::string& parallel) {
  const apus::dist::World& world = apus::dist::World::get();
  if (parallel == "tensor" && world.size() > 1) parts.tensor_ranks = &world;
  return parts;
}

// -v under a split: what this rank sent the others against what the count says it sends, and its
// time in the exchanges against what the counted bytes take at the link rate (a collective).
void report_traffic(const apus::PipelineCost& cost, const std::string& device) {
  const apus::dist::World& world = apus::dist::World::get();
  double counted = 0;
  for (const apus::StageCost& s : cost.stages) counted += double(s.calls) * s.sent_bytes;
  const apus::dist::World::Traffic t = world.traffic();
  const double link = apus::dist::link_rates(world, apus::backend_for(device)).bps();
  std::fprintf(stderr,
               "rank %d of %d: %lld exchanges, %.0f bytes sent (counted %.0f), %.3f s in them (the counted bytes take "
               "%.3f s at %.2f GB/s)\n",
               world.rank(), world.size(), (long long)t.calls, t.sent, counted, t.seconds, counted / link, link / 1e9);
}

// Renders this process's part of the batch (rank_plan) and writes its files (named by their place
// in the whole batch).
int run_image(const apus::ModelParts& parts, std::vector<apus::ImageRequest> requests, const std::string& parallel,
              const std::string& out, int quality, bool verbose, const std::string& trace_file,
              const std::string& device) {
  const apus::ImageFormat format = apus::image_format_of_file(out, "-o");
  // One request per process: each stage's weights are mapped for that stage only.
  const auto model = apus::ImageModel::open(split_parts(parts, parallel), apus::Weights::per_stage, device);
  const int batch = int(requests.size());
  const RankPlan plan = rank_plan(parallel, *model, requests.front(), batch, device, verbose);
  const apus::Share share = plan.outputs;
  if (share.count == 0) return 0;
  std::vector<apus::ImageRequest> mine(requests.begin() + share.first, requests.begin() + share.first + share.count);
  for (apus::ImageRequest& r : mine) r.parallel = plan.split;
  const std::vector<apus::ImageResult> results = model->generate_batch(mine, say);
  if (verbose && plan.split.strategy != apus::Parallel::none) report_traffic(model->count(mine.front(), batch), device);
  if (!plan.writes) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < share.count; ++i) {
    const apus::ImageResult& r = results[size_t(i)];
    const std::string name = output_name(out, share.first + i, batch);
    const std::vector<uint8_t> bytes = apus::encode_image(format, apus::Rgb8Image{r.width, r.height, r.rgb}, quality,
                                                          apus::image_metadata(mine[size_t(i)], r, *model), name);
    apus::write_whole_file(name, bytes.data(), bytes.size());
  }
  const double write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (verbose)
    report_stages(model->count(mine.front(), int(share.count)), results.front().stages, "write image", write_s, device);
  if (!trace_file.empty()) apus::write_trace_file(trace_file, results.front().trace);
  for (int i = 0; i < share.count; ++i)
    std::fprintf(stderr, "wrote %s\n", output_name(out, share.first + i, batch).c_str());
  return 0;
}

// A seed as torch takes it: a whole number in 0 .. 2^64 - 1, nothing clamped or wrapped.
uint64_t parse_seed(const std::string& text) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  APUS_CHECK(!text.empty() && ec == std::errc() && end == text.data() + text.size(), "--seed ", text,
             ": expected a whole number in 0..18446744073709551615");
  return v;
}

// --lora FILE[:SCALE]: the scale after the last ':' when it reads as a number (a path may hold
// colons), 1 otherwise.
apus::Lora parse_lora(const std::string& text) {
  apus::Lora lora{text, 1.0f};
  const size_t colon = text.rfind(':');
  if (colon != std::string::npos && colon + 1 < text.size()) {
    const std::string tail = text.substr(colon + 1);
    float scale = 0;
    const auto [end, ec] = std::from_chars(tail.data(), tail.data() + tail.size(), scale);
    const bool number = end == tail.data() + tail.size();
    APUS_CHECK(!number || ec != std::errc::result_out_of_range, "--lora ", text, ": the scale ", tail,
               " is beyond a float's range");
    if (number && ec == std::errc()) lora = {text.substr(0, colon), scale};
  }
  APUS_CHECK(!lora.file.empty(), "--lora ", text, ": expected FILE or FILE:SCALE");
  APUS_CHECK(std::isfinite(lora.scale), "--lora ", text, ": the scale must be a finite number");
  return lora;
}

// The file an option names: an empty name is refused naming the option (the engine's errors name
// the path, and an empty one names nothing).
const std::string& named_file(const std::string& path, const char* flag) {
  APUS_CHECK(!path.empty(), flag, ": an empty file name");
  return path;
}

// Where a result goes when -o names none: outputs/NNNNN<extension> in the current folder (made if
// absent), one past the highest number there, so a run never writes over an earlier one's file.
// Under mpirun, rank 0 names it for every rank.
std::string unnamed_output(const std::string& extension) {
  namespace fs = std::filesystem;
  const apus::dist::World& world = apus::dist::World::get();
  if (world.rank() != 0) return world.broadcast("", "the output's name");
  std::error_code ec;
  fs::create_directories("outputs", ec);
  APUS_CHECK(fs::is_directory("outputs"), "outputs: not a folder and cannot be made one (name the file with -o)");
  long last = 0;
  for (const fs::directory_entry& e : fs::directory_iterator("outputs", ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 5 && std::all_of(name.begin(), name.begin() + 5, [](char c) { return c >= '0' && c <= '9'; }))
      last = std::max(last, std::stol(name.substr(0, 5)));
  }
  char name[48];
  std::snprintf(name, sizeof name, "outputs/%05ld%s", last + 1, extension.c_str());
  return world.broadcast(name, "the output's name");
}

// Every file a run will write can be created, checked before any model loads.
void check_output(const std::string& out, int batch) {
  named_file(out, "-o");
  for (int i = 0; i < batch; ++i) apus::check_writable(output_name(out, i, batch));
}

// Before any model opens under several ranks (issue 43; --parallel: rank_plan): without a seed,
// rank 0 draws one for all, since the ranks of a split must sample the same noise.
template <typename Request> void prepare_ranks(Request& r) {
  const apus::dist::World& world = apus::dist::World::get();
  if (world.size() > 1 && !r.seed)
    r.seed = parse_seed(world.broadcast(std::to_string(std::random_device{}()), "the seed"));
}

// The audio format to write: --format's when given (its extension must agree), else the one -o's
// extension names.
std::string audio_format_for(const std::string& out, const std::string& format) {
  const std::string ext = apus::extension_of(out);
  const std::string implied = ext == ".flac" ? "flac" : ext == ".wav" ? "wav" : "";
  APUS_CHECK(!implied.empty(), "-o ", out, ": apus audio writes .wav or .flac files");
  if (format.empty()) return implied;
  apus::parse_audio_format(format);  // names the formats when this one is none of them
  APUS_CHECK((format == "flac") == (implied == "flac"), "--format ", format, " and -o ", out,
             ": the file's extension names another format");
  return format;
}

// Whether an option was given on the command line (null: the command does not take it).
bool given(const CLI::Option* option) { return option && *option; }

// The value of an option given on the command line; absent otherwise, which the engine reads as
// the model's default.
template <typename T> std::optional<T> if_given(const CLI::Option* option, const T& value) {
  return given(option) ? std::optional<T>(value) : std::nullopt;
}

// Generates this process's share of the batch and writes its files (named by their place in the
// whole batch); clips: the input clips' files, empty where none was given.
int run_audio(const apus::ModelParts& parts, std::vector<apus::AudioRequest> all, const std::string& parallel,
              const apus::ClipNames& clips, const std::string& out, const std::string& format_name, bool verbose,
              const std::string& trace_file, const std::string& device) {
  const int batch = int(all.size());
  const apus::AudioFormat format = apus::parse_audio_format(format_name);
  const auto model = apus::AudioModel::open(split_parts(parts, parallel), apus::Weights::per_stage, device);
  const RankPlan plan = rank_plan(parallel, *model, all.front(), batch, device, verbose);
  const apus::Share share = plan.outputs;
  if (share.count == 0) return 0;
  std::vector<apus::AudioRequest> requests(all.begin() + share.first, all.begin() + share.first + share.count);
  for (apus::AudioRequest& r : requests) r.parallel = plan.split;
  // Read once the model is open: no clip decodes past the longest the model can use.
  auto read_clip = [&](const std::string& path) {
    apus::Audio a = apus::read_audio(path, model->max_seconds());
    return apus::AudioClip{a.rate, a.channels, std::move(a.samples)};
  };
  if (!clips.init.empty()) {
    const apus::AudioClip clip = read_clip(clips.init);
    for (apus::AudioRequest& r : requests) r.init_audio = clip;
  }
  if (!clips.inpaint.empty()) {
    const apus::AudioClip clip = read_clip(clips.inpaint);
    for (apus::AudioRequest& r : requests) r.inpaint_audio = clip;
  }
  const std::vector<apus::AudioResult> results = model->generate_batch(requests, say);
  if (verbose && plan.split.strategy != apus::Parallel::none)
    report_traffic(model->count(requests.front(), batch), device);
  if (!plan.writes) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < share.count; ++i) {
    const apus::AudioRequest& req = requests[size_t(i)];
    const apus::AudioResult& r = results[size_t(i)];
    apus::Audio audio{r.sample_rate, r.channels, r.samples};
    apus::write_audio(output_name(out, share.first + i, batch), audio, format,
                      apus::audio_metadata(req, r, *model, clips));
  }
  const double write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (verbose)
    report_stages(model->count(requests.front(), int(share.count)), results.front().stages, "write audio", write_s,
                  device);
  if (!trace_file.empty()) apus::write_trace_file(trace_file, results.front().trace);
  for (int i = 0; i < share.count; ++i)
    std::fprintf(stderr, "wrote %s\n", output_name(out, share.first + i, batch).c_str());
  return 0;
}

const char* const kDeviceHelp = "cpu, or cuda[:N] where the build has the CUDA backend";

const char* const kModelHelp =
    "a diffusers folder, a cached ORG/NAME, or one transformer file (BFL or ComfyUI safetensors, GGUF; for audio the "
    "official keys' safetensors or sa3.cpp's DiT GGUF)";
const char* const kImageModelHelp =
    "a diffusers folder, a cached ORG/NAME, or one transformer file (BFL or ComfyUI safetensors, GGUF)";

// Which family's files a command's part options describe: `image` and `audio` take one family,
// the tools (serve, bench, roofline, gate) either.
enum class Family { image, audio, either };

// The parts a single-file --model needs beside it (or that replace a folder's).
void add_part_options(CLI::App* app, apus::ModelParts& parts, Family family = Family::either) {
  const char* const text_encoder[] = {"Qwen3, the text encoder, as one file (transformers' names, or llama.cpp's GGUF)",
                                      "T5Gemma, the text encoder, as one file (transformers' names, or sa3.cpp's GGUF)",
                                      "the text encoder as one file (transformers' names, or llama.cpp's GGUF)"};
  const char* const vae[] = {"the VAE as one file (diffusers' or BFL's names)",
                             "SAME, the autoencoder, as one file (sa3.cpp's SAME GGUF)",
                             "the VAE as one file (diffusers' or BFL's names; sa3.cpp's SAME GGUF)"};
  app->add_option("--text-encoder", parts.text_encoder, text_encoder[int(family)]);
  app->add_option("--vae", parts.vae, vae[int(family)]);
  app->add_option("--tokenizer", parts.tokenizer,
                  "the tokenizer: a folder holding tokenizer.json, the file itself, or a GGUF carrying one "
                  "(a text encoder GGUF's own is used when this is absent)");
  app->add_option("--config", parts.config,
                  "a diffusers folder (or cached ORG/NAME) whose configs serve a single-file --model");
  std::map<std::string, apus::Quant> quants;
  for (const apus::Quant q : {apus::Quant::none, apus::Quant::int8, apus::Quant::q8_0, apus::Quant::fp8})
    quants[apus::quant_name(q)] = q;
  app->add_option(
         "--quant", parts.quant,
         "none; int8: the transformer's and text encoder's linears in int8, and SAME's attention "
         "projections (a scale per output feature, activations per token; CPUs with VNNI or AVX2, or a GPU), faster "
         "and further from the official output: measure it with `apus gate`; q8_0: the transformer's and text "
         "encoder's weights held as GGUF Q8_0 blocks (a scale a 32 values), half of bf16's memory, the activations "
         "untouched; fp8: as int8 with float8_e4m3fn codes and products summed in fp32 (the fp8 tensor cores of "
         "Ada and Hopper GPUs; a CPU runs the codes through its bf16 GEMM, slower than bf16), a file's own "
         "float8_e4m3fn weights multiplied as "
         "they are")
      ->transform(CLI::CheckedTransformer(quants, CLI::ignore_case).description("{none,int8,q8_0,fp8}"));
}

// The request options the commands share, each declared once (add_request_options): a command
// names those it takes and what an absent one means there. A value reaches the request only when
// given on the command line, so the model's defaults apply otherwise.
// --rank-timeout: set on the world as it is parsed.
void add_rank_timeout(CLI::App* app) {
  app->add_option_function<double>(
         "--rank-timeout", [](double s) { apus::dist::World::get().set_timeout(s); },
         "started by mpirun or srun, seconds a rank waits for the others in an exchange before ending the job (600)")
      ->type_name("SECONDS");
}

struct RequestOptions {
  std::string prompt, seed, precision = "bf16", negative, trace, device = "cpu", parallel = "auto";
  int width = 0, height = 0, steps = 0, batch = 1;
  double seconds = 0, rank_memory = 0;
  float cfg = 0;
  bool verbose = false;
  std::vector<std::string> images, loras;
  CLI::Option *width_opt = nullptr, *height_opt = nullptr, *seconds_opt = nullptr, *steps_opt = nullptr,
              *cfg_opt = nullptr, *seed_opt = nullptr, *negative_opt = nullptr, *trace_opt = nullptr;

  // What was given, into a request of either kind; images are the command's to place.
  void into(apus::ImageRequest& r) const {
    r.width = if_given(width_opt, width);
    r.height = if_given(height_opt, height);
    r.steps = if_given(steps_opt, steps);
    r.cfg = if_given(cfg_opt, cfg);
    common_into(r);
  }
  void into(apus::AudioRequest& r) const {
    r.seconds = if_given(seconds_opt, seconds);
    r.steps = if_given(steps_opt, steps);
    r.cfg = if_given(cfg_opt, cfg);
    common_into(r);
  }
  // For a command taking either kind (bench, roofline): the options of the other kind refused.
  void refuse_other_kind(bool audio, const std::string& model) const {
    if (audio)
      APUS_CHECK(!given(width_opt) && !given(height_opt) && images.empty(), model,
                 ": --width/--height/--image are for image models");
    else APUS_CHECK(!given(seconds_opt), model, ": --seconds is for audio models");
  }

 private:
  template <typename Request> void common_into(Request& r) const {
    r.prompt = prompt;
    if (given(seed_opt)) r.seed = parse_seed(seed);
    r.fp32 = precision == "fp32";
    if (given(negative_opt)) r.negative_prompt = negative;
    for (const std::string& lora : loras) r.loras.push_back(parse_lora(lora));
    r.trace = given(trace_opt);
  }
};

// Which of the shared request options a command takes; a default note is what an absent one
// means in that command.
enum class Need { no, optional, required };
struct Takes {
  Need prompt = Need::no;         // --prompt/-p
  const char* sides = nullptr;    // -W/-H
  const char* seconds = nullptr;  // --seconds
  bool steps = false, cfg = false, precision = false, images = false, negative = false;
  const char* seed = nullptr;  // --seed/-s
  bool run = false;            // -n, --lora, --trace, -v, --device: a command that renders and writes
};

void add_request_options(CLI::App* app, RequestOptions& o, Family family, const Takes& takes) {
  const int f = int(family);
  if (takes.prompt != Need::no)
    app->add_option("--prompt,-p", o.prompt, "text prompt")->required(takes.prompt == Need::required);
  if (takes.sides) {
    const std::string note = std::string(", a multiple of 16 (default: ") + takes.sides + ")";
    o.width_opt = app->add_option("--width,-W", o.width, "image width" + note);
    o.height_opt = app->add_option("--height,-H", o.height, "image height" + note);
  }
  if (takes.seconds)
    o.seconds_opt =
        app->add_option("--seconds", o.seconds,
                        std::string("clip length (default: ") + takes.seconds + "; up to 380 s medium, 120 s small)");
  const char* const steps[] = {"sampling steps (default: 4 distilled, 50 -base)", "sampling steps (default: 8)",
                               "sampling steps (default: the model's: klein 4 distilled, 50 -base; Stable Audio 3 8)"};
  if (takes.steps) o.steps_opt = app->add_option("--steps", o.steps, steps[f]);
  const char* const cfg[] = {"guidance scale for the -base models (default 4; 1: off)",
                             "classifier-free guidance scale (1: off, the default; ~7 for -base models)",
                             "guidance scale (default: the model's)"};
  if (takes.cfg) o.cfg_opt = app->add_option("--cfg", o.cfg, cfg[f]);
  const char* const precision[] = {"bf16 (as the official pipeline) or fp32 (parity)",
                                   "bf16 (fast) or fp32 (the official CPU run)", "bf16 or fp32"};
  if (takes.precision)
    app->add_option("--precision", o.precision, precision[f])->check(CLI::IsMember({"bf16", "fp32"}));
  const char* const images[] = {
      "a reference image to edit from (PNG, JPEG or WebP; repeatable); with --mask, the image to repaint", "",
      "a reference image to edit from (image models; PNG, JPEG or WebP; repeatable)"};
  if (takes.images)
    app->add_option("--image,-i", o.images, images[f])->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  const char* const negative[] = {"guidance's unconditional prompt (-base models; default \"\")",
                                  "the unconditional branch's prompt (with --cfg)", ""};
  if (takes.negative) o.negative_opt = app->add_option("--negative-prompt", o.negative, negative[f]);
  if (takes.seed)
    o.seed_opt =
        app->add_option("--seed,-s", o.seed, std::string("seed of torch's CPU generator (default: ") + takes.seed + ")")
            ->type_name("UINT64");
  if (!takes.run) return;
  app->add_option("--parallel", o.parallel,
                  "started by mpirun or srun, how the ranks split the work: batch (-n's outputs over the ranks), "
                  "cfg (each step's guided branches and images over the ranks), ulysses (every image's tokens over the "
                  "ranks, attention exchanging heads), tensor (the transformer's weights and features over the ranks, "
                  "each holding its share: a model too big for one), none (rank 0 does it all), auto (tensor when one "
                  "process could not hold the request in a rank's memory, else of batch, cfg and ulysses the one the "
                  "cost model predicts fastest; -v says)")
      ->check(CLI::IsMember({"auto", "batch", "none", "ulysses", "tensor", "cfg"}));
  app->add_option("--rank-memory", o.rank_memory,
                  "started by mpirun or srun, the memory a rank may use, in GiB, for auto's check (default: on a "
                  "device its own memory, else this machine's memory or cgroup limit over the ranks on it): a "
                  "request one process could not hold opens the model with its weights split over the ranks (tensor)")
      ->check(CLI::PositiveNumber)
      ->type_name("GIB");
  add_rank_timeout(app);
  const char* const batch[] = {"images rendered together, seeds seed, seed+1, ... (-o out.png gives out-1.png, ...)",
                               "clips generated together, seeds seed, seed+1, ...", ""};
  app->add_option("--batch,-n", o.batch, batch[f]);
  const char* const lora[] = {
      "a LoRA for the transformer, FILE[:SCALE] (repeatable, applied in order; diffusers/PEFT, BFL or kohya "
      "safetensors)",
      "a LoRA for the DiT and duration conditioner, FILE[:SCALE] (SCALE: the official strength; repeatable, applied in "
      "order; the official lora / dora-rows format or PEFT's)",
      ""};
  app->add_option("--lora", o.loras, lora[f])->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app->add_flag("-v,--verbose", o.verbose, "print per-stage times and peak memory");
  o.trace_opt =
      app->add_option("--trace", o.trace, "write the request's timeline (Chrome trace events, ui.perfetto.dev) here");
  app->add_option("--device", o.device, kDeviceHelp);
}

// A subcommand: its options registered on the app before parsing, `run` called if it was given.
struct Command {
  CLI::App* app;
  std::function<int()> run;
};

Command image_command(CLI::App& app) {
  struct Options {
    RequestOptions r;
    apus::ModelParts parts;
    std::string out, mask_file, inpaint_reference, noise;
    int quality = 95;
    double strength = apus::Inpainting{}.strength;
    CLI::Option *mask_opt, *strength_opt, *inpaint_reference_opt, *noise_opt, *out_opt;
  };
  const auto o = std::make_shared<Options>();
  auto* image = app.add_subcommand("image", "render a prompt to a PNG");
  image->add_option("--model", o->parts.model, kImageModelHelp)->required();
  add_part_options(image, o->parts, Family::image);
  add_request_options(image, o->r, Family::image,
                      {.prompt = Need::required,
                       .sides = "the first --image's, or 1024",
                       .steps = true,
                       .cfg = true,
                       .precision = true,
                       .images = true,
                       .negative = true,
                       .seed = "drawn from the OS, reported",
                       .run = true});
  o->mask_opt = image->add_option("--mask", o->mask_file, "inpainting: repaint the --image where this image is white");
  o->strength_opt =
      image->add_option("--strength", o->strength, "inpainting: the share of the schedule run, 0..1 (default 0.8)");
  o->inpaint_reference_opt =
      image->add_option("--reference", o->inpaint_reference, "inpainting: a reference image for the repainted area");
  o->noise_opt = image->add_option("--noise", o->noise, "safetensors file with tensor 'noise' [1,128,H/16,W/16]");
  o->out_opt =
      image->add_option("-o,--output", o->out,
                        "output file: .png, .jpg or .webp, the parameters inside as A1111 writes them "
                        "(outputs/NNNNN.png, the next number there); -n adds -1, -2, ... before the extension");
  image->add_option("--quality", o->quality, "JPEG and WebP quality, 1..100 (95; WebP 100: lossless)");
  return {
      image, [o] {
        const RequestOptions& asked = o->r;
        apus::ImageRequest req;
        asked.into(req);
        if (*o->mask_opt) {
          APUS_CHECK(asked.images.size() == 1, "--mask repaints one --image, not ", asked.images.size(),
                     " (a reference for the repainted area goes in --reference)");
          req.inpaint = apus::Inpainting{apus::read_image(named_file(asked.images[0], "--image")),
                                         apus::read_image(named_file(o->mask_file, "--mask")), o->strength};
          if (*o->inpaint_reference_opt)
            req.references.push_back(apus::read_image(named_file(o->inpaint_reference, "--reference")));
        } else {
          APUS_CHECK(!*o->strength_opt && !*o->inpaint_reference_opt,
                     "--strength and --reference are for inpainting (--mask)");
          for (const std::string& file : asked.images)
            req.references.push_back(apus::read_image(named_file(file, "--image")));
        }
        if (*o->noise_opt) req.noise_file = named_file(o->noise, "--noise");
        // -n as the engine takes a batch, before any output name is tried.
        prepare_ranks(req);
        const std::vector<apus::ImageRequest> requests = apus::batch_of(req, asked.batch);
        if (!*o->out_opt) o->out = unnamed_output(".png");
        check_output(o->out, asked.batch);
        apus::image_format_of_file(o->out, "-o");  // a name promising a format apus does not write
        APUS_CHECK(o->quality >= 1 && o->quality <= 100, "--quality ", o->quality, ": expected 1..100");
        if (req.trace) apus::check_writable(named_file(asked.trace, "--trace"));
        const std::string parallel = fitting_parallel<apus::ImageModel>(
            asked.parallel, asked.rank_memory, o->parts, requests.front(), asked.batch, asked.device, asked.verbose);
        return run_image(o->parts, requests, parallel, o->out, o->quality, asked.verbose, asked.trace, asked.device);
      }};
}

Command audio_command(CLI::App& app) {
  struct Options {
    RequestOptions r;
    apus::ModelParts parts;
    std::string out, format = "wav", decode, init_audio, inpaint_audio;
    double init_noise_level = apus::kDefaultInitNoiseLevel;
    float apg = 1;
    std::vector<double> inpaint_starts, inpaint_ends;
    CLI::Option *init_audio_opt, *init_level_opt, *inpaint_audio_opt, *format_opt, *out_opt;
  };
  const auto o = std::make_shared<Options>();
  auto* audio = app.add_subcommand("audio", "generate a clip from a prompt (Stable Audio 3)");
  audio
      ->add_option("--model", o->parts.model,
                   "model directory: the published layout (model_config.json) or diffusers' folders; or one "
                   "checkpoint file under the official keys (ComfyUI's stable_audio_3_*.safetensors)")
      ->required();
  add_part_options(audio, o->parts, Family::audio);
  add_request_options(audio, o->r, Family::audio,
                      {.prompt = Need::required,
                       .seconds = "30",
                       .steps = true,
                       .cfg = true,
                       .precision = true,
                       .negative = true,
                       .seed = "drawn from the OS, reported",
                       .run = true});
  o->format_opt = audio->add_option("--format", o->format,
                                    "wav (16-bit), wav-float or flac (default: from -o's extension, .wav or .flac)");
  audio->add_option("--apg", o->apg, "adaptive projected guidance share, 0..1 (1: the official default)");
  o->init_audio_opt =
      audio->add_option("--init-audio", o->init_audio, "audio-to-audio: start from this clip (any rate: resampled)");
  o->init_level_opt = audio->add_option("--init-noise-level", o->init_noise_level,
                                        "audio-to-audio: noise mixed into the clip, (0, 1] (default 0.9)");
  o->inpaint_audio_opt =
      audio->add_option("--inpaint-audio", o->inpaint_audio, "inpainting: the clip to keep outside the regions");
  audio->add_option("--inpaint-start", o->inpaint_starts, "inpainting: a region's start in seconds (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  audio->add_option("--inpaint-end", o->inpaint_ends, "inpainting: a region's end in seconds (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  audio
      ->add_option("--decode", o->decode,
                   "chunked (the official 128-latent chunks) or whole; default: the model's config")
      ->check(CLI::IsMember({"chunked", "whole"}));
  o->out_opt = audio->add_option(
      "-o,--output", o->out,
      "output file, .wav or .flac (outputs/NNNNN.wav, the next number there; .flac with --format flac)");
  return {audio, [o] {
            const RequestOptions& asked = o->r;
            apus::AudioRequest req;
            asked.into(req);
            req.apg = o->apg;
            if (!o->decode.empty()) req.chunked_decode = o->decode == "chunked";
            // As the official CLI: regions in pairs, and only with the clip they cut into.
            APUS_CHECK(o->inpaint_starts.size() == o->inpaint_ends.size(),
                       "--inpaint-start and --inpaint-end must be given ", "the same number of times (",
                       o->inpaint_starts.size(), " and ", o->inpaint_ends.size(), ")");
            APUS_CHECK(o->inpaint_starts.empty() == !*o->inpaint_audio_opt,
                       *o->inpaint_audio_opt ? "--inpaint-audio needs --inpaint-start and --inpaint-end"
                                             : "--inpaint-start/--inpaint-end need --inpaint-audio");
            req.init_noise_level = if_given(o->init_level_opt, o->init_noise_level);
            apus::ClipNames clips;
            if (*o->init_audio_opt) clips.init = named_file(o->init_audio, "--init-audio");
            if (*o->inpaint_audio_opt) clips.inpaint = named_file(o->inpaint_audio, "--inpaint-audio");
            for (size_t i = 0; i < o->inpaint_starts.size(); ++i)
              req.inpaint_regions.emplace_back(o->inpaint_starts[i], o->inpaint_ends[i]);
            // -n as the engine takes a batch, before any output name is tried; the clips join
            // each request once the model is open.
            prepare_ranks(req);
            std::vector<apus::AudioRequest> requests = apus::batch_of(req, asked.batch);
            if (!*o->out_opt) o->out = unnamed_output(o->format == "flac" ? ".flac" : ".wav");
            check_output(o->out, asked.batch);
            o->format = audio_format_for(o->out, *o->format_opt ? o->format : "");
            if (req.trace) apus::check_writable(named_file(asked.trace, "--trace"));
            const std::string parallel =
                fitting_parallel<apus::AudioModel>(asked.parallel, asked.rank_memory, o->parts, requests.front(),
                                                   asked.batch, asked.device, asked.verbose);
            return run_audio(o->parts, std::move(requests), parallel, clips, o->out, o->format, asked.verbose,
                             asked.trace, asked.device);
          }};
}

Command synth_command(CLI::App& app) {
  struct Options {
    std::string model = "flux2-klein-4b", like, out, seed = "0";
    CLI::Option* like_opt;
  };
  const auto o = std::make_shared<Options>();
  auto* synth = app.add_subcommand("synth", "write a random-weight checkpoint in the published layout");
  auto* model_opt =
      synth->add_option("--model", o->model, "published model to mimic")->check(CLI::IsMember(apus::kPublishedModels));
  o->like_opt = synth->add_option("--like", o->like, "checkpoint folder whose layout to mimic instead")
                    ->check(CLI::ExistingDirectory);
  model_opt->excludes(o->like_opt);
  synth->add_option("--out", o->out, "output directory")->required();
  synth->add_option("--seed", o->seed, "weight seed")->type_name("UINT64");
  return {synth, [o] {
            if (*o->like_opt) apus::synth_checkpoint(o->like, o->out, parse_seed(o->seed), say);
            else apus::synth_published(o->model, o->out, parse_seed(o->seed), say);
            return 0;
          }};
}

Command pull_command(CLI::App& app) {
  struct Options {
    std::string repo, revision = "main";
  };
  const auto o = std::make_shared<Options>();
  auto* pull = app.add_subcommand("pull", "download a Hugging Face repository into the local cache");
  pull->add_option("repo", o->repo, "ORG/NAME, e.g. black-forest-labs/FLUX.2-klein-4B")->required();
  pull->add_option("--revision", o->revision, "branch, tag or commit (main)");
  return {pull, [o] {
            std::printf("%s\n", apus::hf_pull(o->repo, o->revision, say).c_str());
            return 0;
          }};
}

Command calibrate_command(CLI::App& app) {
  struct Options {
    bool refresh = false;
    std::string device = "cpu";
  };
  const auto o = std::make_shared<Options>();
  auto* calibrate = app.add_subcommand("calibrate",
                                       "measure this machine's ceilings (bf16 GEMM rate, the int8 tier's where the CPU "
                                       "has VNNI or AVX2, memory bandwidth) and cache them");
  calibrate->add_flag("--refresh", o->refresh, "measure again even when a calibration is cached");
  calibrate->add_option("--device", o->device, "cpu, or cuda[:N]: the device whose ceilings to measure");
  return {calibrate, [o] {
            // Under mpirun or srun rank 0 measures the device alone (the others would share its
            // cores), then every rank the link between them.
            const apus::dist::World& world = apus::dist::World::get();
            if (world.rank() == 0) {
              bool cached = false;
              std::string key;
              const apus::Chip chip = apus::device_ceiling(o->device, o->refresh, &cached, &key);
              std::printf("%s\n  %s\n  %s (%s)\n  %s\n", key.c_str(), apus::describe_rates(chip).c_str(),
                          cached ? "cached" : "measured now", apus::calibration_file().c_str(), chip.note.c_str());
            }
            if (world.size() == 1) return 0;
            const apus::dist::LinkRates link = apus::dist::link_rates(world, apus::backend_for(o->device), o->refresh);
            if (world.rank() == 0)
              std::printf("%s\n  %.2f GB/s all-gather, %.2f GB/s all-to-all (what a rank sends)\n  %s\n",
                          link.key.c_str(), link.all_gather_bps / 1e9, link.all_to_all_bps / 1e9,
                          link.cached ? "cached" : "measured now");
            return 0;
          }};
}

// The chip `apus serve` over ranks prices auto's splits at: this machine's calibration (rank 0's;
// auto only) with the link rate between the ranks (dist/link.h; a collective: every rank).
apus::Chip rank_chip(const std::string& parallel, const std::string& device) {
  const apus::dist::World& world = apus::dist::World::get();
  const double link = apus::dist::link_rates(world, apus::backend_for(device)).bps();
  apus::Chip here = parallel == "auto" && world.rank() == 0 ? apus::device_ceiling(device) : apus::Chip{};
  here.link_bps = link;
  return here;
}

// A rank of `apus serve` but rank 0: the models loaded as rank 0 loads them, then every request
// rank 0 announces run on them, until it releases the ranks.
int follow_rank_0(const apus::server::Ranks& ranks, const apus::server::ServeOptions& s) {
  std::vector<apus::AnyModel> models;
  for (const apus::ModelParts& parts : s.models)
    models.push_back(apus::AnyModel::open(parts, apus::Weights::resident, s.device));
  ranks.follow(models);
  return 0;
}

// Rank 0 of `apus serve` over ranks: serves until a signal or a lost rank. mpirun signals every
// rank at once (and kills them a second later), so there is nothing to drain: the request in
// flight is answered 503 and the job ends. A lost rank (dead, hung, or out of step after a
// failure) ends the job with its message once that request is answered; restart it (the kept
// history stays).
int serve_until_lost(apus::server::Server& server, const apus::dist::World& world, const sigset_t& signals) {
  const timespec tick{0, 100'000'000};
  int signal = -1;
  while (signal < 0 && !world.lost()) signal = sigtimedwait(&signals, nullptr, &tick);
  world.interrupt();
  server.shutdown(0);
  if (signal < 0)
    world.abort(
        "a rank was lost or fell out of step (the failed request says which exchange); the job ends: "
        "restart it");
  std::fprintf(stderr, "%s: stopped (a request running over the ranks was answered 503)\n",
               signal == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stderr);
  // Not through MPI_Finalize: the other ranks were signalled too, and waiting for them could hang.
  std::_Exit(0);
}

Command serve_command(CLI::App& app) {
  struct Options {
    apus::server::ServeOptions serve;
    std::vector<std::string> models, aliases;
    apus::ModelParts parts;
    size_t max_body_mb = serve.max_body >> 20, kept_results_mb = serve.kept_results_bytes >> 20;
    double drain_seconds = 30, rank_memory = 0;
    std::string parallel = "auto";
  };
  const auto o = std::make_shared<Options>();
  apus::server::ServeOptions& s = o->serve;
  auto* serve = app.add_subcommand("serve", "serve the models over HTTP (OpenAI-style images and audio, jobs)");
  serve->add_option("--model", o->models, std::string(kModelHelp) + " (repeatable), loaded once")->required();
  add_part_options(serve, o->parts);
  serve->add_option("--host", s.host, "address to listen on (127.0.0.1)");
  serve->add_option("--port", s.port, "port (8080)")->check(CLI::Range(0, 65535));
  serve->add_option("--queue", s.queue, "requests that may wait per model (4); more get 429");
  serve->add_option("--api-key", s.api_key, "require Authorization: Bearer KEY (or APUS_API_KEY)");
  serve->add_option("--cors", s.cors, "let pages from this origin call the API (off by default)");
  serve->add_option("--device", s.device, kDeviceHelp);
  serve->add_option("--max-body-mb", o->max_body_mb, "largest request body in MiB (32): audio inputs come as base64")
      ->check(CLI::Range(1, 4096));
  serve
      ->add_option("--header-timeout", s.header_seconds,
                   "seconds a client has to send a request's line and headers (10); bodies must move at 64 KiB/s")
      ->check(CLI::Range(0.1, 3600.0));
  serve->add_option("--max-connections", s.max_connections, "open connections at once (512)")
      ->check(CLI::Range(1, 65536));
  serve
      ->add_option("--max-connections-per-address", s.max_connections_per_address,
                   "open connections from one client address (64)")
      ->check(CLI::Range(1, 65536));
  serve
      ->add_option("--kept-results-mb", o->kept_results_mb,
                   "MiB of finished jobs' files kept for GET /v1/jobs/{id} (256); the oldest go first")
      ->check(CLI::Range(1, 1 << 20));
  serve->add_option("--output-dir", s.output_dir,
                    "keep every finished job here: its files (ID-N.png, .wav, ...) and record (ID.json), listed by GET "
                    "/v1/jobs after restarts too; made if absent");
  serve->add_option("--lora-dir", s.lora_dir,
                    "the LoRAs clients may apply by file name (\"loras\": [{\"name\", \"scale\"}]; GET /v1/loras)");
  serve->add_option("--alias", o->aliases,
                    "NAME=MODEL: clients asking for model NAME get the loaded MODEL (repeatable; OpenAI's gpt-image-1, "
                    "dall-e-3, tts-1, ... already answer with the server's model of their kind)");
  serve->add_option("--drain-seconds", o->drain_seconds, "on SIGTERM / SIGINT, let running jobs finish this long (30)")
      ->check(CLI::Range(0.0, 86400.0));
  serve
      ->add_option("--max-request-seconds", s.max_request_seconds,
                   "refuse (413) a request whose floor at this machine's calibrated rate passes this many seconds "
                   "(900; 0: no bound)")
      ->check(CLI::Range(0.0, 1e6));
  serve
      ->add_option("--parallel", o->parallel,
                   "started by mpirun or srun, how each request splits over the ranks: batch (a request's outputs "
                   "over the ranks, rank 0 gathering them), cfg, ulysses, tensor (every model's transformer weights "
                   "split over the ranks), none (rank 0 alone) or auto (a model one process could not hold opens "
                   "split, the rest take the cost model's pick per request; a named split a request cannot take gives "
                   "way to it)")
      ->check(CLI::IsMember({"auto", "cfg", "ulysses", "none", "batch", "tensor"}));
  serve
      ->add_option("--rank-memory", o->rank_memory,
                   "started by mpirun or srun, the memory a rank may use, in GiB (default: on a device its own "
                   "memory, else this machine's memory or cgroup limit over the ranks on it): under auto, a model "
                   "one process could not hold resident opens with its weights split over the ranks (tensor)")
      ->check(CLI::PositiveNumber)
      ->type_name("GIB");
  add_rank_timeout(serve);
  return {serve, [o] {
            apus::server::ServeOptions& s = o->serve;
            // The parts options serve the single-file models among the --model's.
            const bool parts = !o->parts.text_encoder.empty() || !o->parts.vae.empty() || !o->parts.tokenizer.empty() ||
                               !o->parts.config.empty();
            bool single_file = false;
            for (const std::string& model : o->models) {
              apus::ModelParts p{model};
              p.quant = o->parts.quant;
              if (apus::is_single_file(model)) {
                p = o->parts;
                p.model = model;
                single_file = true;
              }
              s.models.push_back(p);
            }
            APUS_CHECK(!parts || single_file,
                       "serve: --text-encoder/--vae/--tokenizer/--config are for a single-file --model");
            for (const std::string& alias : o->aliases) {
              const size_t eq = alias.find('=');
              APUS_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < alias.size(), "serve: --alias ", alias,
                         ": expected NAME=MODEL");
              s.aliases[alias.substr(0, eq)] = alias.substr(eq + 1);
            }
            if (s.api_key.empty())
              if (const char* key = std::getenv("APUS_API_KEY")) s.api_key = key;
            if (s.api_key.empty() && s.host != "127.0.0.1" && s.host != "localhost" && s.host != "::1")
              std::fprintf(stderr, "warning: listening on %s without an API key: anyone who reaches it can use it\n",
                           s.host.c_str());
            // SIGTERM and SIGINT are taken by this thread alone (blocked in every thread the server
            // starts), so a signal becomes a graceful shutdown rather than a kill.
            sigset_t signals;
            sigemptyset(&signals);
            sigaddset(&signals, SIGTERM);
            sigaddset(&signals, SIGINT);
            pthread_sigmask(SIG_BLOCK, &signals, nullptr);
            s.max_body = o->max_body_mb << 20;
            s.kept_results_bytes = o->kept_results_mb << 20;
            apus::dist::World& world = apus::dist::World::get();
            std::optional<apus::server::Ranks> ranks;
            if (world.size() > 1) {
              for (apus::ModelParts& parts : s.models) parts = split_parts(parts, o->parallel);
              std::vector<bool> split(s.models.size(), o->parallel == "tensor");
              if (o->parallel == "auto") split = open_split_where_needed(s.models, o->rank_memory, s.device);
              ranks.emplace(world, o->parallel, rank_chip(o->parallel, s.device), split);
              if (world.rank() != 0) return follow_rank_0(*ranks, s);
              world.throw_when_lost();
              s.ranks = &*ranks;
            }
            apus::server::Server server(s);
            const int port = server.start();
            std::fprintf(stderr, "serving %zu model(s) on http://%s:%d%s\n", s.models.size(), s.host.c_str(), port,
                         ranks ? (" over " + std::to_string(world.size()) + " ranks").c_str() : "");
            int signal = 0;
            if (!ranks) {
              sigwait(&signals, &signal);
              std::fprintf(stderr, "%s: draining (up to %g s), then stopping\n",
                           signal == SIGTERM ? "SIGTERM" : "SIGINT", o->drain_seconds);
              server.shutdown(o->drain_seconds);
              std::fprintf(stderr, "stopped\n");
              return 0;
            }
            return serve_until_lost(server, world, signals);
          }};
}

Command bench_command(CLI::App& app) {
  struct Options {
    apus::BenchOptions bench;
    RequestOptions r;
    std::string synthetic;
    bool list_variants = false;
    CLI::Option *model_opt, *synthetic_opt, *json_opt, *chart_opt, *trace_opt;
  };
  const auto o = std::make_shared<Options>();
  apus::BenchOptions& b = o->bench;
  o->r.prompt = "a red fox in fresh snow, morning light";
  auto* bench = app.add_subcommand("bench", "time requests stage by stage against this machine's calibrated ceiling");
  o->model_opt = bench->add_option("--model", b.model.model, kModelHelp);
  add_part_options(bench, b.model);
  bench->add_option("--device", b.device, kDeviceHelp);
  o->synthetic_opt =
      bench
          ->add_option("--synthetic", o->synthetic, "bench `apus synth` weights of this published model (written once)")
          ->check(CLI::IsMember(apus::kPublishedModels));
  o->model_opt->excludes(o->synthetic_opt);
  add_request_options(bench, o->r, Family::either,
                      {.prompt = Need::optional,
                       .sides = "the first --image's, or 1024",
                       .seconds = "30",
                       .steps = true,
                       .cfg = true,
                       .precision = true,
                       .images = true,
                       .seed = "0"});
  bench->add_option("--reps", b.reps, "timed requests (3)")->check(CLI::Range(1, 1000));
  bench->add_option("--warmup", b.warmup, "untimed requests first (1)")->check(CLI::Range(0, 100));
  o->json_opt = bench->add_option("--json", b.json, "write the report (docs/BENCH.md) to this file");
  o->chart_opt = bench->add_option("--chart", b.chart, "draw each stage against its floor (or the A/B arms) as an SVG");
  bench->add_flag("--list-variants", o->list_variants, "list the kernel variant knobs --ab can compare, and exit");
  auto* ab_opt = bench->add_option("--ab", b.ab, "KNOB=A,B: time two choices of a knob interleaved in this process");
  bench
      ->add_option("--ab-bound", b.ab_bound,
                   "largest mean |A - B| of the outputs (default: how far flipping the precision moves them)")
      ->check(CLI::NonNegativeNumber);
  o->trace_opt =
      bench->add_option("--trace", b.trace, "after the timed requests, trace one more and write its timeline here")
          ->excludes(ab_opt);
  return {bench, [o] {
            apus::BenchOptions& b = o->bench;
            if (o->list_variants) {
              apus::print_variants();
              return 0;
            }
            APUS_CHECK(*o->model_opt || *o->synthetic_opt, "bench: give --model DIR or --synthetic NAME");
            if (*o->synthetic_opt)
              // On a device the values are made as the models fetch them, straight into device memory.
              b.model.model = apus::synthetic_model_dir(o->synthetic, say, b.device != "cpu");
            const bool audio = apus::model_kind(b.model) == apus::ModelKind::audio;
            o->r.refuse_other_kind(audio, b.model.model);
            if (audio) {
              b.audio.seed = 0;
              o->r.into(b.audio);
            } else {
              b.image.seed = 0;
              o->r.into(b.image);
              for (const std::string& file : o->r.images)
                b.image.references.push_back(apus::read_image(named_file(file, "--image")));
            }
            for (const auto& [option, file] : {std::pair{o->json_opt, &b.json}, std::pair{o->trace_opt, &b.trace},
                                               std::pair{o->chart_opt, &b.chart}})
              if (*option) apus::check_writable(named_file(*file, option->get_name().c_str()));
            return apus::run_bench(b);
          }};
}

Command report_command(CLI::App& app) {
  const auto files = std::make_shared<std::vector<std::string>>();
  auto* report = app.add_subcommand("report", "a Markdown table of apus bench --json reports");
  report->add_option("reports", *files, "bench reports")->required()->check(CLI::ExistingFile);
  return {report, [files] {
            std::printf("%s", apus::bench_table(*files).c_str());
            return 0;
          }};
}

Command roofline_command(CLI::App& app) {
  struct Options {
    apus::ModelParts model{"flux2-klein-4b"};
    std::string chip = "h200";
    RequestOptions r;
    int chips = 1;
    double peak_tflops = 0, gbps = 0, link_gbps = 0;
    bool json = false;
    CLI::Option *peak_opt, *gbps_opt, *link_opt;
  };
  const auto o = std::make_shared<Options>();
  auto* roofline = app.add_subcommand("roofline", "FLOPs, bytes and floors counted from the model code");
  roofline->add_option("--model", o->model.model,
                       "model directory or single file (configs and shapes only are read) or a published name "
                       "(flux2-klein-4b, flux2-klein-9b, stable-audio-3-medium, ...)");
  add_part_options(roofline, o->model);
  add_request_options(roofline, o->r, Family::either, {.sides = "1024", .seconds = "30", .steps = true, .cfg = true});
  roofline->add_option("--chip", o->chip, "v6e, h200, h100, l4, rtx-pro-6000 or cpu");
  roofline->add_option("--chips", o->chips, "chips for the collective comparison (1..4096)")
      ->check(CLI::Range(1, 4096).description(""));
  o->peak_opt = roofline->add_option("--peak-tflops", o->peak_tflops, "override the chip's dense bf16 TFLOP/s");
  o->gbps_opt = roofline->add_option("--gbps", o->gbps, "override the chip's memory GB/s");
  o->link_opt = roofline->add_option("--link-gbps", o->link_gbps, "override the chip's link GB/s (each way)");
  roofline->add_flag("--json", o->json, "print the JSON interface instead of the table");
  return {roofline, [o] {
            // An override is a rate a chip could have: positive, finite, below a petascale bound.
            for (const auto& [opt, value, unit, most] :
                 {std::tuple{o->peak_opt, o->peak_tflops, "TFLOP/s", 1e6},
                  std::tuple{o->gbps_opt, o->gbps, "GB/s", 1e6}, std::tuple{o->link_opt, o->link_gbps, "GB/s", 1e6}})
              APUS_CHECK(!*opt || (std::isfinite(value) && value >= 1e-3 && value <= most), opt->get_name(), " ", value,
                         ": expected a rate in ", unit, " from 0.001 to ", most);
            // "cpu" is this machine: its calibration, not a table entry measured elsewhere.
            apus::Roofline r{o->chip == "cpu" ? apus::device_ceiling("cpu") : apus::find_chip(o->chip), o->chips};
            if (*o->peak_opt) r.chip.bf16_flops = o->peak_tflops * 1e12;
            if (*o->gbps_opt) r.chip.memory_bps = o->gbps * 1e9;
            if (*o->link_opt) r.chip.link_bps = o->link_gbps * 1e9;
            // Audio models (Stable Audio 3) count a clip; image models a picture.
            const apus::AnyModel model = apus::AnyModel::open(o->model, apus::Weights::none);
            apus::PipelineCost cost;
            o->r.refuse_other_kind(bool(model.audio()), o->model.model);
            if (model.audio()) {
              apus::AudioRequest a;
              o->r.into(a);
              cost = model.audio()->count(a);
            } else {
              apus::ImageRequest req;
              o->r.into(req);
              cost = model.image()->count(req);
            }
            cost.model = o->model.model;
            if (o->json) std::printf("%s\n", apus::roofline_json(cost, r).dump(2).c_str());
            else std::printf("%s", apus::roofline_table(cost, r).c_str());
            return 0;
          }};
}

Command gate_command(CLI::App& app) {
  struct Options {
    apus::GateOptions gate;
    RequestOptions r;
    std::string candidate, json;
  };
  const auto o = std::make_shared<Options>();
  apus::GateOptions& g = o->gate;
  auto* gate = app.add_subcommand(
      "gate", "judge a tier or variant against the model's own bf16-vs-fp32 disagreement over a prompt set");
  gate->add_option("--model", g.reference.model, kModelHelp)->required();
  add_part_options(gate, g.reference);
  gate->add_option("--candidate", o->candidate,
                   "another file of the same transformer's weights to judge (a GGUF quantisation, fp8), with the "
                   "same other parts");
  gate->add_option("--knob", g.knob, "NAME=CHOICE: a kernel variant to judge (apus bench --list-variants)");
  gate->add_option("--prompts", g.prompts, "prompts of the family's set (10)")->check(CLI::Range(1, 10));
  gate->add_option("--seeds", g.seeds, "seeds per prompt, from 0 (2)")->check(CLI::Range(1, 100));
  add_request_options(gate, o->r, Family::either, {.sides = "512", .seconds = "10", .steps = true});
  gate->add_option("--json", o->json, "write the report here");
  gate->add_option("--device", g.device, kDeviceHelp);
  return {gate, [o] {
            apus::GateOptions& g = o->gate;
            // --quant names the candidate's tier; the reference is the model as published.
            g.candidate = g.reference;
            g.reference.quant = apus::Quant::none;
            if (!o->candidate.empty()) g.candidate.model = o->candidate;
            g.width = if_given(o->r.width_opt, o->r.width);
            g.height = if_given(o->r.height_opt, o->r.height);
            g.steps = if_given(o->r.steps_opt, o->r.steps);
            g.seconds = if_given(o->r.seconds_opt, o->r.seconds);
            if (!o->json.empty()) apus::check_writable(o->json);
            const apus::GateReport r =
                apus::run_gate(g, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
            std::printf("%s", r.table().c_str());
            if (!o->json.empty()) {
              const std::string text = r.json().dump(2) + "\n";
              apus::write_whole_file(o->json, text.data(), text.size());
            }
            return r.pass ? 0 : 3;
          }};
}

// The one line a failed command prints. One of several ranks ends them all (World::abort): the
// others may be waiting for it in an exchange.
int failed(const std::string& message) {
  if (apus::dist::launched_size() > 1 && apus::dist::built_with_mpi()) apus::dist::World::get().abort(message);
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"apus: diffusion transformers on one device"};
#if APUS_HAS_CUDA
  const std::string backends = " (CPU and CUDA backends; CUDA opens " + apus::cuda_libraries() + ")";
#else
  const std::string backends = " (CPU backend)";
#endif
  app.set_version_flag("--version", std::string("apus ") + apus::version() + backends +
                                        (apus::dist::built_with_mpi() ? ", MPI ranks" : ""));
  app.require_subcommand(1);
  app.footer(
      "Environment: APUS_KNOBS=NAME=CHOICE[,NAME=CHOICE...] sets kernel variant knobs for the whole process "
      "(apus bench --list-variants lists them).");
  const Command commands[] = {image_command(app),     audio_command(app), synth_command(app), pull_command(app),
                              calibrate_command(app), serve_command(app), bench_command(app), report_command(app),
                              roofline_command(app),  gate_command(app)};
  CLI11_PARSE(app, argc, argv);
  try {
    if (const char* knobs = std::getenv("APUS_KNOBS")) apus::set_knobs(knobs, "APUS_KNOBS");
    for (const Command& c : commands) {
      if (!*c.app) continue;
      // Only image, audio, serve and calibrate run over ranks so far (issue 43).
      const std::string name = c.app->get_name();
      APUS_CHECK(name == "image" || name == "audio" || name == "serve" || name == "calibrate" ||
                     apus::dist::launched_size() == 1,
                 "apus ", name, " does not split over several processes yet (started as one of ",
                 apus::dist::launched_size(), " by mpirun or srun): run it as one process");
      return c.run();
    }
    return 0;
  } catch (const std::bad_alloc&) {
    // Engine allocations name their size (apus::Error); this is a library's or the STL's.
    return failed("out of memory (an allocation failed; the request needs more memory than this process may use)");
  } catch (const std::exception& e) {
    return failed(e.what());
  }
}
