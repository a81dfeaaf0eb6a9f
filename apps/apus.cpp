// apus command line: `apus image` renders a prompt, `apus audio` generates a clip, `apus roofline`
// counts a request's cost, `apus synth` writes a random-weight checkpoint in the published layout.
#include <CLI/CLI.hpp>
#include <pthread.h>
#include <signal.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <new>

#include "apus/apus.h"
#include "core/cost.h"
#include "core/error.h"
#include "cost/ceiling.h"
#include "bench.h"
#include "cost/roofline.h"
#include "io/audio.h"
#include "io/files.h"
#include "io/hf_pull.h"
#include "io/image.h"
#include "pipeline/infotext.h"
#include "io/png.h"
#include "io/synth.h"
#include "server/server.h"

namespace {

// out.png for one image; out-1.png, out-2.png, ... for a batch.
std::string output_name(const std::string& out, int i, int n) {
  if (n == 1) return out;
  const size_t dot = out.rfind('.'), slash = out.rfind('/');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  return (has_ext ? out.substr(0, dot) : out) + "-" + std::to_string(i + 1) + (has_ext ? out.substr(dot) : "");
}

// -v: each stage against its floor on the device that ran it, counted from the same stage code,
// priced at the GEMM rate and bandwidth calibrated there; then the output write and peak memory.
void report_stages(const apus::PipelineCost& cost, const std::vector<apus::StageTime>& stages,
                   const char* write_name, double write_s, const std::string& device) {
  const apus::Chip here = apus::device_ceiling(device);
  const nlohmann::json roof = apus::roofline_json(cost, {here, 1});
  auto floor_of = [&](const std::string& stage) -> double {
    for (const auto& s : roof["stages"])
      if (s["name"] == stage) return s["per_call"]["floor_s"].get<double>();
    return 0;
  };
  std::fprintf(stderr, "floors at %.0f GFLOP/s bf16 and %.1f GB/s, this machine's calibration (%s)\n",
               here.bf16_flops / 1e9, here.memory_bps / 1e9, apus::calibration_file().c_str());
  std::fprintf(stderr, "%-20s %10s %10s %6s\n", "stage", "measured", "floor", "ratio");
  for (const auto& s : stages) {
    const double f = s.stage.empty() ? 0 : floor_of(s.stage);
    if (f > 0)
      std::fprintf(stderr, "%-20s %8.3f s %8.3f s %5.2fx\n", s.name.c_str(), s.seconds, f, s.seconds / f);
    else
      std::fprintf(stderr, "%-20s %8.3f s\n", s.name.c_str(), s.seconds);
  }
  std::fprintf(stderr, "%-20s %8.3f s\n", write_name, write_s);
  std::fprintf(stderr, "peak memory %.2f GiB\n", double(apus::peak_rss_bytes()) / double(1u << 30));
}

int run_image(const std::string& model_dir, const apus::ImageRequest& req, int batch,
              const std::string& out, bool verbose, const std::string& trace_file, const std::string& device) {
  // One request per process: each stage's weights are mapped for that stage only.
  const auto model = apus::ImageModel::open(model_dir, apus::Weights::per_stage, device);
  // A batch renders seeds seed, seed + 1, ... together through every stage.
  std::vector<apus::ImageRequest> requests(size_t(batch), req);
  for (int i = 1; i < batch; ++i)
    requests[size_t(i)].seed = req.seed ? std::optional<uint64_t>(*req.seed + uint64_t(i)) : std::nullopt;
  const std::vector<apus::ImageResult> results =
      model->generate_batch(requests, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < batch; ++i) {
    const apus::ImageResult& r = results[size_t(i)];
    apus::write_png(output_name(out, i, batch), r.width, r.height, r.rgb,
                    {{"parameters", apus::infotext(requests[size_t(i)], r, *model)}, {"Software", "apus"}});
  }
  const double write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (verbose) report_stages(model->count(req, batch), results.front().stages, "write png", write_s, device);
  if (!trace_file.empty()) apus::write_trace_file(trace_file, results.front().trace);
  for (int i = 0; i < batch; ++i) std::fprintf(stderr, "wrote %s\n", output_name(out, i, batch).c_str());
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

// The file an option names: an empty name is refused naming the option (the engine's errors name
// the path, and an empty one names nothing).
const std::string& named_file(const std::string& path, const char* flag) {
  APUS_CHECK(!path.empty(), flag, ": an empty file name");
  return path;
}

// Every file a run will write can be created, checked before any model loads.
void check_output(const std::string& out, int batch) {
  named_file(out, "-o");
  for (int i = 0; i < batch; ++i) apus::check_writable(output_name(out, i, batch));
}

// The value of an option given on the command line; absent otherwise, which the engine reads as
// the model's default.
template <typename T>
std::optional<T> if_given(const CLI::Option* option, const T& value) {
  return *option ? std::optional<T>(value) : std::nullopt;
}

// The input clips' files, empty where none was given.
struct ClipFiles {
  std::string init, inpaint;
};

int run_audio(const std::string& model_dir, apus::AudioRequest req, const ClipFiles& clips, int batch,
              const std::string& out, const std::string& format_name, bool verbose,
              const std::string& inputs, const std::string& trace_file, const std::string& device) {
  const apus::AudioFormat format = apus::parse_audio_format(format_name);
  const auto model = apus::AudioModel::open(model_dir, apus::Weights::per_stage, device);
  // Read once the model is open: no clip decodes past the longest the model can use.
  auto read_clip = [&](const std::string& path) {
    apus::Audio a = apus::read_audio(path, model->max_seconds());
    return apus::AudioClip{a.rate, a.channels, std::move(a.samples)};
  };
  if (!clips.init.empty()) req.init_audio = read_clip(clips.init);
  if (!clips.inpaint.empty()) req.inpaint_audio = read_clip(clips.inpaint);
  std::vector<apus::AudioRequest> requests(size_t(batch), req);
  for (int i = 1; i < batch; ++i)
    requests[size_t(i)].seed = req.seed ? std::optional<uint64_t>(*req.seed + uint64_t(i)) : std::nullopt;
  const std::vector<apus::AudioResult> results =
      model->generate_batch(requests, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < batch; ++i) {
    const apus::AudioResult& r = results[size_t(i)];
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", req.seconds);
    char guidance[64] = "";
    if (req.cfg != 1) std::snprintf(guidance, sizeof guidance, ", CFG scale: %g, APG: %g", req.cfg, req.apg);
    const std::string params = "Seconds: " + std::string(seconds) + ", Steps: " + std::to_string(req.steps) + guidance +
                               ", Sampler: " + model->sampler() + ", Seed: " + std::to_string(r.seed) +
                               ", Model: " + model->label() +
                               (req.fp32 ? ", Precision: fp32" : ", Precision: bf16") + inputs;
    apus::Audio audio{r.sample_rate, r.channels, r.samples};
    apus::write_audio(output_name(out, i, batch), audio, format, {req.prompt, params, "apus"});
  }
  const double write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (verbose) report_stages(model->count(req, batch), results.front().stages, "write audio", write_s, device);
  if (!trace_file.empty()) apus::write_trace_file(trace_file, results.front().trace);
  for (int i = 0; i < batch; ++i) std::fprintf(stderr, "wrote %s\n", output_name(out, i, batch).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"apus: diffusion transformers on one device"};
  app.require_subcommand(1);

  apus::ImageRequest req;
  std::string model_dir, out = "out.png";
  bool verbose = false;
  std::string precision = "bf16";
  std::string seed;
  auto* image = app.add_subcommand("image", "render a prompt to a PNG");
  image->add_option("--model", model_dir, "model directory (diffusers layout)")->required();
  image->add_option("--prompt,-p", req.prompt, "text prompt")->required();
  int width = 0, height = 0, steps = 0;
  float cfg = 0;
  auto* width_opt =
      image->add_option("--width,-W", width, "image width, a multiple of 16 (default: the first --image's, or 1024)");
  auto* height_opt =
      image->add_option("--height,-H", height, "image height, a multiple of 16 (default: the first --image's, or 1024)");
  auto* steps_opt = image->add_option("--steps", steps, "sampling steps (default: 4 distilled, 50 -base)");
  auto* cfg_opt = image->add_option("--cfg", cfg, "guidance scale for the -base models (default 4; 1: off)");
  std::vector<std::string> reference_files;
  image->add_option("--image,-i", reference_files,
                    "a reference image to edit from (PNG, JPEG or WebP; repeatable); with --mask, the image to repaint")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  std::string mask_file, inpaint_reference;
  double strength = 0.8;
  auto* mask_opt = image->add_option("--mask", mask_file, "inpainting: repaint the --image where this image is white");
  auto* strength_opt =
      image->add_option("--strength", strength, "inpainting: the share of the schedule run, 0..1 (default 0.8)");
  auto* inpaint_reference_opt =
      image->add_option("--reference", inpaint_reference, "inpainting: a reference image for the repainted area");
  std::string image_negative;
  auto* image_negative_opt =
      image->add_option("--negative-prompt", image_negative, "guidance's unconditional prompt (-base models; default \"\")");
  auto* seed_opt = image->add_option("--seed,-s", seed, "seed of torch's CPU generator");
  auto* noise_opt = image->add_option("--noise", req.noise_file, "safetensors file with tensor 'noise' [1,128,H/16,W/16]");
  image->add_option("--precision", precision, "bf16 (as the official pipeline) or fp32 (parity)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  int batch = 1;
  image->add_option("--batch,-n", batch, "images rendered together, seeds seed, seed+1, ... (-o out.png gives out-1.png, ...)")
      ->check(CLI::Range(1, 64));
  image->add_option("-o,--output", out, "output PNG");
  image->add_flag("-v,--verbose", verbose, "print per-stage times and peak memory");
  std::string image_trace;
  auto* image_trace_opt =
      image->add_option("--trace", image_trace, "write the request's timeline (Chrome trace events, ui.perfetto.dev) here");
  const char* device_help = "cpu, or cuda[:N] where the build has the CUDA backend (not yet run on a GPU)";
  std::string image_device = "cpu";
  image->add_option("--device", image_device, device_help);

  apus::AudioRequest audio_req;
  std::string audio_model, audio_out = "out.wav", audio_format = "wav", audio_precision = "bf16";
  std::string audio_seed;
  int audio_batch = 1;
  bool audio_verbose = false;
  auto* audio = app.add_subcommand("audio", "generate a clip from a prompt (Stable Audio 3)");
  audio->add_option("--model", audio_model, "model directory: the published layout (model_config.json) or diffusers' folders")->required();
  audio->add_option("--prompt,-p", audio_req.prompt, "text prompt")->required();
  audio->add_option("--seconds", audio_req.seconds, "clip length (up to 380 s medium, 120 s small)");
  audio->add_option("--steps", audio_req.steps, "sampling steps (8 for the distilled models)");
  auto* audio_seed_opt = audio->add_option("--seed,-s", audio_seed, "seed of torch's CPU generator");
  audio->add_option("--precision", audio_precision, "bf16 (fast) or fp32 (the official CPU run)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  audio->add_option("--format", audio_format, "wav (16-bit), wav-float or flac");
  audio->add_option("--cfg", audio_req.cfg, "classifier-free guidance scale (1: off, the default; ~7 for -base models)");
  audio->add_option("--apg", audio_req.apg, "adaptive projected guidance share, 0..1 (1: the official default)");
  std::string audio_negative;
  auto* audio_negative_opt = audio->add_option("--negative-prompt", audio_negative, "the unconditional branch's prompt (with --cfg)");
  std::string audio_decode, init_audio, inpaint_audio;
  std::vector<double> inpaint_starts, inpaint_ends;
  auto* init_audio_opt =
      audio->add_option("--init-audio", init_audio, "audio-to-audio: start from this clip (any rate: resampled)");
  double init_noise_level = apus::kDefaultInitNoiseLevel;
  auto* init_level_opt = audio->add_option("--init-noise-level", init_noise_level,
                                           "audio-to-audio: noise mixed into the clip, (0, 1] (default 0.9)");
  auto* inpaint_audio_opt =
      audio->add_option("--inpaint-audio", inpaint_audio, "inpainting: the clip to keep outside the regions");
  audio->add_option("--inpaint-start", inpaint_starts, "inpainting: a region's start in seconds (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  audio->add_option("--inpaint-end", inpaint_ends, "inpainting: a region's end in seconds (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  audio->add_option("--decode", audio_decode, "chunked (the official 128-latent chunks) or whole; default: the model's config")
      ->check(CLI::IsMember({"chunked", "whole"}));
  audio->add_option("--batch,-n", audio_batch, "clips generated together, seeds seed, seed+1, ...")
      ->check(CLI::Range(1, 64));
  audio->add_option("-o,--output", audio_out, "output file");
  audio->add_flag("-v,--verbose", audio_verbose, "print per-stage times and peak memory");
  std::string audio_trace;
  auto* audio_trace_opt =
      audio->add_option("--trace", audio_trace, "write the request's timeline (Chrome trace events, ui.perfetto.dev) here");
  std::string audio_device = "cpu";
  audio->add_option("--device", audio_device, device_help);

  std::string synth_model = "flux2-klein-4b", synth_like, synth_out;
  std::string synth_seed = "0";
  auto* synth = app.add_subcommand("synth", "write a random-weight checkpoint in the published layout");
  auto* synth_model_opt = synth->add_option("--model", synth_model, "published model to mimic")
      ->check(CLI::IsMember(apus::kPublishedModels));
  auto* synth_like_opt =
      synth->add_option("--like", synth_like, "checkpoint folder whose layout to mimic instead")
          ->check(CLI::ExistingDirectory);
  synth_model_opt->excludes(synth_like_opt);
  synth->add_option("--out", synth_out, "output directory")->required();
  synth->add_option("--seed", synth_seed, "weight seed");

  std::string roof_model = "flux2-klein-4b", chip_name = "h200";
  int chips = 1;
  double peak_tflops = 0, gbps = 0, link_gbps = 0;
  bool as_json = false;
  std::string pull_repo, pull_revision = "main";
  auto* pull = app.add_subcommand("pull", "download a Hugging Face repository into the local cache");
  pull->add_option("repo", pull_repo, "ORG/NAME, e.g. black-forest-labs/FLUX.2-klein-4B")->required();
  pull->add_option("--revision", pull_revision, "branch, tag or commit (main)");
  bool refresh = false;
  auto* calibrate = app.add_subcommand("calibrate", "measure this machine's ceilings (bf16 GEMM rate, memory bandwidth) and cache them");
  calibrate->add_flag("--refresh", refresh, "measure again even when a calibration is cached");
  std::string calibrate_device = "cpu";
  calibrate->add_option("--device", calibrate_device, "cpu, or cuda[:N]: the device whose ceilings to measure");
  apus::server::ServeOptions serve_opts;
  auto* serve = app.add_subcommand("serve", "serve the models over HTTP (OpenAI-style images and audio, jobs)");
  serve->add_option("--model", serve_opts.models, "a model directory (repeatable), loaded once")->required();
  serve->add_option("--host", serve_opts.host, "address to listen on (127.0.0.1)");
  serve->add_option("--port", serve_opts.port, "port (8080)")->check(CLI::Range(0, 65535));
  serve->add_option("--queue", serve_opts.queue, "requests that may wait per model (4); more get 429");
  serve->add_option("--api-key", serve_opts.api_key, "require Authorization: Bearer KEY (or APUS_API_KEY)");
  serve->add_option("--cors", serve_opts.cors, "let pages from this origin call the API (off by default)");
  serve->add_option("--device", serve_opts.device, device_help);
  size_t max_body_mb = serve_opts.max_body >> 20;
  serve->add_option("--max-body-mb", max_body_mb, "largest request body in MiB (32): audio inputs come as base64")
      ->check(CLI::Range(1, 4096));
  serve->add_option("--header-timeout", serve_opts.header_seconds,
                    "seconds a client has to send a request's line and headers (10); bodies must move at 64 KiB/s")
      ->check(CLI::Range(0.1, 3600.0));
  serve->add_option("--max-connections", serve_opts.max_connections, "open connections at once (512)")
      ->check(CLI::Range(1, 65536));
  serve->add_option("--max-connections-per-address", serve_opts.max_connections_per_address,
                    "open connections from one client address (64)")
      ->check(CLI::Range(1, 65536));
  size_t kept_results_mb = serve_opts.kept_results_bytes >> 20;
  serve->add_option("--kept-results-mb", kept_results_mb,
                    "MiB of finished jobs' files kept for GET /v1/jobs/{id} (256); the oldest go first")
      ->check(CLI::Range(1, 1 << 20));
  double drain_seconds = 30;
  serve->add_option("--drain-seconds", drain_seconds, "on SIGTERM / SIGINT, let running jobs finish this long (30)")
      ->check(CLI::Range(0.0, 86400.0));
  apus::BenchOptions bench_opts;
  bench_opts.image.prompt = "a red fox in fresh snow, morning light";
  std::string bench_synthetic, bench_seed;
  double bench_seconds = 0;
  int bench_steps = 0;
  auto* bench = app.add_subcommand("bench", "time requests stage by stage against this machine's calibrated ceiling");
  auto* bench_model_opt = bench->add_option("--model", bench_opts.model, "model directory or cached ORG/NAME");
  bench->add_option("--device", bench_opts.device, device_help);
  auto* bench_synthetic_opt =
      bench->add_option("--synthetic", bench_synthetic, "bench `apus synth` weights of this published model (written once)")
          ->check(CLI::IsMember(apus::kPublishedModels));
  bench_model_opt->excludes(bench_synthetic_opt);
  bench->add_option("--prompt,-p", bench_opts.image.prompt, "text prompt");
  int bench_width = 0, bench_height = 0;
  auto* bench_width_opt = bench->add_option("--width,-W", bench_width, "image width");
  auto* bench_height_opt = bench->add_option("--height,-H", bench_height, "image height");
  auto* bench_seconds_opt = bench->add_option("--seconds", bench_seconds, "clip length (audio models)");
  auto* bench_steps_opt = bench->add_option("--steps", bench_steps, "sampling steps (the model's default)");
  std::vector<std::string> bench_images;
  bench->add_option("--image,-i", bench_images, "a reference image to edit from (image models; repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  float bench_cfg = 0;
  auto* bench_cfg_opt = bench->add_option("--cfg", bench_cfg, "guidance scale (the model's default)");
  bench->add_option("--seed,-s", bench_seed, "seed (0)");
  std::string bench_precision = "bf16";
  bench->add_option("--precision", bench_precision, "bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}));
  bench->add_option("--reps", bench_opts.reps, "timed requests (3)")->check(CLI::Range(1, 1000));
  bench->add_option("--warmup", bench_opts.warmup, "untimed requests first (1)")->check(CLI::Range(0, 100));
  auto* bench_json_opt = bench->add_option("--json", bench_opts.json, "write the report (docs/BENCH.md) to this file");
  auto* bench_chart_opt =
      bench->add_option("--chart", bench_opts.chart, "draw each stage against its floor (or the A/B arms) as an SVG");
  bool list_variants = false;
  bench->add_flag("--list-variants", list_variants, "list the kernel variant knobs --ab can compare, and exit");
  auto* bench_ab_opt =
      bench->add_option("--ab", bench_opts.ab, "KNOB=A,B: time two choices of a knob interleaved in this process");
  bench->add_option("--ab-bound", bench_opts.ab_bound,
                    "largest mean |A - B| of the outputs (default: how far flipping the precision moves them)")
      ->check(CLI::NonNegativeNumber);
  auto* bench_trace_opt =
      bench->add_option("--trace", bench_opts.trace, "after the timed requests, trace one more and write its timeline here")
          ->excludes(bench_ab_opt);
  std::vector<std::string> report_files;
  auto* report = app.add_subcommand("report", "a Markdown table of apus bench --json reports");
  report->add_option("reports", report_files, "bench reports")->required()->check(CLI::ExistingFile);
  auto* roofline = app.add_subcommand("roofline", "FLOPs, bytes and floors counted from the model code");
  roofline->add_option("--model", roof_model, "model directory (configs only are read) or a published name (flux2-klein-4b, flux2-klein-9b, stable-audio-3-medium, ...)");
  int roof_width = 0, roof_height = 0, roof_steps = 0;
  auto* roof_width_opt = roofline->add_option("--width,-W", roof_width, "image width");
  auto* roof_height_opt = roofline->add_option("--height,-H", roof_height, "image height");
  auto* roof_steps_opt = roofline->add_option("--steps", roof_steps, "sampling steps");
  double roof_seconds = 30;
  auto* roof_seconds_opt = roofline->add_option("--seconds", roof_seconds, "clip length (audio models)");
  roofline->add_option("--chip", chip_name, "v6e, h200, h100, l4, rtx-pro-6000 or cpu");
  roofline->add_option("--chips", chips, "chips for the collective comparison")->check(CLI::PositiveNumber);
  roofline->add_option("--peak-tflops", peak_tflops, "override the chip's dense bf16 TFLOP/s");
  roofline->add_option("--gbps", gbps, "override the chip's memory GB/s");
  roofline->add_option("--link-gbps", link_gbps, "override the chip's link GB/s (each way)");
  roofline->add_flag("--json", as_json, "print the JSON interface instead of the table");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*image) {
      if (*seed_opt) req.seed = parse_seed(seed);
      check_output(out, batch);
      req.fp32 = precision == "fp32";
      if (*image_negative_opt) req.negative_prompt = image_negative;
      if (*mask_opt) {
        APUS_CHECK(reference_files.size() == 1, "--mask repaints one --image, not ", reference_files.size(),
                   " (a reference for the repainted area goes in --reference)");
        req.inpaint = apus::Inpainting{apus::read_image(named_file(reference_files[0], "--image")),
                                       apus::read_image(named_file(mask_file, "--mask")), strength};
        if (*inpaint_reference_opt) req.references.push_back(apus::read_image(named_file(inpaint_reference, "--reference")));
      } else {
        APUS_CHECK(!*strength_opt && !*inpaint_reference_opt, "--strength and --reference are for inpainting (--mask)");
        for (const std::string& file : reference_files) req.references.push_back(apus::read_image(named_file(file, "--image")));
      }
      if (*noise_opt) named_file(req.noise_file, "--noise");
      req.width = if_given(width_opt, width);
      req.height = if_given(height_opt, height);
      req.steps = if_given(steps_opt, steps);
      req.cfg = if_given(cfg_opt, cfg);
      req.trace = bool(*image_trace_opt);
      if (req.trace) apus::check_writable(named_file(image_trace, "--trace"));
      return run_image(model_dir, req, batch, out, verbose, image_trace, image_device);
    }
    if (*audio) {
      if (*audio_seed_opt) audio_req.seed = parse_seed(audio_seed);
      check_output(audio_out, audio_batch);
      audio_req.fp32 = audio_precision == "fp32";
      if (!audio_decode.empty()) audio_req.chunked_decode = audio_decode == "chunked";
      if (*audio_negative_opt) audio_req.negative_prompt = audio_negative;
      // As the official CLI: regions in pairs, and only with the clip they cut into.
      APUS_CHECK(inpaint_starts.size() == inpaint_ends.size(), "--inpaint-start and --inpaint-end must be given ",
                 "the same number of times (", inpaint_starts.size(), " and ", inpaint_ends.size(), ")");
      APUS_CHECK(inpaint_starts.empty() == !*inpaint_audio_opt,
                 *inpaint_audio_opt ? "--inpaint-audio needs --inpaint-start and --inpaint-end"
                                    : "--inpaint-start/--inpaint-end need --inpaint-audio");
      audio_req.init_noise_level = if_given(init_level_opt, init_noise_level);
      ClipFiles clips;
      std::string inputs;
      char text[96];
      if (*init_audio_opt) {
        clips.init = named_file(init_audio, "--init-audio");
        std::snprintf(text, sizeof text, ", Init noise level: %g", init_noise_level);
        inputs += ", Init audio: " + init_audio + text;
      }
      if (*inpaint_audio_opt) {
        clips.inpaint = named_file(inpaint_audio, "--inpaint-audio");
        inputs += ", Inpaint audio: " + inpaint_audio + ", Inpaint:";
        for (size_t i = 0; i < inpaint_starts.size(); ++i) {
          audio_req.inpaint_regions.emplace_back(inpaint_starts[i], inpaint_ends[i]);
          std::snprintf(text, sizeof text, " %g-%g s", inpaint_starts[i], inpaint_ends[i]);
          inputs += text;
        }
      }
      audio_req.trace = bool(*audio_trace_opt);
      if (audio_req.trace) apus::check_writable(named_file(audio_trace, "--trace"));
      return run_audio(audio_model, audio_req, clips, audio_batch, audio_out, audio_format, audio_verbose, inputs,
                       audio_trace, audio_device);
    }
    if (*calibrate) {
      bool cached = false;
      std::string key;
      const apus::Chip chip = apus::device_ceiling(calibrate_device, refresh, &cached, &key);
      std::printf("%s\n  bf16 GEMM %.0f GFLOP/s, memory %.1f GB/s\n  %s (%s)\n  %s\n", key.c_str(),
                  chip.bf16_flops / 1e9, chip.memory_bps / 1e9, cached ? "cached" : "measured now",
                  apus::calibration_file().c_str(), chip.note.c_str());
      return 0;
    }
    if (*pull) {
      const std::string dir = apus::hf_pull(pull_repo, pull_revision, [](const std::string& l) {
        std::fprintf(stderr, "%s\n", l.c_str());
      });
      std::printf("%s\n", dir.c_str());
      return 0;
    }
    if (*serve) {
      if (serve_opts.api_key.empty())
        if (const char* key = std::getenv("APUS_API_KEY")) serve_opts.api_key = key;
      if (serve_opts.api_key.empty() && serve_opts.host != "127.0.0.1" && serve_opts.host != "localhost" &&
          serve_opts.host != "::1")
        std::fprintf(stderr, "warning: listening on %s without an API key: anyone who reaches it can use it\n",
                     serve_opts.host.c_str());
      // SIGTERM and SIGINT are taken by this thread alone (blocked in every thread the server
      // starts), so a signal becomes a graceful shutdown rather than a kill.
      sigset_t signals;
      sigemptyset(&signals);
      sigaddset(&signals, SIGTERM);
      sigaddset(&signals, SIGINT);
      pthread_sigmask(SIG_BLOCK, &signals, nullptr);
      serve_opts.max_body = max_body_mb << 20;
      serve_opts.kept_results_bytes = kept_results_mb << 20;
      apus::server::Server server(serve_opts);
      const int port = server.start();
      std::fprintf(stderr, "serving %zu model(s) on http://%s:%d\n", serve_opts.models.size(),
                   serve_opts.host.c_str(), port);
      int signal = 0;
      sigwait(&signals, &signal);
      std::fprintf(stderr, "%s: draining (up to %g s), then stopping\n", signal == SIGTERM ? "SIGTERM" : "SIGINT",
                   drain_seconds);
      server.shutdown(drain_seconds);
      std::fprintf(stderr, "stopped\n");
      return 0;
    }
    if (*bench) {
      if (list_variants) {
        apus::print_variants();
        return 0;
      }
      APUS_CHECK(*bench_model_opt || *bench_synthetic_opt, "bench: give --model DIR or --synthetic NAME");
      if (*bench_synthetic_opt)
        // On a device the values are made as the models fetch them, straight into device memory.
        bench_opts.model = apus::synthetic_model_dir(
            bench_synthetic, [](const std::string& l) { std::fprintf(stderr, "%s\n", l.c_str()); },
            bench_opts.device != "cpu");
      const bool audio_bench = apus::is_audio_model(bench_opts.model);
      if (audio_bench) {
        APUS_CHECK(!*bench_width_opt && !*bench_height_opt && bench_images.empty(), bench_opts.model,
                   ": --width/--height/--image are for image models");
        bench_opts.audio.prompt = bench_opts.image.prompt;
        if (*bench_seconds_opt) bench_opts.audio.seconds = bench_seconds;
        if (*bench_steps_opt) bench_opts.audio.steps = bench_steps;
        if (*bench_cfg_opt) bench_opts.audio.cfg = bench_cfg;
        bench_opts.audio.seed = bench_seed.empty() ? 0 : parse_seed(bench_seed);
        bench_opts.audio.fp32 = bench_precision == "fp32";
      } else {
        APUS_CHECK(!*bench_seconds_opt, bench_opts.model, ": --seconds is for audio models");
        for (const std::string& file : bench_images)
          bench_opts.image.references.push_back(apus::read_image(named_file(file, "--image")));
        bench_opts.image.width = if_given(bench_width_opt, bench_width);
        bench_opts.image.height = if_given(bench_height_opt, bench_height);
        bench_opts.image.steps = if_given(bench_steps_opt, bench_steps);
        bench_opts.image.cfg = if_given(bench_cfg_opt, bench_cfg);
        bench_opts.image.seed = bench_seed.empty() ? 0 : parse_seed(bench_seed);
        bench_opts.image.fp32 = bench_precision == "fp32";
      }
      for (const auto& [option, file] : {std::pair{bench_json_opt, &bench_opts.json},
                                         std::pair{bench_trace_opt, &bench_opts.trace},
                                         std::pair{bench_chart_opt, &bench_opts.chart}})
        if (*option) apus::check_writable(named_file(*file, option->get_name().c_str()));
      return apus::run_bench(bench_opts);
    }
    if (*report) {
      std::printf("%s", apus::bench_table(report_files).c_str());
      return 0;
    }
    if (*roofline) {
      // "cpu" is this machine: its calibration, not a table entry measured elsewhere.
      apus::Roofline r{chip_name == "cpu" ? apus::device_ceiling("cpu") : apus::find_chip(chip_name), chips};
      if (peak_tflops > 0) r.chip.bf16_flops = peak_tflops * 1e12;
      if (gbps > 0) r.chip.memory_bps = gbps * 1e9;
      if (link_gbps > 0) r.chip.link_bps = link_gbps * 1e9;
      // Audio models (Stable Audio 3) count a clip; image models a picture.
      apus::PipelineCost cost;
      if (apus::is_audio_model(roof_model)) {
        apus::AudioRequest a;
        a.seconds = roof_seconds;
        if (*roof_steps_opt) a.steps = roof_steps;
        cost = apus::AudioModel::open(roof_model, apus::Weights::none)->count(a);
      } else {
        APUS_CHECK(!*roof_seconds_opt, roof_model, ": --seconds is for audio models");
        apus::ImageRequest roof_req;
        roof_req.width = if_given(roof_width_opt, roof_width);
        roof_req.height = if_given(roof_height_opt, roof_height);
        roof_req.steps = if_given(roof_steps_opt, roof_steps);
        cost = apus::ImageModel::open(roof_model, apus::Weights::none)->count(roof_req);
      }
      cost.model = roof_model;
      if (as_json) std::printf("%s\n", apus::roofline_json(cost, r).dump(2).c_str());
      else std::printf("%s", apus::roofline_table(cost, r).c_str());
      return 0;
    }
    const auto progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    if (*synth_like_opt)
      apus::synth_checkpoint(synth_like, synth_out, parse_seed(synth_seed), progress);
    else
      apus::synth_published(synth_model, synth_out, parse_seed(synth_seed), progress);
    return 0;
  } catch (const std::bad_alloc&) {
    // Engine allocations name their size (apus::Error); this is a library's or the STL's.
    std::fprintf(stderr, "error: out of memory (an allocation failed; the request needs more memory "
                         "than this process may use)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
