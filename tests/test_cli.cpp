// The apus CLI end to end on the fixture models: the PNG, its metadata and its pixels, and
// one-line errors with a non-zero exit for bad input.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "io/files.h"
#include "io/media/png.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#endif
#include "io/weights/safetensors.h"
#include "sa3_fixtures.h"
#include "test_util.h"

namespace apus {
namespace {

class CliImage : public ::testing::TestWithParam<std::string> {};

TEST_P(CliImage, SeededRunReproducesTheOfficialImage) {
  const std::string variant = GetParam();
  const test::Reference ref(variant);
  const std::string out = ::testing::TempDir() + variant + "_cli.png";
  const int w = ref.meta["width"], h = ref.meta["height"], seed = ref.meta["seed"], steps = ref.meta["steps"];
  // The distilled models' 4 steps are apus's default; a -base model's 50 would be, so its fixture's
  // steps and guidance scale are asked for.
  const bool distilled = ref.meta["is_distilled"];
  char scale[32];
  std::snprintf(scale, sizeof scale, "%g", ref.meta["guidance_scale"].get<double>());
  const test::CliRun r =
      test::run_cli("image --model " + test::fixture(variant) + " --prompt " +
                    test::shell_quote(ref.meta["prompt"].get<std::string>()) + " --width " + std::to_string(w) +
                    " --height " + std::to_string(h) + " --seed " + std::to_string(seed) +
                    (distilled ? "" : " --steps " + std::to_string(steps) + " --cfg " + scale) + " -v -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("seed " + std::to_string(seed)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step " + std::to_string(steps) + "/" + std::to_string(steps)), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("peak memory"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("this machine's calibration"), std::string::npos) << r.output;

  const PngImage png = read_png(out);
  ASSERT_EQ(png.width, w);
  ASSERT_EQ(png.height, h);
  std::string params;
  for (const auto& [k, v] : png.text)
    if (k == "parameters") params = v;
  EXPECT_NE(params.find(ref.meta["prompt"].get<std::string>()), std::string::npos) << params;
  EXPECT_NE(params.find("Seed: " + std::to_string(seed)), std::string::npos) << params;
  EXPECT_NE(params.find("Steps: " + std::to_string(steps)), std::string::npos) << params;
  char guidance[48];
  std::snprintf(guidance, sizeof guidance, "CFG scale: %g,",
                distilled ? 1.0 : ref.meta["guidance_scale"].get<double>());
  EXPECT_NE(params.find(guidance), std::string::npos) << params;
  EXPECT_NE(params.find("Size: " + std::to_string(w) + "x" + std::to_string(h)), std::string::npos);

  // The seeded bf16 draw is the noise the bf16 reference ran from, so the bound is the
  // reference's own bf16-vs-fp32 disagreement on the final bytes.
  const Tensor& ref_bf16 = ref.file.get("bf16.image_u8");
  const Tensor& ref_fp32 = ref.file.get("fp32.image_u8");
  const double ref_disagreement = test::level_gap(ref_bf16, ref_fp32).mean;
  const double ours_to_fp32 = test::level_gap(png.rgb, ref_fp32).mean;
  const double ours_to_bf16 = test::level_gap(png.rgb, ref_bf16).mean;
  std::printf("[ measure ] cli %s mean |d| to fp32 ref %.3f, to bf16 ref %.3f, ref disagreement %.3f\n",
              variant.c_str(), ours_to_fp32, ours_to_bf16, ref_disagreement);
  EXPECT_LT(ours_to_fp32, test::kBf16Factor * ref_disagreement);
  EXPECT_LT(ours_to_bf16, test::kBf16Factor * ref_disagreement);
  std::filesystem::remove(out);
}

TEST_P(CliImage, Fp32ParityModeMatchesTheFp32Reference) {
  const std::string variant = GetParam();
  const test::Reference ref(variant);
  // The fp32 reference ran from the bf16 draw; hand the same noise over as a file.
  const std::string noise = ::testing::TempDir() + variant + "_noise.safetensors";
  write_safetensors(noise, {{"noise", ref.file.get("fp32.noise")}});
  const std::string out = ::testing::TempDir() + variant + "_fp32.png";
  const test::CliRun r =
      test::run_cli("image --model " + test::fixture(variant) + " --prompt " +
                    test::shell_quote(ref.meta["prompt"].get<std::string>()) + " --width " +
                    std::to_string(int(ref.meta["width"])) + " --height " + std::to_string(int(ref.meta["height"])) +
                    " --noise " + noise + " --steps " + std::to_string(int(ref.meta["steps"])) + " --cfg " +
                    std::to_string(ref.meta["guidance_scale"].get<double>()) + " --precision fp32 -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  const PngImage png = read_png(out);
  const Tensor& want = ref.file.get("fp32.image_u8");
  ASSERT_EQ(png.rgb.size(), size_t(want.numel()));
  const int worst = test::level_gap(png.rgb, want).worst;
  EXPECT_LE(worst, 1) << "fp32 pixels differ from the fp32 reference by up to " << worst;
  std::filesystem::remove(out);
  std::filesystem::remove(noise);
}

INSTANTIATE_TEST_SUITE_P(Klein, CliImage,
                         ::testing::Values("klein_tiny_a", "klein_tiny_b", "klein_tiny_base", "klein_tiny_9b"));

// An edit the oracle rendered, through the CLI: `args` (model, prompt, reference images) from the
// fixture's seed in bf16, at the fixture's size and within twice the reference's own bf16-vs-fp32
// disagreement of the bf16 image; then from the fixture's fp32 noise in fp32, within one level of the
// fp32 image everywhere. Returns the bf16 run and its image for the caller's own checks.
struct EditRun {
  test::CliRun run;
  PngImage png;
};
EditRun expect_official_edit(const std::string& name, const std::string& args, const SafetensorsFile& ref,
                             const Json& meta) {
  const std::string out = ::testing::TempDir() + name + ".png";
  EditRun e{test::run_cli(args + " --seed " + std::to_string(meta["seed"].get<int>()) + " -v -o " + out), {}};
  EXPECT_EQ(e.run.status, 0) << e.run.output;
  if (e.run.status != 0) return e;
  e.png = read_png(out);
  EXPECT_EQ(e.png.width, meta["width"].get<int>());
  EXPECT_EQ(e.png.height, meta["height"].get<int>());
  const Tensor& ref_bf16 = ref.get("bf16.image_u8");
  const Tensor& ref_fp32 = ref.get("fp32.image_u8");
  const double disagreement = test::level_gap(ref_bf16, ref_fp32).mean;
  const double to_bf16 = test::level_gap(e.png.rgb, ref_bf16).mean;
  std::printf("[ measure ] %s mean |d| to bf16 ref %.3f, ref disagreement %.3f\n", name.c_str(), to_bf16, disagreement);
  EXPECT_LT(to_bf16, test::kBf16Factor * disagreement);

  const std::string noise = ::testing::TempDir() + name + "_noise.safetensors",
                    out32 = ::testing::TempDir() + name + "32.png";
  write_safetensors(noise, {{"noise", ref.get("fp32.noise")}});
  const test::CliRun r32 = test::run_cli(args + " --noise " + noise + " --precision fp32 -o " + out32);
  EXPECT_EQ(r32.status, 0) << r32.output;
  if (r32.status != 0) return e;
  const PngImage png32 = read_png(out32);
  EXPECT_EQ(png32.rgb.size(), size_t(ref_fp32.numel()));
  const int worst = test::level_gap(png32.rgb, ref_fp32).worst;
  EXPECT_LE(worst, 1) << "fp32 " << name << " differs from the fp32 reference by up to " << worst;
  return e;
}

// Editing with two reference images (tools/oracle reference_edit): the first, 72x70, centre-cropped
// to 64x64, sets the output size; the second, 64x96, is taken as it is. No -W/-H.
TEST(CliEdit, ReferenceImagesReproduceTheOfficialEdit) {
  const std::string refs = test::fixture("klein_tiny_a_edit");
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("klein_tiny_a_edit_ref.safetensors"));
  const Json meta = read_json(test::fixture("klein_tiny_a_edit_ref.json"));
  const EditRun e = expect_official_edit("edit",
                                         "image --model " + test::fixture("klein_tiny_a") + " --prompt " +
                                             test::shell_quote(meta["prompt"].get<std::string>()) + " --image " + refs +
                                             "/ref0.png --image " + refs + "/ref1.png",
                                         ref, meta);
  EXPECT_NE(e.run.output.find("vae encode"), std::string::npos) << e.run.output;
  // Here the fp32 image is held to the same bound too.
  const Tensor& ref_fp32 = ref.get("fp32.image_u8");
  EXPECT_LT(test::level_gap(e.png.rgb, ref_fp32).mean,
            test::kBf16Factor * test::level_gap(ref.get("bf16.image_u8"), ref_fp32).mean);
}

// Flux2KleinKVPipeline (the -kv checkpoints, tools/oracle reference_kv) on the 9B-shaped model:
// two references whose tokens run once at timestep 0, attending only to each other, their keys
// and values cached for every step (Flux2KvCache in test_flux2_stages.cpp holds the transformer's
// velocities to the reference's, where the cache's semantics show more than in these pixels).
TEST(CliEdit, ReferenceCacheReproducesTheOfficialKvPipeline) {
  const std::string model = test::fixture("klein_tiny_9b_kv"), refs = test::fixture("klein_tiny_9b_kv_refs");
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture("klein_tiny_9b_kv_ref.safetensors"));
  const Json meta = read_json(test::fixture("klein_tiny_9b_kv_ref.json"));
  const std::string args = " --prompt " + test::shell_quote(meta["prompt"].get<std::string>()) + " --image " + refs +
                           "/ref0.png --image " + refs + "/ref1.png";
  const std::string out = ::testing::TempDir() + "kv.png";
  const EditRun e = expect_official_edit("kv", "image --model " + model + args, ref, meta);
  EXPECT_NE(e.run.output.find("step 4/4"), std::string::npos) << "the KV pipeline's 4 steps by default\n"
                                                              << e.run.output;

  // The KV pipeline has neither guidance nor inpainting.
  const test::CliRun guided = test::run_cli("image --model " + model + args + " --cfg 3 -o " + out);
  EXPECT_NE(guided.status, 0);
  EXPECT_NE(guided.output.find("Flux2KleinKVPipeline model (model_index.json), which runs without guidance"),
            std::string::npos)
      << guided.output;
  const test::CliRun inpaint = test::run_cli("image --model " + model + " -p x --image " + refs + "/ref0.png --mask " +
                                             refs + "/ref1.png -o " + out);
  EXPECT_NE(inpaint.status, 0);
  EXPECT_NE(inpaint.output.find("has no inpainting"), std::string::npos) << inpaint.output;
}

// References the pipeline would refuse (check_image_input) are refused naming the image; so is a
// file that is not an image. One over 1024x1024 pixels is resized and runs.
TEST(CliEdit, ReferencesThePipelineRefusesAreRefusedLargeOnesResized) {
  const std::string model = test::fixture("klein_tiny_a"), dir = ::testing::TempDir();
  auto png_of = [&](const std::string& name, int w, int h) {
    const std::string path = dir + name;
    write_png(path, w, h, std::vector<uint8_t>(size_t(w) * size_t(h) * 3, 128), {});
    return path;
  };
  const struct {
    std::string file, expect;
  } cases[] = {
      {png_of("small.png", 48, 80), "reference image 1 is 48x80: both sides must be at least 64 pixels"},
      {png_of("thin.png", 64, 640), "reference image 1 is 64x640: the aspect ratio must be at most 8:1"},
      {test::fixture("klein_tiny_a_ref.json"), "klein_tiny_a_ref.json"},
  };
  // Over 1024x1024 pixels a reference is resized (with PIL's Lanczos filter), not refused.
  const test::CliRun large = test::run_cli("image --model " + model + " -p x --steps 1 -W 32 -H 32 --image " +
                                           png_of("large.png", 1040, 1024) + " -v -o " + dir + "large_ref.png");
  EXPECT_EQ(large.status, 0) << large.output;
  EXPECT_NE(large.output.find("vae encode"), std::string::npos) << large.output;
  for (const auto& c : cases) {
    const test::CliRun r =
        test::run_cli("image --model " + model + " -p x --steps 1 --image " + c.file + " -o " + dir + "refused.png");
    EXPECT_NE(r.status, 0) << c.file;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("error: "), std::string::npos) << r.output;
  }
}

// Inpainting (tools/oracle reference_inpaint): a 100x84 image resized to 96x80, a 75x61 mask, on
// the distilled model with a reference image at strength 0.6 (3 of 4 steps) and on the -base
// model with guidance at strength 0.8. bf16 from the seed against the bf16 reference, bounded by
// the official code's own bf16-vs-fp32 disagreement (fp32 run from the same bf16 draw); fp32 from
// the seed (the fp32 draw) within one level of the fp32 reference everywhere.
class CliInpaint : public ::testing::TestWithParam<std::string> {};

TEST_P(CliInpaint, ReproducesTheOfficialInpainting) {
  const std::string variant = GetParam(), dir = test::fixture(variant + "_inpaint") + "/";
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture(variant + "_inpaint_ref.safetensors"));
  const Json meta = read_json(test::fixture(variant + "_inpaint_ref.json"));
  char numbers[96];
  std::snprintf(numbers, sizeof numbers, " --strength %.17g --cfg %.17g --steps %d --seed %d",
                meta["strength"].get<double>(), meta["guidance_scale"].get<double>(), meta["steps"].get<int>(),
                meta["seed"].get<int>());
  const std::string args =
      "image --model " + test::fixture(variant) + " --prompt " + test::shell_quote(meta["prompt"].get<std::string>()) +
      " --image " + dir + "image.png --mask " + dir + "mask.png" +
      (meta["files"].contains("reference") ? " --reference " + dir + "reference.png" : "") + numbers;
  const std::string out = ::testing::TempDir() + variant + "_inpaint.png";
  const test::CliRun r = test::run_cli(args + " -v -o " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  const int run = meta["steps_run"];
  EXPECT_NE(r.output.find("step " + std::to_string(run) + "/" + std::to_string(run)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("vae encode"), std::string::npos) << r.output;
  const PngImage png = read_png(out);
  ASSERT_EQ(png.width, meta["width"].get<int>());
  ASSERT_EQ(png.height, meta["height"].get<int>());
  std::string params;
  for (const auto& [k, v] : png.text)
    if (k == "parameters") params = v;
  char strength[64];
  std::snprintf(strength, sizeof strength, "Denoising strength: %g,", meta["strength"].get<double>());
  EXPECT_NE(params.find(strength), std::string::npos) << params;
  const Tensor& ref_bf16 = ref.get("bf16.image_u8");
  const double disagreement = test::level_gap(ref_bf16, ref.get("fp32_bf16_noise.image_u8")).mean;
  const double to_bf16 = test::level_gap(png.rgb, ref_bf16).mean;
  std::printf("[ measure ] %s inpainting mean |d| to bf16 ref %.3f, ref disagreement %.3f\n", variant.c_str(), to_bf16,
              disagreement);
  EXPECT_LT(to_bf16, test::kBf16Factor * disagreement);

  const std::string out32 = ::testing::TempDir() + variant + "_inpaint32.png";
  const test::CliRun r32 = test::run_cli(args + " --precision fp32 -o " + out32);
  ASSERT_EQ(r32.status, 0) << r32.output;
  const PngImage png32 = read_png(out32);
  const Tensor& ref_fp32 = ref.get("fp32.image_u8");
  ASSERT_EQ(png32.rgb.size(), size_t(ref_fp32.numel()));
  const int worst = test::level_gap(png32.rgb, ref_fp32).worst;
  EXPECT_LE(worst, 1) << "fp32 inpainting differs from the fp32 reference by up to " << worst;
  std::filesystem::remove(out);
  std::filesystem::remove(out32);
}

INSTANTIATE_TEST_SUITE_P(Klein, CliInpaint, ::testing::Values("klein_tiny_a", "klein_tiny_base"));

// What inpainting cannot take is refused before any weight loads, naming the flag or the value.
TEST(CliInpaint, BadInputIsRefused) {
  const std::string model = " --model " + test::fixture("klein_tiny_a"),
                    dir = test::fixture("klein_tiny_a_inpaint") + "/";
  const std::string image = " --image " + dir + "image.png", mask = " --mask " + dir + "mask.png";
  const std::string tiny = ::testing::TempDir() + "apus_tiny.png";
  write_png(tiny, 20, 12, std::vector<uint8_t>(20 * 12 * 3, 7), {});
  const struct {
    std::string args, expect;
  } cases[] = {
      {image + " --strength 0.5", "--strength and --reference are for inpainting (--mask)"},
      {image + " --reference " + dir + "reference.png", "--strength and --reference are for inpainting (--mask)"},
      {image + " --image " + dir + "reference.png" + mask, "--mask repaints one --image, not 2"},
      {mask, "--mask repaints one --image, not 0"},
      {image + " --mask " + test::fixture("klein_tiny_a_ref.json"), "klein_tiny_a_ref.json"},
      {image + mask + " --strength 1.5", "strength 1.5 outside [0, 1]"},
      {image + mask + " --strength 0", "strength 0 of 4 steps runs no step"},
      {image + mask + " -W 64 -H 64", "inpainting renders at the image's size, 96x80, not the 64x64 asked"},
      {" --image " + tiny + mask, "the image to inpaint is 20x12: both sides must be at least 16 pixels"},
      {image + mask + " --reference " + tiny, "the reference image is 20x12: both sides must be at least 16 pixels"},
  };
  for (const auto& c : cases) {
    const test::CliRun r =
        test::run_cli("image" + model + " -p x" + c.args + " -o " + ::testing::TempDir() + "refused.png");
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find("error: "), std::string::npos) << r.output;
  }
  std::filesystem::remove(tiny);
}

TEST(Cli, BatchWritesOneFilePerSeedEachAsItsOwnRun) {
  const std::string model = test::fixture("klein_tiny_a"), dir = ::testing::TempDir();
  const test::CliRun batch = test::run_cli(
      "image --model " + model + " --prompt 'a red fox' -W 64 -H 48 --seed 5 -n 2 -o " + dir + "apus_batch.png");
  ASSERT_EQ(batch.status, 0) << batch.output;
  const test::CliRun single = test::run_cli("image --model " + model +
                                            " --prompt 'a red fox' -W 64 -H 48 --seed 6 -o " + dir + "apus_single.png");
  ASSERT_EQ(single.status, 0) << single.output;
  const PngImage second = read_png(dir + "apus_batch-2.png");
  EXPECT_EQ(second.rgb, read_png(dir + "apus_single.png").rgb);
  EXPECT_NE(second.rgb, read_png(dir + "apus_batch-1.png").rgb);
  bool seed6 = false;
  for (const auto& [k, v] : second.text) seed6 |= k == "parameters" && v.find("Seed: 6") != std::string::npos;
  EXPECT_TRUE(seed6);
  for (const char* f : {"apus_batch-1.png", "apus_batch-2.png", "apus_single.png"}) std::filesystem::remove(dir + f);
}

// The format written is the one the output's name promises: -o x.flac writes FLAC without --format
// (it used to write a WAV under that name), -o x.wav a WAV.
TEST(Cli, AudioFormatFollowsTheOutputsExtension) {
  const std::string dir = ::testing::TempDir();
  for (const auto& [name, magic] : {std::pair{"apus_ext.flac", "fLaC"}, std::pair{"apus_ext.wav", "RIFF"}}) {
    const test::CliRun r =
        test::run_cli("audio --model " + test::official_dir() + " -p hi --seconds 1 --seed 3 -o " + dir + name);
    ASSERT_EQ(r.status, 0) << r.output;
    std::ifstream f(dir + name, std::ios::binary);
    char head[4] = {};
    f.read(head, 4);
    EXPECT_EQ(std::string(head, 4), magic) << name;
    std::filesystem::remove(dir + name);
  }
}

// Without -o a result goes to outputs/ under the next free number: a second run keeps the first's
// file, the batch's names follow the number, a clip takes its format's extension.
TEST(Cli, UnnamedOutputsNeverWriteOverEarlierOnes) {
  const std::string dir = test::scratch_dir.path() + "unnamed_outputs";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/outputs");
  std::ofstream(dir + "/outputs/00007-kept.png") << "a user's file";
  const std::string in_dir = "cd " + test::shell_quote(dir) + " && ";
  const std::string image = "image --model " + test::fixture("klein_tiny_a") + " -p x -W 32 -H 32 --steps 1 -s 1";
  for (const char* extra : {"", " -n 2"}) {
    const test::CliRun r = test::run_cli(image + extra, in_dir);
    ASSERT_EQ(r.status, 0) << r.output;
  }
  const test::CliRun clip = test::run_cli(
      "audio --model " + test::official_dir() + " -p rain --seconds 1 --steps 1 -s 1 --format flac", in_dir);
  ASSERT_EQ(clip.status, 0) << clip.output;
  EXPECT_NE(clip.output.find("wrote outputs/00010.flac"), std::string::npos) << clip.output;
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/outputs"))
    names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"00007-kept.png", "00008.png", "00009-1.png", "00009-2.png", "00010.flac"}));
  EXPECT_EQ(read_file(dir + "/outputs/00007-kept.png"), "a user's file");
}

TEST(Cli, VersionNamesTheReleaseAndBackends) {
  const test::CliRun r = test::run_cli("--version");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind(std::string("apus ") + version() + " (", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("backend"), std::string::npos) << r.output;
}

TEST(CliErrors, BadInputGivesOneLineErrorAndNonZeroExit) {
  const std::string model = test::fixture("klein_tiny_a");
  std::string long_prompt;  // digits tokenise one by one: well over 512 tokens
  for (int i = 0; i < 300; ++i) long_prompt += "lighthouse 12345 ";
  struct Case {
    std::string args, expect;
  };
  const std::string wrong_noise = ::testing::TempDir() + "apus_wrong_noise.safetensors";
  Tensor small = Tensor::heap({1, 128, 2, 2}, DType::f32);
  std::memset(small.data, 0, small.nbytes());
  write_safetensors(wrong_noise, {{"noise", small}});
  const std::vector<Case> cases = {
      {"image --model /nonexistent --prompt hi", "/nonexistent"},
      {"image --model " + model + " --prompt hi --width 100", "multiples of 16"},
      {"image --model " + model + " --prompt hi --width 65536 --height 65536", "outside"},
      {"image --model " + model + " --prompt ''", "prompt is empty"},
      {"image --model " + model + " --prompt " + test::shell_quote(long_prompt), "over the 512"},
      {"image --model " + model + " --prompt hi --noise /nonexistent.safetensors", "/nonexistent.safetensors"},
      {"image --model " + model + " --prompt hi --steps 0", "steps"},
      {"image --model " + model + " --prompt hi -W 64 -H 48 --noise " + wrong_noise, "expected [1, 128, 3, 4]"},
      // Caught before any work: seeds that torch would not take, a file as the model, outputs
      // that cannot be written.
      {"image --model " + model + " --prompt hi --seed 18446744073709551616", "--seed 18446744073709551616: expected"},
      {"image --model " + model + " --prompt hi --seed -1", "--seed -1: expected a whole number"},
      {"audio --model /x --prompt hi --seed 1e3", "--seed 1e3: expected"},
      {"image --model " + test::fixture("klein_tiny_a_ref.json") + " --prompt hi",
       "klein_tiny_a_ref.json: neither a GGUF nor a safetensors file"},
      {"image --model " + model + " --prompt hi -W 64 -H 48 -o /nonexistent-dir/x.png",
       "cannot create a file in /nonexistent-dir/"},
      {"image --model " + model + " --prompt hi -W 64 -H 48 -o " + ::testing::TempDir(),
       "is a directory, not a regular file"},
      // An output name promising another format than the one written.
      {"image --model " + model + " --prompt hi -o " + ::testing::TempDir() + "apus_x.gif",
       "apus_x.gif: apus writes images as .png, .jpg (or .jpeg) and .webp files"},
      {"image --model " + model + " --prompt hi --quality 0 -o " + ::testing::TempDir() + "apus_x.jpg",
       "--quality 0: expected 1..100"},
      {"audio --model /x --prompt hi -o " + ::testing::TempDir() + "apus_x.mp3", "apus_x.mp3: apus audio writes .wav"},
      {"audio --model /x --prompt hi --format flac -o " + ::testing::TempDir() + "apus_x.wav",
       "--format flac and -o " + ::testing::TempDir() + "apus_x.wav: the file's extension names another format"},
      {"audio --model /x --prompt hi --format ogg", "audio format 'ogg' is not one of wav, wav-float, flac"},
  };
  for (const auto& c : cases) {
    const test::CliRun r = test::run_cli(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find("error: "), std::string::npos) << r.output;
    size_t lines = 0;
    for (char ch : r.output) lines += ch == '\n';
    EXPECT_LE(lines, 1u) << r.output;
  }
}

// Settings a tool would otherwise accept and ignore or print nonsense for: the gate's --seconds
// on an image model (and -W on an audio one), roofline's rate overrides outside what a chip can
// have (a negative one used to be dropped, inf gave floors of 0 s, 1e308 300-digit figures).
TEST(CliErrors, ToolSettingsOutsideTheirMeaningAreRefusedNamingTheFlag) {
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {"gate --model " + test::fixture("klein_tiny_a") + " --quant int8 --seconds 5", "--seconds is for audio models"},
      {"gate --model " + test::pipeline_dir() + " --quant int8 -W 64", "--width and --height are for image models"},
      {"gate --model " + test::fixture("klein_tiny_a") + " --candidate " +
           test::fixture("sa3_gguf/medium/stable-audio-3-medium-dit-tiny-v1.0-F32.gguf"),
       "is an audio model's file, and --model"},
      {"roofline --peak-tflops -1", "--peak-tflops -1: expected a rate in TFLOP/s from 0.001 to 1e+06"},
      {"roofline --peak-tflops nan", "--peak-tflops nan: expected a rate"},
      {"roofline --json --peak-tflops inf", "--peak-tflops inf: expected a rate"},
      {"roofline --peak-tflops 1e308", "--peak-tflops 1e+308: expected a rate"},
      {"roofline --gbps 1e-300", "--gbps 1e-300: expected a rate in GB/s"},
      {"roofline --link-gbps 0", "--link-gbps 0: expected a rate in GB/s"},
  };
  for (const Case& c : cases) {
    const test::CliRun r = test::run_cli(c.args);
    EXPECT_EQ(r.status, 1) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find("error: "), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
  }
  const test::CliRun chips = test::run_cli("roofline --chips 0");
  EXPECT_NE(chips.status, 0);
  EXPECT_NE(chips.output.find("--chips: Value 0 not in range 1 to 4096"), std::string::npos) << chips.output;
}

// An explicit 0 is a value the engine checks, not "absent": it must not render at a default size,
// the reference's height, or without the guidance asked for.
TEST(CliErrors, ExplicitZerosAreRefusedNamingTheSetting) {
  const std::string model = test::fixture("klein_tiny_a"), base = test::fixture("klein_tiny_base");
  const std::string out = ::testing::TempDir() + "apus_zero.png";
  const std::string reference = test::fixture("klein_tiny_a_edit/ref0.png");
  struct Case {
    std::string args, expect;
  };
  const std::string image = "image -o " + out + " -p hi --model ";
  const std::vector<Case> cases = {
      {image + model + " -W 0 -H 48", "width 0 outside 16..4096"},
      {image + model + " -H 0 --image " + reference, "height 0 outside 16..4096"},
      {image + model + " -W 64 -H 48 --steps 0", "steps 0 outside 1..200"},
      {image + model + " -W 64 -H 48 --cfg 0", "cfg 0 outside (0, 100]"},
      {image + base + " -W 64 -H 48 --steps 2 --cfg 0", "cfg 0 outside (0, 100]"},
      {"roofline --model flux2-klein-4b -W 0", "width 0 outside 16..4096"},
      {"bench --model " + model + " -W 64 -H 0 --reps 1 --warmup 0", "height 0"},
  };
  for (const Case& c : cases) {
    const test::CliRun r = test::run_cli(c.args);
    EXPECT_EQ(r.status, 1) << c.args << "\n" << r.output;
    const size_t at = r.output.rfind("error: ");
    ASSERT_NE(at, std::string::npos) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect, at), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_FALSE(std::filesystem::exists(out)) << c.args;
  }
  // Absent is still the model's default.
  const test::CliRun defaults =
      test::run_cli("image --model " + model + " -p hi --image " + reference + " --steps 1 -o " + out);
  ASSERT_EQ(defaults.status, 0) << defaults.output;
  const PngImage png = read_png(out);
  const PngImage ref = read_png(reference);
  EXPECT_EQ(png.width, ref.width / 16 * 16);
  EXPECT_EQ(png.height, ref.height / 16 * 16);
  std::filesystem::remove(out);
}

TEST(CliErrors, CudaWithoutAUsableGpuSaysSoAndWhatWasFound) {
  const std::string out = ::testing::TempDir() + "apus_cuda.png";
  const test::CliRun r =
      test::run_cli("image --model " + test::fixture("klein_tiny_a") + " -p hi -W 64 -H 48 --device cuda -o " + out);
#if APUS_HAS_CUDA
  std::string why;
  if (cuda_available(&why)) GTEST_SKIP() << "a GPU is usable here";
  EXPECT_EQ(r.status, 1) << r.output;
  // What the runtime said, and what the driver's version (0: none) tells about it.
  for (const char* part : {"device cuda:0: no usable CUDA GPU (cudaGetDeviceCount: ", "; ", ")"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  EXPECT_TRUE(r.output.find("no NVIDIA driver is loaded") != std::string::npos ||
              r.output.find("the driver supports CUDA ") != std::string::npos)
      << r.output;
#else
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("this build has no CUDA backend"), std::string::npos) << r.output;
#endif
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out));
}

TEST(CliErrors, RequestTooLargeForThisMachineIsRefusedBeforeLoading) {
  // The engine's own published-layout configs (no weights): the memory check runs before any
  // weight file would be opened.
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  if (ram > 64e9) GTEST_SKIP() << "this machine could hold a 4096x4096 decode";
  const std::string published = std::string(APUS_FIXTURES) + "/../../data/flux2-klein-4b";
  const test::CliRun r = test::run_cli("image --model " + published + " --prompt hi -W 4096 -H 4096");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("needs about"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("vae_decode"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace apus
