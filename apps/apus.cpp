// apus command line: `apus image` renders a prompt, `apus synth` writes a random-weight
// checkpoint in the published layout.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "apus/apus.h"
#include "core/error.h"
#include "cost/roofline.h"
#include "io/png.h"
#include "models/flux2/synth.h"

namespace {

int run_image(const apus::ImageOptions& o, const std::string& out, bool verbose) {
  const apus::ImageResult r = apus::generate_image(o, [](const std::string& line) {
    std::fprintf(stderr, "%s\n", line.c_str());
  });
  const std::string params = o.prompt + "\nSteps: " + std::to_string(o.steps) +
                             ", Sampler: Euler (flow match), CFG scale: 1, Seed: " +
                             std::to_string(r.seed) + ", Size: " + std::to_string(r.width) + "x" +
                             std::to_string(r.height) + ", Model: FLUX.2-klein-4B" +
                             (o.fp32 ? ", Precision: fp32" : ", Precision: bf16") +
                             (o.noise_file.empty() ? "" : ", Noise: " + o.noise_file);
  const auto t0 = std::chrono::steady_clock::now();
  apus::write_png(out, r.width, r.height, r.rgb, {{"parameters", params}, {"Software", "apus"}});
  const double write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (verbose) {
    // Each stage against its floor on this machine, counted from the same model code.
    const apus::PipelineCost cost = apus::count_klein(o.model_dir, o.width, o.height, o.steps);
    const nlohmann::json roof = apus::roofline_json(cost, {apus::find_chip("cpu"), 1});
    auto floor_of = [&](const std::string& stage) -> double {
      const std::string key = stage == "text encoder"                  ? "text_encoder"
                              : stage.rfind("transformer step", 0) == 0 ? "dit_step"
                              : stage == "vae decode"                  ? "vae_decode"
                                                                       : "";
      for (const auto& s : roof["stages"])
        if (s["name"] == key) return s["per_call"]["floor_s"].get<double>();
      return 0;
    };
    std::fprintf(stderr, "%-20s %10s %10s %6s\n", "stage", "measured", "floor", "ratio");
    for (const auto& s : r.stages) {
      const double f = floor_of(s.name);
      if (f > 0)
        std::fprintf(stderr, "%-20s %8.3f s %8.3f s %5.2fx\n", s.name.c_str(), s.seconds, f, s.seconds / f);
      else
        std::fprintf(stderr, "%-20s %8.3f s\n", s.name.c_str(), s.seconds);
    }
    std::fprintf(stderr, "%-20s %8.3f s\n", "write png", write_s);
    std::fprintf(stderr, "peak memory %.2f GiB\n", double(apus::peak_rss_bytes()) / double(1u << 30));
  }
  std::fprintf(stderr, "wrote %s\n", out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"apus: FLUX.2 [klein] text-to-image on one device"};
  app.require_subcommand(1);

  apus::ImageOptions o;
  std::string out = "out.png";
  bool verbose = false;
  std::string precision = "bf16";
  uint64_t seed = 0;
  auto* image = app.add_subcommand("image", "render a prompt to a PNG");
  image->add_option("--model", o.model_dir, "FLUX.2-klein-4B directory (diffusers layout)")->required();
  image->add_option("--prompt,-p", o.prompt, "text prompt")->required();
  image->add_option("--width,-W", o.width, "image width, a multiple of 16");
  image->add_option("--height,-H", o.height, "image height, a multiple of 16");
  image->add_option("--steps", o.steps, "sampling steps (4 for the distilled model)");
  auto* seed_opt = image->add_option("--seed,-s", seed, "seed of torch's CPU generator");
  image->add_option("--noise", o.noise_file, "safetensors file with tensor 'noise' [1,128,H/16,W/16]");
  image->add_option("--precision", precision, "bf16 (as the official pipeline) or fp32 (parity)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  image->add_option("-o,--output", out, "output PNG");
  image->add_flag("-v,--verbose", verbose, "print per-stage times and peak memory");

  std::string synth_model = "flux2-klein-4b", synth_like, synth_out;
  uint64_t synth_seed = 0;
  auto* synth = app.add_subcommand("synth", "write a random-weight checkpoint in the published layout");
  auto* synth_model_opt = synth->add_option("--model", synth_model, "published model to mimic")
      ->check(CLI::IsMember({"flux2-klein-4b"}));
  auto* synth_like_opt =
      synth->add_option("--like", synth_like, "checkpoint folder whose layout to mimic instead")
          ->check(CLI::ExistingDirectory);
  synth_model_opt->excludes(synth_like_opt);
  synth->add_option("--out", synth_out, "output directory")->required();
  synth->add_option("--seed", synth_seed, "weight seed");

  std::string roof_model = "flux2-klein-4b", chip_name = "h200";
  int roof_w = 1024, roof_h = 1024, roof_steps = 4, chips = 1;
  double peak_tflops = 0, gbps = 0;
  bool as_json = false;
  auto* roofline = app.add_subcommand("roofline", "FLOPs, bytes and floors counted from the model code");
  roofline->add_option("--model", roof_model, "model directory (configs only are read) or flux2-klein-4b");
  roofline->add_option("--width,-W", roof_w, "image width");
  roofline->add_option("--height,-H", roof_h, "image height");
  roofline->add_option("--steps", roof_steps, "sampling steps");
  roofline->add_option("--chip", chip_name, "v6e, h200, h100, l4, rtx-pro-6000 or cpu");
  roofline->add_option("--chips", chips, "chips for the collective comparison")->check(CLI::PositiveNumber);
  roofline->add_option("--peak-tflops", peak_tflops, "override the chip's dense bf16 TFLOP/s");
  roofline->add_option("--gbps", gbps, "override the chip's memory GB/s");
  roofline->add_flag("--json", as_json, "print the JSON interface instead of the table");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*image) {
      if (*seed_opt) o.seed = seed;
      o.fp32 = precision == "fp32";
      return run_image(o, out, verbose);
    }
    if (*roofline) {
      apus::Roofline r{apus::find_chip(chip_name), chips};
      if (peak_tflops > 0) r.chip.bf16_flops = peak_tflops * 1e12;
      if (gbps > 0) r.chip.memory_bps = gbps * 1e9;
      const apus::PipelineCost cost = apus::count_klein(roof_model, roof_w, roof_h, roof_steps);
      if (as_json) std::printf("%s\n", apus::roofline_json(cost, r).dump(2).c_str());
      else std::printf("%s", apus::roofline_table(cost, r).c_str());
      return 0;
    }
    const auto progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    if (*synth_like_opt)
      apus::flux2::synth_checkpoint(synth_like, synth_out, synth_seed, progress);
    else
      apus::flux2::synth_klein_4b(synth_out, synth_seed, progress);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
