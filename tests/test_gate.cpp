// `apus gate` (gate/gate.h) and its metrics (gate/metrics.h): the image metrics against the
// libraries they follow (tools/oracle/make_gate_metric_fixtures.py), the rule, and whole gates on
// the tiny oracle models: the int8 tier passes, another model's weights fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "apus/apus.h"
#include "gate/gate.h"
#include "gate/metrics.h"
#include "io/model_dir.h"
#include "io/weights/synth.h"
#include "ops/cpu/cpu_ops.h"
#include "pipeline/registry.h"
#include "sa3_fixtures.h"
#include "test_util.h"

namespace apus {
namespace {

// The fixture script's formula images.
Rgb8Image formula(int w, int h, const std::string& kind) {
  Rgb8Image im{w, h, std::vector<uint8_t>(size_t(w) * size_t(h) * 3)};
  auto base = [](int x, int y, int c) { return (x * 13 + y * 7 + c * 50 + ((x * y) % 17) * 5) % 256; };
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        int v = base(x, y, c);
        if (kind == "noisy") v = std::clamp(v + (x * 31 + y * 17 + c * 11) % 23 - 11, 0, 255);
        if (kind == "blurred") {
          int sum = 0;
          for (int dy = -1; dy <= 1; ++dy)
            for (int dx = -1; dx <= 1; ++dx) sum += base(std::clamp(x + dx, 0, w - 1), std::clamp(y + dy, 0, h - 1), c);
          v = int(std::floor(sum / 9.0 + 0.5));
        }
        im.rgb[(size_t(y) * size_t(w) + size_t(x)) * 3 + size_t(c)] = uint8_t(v);
      }
  return im;
}

TEST(GateMetrics, ImageScoresAreTheLibrariesScores) {
  const Json ref = read_json(test::fixture("gate_metrics_ref.json"));
  for (const Json& c : ref["cases"]) {
    const int w = c["width"], h = c["height"];
    const ImageScores s = image_scores(formula(w, h, c["image"]), formula(w, h, c["reference"]));
    const std::string what = std::to_string(w) + "x" + std::to_string(h) + " " + c["image"].get<std::string>();
    std::printf("[ measure ] %s: PSNR %.6f (skimage %.6f), SSIM %.8f (skimage %.8f), GMSD %.8f (piq %.8f)\n",
                what.c_str(), s.psnr, c["psnr"].get<double>(), s.ssim, c["ssim"].get<double>(), s.gmsd,
                c["gmsd"].get<double>());
    EXPECT_NEAR(s.psnr, c["psnr"].get<double>(), 1e-9) << what;
    EXPECT_NEAR(s.ssim, c["ssim"].get<double>(), 1e-9) << what;
    EXPECT_NEAR(s.gmsd, c["gmsd"].get<double>(), 1e-9) << what;
  }
  const Rgb8Image a = formula(40, 30, "base");
  const ImageScores same = image_scores(a, a);
  EXPECT_EQ(same.psnr, 100);
  EXPECT_DOUBLE_EQ(same.ssim, 1);
  EXPECT_EQ(same.gmsd, 0);
  test::expect_error([&] { image_scores(a, formula(30, 40, "base")); }, {"40x30", "30x40"});
}

TEST(GateMetrics, AudioScoresGrowWithTheDifference) {
  std::vector<float> ref(2 * 4096), near = ref, far = ref;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double t = double(i / 2) / 8000;
    ref[i] = float(0.5 * std::sin(2 * M_PI * 440 * t));
    near[i] = ref[i] + float(0.001 * std::sin(2 * M_PI * 3000 * t));
    far[i] = float(0.5 * std::sin(2 * M_PI * 660 * t));
  }
  const AudioScores same = audio_scores(ref, ref, 2, 8000), a = audio_scores(near, ref, 2, 8000),
                    b = audio_scores(far, ref, 2, 8000);
  EXPECT_EQ(same.stft, 0);
  EXPECT_EQ(same.log_mel, 0);
  EXPECT_GT(a.stft, 0);
  EXPECT_LT(a.stft, b.stft);
  EXPECT_LT(a.log_mel, b.log_mel);
}

// The rule: a metric's threshold is the bf16 renders' worst pair, and the candidate's median must
// be on its good side.
TEST(GateRule, TheCandidatesMedianAgainstTheFloorsWorstPair) {
  const GateMetric psnr = judge("PSNR dB", true, {30, 25, 35}, {26, 24, 40});
  EXPECT_EQ(psnr.threshold, 25);
  EXPECT_EQ(psnr.candidate_median, 26);
  EXPECT_EQ(psnr.candidate_worst, 24);
  EXPECT_TRUE(psnr.pass);
  EXPECT_FALSE(judge("PSNR dB", true, {30, 25, 35}, {24, 24.5, 40}).pass);
  const GateMetric gmsd = judge("GMSD", false, {0.01, 0.03, 0.02}, {0.02, 0.04, 0.025});
  EXPECT_EQ(gmsd.threshold, 0.03);
  EXPECT_EQ(gmsd.candidate_median, 0.025);
  EXPECT_TRUE(gmsd.pass);
  EXPECT_FALSE(judge("GMSD", false, {0.01, 0.03, 0.02}, {0.035, 0.04, 0.025}).pass);
  test::expect_error([] { judge("SSIM", true, {1, 2}, {1}); }, {"2 floor scores", "1 candidate"});
}

GateOptions tiny_gate(const std::string& model) {
  GateOptions o;
  o.reference.model = model;
  o.candidate = o.reference;
  o.prompts = 3;
  o.seeds = 2;
  // Each kind's own size settings (the gate refuses the other kind's).
  if (model_kind(o.reference) == ModelKind::audio) {
    o.seconds = 1;
  } else {
    o.width = 64;
    o.height = 48;
  }
  return o;
}

// The tier on the tiny klein passes. On the tiny Stable Audio 3 it sits at the edge (docs/SPEED.md,
// session 16: over the full 20 pairs MR-STFT's median 0.5579 against a threshold of 0.5571, a
// FAIL; log-mel passes), so its verdict is reported, and the report's shape held.
TEST(Gate, Int8TierOnTheTinyModels) {
  if (!cpu::exact_int8_products()) GTEST_SKIP() << "this CPU has neither VNNI nor AVX2: the int8 tier refuses it";
  for (const std::string& model : {test::fixture("klein_tiny_a"), test::official_dir()}) {
    GateOptions o = tiny_gate(model);
    o.candidate.quant = Quant::int8;
    const GateReport r = run_gate(o);
    std::printf("%s", r.table().c_str());
    EXPECT_EQ(r.pairs.size(), 6u);
    EXPECT_EQ(r.change, "--quant int8");
    if (r.kind == "image") EXPECT_TRUE(r.pass) << model;
    const Json j = r.json();
    EXPECT_EQ(j["pass"], r.pass);
    ASSERT_EQ(j["metrics"].size(), r.kind == "image" ? 3u : 2u);
    for (const Json& m : j["metrics"]) {
      EXPECT_EQ(m["bf16"].size(), 6u);
      EXPECT_EQ(m["candidate"].size(), 6u);
      // The candidate differs from the reference's bf16 renders: the tier was applied.
      EXPECT_NE(m["bf16"], m["candidate"]) << model << " " << m["name"];
    }
  }
}

// The fp8 tier's verdicts on the tiny models, as the gate gives them: klein passes (its PSNR, SSIM
// and GMSD medians within the bf16 renders' worst), Stable Audio 3 fails (MR-STFT median 0.650
// against 0.559 over 20 pairs, session 35), and the report names the change.
TEST(Gate, Fp8TierOnTheTinyModels) {
  for (const std::string& model : {test::fixture("klein_tiny_a"), test::official_dir()}) {
    GateOptions o = tiny_gate(model);
    o.candidate.quant = Quant::fp8;
    const GateReport r = run_gate(o);
    std::printf("%s", r.table().c_str());
    EXPECT_EQ(r.change, "--quant fp8");
    EXPECT_EQ(r.pass, r.kind == "image") << model;
    for (const Json& m : r.json()["metrics"]) EXPECT_NE(m["bf16"], m["candidate"]) << model << " " << m["name"];
  }
}

// Random weights of the same shapes are another model: far outside what bf16 moves the renders.
TEST(Gate, AnotherModelsWeightsFail) {
  const std::string other = ::testing::TempDir() + "gate_other_klein";
  synth_checkpoint(test::fixture("klein_tiny_a"), other, 7, {});
  GateOptions o = tiny_gate(test::fixture("klein_tiny_a"));
  o.candidate.model = other;
  const GateReport r = run_gate(o);
  std::printf("%s", r.table().c_str());
  EXPECT_FALSE(r.pass);
  for (const GateMetric& m : r.metrics) EXPECT_FALSE(m.pass) << m.name;
  std::filesystem::remove_all(other);
}

TEST(Gate, RefusesNothingToJudge) {
  test::expect_error([] { run_gate(tiny_gate(test::fixture("klein_tiny_a"))); }, {"no change to judge"});
  GateOptions o = tiny_gate(test::fixture("klein_tiny_a"));
  o.knob = "cpu.attention_block=7";
  test::expect_error([&] { run_gate(o); }, {"cpu.attention_block", "7"});
}

// The CLI's verdict, exit status and JSON agree: a knob that leaves every render's bytes as they are
// (the query rows per attention task) passes with exit 0; another model's weights fail with exit 3.
// (Whether int8 passes two pairs of a random tiny model is the noise of its bf16 renders, not the
// CLI's to judge: Int8Tier holds the tier to the official renders.)
TEST(Gate, CliWritesTheReportAndExitsByTheVerdict) {
  const std::string json = ::testing::TempDir() + "gate.json";
  const std::string args =
      "gate --model " + test::fixture("klein_tiny_a") + " --prompts 2 --seeds 1 -W 64 -H 48 --json " + json;
  const test::CliRun same = test::run_cli(args + " --knob cpu.attention_block=32");
  EXPECT_EQ(same.status, 0) << same.output;
  EXPECT_NE(same.output.find("PASS"), std::string::npos) << same.output;
  Json j = read_json(json);
  EXPECT_EQ(j["pass"], true);
  EXPECT_EQ(j["pairs"].size(), 2u);
  const std::string other = ::testing::TempDir() + "gate_cli_other_klein";
  synth_checkpoint(test::fixture("klein_tiny_a"), other, 7, {});
  const test::CliRun changed = test::run_cli(args + " --candidate " + other);
  EXPECT_EQ(changed.status, 3) << changed.output;
  EXPECT_NE(changed.output.find("FAIL"), std::string::npos) << changed.output;
  j = read_json(json);
  EXPECT_EQ(j["pass"], false);
  std::filesystem::remove(json);
  std::filesystem::remove_all(other);
}

}  // namespace
}  // namespace apus
