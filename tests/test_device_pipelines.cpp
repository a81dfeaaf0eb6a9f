// Whole requests of both families on a device backend: what the GPU path needs from the pipelines
// (weights placed on the device, every host-built input staged, results brought back) proven on the
// shadow device (shadow_device.h), which faults on any host access to its memory and computes with
// the CPU backend, so each request must give the CPU's output byte for byte.
#include <cstring>
#include <filesystem>
#include <thread>

#include "apus/apus.h"
#include "core/memory.h"
#include "cost/ceiling.h"
#include "dist/link.h"
#include "dist/memory_check.h"
#include "io/media/image.h"
#include "io/weights/safetensors.h"
#include "io/weights/synth.h"
#include "pipeline/registry.h"
#include "pipeline/stage.h"
#include "sa3_fixtures.h"
#include "shadow_device.h"
#include "test_util.h"
#include "thread_ranks.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#endif

namespace apus {
namespace {

// The shadow device is a test of the pipelines only if it faults where a GPU would.
TEST(ShadowDeviceDeathTest, HostAccessToItsMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  test::ShadowDevice& device = test::shadow_device();
  Tensor host = Tensor::heap({4}, DType::f32);
  for (int i = 0; i < 4; ++i) host.ptr<float>()[i] = float(i) + 0.5f;
  const Tensor on_device = device.upload(host);
  EXPECT_TRUE(device.owns(on_device.data));
  EXPECT_EQ(to_f32_vector(device.download(on_device)), to_f32_vector(host));
  EXPECT_DEATH(std::printf("%f\n", double(load_f32(on_device, 1))), "host code touched shadow device memory");
}

// An attention's key mask is an operand like the others: staged to the device, or refused there.
TEST(ShadowDevice, AttentionKeyMasksLiveOnTheDevice) {
  test::ShadowDevice& device = test::shadow_device();
  Arena arena(size_t(1) << 20, false, device);
  Context c{&arena, DType::f32};
  c.backend = &device;
  Tensor host_mask = Tensor::heap({8}, DType::i64);
  for (int64_t j = 0; j < 8; ++j) host_mask.ptr<int64_t>()[j] = j < 5;
  // Equal scores (q = k = 0), values j on key row j: the output is the mean of the visible rows'.
  Tensor q = ops::zeros(c, {8, 16}, DType::f32), o = ops::empty(c, {8, 16}, DType::f32);
  const Tensor v = ops::host_filled(c, {8, 16}, DType::f32, [](Tensor& t) {
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = float(i / 16);
  });
  test::expect_error(
      [&] {
        ops::attention(c, q, q, v, o, 16, 0.25f, {false, &host_mask, 1});
      },
      {"attention", "lives on cpu:0", "shadow"});
  const Tensor staged = ops::to_context(c, host_mask);
  ops::attention(c, q, q, v, o, 16, 0.25f, {false, &staged, 1});
  for (const float x : to_f32_vector(ops::to_host(c, o))) EXPECT_NEAR(x, 2.0f, 1e-6f);  // keys 0..4
}

struct ImageRun {
  std::string name, variant;
  ImageRequest request;
};

std::vector<ImageRun> image_runs() {
  auto request = [](const char* prompt, bool fp32) {
    ImageRequest r;
    r.prompt = prompt;
    r.seed = 7;
    r.steps = 2;
    r.width = 64;
    r.height = 48;
    r.fp32 = fp32;
    return r;
  };
  std::vector<ImageRun> runs;
  runs.push_back({"distilled bf16", "klein_tiny_a", request("a red fox in the snow", false)});
  runs.push_back({"distilled fp32", "klein_tiny_a", request("a red fox in the snow", true)});
  ImageRun base{"base with guidance and a negative prompt", "klein_tiny_base", request("a lighthouse", false)};
  base.request.cfg = 3.5f;
  base.request.negative_prompt = "fog";
  runs.push_back(base);
  ImageRun edit{"edit with two references", "klein_tiny_a", request("make it blue", false)};
  edit.request.width.reset();
  edit.request.height.reset();
  const Json meta = read_json(test::fixture("klein_tiny_a_edit_ref.json"));
  for (const Json& name : meta["references"])
    edit.request.references.push_back(read_image(test::fixture("klein_tiny_a_edit/" + name.get<std::string>())));
  runs.push_back(edit);
  ImageRun inpaint{"inpainting", "klein_tiny_a", request("a cat", false)};
  inpaint.request.width.reset();
  inpaint.request.height.reset();
  inpaint.request.inpaint = Inpainting{edit.request.references[0], edit.request.references[0], 0.6};
  for (size_t i = 0; i < inpaint.request.inpaint->mask.rgb.size(); ++i)
    inpaint.request.inpaint->mask.rgb[i] = (i / 3) % 5 < 2 ? 255 : 0;
  runs.push_back(inpaint);
  runs.push_back({"9B-shaped", "klein_tiny_9b", request("a bridge at dusk", false)});
  ImageRun lora{"two LoRAs", "klein_tiny_a", request("a red fox in the snow", false)};
  lora.request.loras = {{test::fixture("klein_lora/peft.safetensors"), 0.7f},
                        {test::fixture("klein_lora/bfl.safetensors"), 0.5f}};
  runs.push_back(lora);
  ImageRun kv{"reference K/V cache", "klein_tiny_9b_kv", request("the same bridge in winter", false)};
  kv.request.width.reset();
  kv.request.height.reset();
  kv.request.references = {edit.request.references[0]};
  runs.push_back(kv);
  return runs;
}

TEST(ShadowDevice, KleinRequestsComputeWhatTheCpuComputes) {
  test::ShadowDevice& device = test::shadow_device();
  for (const ImageRun& run : image_runs()) {
    SCOPED_TRACE(run.name);
    const ImageResult cpu =
        open_image_model(test::fixture(run.variant), Weights::per_stage, nullptr)->generate(run.request);
    const size_t before = device.ops_run();
    const ImageResult dev =
        open_image_model(test::fixture(run.variant), Weights::per_stage, &device)->generate(run.request);
    EXPECT_GT(device.ops_run(), before + 100);
    EXPECT_EQ(dev.width, cpu.width);
    EXPECT_EQ(dev.height, cpu.height);
    EXPECT_TRUE(dev.rgb == cpu.rgb);
  }
}

// The files people download hold their weights quantised (GGUF's blocks, BFL's fp8, ComfyUI's int8,
// mxfp8 and nvfp4 layouts; or --quant q8_0 made them so): on a device they stay as stored, their
// block factors beside them, and the linears and the token table decode them there. Each image
// must be the CPU's, byte for byte.
TEST(ShadowDevice, QuantisedFilesComputeWhatTheCpuComputes) {
  test::ShadowDevice& device = test::shadow_device();
  const std::string root = test::fixture("klein_tiny_a");
  auto transformer = [&](const char* file) {
    ModelParts p;
    p.model = test::fixture(std::string("klein_single/") + file);
    p.config = root;
    return p;
  };
  auto text_encoder = [&](const char* file) {
    ModelParts p{root};
    p.text_encoder = test::fixture(std::string("klein_single/") + file);
    return p;
  };
  const std::vector<std::pair<std::string, ModelParts>> runs = {
      {"GGUF Q4_K_M transformer (Q4_K, Q6_K, Q8_0)", transformer("flux-2-klein-tiny-Q4_K_M.gguf")},
      {"BFL's fp8 transformer", transformer("flux-2-klein-tiny-fp8.safetensors")},
      {"ComfyUI's mixed transformer (fp8, int8, mxfp8, nvfp4)",
       transformer("flux-2-klein-tiny-comfy-mixed.safetensors")},
      {"GGUF Q8_0 text encoder, its token table too", text_encoder("qwen3-tiny-Q8_0.gguf")},
      {"ComfyUI's mixed text encoder", text_encoder("qwen3-tiny-comfy-mixed.safetensors")},
      {"--quant q8_0",
       [&] {
         ModelParts p{root};
         p.quant = Quant::q8_0;
         return p;
       }()},
  };
  for (const auto& [name, parts] : runs)
    for (const bool fp32 : {false, true}) {
      SCOPED_TRACE(name + (fp32 ? " fp32" : " bf16"));
      ImageRequest r;
      r.prompt = "a lighthouse in fog";
      r.seed = 11;
      r.steps = 2;
      r.width = 64;
      r.height = 48;
      r.fp32 = fp32;
      const ImageResult cpu = open_image_model(parts, Weights::per_stage, nullptr)->generate(r);
      const size_t before = device.ops_run();
      const ImageResult dev = open_image_model(parts, Weights::per_stage, &device)->generate(r);
      EXPECT_GT(device.ops_run(), before + 100);
      EXPECT_TRUE(dev.rgb == cpu.rgb);
    }
}

struct AudioRun {
  std::string name, dir;
  AudioRequest request;
};

TEST(ShadowDevice, Sa3RequestsComputeWhatTheCpuComputes) {
  test::ShadowDevice& device = test::shadow_device();
  const std::string base =
      test::official_variant_dir("device_base", read_json(test::fixture("sa3_tiny/original_base/model_config.json")));
  const std::string noise = test::official_variant_dir("device_noise", test::decoder_noise_config());
  AudioRequest guided = test::reference_request(false);
  guided.cfg = 7;
  guided.negative_prompt = "noise, hiss";
  AudioRequest empty = test::reference_request(false);
  empty.prompt = "";
  const std::vector<AudioRun> runs = {
      {"diffusers layout bf16", test::pipeline_dir(), test::reference_request(false)},
      {"official layout fp32", test::official_dir(), test::reference_request(true)},
      {"small model (SAME-S)", test::official_small_dir(), test::reference_request(false)},
      {"base with guidance and a negative prompt", base, guided},
      {"decoder noise", noise, test::reference_request(false)},
      {"empty prompt", test::official_dir(), empty},
      {"audio-to-audio", test::official_dir(), test::inputs_request(false, "a2a")},
      {"inpainting", test::official_dir(), test::inputs_request(false, "inpaint")},
  };
  for (const AudioRun& run : runs) {
    SCOPED_TRACE(run.name);
    const AudioResult cpu = open_audio_model(run.dir, Weights::per_stage, nullptr)->generate(run.request);
    const size_t before = device.ops_run();
    const AudioResult dev = open_audio_model(run.dir, Weights::per_stage, &device)->generate(run.request);
    EXPECT_GT(device.ops_run(), before + 100);
    ASSERT_EQ(dev.samples.size(), cpu.samples.size());
    EXPECT_EQ(std::memcmp(dev.samples.data(), cpu.samples.data(), cpu.samples.size() * sizeof(float)), 0);
  }
  std::filesystem::remove_all(base);
  std::filesystem::remove_all(noise);
}

// Requests split over ranks on a device (issue 43): each rank a thread with the model on the
// shadow device, whose exchanges move device memory without the host reading it (as NCCL does
// between GPUs). Every rank's result must be one CPU process's, byte for byte: Ulysses over 1, 2
// and 3 ranks (3 divides neither family's heads), cfg on a guided -base request, tensor over a
// model opened split.
struct SplitRun {
  std::string name;
  Parallel strategy;
  int ranks;
};

const std::vector<SplitRun> split_runs = {{"ulysses, 1 rank (the GPU check's NCCL case)", Parallel::ulysses, 1},
                                          {"ulysses, 2 ranks", Parallel::ulysses, 2},
                                          {"ulysses, 3 ranks", Parallel::ulysses, 3},
                                          {"cfg, 2 ranks", Parallel::cfg, 2},
                                          {"tensor, 2 ranks", Parallel::tensor, 2}};

// run(rank group, weights split over it or null) on every rank of `split`, each rank's result
// checked by `same` against one CPU process's; the device must have run exchanges.
template <typename Run, typename Same> void check_split_on_device(const SplitRun& split, Run&& run, Same&& same) {
  test::ShadowDevice& device = test::shadow_device();
  test::ThreadRanks all(split.ranks);
  std::vector<std::unique_ptr<test::ThreadRanks::Rank>> ranks;
  for (int r = 0; r < split.ranks; ++r) ranks.push_back(std::make_unique<test::ThreadRanks::Rank>(all, r));
  const size_t before = device.exchanges_run();
  std::vector<std::thread> threads;
  for (int r = 0; r < split.ranks; ++r)
    threads.emplace_back([&, r] {
      const ProcessGroup* rank = ranks[size_t(r)].get();
      same(r, run(rank, split.strategy == Parallel::tensor ? rank : nullptr));
    });
  for (std::thread& t : threads) t.join();
  EXPECT_GE(device.exchanges_run(), before + size_t(split.ranks));
  for (int r = 0; r < split.ranks && split.ranks > 1; ++r)
    EXPECT_GT(ranks[size_t(r)]->sent, 0) << "rank " << r << " sent nothing";
}

TEST(ShadowDevice, KleinSplitOverRanksComputesWhatOneCpuProcessComputes) {
  const test::WidenedBf16 widened;
  for (const SplitRun& split : split_runs) {
    SCOPED_TRACE(split.name);
    ImageRequest r = test::small_image_request("a red fox in the snow", test::test_seed());
    const std::string variant = split.strategy == Parallel::cfg ? "klein_tiny_base" : "klein_tiny_a";
    if (split.strategy == Parallel::cfg) {
      r.cfg = 3.5f;
      r.negative_prompt = "fog";
    }
    const ImageResult cpu = open_image_model(test::fixture(variant), Weights::per_stage, nullptr)->generate(r);
    check_split_on_device(
        split,
        [&](const ProcessGroup* rank, const ProcessGroup* weights_split) {
          ModelParts parts;
          parts.model = test::fixture(variant);
          parts.tensor_ranks = weights_split;
          ImageRequest mine = r;
          mine.parallel = {split.strategy, rank};
          return open_image_model(parts, Weights::per_stage, &test::shadow_device())->generate(mine);
        },
        [&](int rank, const ImageResult& dev) { EXPECT_TRUE(dev.rgb == cpu.rgb) << "rank " << rank; });
  }
}

TEST(ShadowDevice, Sa3SplitOverRanksComputesWhatOneCpuProcessComputes) {
  const test::WidenedBf16 widened;
  for (const SplitRun& split : split_runs) {
    SCOPED_TRACE(split.name);
    AudioRequest r = test::reference_request(false);
    r.seed = test::test_seed();
    if (split.strategy == Parallel::cfg) {
      r.cfg = 7;
      r.negative_prompt = "noise, hiss";
    }
    const AudioResult cpu = open_audio_model(test::pipeline_dir(), Weights::per_stage, nullptr)->generate(r);
    check_split_on_device(
        split,
        [&](const ProcessGroup* rank, const ProcessGroup* weights_split) {
          ModelParts parts;
          parts.model = test::pipeline_dir();
          parts.tensor_ranks = weights_split;
          AudioRequest mine = r;
          mine.parallel = {split.strategy, rank};
          return open_audio_model(parts, Weights::per_stage, &test::shadow_device())->generate(mine);
        },
        [&](int rank, const AudioResult& dev) {
          ASSERT_EQ(dev.samples.size(), cpu.samples.size()) << "rank " << rank;
          EXPECT_EQ(std::memcmp(dev.samples.data(), cpu.samples.data(), cpu.samples.size() * sizeof(float)), 0)
              << "rank " << rank;
        });
  }
}

// Under several ranks on a device, auto prices the splits at the rate of the device's own
// exchanges (NCCL between GPUs), measured through them: here over two thread ranks on the
// shadow device, each measurement's exchanges the device's, every byte of each part gathered.
TEST(ShadowDevice, LinkRatesAreMeasuredThroughTheDevicesExchanges) {
  test::ShadowDevice& device = test::shadow_device();
  test::ThreadRanks all(2);
  const test::ThreadRanks::Rank first(all, 0), second(all, 1);
  const size_t before = device.exchanges_run(), part = size_t(1) << 20;
  double rates[2][2] = {};
  std::thread other([&] {
    rates[1][0] = dist::device_link_bps(second, device, false, part, 3);
    rates[1][1] = dist::device_link_bps(second, device, true, part, 3);
  });
  rates[0][0] = dist::device_link_bps(first, device, false, part, 3);
  rates[0][1] = dist::device_link_bps(first, device, true, part, 3);
  other.join();
  EXPECT_EQ(device.exchanges_run(), before + 2 * 2 * 3);
  for (const auto& rank : rates)
    for (const double bps : rank) EXPECT_GT(bps, 0);
  EXPECT_EQ(first.sent, 2 * 3 * double(part));
  EXPECT_EQ(second.sent, 2 * 3 * double(part));
}

// auto's memory check under several ranks on devices weighs a rank's own device memory (a GPU a
// rank), not the host's over the ranks; --rank-memory overrides both.
TEST(ShadowDevice, AutoWeighsARanksDeviceMemory) {
  test::ShadowDevice& device = test::shadow_device();
  const PipelineCost cost = open_image_model(test::fixture("klein_tiny_a"), Weights::none, &device)
                                ->count(test::small_image_request("a fox", 1));
  const double need = peak_memory_need(cost, false).first;
  device.set_memory_bytes(need / 2);
  const std::string short_of = dist::memory_shortfall(cost, false, 0, 4, &device);
  EXPECT_NE(short_of.find("more than the " + bytes_text(need / 2) + " a rank has: shadow's memory"), std::string::npos)
      << short_of;
  device.set_memory_bytes(need * 2);
  EXPECT_EQ(dist::memory_shortfall(cost, false, 0, 4, &device), "");
  EXPECT_NE(dist::memory_shortfall(cost, false, 1e-6, 4, &device).find("--rank-memory"), std::string::npos);
  device.set_memory_bytes(0);  // the host's budget again
  EXPECT_EQ(dist::memory_shortfall(cost, false, 0, 1, &device), "");
}

// What `apus serve --device` holds: models resident on the device, serving request after request.
TEST(ShadowDevice, ResidentModelsServeRequestAfterRequest) {
  test::ShadowDevice& device = test::shadow_device();
  const auto image_cpu = open_image_model(test::fixture("klein_tiny_a"), Weights::resident, nullptr);
  const auto image_dev = open_image_model(test::fixture("klein_tiny_a"), Weights::resident, &device);
  const auto audio_cpu = open_audio_model(test::official_dir(), Weights::resident, nullptr);
  const auto audio_dev = open_audio_model(test::official_dir(), Weights::resident, &device);
  for (const uint64_t seed : {3u, 4u}) {
    ImageRequest image = image_runs().front().request;
    image.seed = seed;
    EXPECT_TRUE(image_dev->generate(image).rgb == image_cpu->generate(image).rgb) << "image seed " << seed;
    AudioRequest clip = test::reference_request(false);
    clip.seed = seed;
    EXPECT_EQ(audio_dev->generate(clip).samples, audio_cpu->generate(clip).samples) << "clip seed " << seed;
  }
}

// The device allocations a step of `model` makes for request r: a 4-step request's less a
// 2-step one's, halved (what a request allocates once cancels).
template <typename Model, typename Request>
double allocations_a_step(test::ShadowDevice& device, Model& model, Request r) {
  auto allocations = [&](int steps) {
    r.steps = steps;
    const size_t before = device.allocations();
    model.generate(r);
    return device.allocations() - before;
  };
  const size_t two = allocations(2), four = allocations(4);
  return (double(four) - double(two)) / 2;
}

// A denoising step allocates no device memory: a GPU's allocation is a cudaMalloc and its release
// a cudaFree, which waits for the device to finish everything queued, so each would drain the
// launch queue mid-step. Activations live in the arena, and the host's small inputs (an adapter's
// gate for every adapted linear, a sigma) are staged into it (host_filled, Backend::upload_into):
// a resident model's extra steps allocate nothing, with LoRAs or without (before session 35: one
// allocation a gate, 72 a step on klein's tiny model with two LoRAs, hundreds on a real one).
TEST(ShadowDevice, AStepAllocatesNoDeviceMemory) {
  test::ShadowDevice& device = test::shadow_device();
  const auto model = open_image_model(test::fixture("klein_tiny_a"), Weights::resident, &device);
  auto per_step = [&](const std::vector<Lora>& loras) {
    ImageRequest r = image_runs().front().request;
    r.loras = loras;
    return allocations_a_step(device, *model, r);
  };
  const double plain = per_step({});
  const double adapted = per_step(
      {{test::fixture("klein_lora/peft.safetensors"), 0.7f}, {test::fixture("klein_lora/bfl.safetensors"), 0.5f}});
  std::printf("[ measure ] device allocations a klein step: %.1f plain, %.1f with two LoRAs\n", plain, adapted);
  EXPECT_EQ(plain, 0);
  EXPECT_EQ(adapted, 0);
  // Stable Audio 3's steps the same, with a LoRA on its DiT.
  const auto audio = open_audio_model(test::official_dir(), Weights::resident, &device);
  auto audio_per_step = [&](const std::vector<Lora>& loras) {
    AudioRequest r = test::reference_request(false);
    r.loras = loras;
    return allocations_a_step(device, *audio, r);
  };
  const Json pair = read_json(test::fixture("sa3_lora/reference.json"))["cases"].at("pair");
  std::vector<Lora> sa3_loras;
  for (const Json& l : pair)
    sa3_loras.push_back({test::fixture("sa3_lora/" + l[0].get<std::string>()), l[1].get<float>()});
  const double audio_plain = audio_per_step({}), audio_adapted = audio_per_step(sa3_loras);
  std::printf("[ measure ] device allocations an SA3 step: %.1f plain, %.1f with two LoRAs\n", audio_plain,
              audio_adapted);
  EXPECT_EQ(audio_plain, 0);
  EXPECT_EQ(audio_adapted, 0);
}

// A device's steps queued without a wait between them (device.steps=deferred) and recorded as one
// graph each (graphs: the shadow device runs a recorded step's ops only at its launch, with the
// operands they were called with) compute the checked steps' bytes, in every mode of both
// families: guidance, edits, inpainting, the -kv cache, LoRAs (their gates staged from the host
// inside the recording). Three steps, so two are recorded a request.
TEST(ShadowDevice, QueuedAndRecordedStepsComputeTheCheckedStepsBytes) {
  test::ShadowDevice& device = test::shadow_device();
  for (ImageRun run : image_runs()) {
    SCOPED_TRACE(run.name);
    run.request.steps = 3;
    const auto model = open_image_model(test::fixture(run.variant), Weights::resident, &device);
    const std::vector<uint8_t> checked = model->generate(run.request).rgb;
    {
      const KnobScope queued("device.steps", "deferred");
      EXPECT_EQ(model->generate(run.request).rgb, checked) << "deferred";
    }
    const KnobScope recorded("device.steps", "graphs");
    const size_t before = device.graphs_launched();
    EXPECT_EQ(model->generate(run.request).rgb, checked) << "graphs";
    EXPECT_GT(device.graphs_launched(), before) << "no step was recorded";
  }
  const auto audio = open_audio_model(test::official_dir(), Weights::resident, &device);
  AudioRequest r = test::reference_request(false);
  r.steps = 3;
  for (const Json& l : read_json(test::fixture("sa3_lora/reference.json"))["cases"].at("pair"))
    r.loras.push_back({test::fixture("sa3_lora/" + l[0].get<std::string>()), l[1].get<float>()});
  const std::vector<float> checked = audio->generate(r).samples;
  // The host queues at most two steps ahead of the device: step 3 waits for step 1's mark.
  const size_t waits = device.mark_waits();
  {
    const KnobScope queued("device.steps", "deferred");
    EXPECT_EQ(audio->generate(r).samples, checked) << "SA3 deferred";
  }
  EXPECT_EQ(device.mark_waits() - waits, 1u) << "deferred";
  const KnobScope recorded("device.steps", "graphs");
  const size_t before = device.graphs_launched();
  EXPECT_EQ(audio->generate(r).samples, checked) << "SA3 graphs";
  EXPECT_EQ(device.graphs_launched() - before, 2u) << "SA3's steps 2 and 3";
  EXPECT_EQ(device.mark_waits() - waits, 2u) << "graphs";
}

// Queued steps are reported as the host sees the device finish them, at most two steps behind
// the queue: an interrupt from step 1's progress line (finish_steps) stops the request after step
// 2, the one queued behind it (a checked run: after step 1), and a request runs as many steps as
// a checked one otherwise.
TEST(ShadowDevice, QueuedStepsStopWithinTwoStepsOfAnInterrupt) {
  const auto model = open_image_model(test::fixture("klein_tiny_a"), Weights::resident, &test::shadow_device());
  ImageRequest r = image_runs().front().request;
  r.steps = 4;
  std::atomic<bool> finish{false};
  r.finish_steps = &finish;
  for (const char* queue : {"checked", "deferred", "graphs"}) {
    SCOPED_TRACE(queue);
    const KnobScope scope("device.steps", queue);
    finish = false;
    std::vector<std::string> steps;
    const ImageResult early = model->generate(r, [&](const std::string& line) {
      if (line.rfind("step ", 0) == 0) steps.push_back(line.substr(0, 8));
      if (line.rfind("step 1/4", 0) == 0) finish = true;
    });
    const bool checked = std::string(queue) == "checked";
    EXPECT_EQ(early.steps_run, checked ? 1 : 2);
    const std::vector<std::string> said =
        checked ? std::vector<std::string>{"step 1/4"} : std::vector<std::string>{"step 1/4", "step 2/4"};
    EXPECT_EQ(steps, said);
    finish = false;
    r.finish_steps = nullptr;
    EXPECT_EQ(model->generate(r).steps_run, 4);
    r.finish_steps = &finish;
  }
}

// A step whose state turns non-finite is named as a checked run names it, though its flag is read
// only after the last step: a copy of klein's tiny model with a NaN in its output projection.
TEST(ShadowDevice, QueuedStepsNameTheFirstNonFiniteStep) {
  namespace fs = std::filesystem;
  const std::string dir = ::testing::TempDir() + "apus_nan_steps_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::copy(test::fixture("klein_tiny_a"), dir, fs::copy_options::recursive);
  const std::string file = dir + "/transformer/diffusion_pytorch_model.safetensors";
  std::vector<NamedTensor> tensors;
  {
    const SafetensorsFile f = SafetensorsFile::open(file);
    for (const auto& name : f.names()) {
      const Tensor& t = f.get(name);
      Tensor copy = Tensor::heap(t.shape, t.dtype);
      std::memcpy(copy.data, t.data, t.nbytes());
      if (name == "proj_out.weight") copy.ptr<uint16_t>()[3] = f32_to_bf16(NAN);
      tensors.push_back({name, copy});
    }
  }
  fs::remove(file);
  write_safetensors(file, tensors);
  const auto model = open_image_model(dir, Weights::resident, &test::shadow_device());
  ImageRequest r = image_runs().front().request;
  r.steps = 3;
  for (const char* queue : {"checked", "deferred", "graphs"}) {
    SCOPED_TRACE(queue);
    const KnobScope scope("device.steps", queue);
    test::expect_error([&] { model->generate(r); }, {"transformer step 1/3", "NaN or Inf"});
  }
  fs::remove_all(dir);
}

// A request is admitted against the device's own memory, not the host's: refused naming the device
// when its weights and activations would not fit there.
TEST(ShadowDevice, RequestsAreAdmittedAgainstTheDevicesMemory) {
  test::ShadowDevice& device = test::shadow_device();
  const auto image = open_image_model(test::fixture("klein_tiny_a"), Weights::per_stage, &device);
  const auto audio = open_audio_model(test::official_dir(), Weights::per_stage, &device);
  device.set_memory_bytes(64e3);
  test::expect_error([&] { image->generate(image_runs().front().request); }, {"64x48 needs about", "shadow's memory"});
  test::expect_error([&] { audio->generate(test::reference_request(false)); }, {"needs about", "shadow's memory"});
  device.set_memory_bytes(64e9);
  EXPECT_FALSE(image->generate(image_runs().front().request).rgb.empty());
  device.set_memory_bytes(0);
}

// `apus bench --device` and `-v` price stages against the device's own ceilings, measured there
// and cached under its name and hardware.
TEST(ShadowDevice, CeilingsAreMeasuredOnTheDevice) {
  test::ShadowDevice& device = test::shadow_device();
  Arena arena(size_t(64) << 20, false, device);
  Context ctx{&arena};
  ctx.backend = &device;
  EXPECT_EQ(calibration_key(ctx), "shadow | shadow");
  const size_t before = device.ops_run();
  const Chip chip = measure_ceiling(ctx);
  EXPECT_GE(device.ops_run(), before + 13);  // 11 GEMMs and 3 copies (the first GEMM builds the kernel)
  EXPECT_GT(chip.bf16_flops, 1e9);
  EXPECT_GT(chip.memory_bps, 1e8);
  // The int8 tier's linear runs on a device (a GPU's integer tensor cores): its rate measured there.
  EXPECT_GT(chip.int8_ops, 1e9);
}

// `apus bench --device ... --synthetic`: the published layout with values made as they are fetched
// (synth_on_demand), so weights go straight to the device with nothing written first. The values
// are synth_checkpoint's byte for byte: the same requests on the device from the on-demand layout
// and on the CPU from the written checkpoint agree exactly.
TEST(ShadowDevice, OnDemandSyntheticWeightsAreTheWrittenOnesAndReachTheDevice) {
  test::ShadowDevice& device = test::shadow_device();
  const std::string tmp = ::testing::TempDir() + "apus_on_demand_" + std::to_string(::getpid());
  std::filesystem::remove_all(tmp);
  struct Case {
    std::string name, source;
    std::vector<std::string> components;
  };
  for (const Case& c : {Case{"klein", test::fixture("klein_tiny_a"), {"transformer", "text_encoder", "vae"}},
                        Case{"sa3", test::official_dir(), {".", "t5gemma-b-b-ul2"}}}) {
    SCOPED_TRACE(c.name);
    const std::string written = tmp + "/" + c.name + "_written", on_demand = tmp + "/" + c.name + "_on_demand";
    synth_checkpoint(c.source, written, 11, {});
    synth_on_demand(c.source, on_demand, 11, {});
    int tensors = 0;
    for (const std::string& component : c.components) {
      const auto a = SafetensorsFolder::open(written + "/" + component);
      const auto b = open_weights(on_demand + "/" + component);
      for (const std::string& name : a->names()) {
        const Tensor& ta = a->stored(name);
        if (ta.dtype == DType::i64) continue;  // a buffer no model fetches (bn.num_batches_tracked)
        const Tensor tb = b->fetch(name, ta.shape);
        ASSERT_EQ(ta.shape, tb.shape) << name;
        EXPECT_EQ(std::memcmp(ta.data, tb.data, ta.nbytes()), 0) << component << " " << name;
        ++tensors;
      }
    }
    EXPECT_GT(tensors, 20);
    if (c.name == "klein") {
      const ImageRequest r = image_runs().front().request;
      EXPECT_TRUE(open_image_model(on_demand, Weights::per_stage, &device)->generate(r).rgb ==
                  open_image_model(written, Weights::per_stage, nullptr)->generate(r).rgb);
    } else {
      const AudioRequest r = test::reference_request(false);
      EXPECT_EQ(open_audio_model(on_demand, Weights::per_stage, &device)->generate(r).samples,
                open_audio_model(written, Weights::per_stage, nullptr)->generate(r).samples);
    }
  }
  std::filesystem::remove_all(tmp);
}

// Every command that runs a model takes --device: an unknown name is refused, and where this build
// or machine has no GPU, `cuda:0` is refused with the reason, before any work.
TEST(DeviceCli, EveryCommandTakesTheDeviceAndRefusesWhatItCannotRun) {
  bool gpu = false;
#if APUS_HAS_CUDA
  gpu = cuda_available(nullptr);
#endif
  const std::string klein = test::fixture("klein_tiny_a"), out = ::testing::TempDir() + "apus_device_cli_out";
  const std::vector<std::string> commands = {
      "image --model " + klein + " --prompt x -W 64 -H 48 -o " + out + ".png",
      "audio --model " + test::official_dir() + " --prompt x --seconds 1 -o " + out + ".wav",
      "bench --model " + klein + " --reps 1 --warmup 0",
      "serve --model " + klein + " --port 0",
      "calibrate",
      "gate --model " + klein + " --quant int8 --prompts 1 --seeds 1 -W 64 -H 48"};
  for (const std::string& command : commands) {
    SCOPED_TRACE(command);
    const test::CliRun unknown = test::run_cli(command + " --device tpu");
    EXPECT_EQ(unknown.status, 1) << unknown.output;
    EXPECT_NE(unknown.output.find("device 'tpu' is not known (expected cpu, cuda or cuda:N)"), std::string::npos)
        << unknown.output;
    if (gpu) continue;
    const test::CliRun cuda = test::run_cli(command + " --device cuda:0");
    EXPECT_EQ(cuda.status, 1) << cuda.output;
    EXPECT_EQ(cuda.output.rfind("error: ", 0), 0u) << cuda.output;
    EXPECT_TRUE(cuda.output.find("cuda:0") != std::string::npos ||
                cuda.output.find("no CUDA backend") != std::string::npos)
        << cuda.output;
  }
  EXPECT_FALSE(std::filesystem::exists(out + ".png"));
}

}  // namespace
}  // namespace apus
