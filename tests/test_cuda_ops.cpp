// The CUDA backend beyond the op table (test_op_table.cpp runs every op case on it too): host
// operands refused, the FLUX.2 stages and whole klein and Stable Audio 3 requests on the device
// against the reference. Runs where a CUDA device is present and skips with the reason where not
// (built without nvcc, no driver, no GPU).
#include <cstring>

#include "apus/apus.h"
#include "io/media/image.h"
#include "io/weights/safetensors.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "ops/backend.h"
#include "ops/ops.h"
#include "pipeline/stage.h"
#include "sa3_fixtures.h"
#include "test_util.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#include "ops/cuda/cudnn_attention.h"
#endif

namespace apus {
namespace {

#if APUS_HAS_CUDA
// GPU 0's backend, or null with the reason there is none (no driver, no device).
Backend* gpu_or_null(std::string& why) { return cuda_available(&why) ? &cuda_backend(0) : nullptr; }

// Host operands are refused by the CUDA backend, naming the device (the front end's check), and
// without a device the backend itself is refused with the reason.
TEST(CudaOps, HostOperandsAreRefused) {
  std::string why;
  Backend* device = gpu_or_null(why);
  if (!device) {
    test::expect_error([] { cuda_backend(0); }, {"cuda:0"});
    GTEST_SKIP() << "no CUDA device here: " << why;
  }
  Backend& gpu = *device;
  Arena arena(size_t(1) << 20, false, gpu);
  Context dev{&arena, DType::bf16, nullptr, false, &gpu};
  Tensor host = Tensor::heap({4, 8}, DType::bf16), on_device = Tensor::in(arena, {4, 8}, DType::bf16);
  test::expect_error([&] { ops::copy(dev, host, on_device); }, {"copy", "cuda"});
}

// The FLUX.2 transformer on the device, weights uploaded at their first fetch: every step of the
// official run from the reference's own inputs, held to the CPU stage test's bounds.
TEST(CudaStages, Flux2TransformerMatchesTheReferenceEveryStep) {
  std::string why;
  Backend* device = gpu_or_null(why);
  if (!device) GTEST_SKIP() << "no CUDA device here: " << why;
  Backend& gpu = *device;
  for (const std::string variant : {"klein_tiny_a", "klein_tiny_9b"})
    for (const std::string p : {"fp32", "bf16"}) {
      SCOPED_TRACE(variant + " " + p);
      const test::Reference ref(variant);
      const auto dit =
          test::load_stage<flux2::Transformer>(ModelDir::open(test::fixture(variant), true, &gpu), "transformer");
      const auto& cfg = dit.config();
      Arena arena(size_t(64) << 20, false, gpu);
      Context ctx{&arena, test::precision_dtype(p), nullptr, false, &gpu};
      const Tensor& embeds = ref.file.get(p + ".prompt_embeds");
      const int64_t t = embeds.shape[1], l = ref.file.get(p + ".latent_ids").shape[1];
      const auto pro = dit.prologue(ctx, gpu.upload(ref.as(p + ".prompt_embeds", ctx.act, {t, cfg.joint_dim})),
                                    gpu.upload(ref.file.get(p + ".text_ids").reshape({t, 4})),
                                    gpu.upload(ref.file.get(p + ".latent_ids").reshape({l, 4})));
      for (int step = 0; step < ref.meta["steps"].get<int>(); ++step) {
        const std::string s = ".dit.step" + std::to_string(step);
        const Tensor latents = gpu.upload(ref.as(p + s + ".latents_in", ctx.act, {l, cfg.in_channels}));
        Tensor poison = Tensor::heap({l, cfg.out_channels}, ctx.act);
        std::memset(poison.data, 0xff, poison.nbytes());
        Tensor velocity = gpu.upload(poison);
        dit.forward(ctx, pro, latents, ref.f32(p + ".scheduler.step" + std::to_string(step) + ".t")[0], velocity);
        test::expect_matches("cuda transformer" + s, p, to_f32_vector(to_host(velocity)),
                             ref.f32("fp32" + s + ".velocity"), ref.f32("bf16" + s + ".velocity"));
      }
    }
}

// The FLUX.2 VAE decoder on the device (its batch-norm statistics computed on the host at load and
// placed there) from the reference's final latents, held to the CPU stage test's bounds.
TEST(CudaStages, Flux2VaeDecodeMatchesTheReference) {
  std::string why;
  Backend* device = gpu_or_null(why);
  if (!device) GTEST_SKIP() << "no CUDA device here: " << why;
  Backend& gpu = *device;
  for (const std::string variant : {"klein_tiny_a", "klein_tiny_b"})
    for (const std::string p : {"fp32", "bf16"}) {
      SCOPED_TRACE(variant + " " + p);
      const test::Reference ref(variant);
      const auto vae = test::load_stage<flux2::VaeDecoder>(ModelDir::open(test::fixture(variant), true, &gpu), "vae");
      Arena arena(size_t(64) << 20, false, gpu);
      Context ctx{&arena, test::precision_dtype(p), nullptr, false, &gpu};
      const auto grid = ref.meta["latent_grid_hw"].get<std::vector<int64_t>>();
      const int64_t h = grid[0], w = grid[1], s = vae.config().pixels_per_token();
      const std::string latents = p + ".step" + std::to_string(ref.meta["steps"].get<int>() - 1) + ".latents";
      Tensor poison = Tensor::heap({1, vae.config().out_channels, h * s, w * s}, ctx.act);
      std::memset(poison.data, 0xff, poison.nbytes());
      Tensor image = gpu.upload(poison);
      vae.decode(ctx, gpu.upload(ref.as(latents, ctx.act, {h * w, vae.config().packed_channels()})), h, w, image);
      test::expect_matches("cuda vae image", p, to_f32_vector(to_host(image)), ref.f32("fp32.vae.image"),
                           ref.f32("bf16.vae.image"));
    }
}

// Whole klein requests on the device (`--device cuda`): the official image from the seed, for a
// distilled model, a -base one with guidance and an edit with two references, held to the CLI
// tests' bound (twice the reference's own bf16-vs-fp32 disagreement, in mean pixel levels).
TEST(CudaPipelines, KleinRendersTheOfficialImagesOnTheDevice) {
  std::string why;
  if (!gpu_or_null(why)) GTEST_SKIP() << "no CUDA device here: " << why;
  struct Run {
    std::string variant, ref_file, meta_file;
    bool edit;
  };
  for (const Run& run :
       {Run{"klein_tiny_a", "klein_tiny_a_ref.safetensors", "klein_tiny_a_ref.json", false},
        Run{"klein_tiny_base", "klein_tiny_base_ref.safetensors", "klein_tiny_base_ref.json", false},
        Run{"klein_tiny_a", "klein_tiny_a_edit_ref.safetensors", "klein_tiny_a_edit_ref.json", true}}) {
    SCOPED_TRACE(run.ref_file);
    const SafetensorsFile ref = SafetensorsFile::open(test::fixture(run.ref_file));
    const Json meta = read_json(test::fixture(run.meta_file));
    const auto model = ImageModel::open(test::fixture(run.variant), Weights::per_stage, "cuda");
    ImageRequest r;
    r.prompt = meta["prompt"].get<std::string>();
    r.seed = meta["seed"].get<uint64_t>();
    r.steps = meta["steps"].get<int>();
    if (run.edit) {
      for (const Json& name : meta["references"])
        r.references.push_back(read_image(test::fixture(run.variant + "_edit/" + name.get<std::string>())));
    } else {
      r.width = meta["width"];
      r.height = meta["height"];
      if (!meta["is_distilled"].get<bool>()) r.cfg = meta["guidance_scale"].get<float>();
    }
    const ImageResult got = model->generate(r);
    const Tensor& bf16 = ref.get("bf16.image_u8");
    const double disagreement = test::level_gap(bf16, ref.get("fp32.image_u8")).mean;
    const double ours = test::level_gap(got.rgb, bf16).mean;
    std::printf("[ measure ] cuda %s: mean |d| to the bf16 reference %.3f, its disagreement %.3f\n",
                run.ref_file.c_str(), ours, disagreement);
    EXPECT_LT(ours, test::kBf16Factor * disagreement);
  }
}

// Whole Stable Audio 3 requests on the device (`apus audio --device cuda`): text-to-audio in both
// layouts, audio-to-audio and inpainting, held to the CPU pipeline tests' bounds against the
// official generate().
TEST(CudaPipelines, Sa3RendersTheOfficialClipsOnTheDevice) {
  std::string why;
  if (!gpu_or_null(why)) GTEST_SKIP() << "no CUDA device here: " << why;
  const SafetensorsFile t2a = SafetensorsFile::open(test::fixture("sa3_pipeline_ref.safetensors"));
  const SafetensorsFile inputs = SafetensorsFile::open(test::fixture("sa3_inputs_ref.safetensors"));
  const auto fp32_ref = test::interleaved(t2a.get("fp32.audio")), bf16_ref = test::interleaved(t2a.get("bf16.audio"));
  for (const std::string& dir : {test::pipeline_dir(), test::official_dir()}) {
    const auto model = AudioModel::open(dir, Weights::per_stage, "cuda");
    for (const bool fp32 : {true, false}) {
      const AudioResult r = model->generate(test::reference_request(fp32));
      ASSERT_EQ(r.samples.size(), fp32_ref.size());
      test::expect_matches("cuda sa3 audio " + dir, fp32 ? "fp32" : "bf16", r.samples, fp32_ref, bf16_ref);
    }
  }
  const double bf16_self = test::rel_l2(bf16_ref, fp32_ref);
  const auto model = AudioModel::open(test::official_dir(), Weights::per_stage, "cuda");
  for (const std::string mode : {"a2a", "inpaint"}) {
    const auto want = test::interleaved(inputs.get(mode + ".fp32.audio"));
    const double err = test::rel_l2(model->generate(test::inputs_request(true, mode)).samples, want);
    const double err_bf16 = test::rel_l2(model->generate(test::inputs_request(false, mode)).samples, want);
    std::printf("[ measure ] cuda sa3 %s: fp32 rel L2 %.3e, bf16 %.3e (official bf16 self-distance %.3e)\n",
                mode.c_str(), err, err_bf16, bf16_self);
    EXPECT_LT(err, test::kFp32Tolerance) << mode;
    EXPECT_LT(err_bf16, test::kBf16Factor * bf16_self) << mode;
  }
}

// The steps queued without a wait (device.steps=deferred) and recorded as CUDA graphs (graphs) on
// the device: the same kernels in the same order, so the checked run's bytes, for klein (with two
// LoRAs, whose gates are staged into each recorded step) and Stable Audio 3, resident as `apus
// serve` and `apus bench` hold them.
TEST(CudaPipelines, QueuedAndRecordedStepsComputeTheCheckedStepsBytes) {
  std::string why;
  if (!gpu_or_null(why)) GTEST_SKIP() << "no CUDA device here: " << why;
  const auto image = ImageModel::open(test::fixture("klein_tiny_a"), Weights::resident, "cuda");
  ImageRequest r = test::small_image_request("a red fox in the snow", 7);
  r.steps = 4;
  r.loras = {{test::fixture("klein_lora/peft.safetensors"), 0.7f}, {test::fixture("klein_lora/bfl.safetensors"), 0.5f}};
  const auto audio = AudioModel::open(test::official_dir(), Weights::resident, "cuda");
  AudioRequest a = test::reference_request(false);
  a.steps = 4;
  const std::vector<uint8_t> rgb = image->generate(r).rgb;
  const std::vector<float> samples = audio->generate(a).samples;
  for (const char* queue : {"deferred", "graphs"}) {
    SCOPED_TRACE(queue);
    const KnobScope scope("device.steps", queue);
    EXPECT_EQ(image->generate(r).rgb, rgb);
    EXPECT_EQ(audio->generate(a).samples, samples);
  }
  EXPECT_GT(device_steps_knob.taken(int(StepQueue::graphs)), 0);
}

// The files people download on the device: each quantised transformer (GGUF's blocks, BFL's fp8,
// ComfyUI's int8 / mxfp8 / nvfp4) renders exactly what its dequantised values render on the same
// GPU, in bf16 and fp32 (the device decodes the CPU's numbers; the kernels after are the same).
// And the int8 tier on the integer tensor cores: nearer the official fp32 image than the
// official bf16 run is, as on the CPU (Int8Tier.KleinImageWithinTheOfficialBf16Disagreement).
TEST(CudaPipelines, QuantisedFilesAndTheInt8TierOnTheDevice) {
  std::string why;
  if (!gpu_or_null(why)) GTEST_SKIP() << "no CUDA device here: " << why;
  auto render = [](const std::string& file, bool fp32) {
    ModelParts p;
    p.model = test::fixture("klein_single/" + file);
    p.config = test::fixture("klein_tiny_a");
    ImageRequest r = test::small_image_request("a lighthouse in fog", 11);
    r.fp32 = fp32;
    return ImageModel::open(p, Weights::per_stage, "cuda")->generate(r).rgb;
  };
  for (const auto& [file, decoded] :
       {std::pair{"flux-2-klein-tiny-Q4_K_M.gguf", "flux-2-klein-tiny-Q4_K_M-dequantized.safetensors"},
        std::pair{"flux-2-klein-tiny-fp8.safetensors", "flux-2-klein-tiny-fp8-dequantized.safetensors"},
        std::pair{"flux-2-klein-tiny-comfy-mixed.safetensors",
                  "flux-2-klein-tiny-comfy-mixed-dequantized.safetensors"}})
    for (const bool fp32 : {false, true}) EXPECT_EQ(render(file, fp32), render(decoded, fp32)) << file << fp32;

  const test::Fp32ImageRequest r("klein_tiny_a");
  ModelParts parts{test::fixture("klein_tiny_a")};
  parts.quant = Quant::int8;
  const std::vector<uint8_t> int8 = ImageModel::open(parts, Weights::per_stage, "cuda")->generate(r.request()).rgb;
  std::printf(
      "[ measure ] cuda klein int8 tier (fp32 activations): mean |d| to the official fp32 image %.3f, "
      "the official bf16 image's %.3f\n",
      r.gap(int8), r.official_gap());
  EXPECT_LT(r.gap(int8), r.official_gap());
  // The fp8 tier on the fp8 tensor cores (Ada, Hopper), held as on the CPU (Fp8Tier in
  // test_fp8.cpp); an older GPU refuses it at load, naming what it lacks.
  parts.quant = Quant::fp8;
  const std::string refusal = backend_for("cuda")->refuses(Products::fp8);
  if (!refusal.empty()) {
    test::expect_error([&] { ImageModel::open(parts, Weights::per_stage, "cuda"); }, {"--quant fp8", "sm_"});
    return;
  }
  const std::vector<uint8_t> fp8 = ImageModel::open(parts, Weights::per_stage, "cuda")->generate(r.request()).rgb;
  std::printf("[ measure ] cuda klein fp8 tier (fp32 activations): mean |d| to the official fp32 image %.3f\n",
              r.gap(fp8));
  EXPECT_LT(r.gap(fp8), 16 * r.official_gap());
}

// One process as a group of one rank: its exchanges copy its own part.
class OneRank final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_gather(void*, const std::vector<size_t>&, const char*) const override {}
  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv, const std::vector<size_t>&,
                  const char*) const override {
    std::memcpy(recv, send, send_bytes[0]);
  }
  void count_exchange(double, double seconds) const override {
    ++exchanges;
    EXPECT_LT(seconds, timeout());
  }
  mutable int exchanges = 0;
};

// A split's exchanges on the GPU go through NCCL (bootstrapped over the group's own): with one
// rank (NCCL refuses two ranks on one GPU) an all-gather keeps the data and an all-to-all copies
// it, device memory to device memory; a whole klein request as Ulysses over that rank is the
// unsplit request's image on the device, byte for byte.
TEST(CudaCollectives, OneRankExchangesOverNccl) {
  std::string why;
  Backend* device = gpu_or_null(why);
  if (!device) GTEST_SKIP() << "no CUDA device here: " << why;
  ASSERT_TRUE(device->exchanges(&why)) << why;
  const OneRank one;
  Tensor host = Tensor::heap({1000}, DType::f32);
  for (int i = 0; i < 1000; ++i) host.ptr<float>()[i] = float(i) * 0.25f - 7;
  Tensor data = device->upload(host), recv = device->upload(Tensor::heap({1000}, DType::f32));
  device->all_gather(one, data.data, {host.nbytes()}, "a test's part");
  device->all_to_all(one, data.data, {host.nbytes()}, recv.data, {host.nbytes()}, "a test's parts");
  EXPECT_EQ(to_f32_vector(device->download(data)), to_f32_vector(host));
  EXPECT_EQ(to_f32_vector(device->download(recv)), to_f32_vector(host));
  EXPECT_EQ(one.exchanges, 2);
  ImageRequest r = test::small_image_request("a red fox in the snow", test::test_seed());
  const auto model = ImageModel::open(test::fixture("klein_tiny_a"), Weights::per_stage, "cuda");
  const ImageResult whole = model->generate(r);
  r.parallel = {Parallel::ulysses, &one};
  EXPECT_TRUE(model->generate(r).rgb == whole.rgb);
  EXPECT_GT(one.exchanges, 2);
}

// cuDNN's view of an operand (cuda.attention=cudnn) finds every element where apus's layout keeps
// it: sample b's row s at b * rows + s, head h's element e at column h * head_dim + e, rows
// row_stride apart (q, k and v as column views of one fused projection).
TEST(CudnnAttention, OperandStridesFindApusLayout) {
  const int64_t batch = 2, rows = 5, heads = 3, d = 8, row_stride = 3 * heads * d + 8;
  const cuda::SdpaTensor t = cuda::sdpa_tensor(batch, rows, heads, d, row_stride);
  EXPECT_EQ(t.dim, (std::array<int64_t, 4>{batch, heads, rows, d}));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t s = 0; s < rows; ++s)
        for (int64_t e = 0; e < d; ++e)
          ASSERT_EQ(b * t.stride[0] + h * t.stride[1] + s * t.stride[2] + e * t.stride[3],
                    (b * rows + s) * row_stride + h * d + e);
}

// The graphs the arm builds pass cudnn-frontend's own checks, without a device, for each GPU
// generation the build holds code for: klein 4B's joint attention at 1024x1024 (24 heads of 128
// over 512 text and 4096 image rows, q, k and v columns of one fused projection), causal grouped
// heads, a batch of two (-base's two guidance branches), the output into a column view; and the
// checks can fail: query heads that no key head divides are refused.
TEST(CudnnAttention, GraphsPassTheFrontendsChecks) {
  const int64_t qkv = 3 * 24 * 128;
  const cuda::SdpaOperands klein{nullptr, nullptr, nullptr, nullptr, qkv, qkv, qkv,        24 * 128,
                                 1,       4608,    4608,    24,      24,  128, 0.0883883f, false};
  const std::string probe = cuda::sdpa_graph_problem(klein, 90);
  if (probe.find("no cudnn-frontend") != std::string::npos || probe.find("cannot open cuDNN") != std::string::npos)
    GTEST_SKIP() << probe;
  const cuda::SdpaOperands grouped{nullptr, nullptr, nullptr, nullptr, 32 * 64, 8 * 64, 8 * 64, 32 * 64,
                                   1,       300,     300,     32,      8,       64,     0.125f, true};
  cuda::SdpaOperands two = klein, into_view = klein;
  two.batch = 2;
  into_view.o_stride = 24 * 128 + 4 * 24 * 128;  // a single block's [attention | MLP] rows
  for (const int sm : {80, 86, 89, 90})
    for (const cuda::SdpaOperands& a : {klein, grouped, two, into_view})
      EXPECT_EQ(cuda::sdpa_graph_problem(a, sm), "") << "sm " << sm << ", " << a.hq << " heads of " << a.d;
  cuda::SdpaOperands uneven = grouped;
  uneven.hq = 12;
  uneven.hk = 5;
  uneven.k_stride = uneven.v_stride = 5 * 64;
  const std::string refused = cuda::sdpa_graph_problem(uneven, 90);
  std::printf("[ measure ] 12 query heads over 5 key heads: %s\n", refused.c_str());
  EXPECT_NE(refused, "");
}

#else
TEST(CudaOps, NeedTheCudaBackend) { GTEST_SKIP() << "built without the CUDA backend (no nvcc at configure time)"; }
#endif

}  // namespace
}  // namespace apus
