// Request traces: the file parses as Chrome trace events, spans nest on each thread's track, the ops
// inside each counted stage's span are exactly the ops (per module, with their FLOPs) the cost
// model counted for it, and tracing changes no output byte.
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "apus/apus.h"
#include "core/cost.h"
#include "io/media/image.h"
#include "io/media/png.h"
#include "sa3_fixtures.h"
#include "test_util.h"

namespace apus {
namespace {

using Json = nlohmann::json;

struct ModuleOps {
  int64_t ops = 0;
  double flops = 0;
  bool operator==(const ModuleOps& o) const { return ops == o.ops && flops == o.flops; }
};
using StageOps = std::map<std::string, ModuleOps>;  // module path -> what ran under it

// Walks every thread's spans in start order, checking that each lies inside the span open around
// it, and files each op under the counted stage and module path it ran in.
std::vector<std::pair<std::string, StageOps>> ops_per_stage_call(const std::string& trace) {
  const Json doc = Json::parse(trace);
  EXPECT_EQ(doc["displayTimeUnit"], "ms");
  std::map<int, std::vector<Json>> tracks;
  for (const Json& e : doc["traceEvents"]) {
    if (e["ph"] == "M") continue;
    EXPECT_EQ(e["ph"], "X") << e.dump();
    EXPECT_GE(e["dur"].get<double>(), 0) << e.dump();
    tracks[e["tid"].get<int>()].push_back(e);
  }
  EXPECT_FALSE(tracks.empty());
  std::vector<std::pair<std::string, StageOps>> calls;
  for (auto& [tid, events] : tracks) {
    std::vector<const Json*> open;
    // Timestamps are nanoseconds printed as fractional microseconds: compared with 1 ps of slack.
    constexpr double kSlack = 1e-6;
    auto end = [](const Json& e) { return e["ts"].get<double>() + e["dur"].get<double>(); };
    for (const Json& e : events) {
      const double ts = e["ts"].get<double>();
      while (!open.empty() && end(*open.back()) <= ts + kSlack) open.pop_back();
      if (!open.empty())
        EXPECT_LE(end(e), end(*open.back()) + kSlack) << e.dump() << " overlaps " << open.back()->dump();
      const std::string cat = e["cat"];
      if (cat == "stage") calls.push_back({e["name"], {}});
      if (cat == "op") {
        EXPECT_TRUE(e["args"].contains("operands")) << e.dump();
        std::string stage, path;
        for (const Json* o : open) {
          if (o->at("cat") == "stage") {
            stage = o->at("name");
            path.clear();
          } else if (o->at("cat") == "module" && !stage.empty()) {
            path += (path.empty() ? "" : "/") + o->at("name").get<std::string>();
          }
        }
        if (!stage.empty()) {
          EXPECT_EQ(calls.back().first, stage);
          ModuleOps& m = calls.back().second[path];
          ++m.ops;
          m.flops += e["args"]["flops"].get<double>();
        }
      }
      if (cat != "op") open.push_back(&e);
    }
  }
  return calls;
}

// Every call of every counted stage in the trace ran the ops the count says, module by module.
void expect_trace_matches_count(const std::string& trace, const PipelineCost& cost) {
  const auto calls = ops_per_stage_call(trace);
  for (const StageCost& s : cost.stages) {
    SCOPED_TRACE(s.name);
    StageOps counted;
    for (const CostLog::Entry& m : s.modules) {
      counted[m.path].ops += m.ops;
      counted[m.path].flops += m.cost.flops;
    }
    int64_t seen = 0;
    for (const auto& [name, ran] : calls) {
      if (name != s.name) continue;
      ++seen;
      ASSERT_EQ(ran.size(), counted.size()) << "modules traced vs counted";
      for (const auto& [path, m] : counted) {
        const auto it = ran.find(path);
        ASSERT_NE(it, ran.end()) << path << " counted but not traced";
        EXPECT_EQ(it->second.ops, m.ops) << path;
        EXPECT_DOUBLE_EQ(it->second.flops, m.flops) << path;
      }
    }
    EXPECT_EQ(seen, s.calls) << "stage spans vs counted calls";
  }
}

TEST(Trace, ImageRequestTraceNestsAndHoldsExactlyTheCountedOps) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  ImageRequest r;
  r.prompt = "a lighthouse at dusk";
  r.width = 64;
  r.height = 48;
  r.steps = 3;
  r.seed = 7;
  const ImageResult plain = model->generate(r);
  EXPECT_TRUE(plain.trace.empty()) << "tracing is off unless asked for";
  r.trace = true;
  const ImageResult traced = model->generate(r);
  EXPECT_EQ(traced.rgb, plain.rgb) << "tracing changed the image";
  ASSERT_FALSE(traced.trace.empty());
  expect_trace_matches_count(traced.trace, model->count(r));
}

TEST(Trace, GuidedImageTraceHoldsExactlyTheCountedOps) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_base"), Weights::per_stage);
  ImageRequest r;
  r.prompt = "a lighthouse";
  r.width = 32;
  r.height = 32;
  r.steps = 2;
  r.negative_prompt = "fog";
  r.trace = true;
  expect_trace_matches_count(model->generate(r).trace, model->count(r));
}

TEST(Trace, EditTraceHoldsExactlyTheCountedOps) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage);
  ImageRequest r;
  r.prompt = "night";
  r.steps = 2;
  for (const char* name : {"ref0.png", "ref1.png"}) {
    PngImage png = read_png(test::fixture(std::string("klein_tiny_a_edit/") + name));
    r.references.push_back({png.width, png.height, std::move(png.rgb)});
  }
  r.trace = true;
  const ImageResult result = model->generate(r);
  EXPECT_EQ(result.width, 64);
  const PipelineCost cost = model->count(r);
  EXPECT_EQ(cost.references, 2);
  EXPECT_EQ(cost.width, 64) << "the first reference's cropped size";
  expect_trace_matches_count(result.trace, cost);
}

// The KV pipeline: the references' own pass counted once in the prologue, every step attending to
// their cached keys and values.
TEST(Trace, ReferenceCacheTraceHoldsExactlyTheCountedOps) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_9b_kv"), Weights::per_stage);
  ImageRequest r;
  r.prompt = "snow";
  r.steps = 2;
  for (const char* name : {"ref0.png", "ref1.png"})
    r.references.push_back(read_image(test::fixture(std::string("klein_tiny_9b_kv_refs/") + name)));
  r.trace = true;
  const ImageResult result = model->generate(r);
  const PipelineCost cost = model->count(r);
  expect_trace_matches_count(result.trace, cost);
  // A step without the references' tokens costs less than one with them in its sequence.
  const auto plain = ImageModel::open(test::fixture("klein_tiny_9b"), Weights::none);
  auto step_flops = [](const PipelineCost& p) {
    for (const StageCost& s : p.stages)
      if (s.name == "dit_step") return s.per_call.flops;
    return 0.0;
  };
  EXPECT_LT(step_flops(cost), step_flops(plain->count(r)));
}

// Inpainting on the -base model with guidance and a reference: the image's encoding, the noised
// start in the prologue, and the masked update after each of the steps the strength leaves.
TEST(Trace, InpaintingTraceHoldsExactlyTheCountedOps) {
  const auto model = ImageModel::open(test::fixture("klein_tiny_base"), Weights::per_stage);
  ImageRequest r;
  r.prompt = "a door";
  r.steps = 4;
  r.cfg = 2;
  const std::string dir = test::fixture("klein_tiny_a_inpaint/");
  r.inpaint = Inpainting{read_image(dir + "image.png"), read_image(dir + "mask.png"), 0.6};
  r.references.push_back(read_image(dir + "reference.png"));
  r.trace = true;
  const ImageResult result = model->generate(r);
  EXPECT_EQ(result.steps_run, 3);
  const PipelineCost cost = model->count(r);
  EXPECT_EQ(cost.steps, 3);
  expect_trace_matches_count(result.trace, cost);
}

TEST(Trace, AudioRequestTraceNestsAndHoldsExactlyTheCountedOps) {
  const auto model = AudioModel::open(test::pipeline_dir(), Weights::resident);
  AudioRequest r;
  r.prompt = "rain on a tin roof";
  r.seconds = 1.5;
  r.steps = 2;
  r.seed = 3;
  const AudioResult plain = model->generate(r);
  r.trace = true;
  const AudioResult traced = model->generate(r);
  EXPECT_EQ(traced.samples, plain.samples) << "tracing changed the clip";
  expect_trace_matches_count(traced.trace, model->count(r));
  // Guided by a negative prompt: the unconditional half's tokens are gathered too.
  r.cfg = 7;
  r.negative_prompt = "hiss";
  expect_trace_matches_count(model->generate(r).trace, model->count(r));
}

TEST(Trace, CliWritesTheTraceFile) {
  const std::string trace = ::testing::TempDir() + "cli_trace.json", out = ::testing::TempDir() + "cli_trace.png";
  const test::CliRun run = test::run_cli("image --model " + test::fixture("klein_tiny_a") +
                                         " -p fox -W 32 -H 32 --steps 1 -s 1 -o " + out + " --trace " + trace);
  ASSERT_EQ(run.status, 0) << run.output;
  std::ifstream file(trace);
  ASSERT_TRUE(file) << trace;
  const Json doc = Json::parse(file);
  size_t stages = 0;
  for (const Json& e : doc["traceEvents"]) stages += e.value("cat", "") == "stage";
  EXPECT_EQ(stages, 4u) << "text encoder, prologue, one step, VAE decode";
  const test::CliRun bad = test::run_cli("image --model " + test::fixture("klein_tiny_a") + " -p fox -W 32 -H 32 -o " +
                                         out + " --trace /nonexistent/dir/t.json");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("/nonexistent/dir"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace apus
