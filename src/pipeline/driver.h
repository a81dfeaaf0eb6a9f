#pragma once
// One driver for every family's pipeline. A family describes its pipeline as a table: its parts
// (one model each: the text encoder, the transformer, the decoder), each with the stages that run
// on it, in order. count() walks the table in counting mode and generate() runs it, so a stage
// exists once. What a family supplies besides the table is the concept PipelineFamily below;
// each family asserts it under its class, so a member missing or misspelt is named there.
#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ops/backend.h"
#include "pipeline/split.h"
#include "pipeline/stage.h"

namespace apus {

// The stages every family has, as the cost model, traces and -v name them (a family names its own
// encoder and decoder: vae_decode, same_decode, ...).
constexpr const char* kTextStage = "text_encoder";
constexpr const char* kPrologueStage = "dit_prologue";
constexpr const char* kStepStage = "dit_step";

// Each request's preview sink, in batch order; empty when no request asked for previews (the
// steps then skip them altogether).
template <typename Request> std::vector<PreviewSink> preview_sinks(const std::vector<Request>& requests) {
  std::vector<PreviewSink> sinks;
  for (const Request& r : requests) sinks.push_back(r.preview);
  if (std::none_of(sinks.begin(), sinks.end(), [](const PreviewSink& p) { return bool(p); })) sinks.clear();
  return sinks;
}

// The sampler's loop: steps first..end-1 of a schedule's sigmas.
struct StepRange {
  int first = 0, end = 0;
  const std::vector<float>* sigmas = nullptr;
};

// One stage on a part's model. `run` is the stage's code, the same in both modes; a stage with
// `steps` runs once per step (and is counted once, filed as end - first calls).
template <typename Work, typename Model> struct Stage {
  const char* name;  // the cost model's and the trace's: "dit_step"
  const char* done;  // what -v files its time under once it ran: "vae decode"
  std::function<void(Context&, const Model&, Work&, int step)> run;
  // The tensor of Work stopped on NaN or Inf after the stage (after each step, the sampler's
  // state), named so in the error; none: unchecked.
  Tensor Work::*output = nullptr;
  const char* produced = nullptr;  // "the text encoder"
  std::function<StepRange(const Work&)> steps;
  bool replicated = false;  // not split by tensor or sequence parallelism
};

template <typename Work> class Part {
 public:
  virtual ~Part() = default;
  // Files the cost of each stage the batch runs and the model's parameters, in the request's
  // activation dtype `act` (the weights held as a run holds them: converted to it).
  virtual void count(Work& w, PipelineCost& p, DType act) const = 0;
  // Runs the part's stages, its sampler steps queued as `queue` says (step_queue_for).
  virtual void run(Context& c, Work& w, StageClock& clock, const Progress& say, StepQueue queue) const = 0;
};

// A part on one model: opened with weights for a run (or held resident), shapes only for a count.
template <typename Work, typename Model> class ModelPart final : public Part<Work> {
 public:
  struct Spec {
    const char* loaded;  // what -v files the model's load under: "transformer load"
    std::function<Model(Weights, DType)> open;
    const std::optional<Model>* resident;
    std::vector<Stage<Work, Model>> stages;
    std::function<bool(const Work&)> used;  // none: every request runs the part
  };
  explicit ModelPart(Spec spec) : s_(std::move(spec)) {}

  void count(Work& w, PipelineCost& p, DType act) const override {
    if (s_.used && !s_.used(w)) return;
    const Model model = s_.open(Weights::none, act);
    const size_t first = p.stages.size();
    for (const Stage<Work, Model>& stage : s_.stages) {
      const StepRange range = stage.steps ? stage.steps(w) : StepRange{0, 1};
      p.stages.push_back(count_stage(stage.name, range.end - range.first, act,
                                     [&](Context& c) { stage.run(c, model, w, range.first); }));
      p.stages.back().replicated = stage.replicated;
    }
    // After the stages: a model may fetch parameters as its code first reads them.
    p.parameters += double(model.parameter_count());
    const double held = double(model.held_bytes());
    p.held_bytes += held;
    for (size_t i = first; i < p.stages.size(); ++i) p.stages[i].model_bytes = held;
  }

  void run(Context& c, Work& w, StageClock& clock, const Progress& say, StepQueue queue) const override {
    if (s_.used && !s_.used(w)) return;
    with_model(
        *s_.resident, [&] { return s_.open(Weights::per_stage, c.act); },
        [&](const Model& model) {
          clock.stop(s_.loaded);
          for (const Stage<Work, Model>& stage : s_.stages) {
            if (!stage.steps) {
              run_stage(c, stage.name, [&] { stage.run(c, model, w, 0); });
              if (stage.output) require_finite(c, w.*stage.output, stage.produced);
              clock.stop(stage.done, stage.name);
              continue;
            }
            const StepRange range = stage.steps(w);
            if (queue != StepQueue::checked) {
              queued_steps(c, model, w, stage, range, queue, clock, say);
              continue;
            }
            for (int i = range.first; i < range.end; ++i) {
              if (!step_starts(c)) break;
              timed_step(c, clock, say, i - range.first, range.end - range.first, (*range.sigmas)[size_t(i)],
                         w.*stage.output, stage.name,
                         [&] { run_stage(c, stage.name, [&] { stage.run(c, model, w, i); }); });
            }
          }
        });
  }

 private:
  // Whether the next step starts: agreed over a split's ranks first, none after finish_steps.
  static bool step_starts(Context& c) {
    if (c.agreement) c.agreement->before_step();
    return !(c.finish_steps && c.finish_steps->load(std::memory_order_relaxed));
  }

  // The steps queued without a wait between them (StepQueue::deferred or graphs): each step's
  // state flagged on the device, the flags read once after the last step and the first non-finite
  // step named as a checked run names it. The host runs at most kStepsAhead steps ahead of the
  // device, so that a cancel or finish_steps stops the request within as many steps as a checked
  // run's; a step is reported (-v, a server's progress) and its time filed once the host has seen
  // the device finish it, the last ones sharing the time left evenly.
  static constexpr int kStepsAhead = 2;
  static void queued_steps(Context& c, const Model& model, Work& w, const Stage<Work, Model>& stage,
                           const StepRange& range, StepQueue queue, StageClock& clock, const Progress& say) {
    const int n = range.end - range.first;
    Tensor flags = Tensor::in(*c.arena, {std::max(n, 1)}, DType::i32);
    auto report = [&](int j, double seconds) {
      say(step_line(j, n, (*range.sigmas)[size_t(range.first + j)], seconds));
    };
    int marks[kStepsAhead] = {};
    int ran = 0, reported = 0;
    for (int i = range.first; i < range.end; ++i, ++ran) {
      if (ran >= kStepsAhead) {
        c.backend->wait_for_mark(marks[reported % kStepsAhead]);
        report(reported, clock.stop_evenly({step_label(reported)}, stage.name));
        ++reported;
      }
      if (!step_starts(c)) break;
      std::optional<StepGraph> graph;
      if (queue == StepQueue::graphs && i > range.first) graph.emplace(*c.backend);
      run_stage(c, stage.name, [&] { stage.run(c, model, w, i); });
      ops::nonfinite_flag(c, w.*stage.output, flags, i - range.first);
      if (graph) graph->launch();
      marks[ran % kStepsAhead] = c.backend->mark_queue();
    }
    if (ran == 0) return;
    const Tensor answers = c.backend->download(flags);  // waits for the queued steps
    for (int j = 0; j < ran; ++j) APUS_CHECK(answers.ptr<int32_t>()[j] == 0, nonfinite_error(step_name(j, n)));
    std::vector<std::string> names;
    for (int j = reported; j < ran; ++j) names.push_back(step_label(j));
    const double each = clock.stop_evenly(names, stage.name);
    for (int j = reported; j < ran; ++j) report(j, each);
  }

  Spec s_;
};

template <typename Work, typename Model>
std::unique_ptr<Part<Work>> model_part(typename ModelPart<Work, Model>::Spec spec) {
  return std::make_unique<ModelPart<Work, Model>>(std::move(spec));
}

// A family's side of the driver. Work is what a batch carries from stage to stage.
template <typename F>
concept PipelineFamily = requires(const F& f, const typename F::Request& r, const std::vector<typename F::Request>& rs,
                                  typename F::Work& w, std::vector<typename F::Result>& results, Context& c,
                                  const Progress& say, int batch) {
  { f.weights() } -> std::same_as<Weights>;
  { f.root() } -> std::convertible_to<std::string>;
  { f.device() } -> std::same_as<Backend*>;
  // The model's defaults in place of the request's absent settings, every bound checked.
  { f.resolved(r) } -> std::same_as<typename F::Request>;
  { f.plan(r, int64_t(batch)) } -> std::same_as<typename F::Work>;  // the batch's shapes and schedule
  f.check_batch_agrees(rs);
  { f.cost_header(r, std::as_const(w), batch) } -> std::same_as<PipelineCost>;
  f.count_inputs(w, batch);                        // the shapes of what tokenize and initial_noise fill
  { f.describe(r) } -> std::same_as<std::string>;  // "512x512", "30 s": what admission names
  { f.compute(r) } -> std::same_as<DType>;
  f.tokenize(w, rs, results, say);
  f.initial_noise(c, w, rs, results);
  { f.parts() } -> std::same_as<const std::vector<std::unique_ptr<Part<typename F::Work>>>&>;
  f.finish(c, w, rs, results);
  // What the driver reads of every request and writes into every result.
  { r.seed } -> std::convertible_to<std::optional<uint64_t>>;
  { r.trace } -> std::convertible_to<bool>;
  { r.preview } -> std::convertible_to<PreviewSink>;
  { r.finish_steps } -> std::convertible_to<const std::atomic<bool>*>;
  { r.parallel } -> std::convertible_to<Parallelism>;
  { w.parallel } -> std::convertible_to<Parallelism>;  // the split the plan runs (pipeline/split.h)
  results[0].seed = uint64_t(0);
  results[0].stages = std::vector<StageTime>{};
  results[0].trace = std::string{};
};

// The cost of `batch` requests like `resolved` (a family's resolved() request), counted by
// walking the table.
template <PipelineFamily F> PipelineCost count_batch(const F& f, const typename F::Request& resolved, int batch) {
  typename F::Work w = f.plan(resolved, batch);
  PipelineCost p = f.cost_header(resolved, w, batch);
  f.count_inputs(w, batch);
  for (const auto& part : f.parts()) part->count(w, p, f.compute(resolved));
  return p;
}

// Renders a batch: every setting checked (and the batch held to agree) before any weight loads,
// admitted against memory by its count, seeded, then run part by part with each stage timed,
// traced and checked finite.
template <PipelineFamily F>
std::vector<typename F::Result> generate_batch_of(const F& f, const std::vector<typename F::Request>& given,
                                                  const Progress& progress, const std::atomic<bool>* stop = nullptr) {
  using Request = typename F::Request;
  APUS_CHECK(f.weights() != Weights::none, f.root(), ": opened for counting only");
  APUS_CHECK(!given.empty(), "no request to render");
  std::vector<Request> requests;
  for (const Request& o : given) requests.push_back(f.resolved(o));
  const Request& r = requests.front();
  const int64_t batch = int64_t(requests.size());
  typename F::Work w = f.plan(r, batch);  // the first request's settings checked before the others are held to them
  f.check_batch_agrees(requests);
  check_memory(count_batch(f, r, int(batch)), f.weights() == Weights::resident,
               f.describe(r) + (batch > 1 ? " x" + std::to_string(batch) : ""), f.device());
  // The stages report through this one, callable whether or not a progress callback was given.
  const Progress say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  std::vector<typename F::Result> results(requests.size());
  std::vector<StageTime> stages;
  const std::unique_ptr<Trace> trace = trace_if_asked(requests);
  StageClock clock(stages, trace.get());
  // On a device activations live in its memory.
  Backend* device = f.device();
  Arena arena(size_t(64) << 20, false, device ? static_cast<Allocator&>(*device) : host_allocator());
  Context ctx{&arena, f.compute(r)};
  ctx.backend = device;
  ctx.trace = trace.get();
  ctx.stop = stop;
  ctx.finish_steps = r.finish_steps;
  std::optional<StepAgreement> agreement;
  if (w.parallel.strategy != Parallel::none && (stop || r.finish_steps)) {
    agreement.emplace(*w.parallel.group, stop, r.finish_steps);
    ctx.stop = agreement->stop();
    ctx.finish_steps = agreement->finish();
    ctx.agreement = &*agreement;
  }

  // Everything that can reject the request (prompts, noise files, input images or clips) comes
  // before any weight loads.
  f.tokenize(w, requests, results, say);
  clock.stop("tokenize");
  for (size_t i = 0; i < requests.size(); ++i)
    results[i].seed = requests[i].seed ? *requests[i].seed : std::random_device{}();
  f.initial_noise(ctx, w, requests, results);
  for (const auto& res : results) say("seed " + std::to_string(res.seed));
  const StepQueue queue = step_queue_for(ctx, !preview_sinks(requests).empty(), w.parallel.strategy != Parallel::none);
  for (const auto& part : f.parts()) part->run(ctx, w, clock, say, queue);
  f.finish(ctx, w, requests, results);
  const std::string timeline = trace ? trace->json() : "";
  for (size_t i = 0; i < results.size(); ++i) {
    results[i].stages = stages;
    if (requests[i].trace) results[i].trace = timeline;
  }
  return results;
}

}  // namespace apus
