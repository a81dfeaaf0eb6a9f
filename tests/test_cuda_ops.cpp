// The CUDA backend's ops against the reference backend, as test_ops.cpp holds the CPU's: fresh
// random inputs (seed printed), poisoned outputs, the same per-op bounds. Runs where a CUDA device
// is present and skips with the reason where not (built without nvcc, no driver, no GPU).
#include <cstring>
#include <functional>
#include <random>

#include "apus/apus.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "op_bounds.h"
#include "sa3_fixtures.h"
#include "ops/backend.h"
#include "ops/ops.h"
#include "test_util.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#endif

namespace apus {
namespace {

using ops::Rounding;

#if APUS_HAS_CUDA
// GPU 0's backend, or null with the reason there is none (no driver, no device).
Backend* gpu_or_null(std::string& why) { return cuda_available(&why) ? &cuda_backend(0) : nullptr; }

struct Case {
  std::string name;
  std::vector<Tensor> inputs;  // host tensors; the op sees device copies on the GPU
  Shape out;
  std::function<void(Context&, const std::vector<Tensor>&, Tensor&)> run;
  bool inner_rounding = false;
};

TEST(CudaOps, EveryOpMatchesTheReferenceBackend) {
  std::string why;
  Backend* device = gpu_or_null(why);
  if (!device) GTEST_SKIP() << "no CUDA device here: " << why;
  Backend& gpu = *device;
  for (const DType act : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(act));
    std::mt19937 rng{test::test_seed()};
    auto random = [&](Shape s, float scale = 1.0f, DType dt = DType(255)) {
      if (dt == DType(255)) dt = act;
      Tensor t = Tensor::heap(std::move(s), dt);
      std::normal_distribution<float> dist(0.0f, scale);
      for (int64_t i = 0; i < t.numel(); ++i) {
        if (dt == DType::bf16) t.ptr<uint16_t>()[i] = f32_to_bf16(dist(rng));
        else t.ptr<float>()[i] = dist(rng);
      }
      return t;
    };
    const int64_t m = 37, d = 96;
    const Tensor x = random({m, d}), y = random({m, d}), g = random({1, d}), g2 = random({m, d}),
                 w = random({45, d}, 0.2f, DType::bf16), bias = random({45}, 1.0f, DType::bf16),
                 img = random({2, 3, 5, 7}), conv_x = random({2, 8, 9, 7}), conv_w = random({6, 8, 3, 3}, 0.2f, DType::bf16),
                 conv_b = random({6}, 1.0f, DType::bf16), gn_x = random({2, 8, 6, 5}, 2.0f), table = random({40, 24}), freqs = random({32}, 1.0f, DType::f32), tables = random({m, 12}, 1.0f, DType::f32);
    // Attention: two samples of 150 rows, 4 query heads of 16 over 2 key heads, padding in the
    // second sample's tail.
    const int64_t s = 300, hd = 16;
    const Tensor aq = random({s, 4 * hd}), ak = random({s, 2 * hd}), av = random({s, 2 * hd}), aq2 = random({s, 4 * hd}),
                 ak2 = random({s, 2 * hd});
    Tensor valid = Tensor::heap({s}, DType::i64);  // an input like the others: on the device there
    for (int64_t j = 0; j < s; ++j) valid.ptr<int64_t>()[j] = j < 270;
    Tensor positions = Tensor::heap({9, 4}, DType::i64);
    for (int64_t i = 0; i < 36; ++i) positions.ptr<int64_t>()[i] = (i * 7) % 23;
    const Tensor gx = random({192, 32}, 1.0f, DType::f32), gc = random({192, 32}), gu = random({192, 32});
    Tensor ids = Tensor::heap({6}, DType::i32);
    for (int64_t i = 0; i < 6; ++i) ids.ptr<int32_t>()[i] = int32_t((i * 17) % 40);
    Tensor weights = Tensor::heap({m}, DType::f32);
    for (int64_t r = 0; r < m; ++r) weights.ptr<float>()[r] = float(r % 5) / 4;
    std::vector<Case> cases = {
        {"linear", {x, w}, {m, 45}, [](Context& c, const auto& in, Tensor& o) { ops::linear(c, in[0], in[1], nullptr, o); }},
        {"linear + bias", {x, w, bias}, {m, 45},
         [](Context& c, const auto& in, Tensor& o) { ops::linear(c, in[0], in[1], &in[2], o); }},
        {"copy", {x}, {m, d}, [](Context& c, const auto& in, Tensor& o) { ops::copy(c, in[0], o); }},
        {"silu", {x}, {m, d}, [](Context& c, const auto& in, Tensor& o) { ops::silu(c, in[0], o); }},
        {"transpose", {x}, {d, m}, [](Context& c, const auto& in, Tensor& o) { ops::transpose(c, in[0], o); }},
        {"upsample_nearest2x", {img}, {2, 3, 10, 14},
         [](Context& c, const auto& in, Tensor& o) { ops::upsample_nearest2x(c, in[0], o); }},
        {"blend", {x, y, weights}, {m, d}, [](Context& c, const auto& in, Tensor& o) { ops::blend(c, in[0], in[1], in[2], o); }},
        {"pingpong_update", {x, y, g2}, {m, d}, [](Context& c, const auto& in, Tensor& o) {
           ops::copy(c, in[0], o);
           ops::pingpong_update(c, o, in[1], in[2], 0.8909032f, 0.7455466f);
         }},
        {"timestep_embedding", {}, {1, 256}, [](Context& c, const auto&, Tensor& o) { ops::timestep_embedding(c, 873.5f, o); }},
        {"fourier_features", {freqs}, {1, 64},
         [](Context& c, const auto& in, Tensor& o) { ops::fourier_features(c, 0.37f, in[0], o); }},
        {"permute", {img}, {3, 7, 2, 5}, [](Context& c, const auto& in, Tensor& o) { ops::permute(c, in[0], o, {1, 3, 0, 2}); }},
        {"conv2d 3x3", {conv_x, conv_w, conv_b}, {2, 6, 9, 7},
         [](Context& c, const auto& in, Tensor& o) { ops::conv2d(c, in[0], in[1], &in[2], o, 1, 1, 1); }},
        {"conv2d stride 2, end padding", {conv_x, conv_w}, {2, 6, 4, 3},
         [](Context& c, const auto& in, Tensor& o) { ops::conv2d(c, in[0], in[1], nullptr, o, 2, 0, 1); }},
        {"embedding", {table, ids}, {6, 24}, [](Context& c, const auto& in, Tensor& o) { ops::embedding(c, in[0], in[1], o); }},
        {"rope_tables f32", {positions}, {9, 16}, [](Context& c, const auto& in, Tensor& o) {
           Tensor sin = Tensor::in(*c.arena, {9, 16}, DType::f32);
           ops::rope_tables(c, in[0], {8, 8, 8, 8}, 2000.0, ops::RopeMath::f32, o, sin);
         }},
        {"rope_tables f64", {positions}, {9, 16}, [](Context& c, const auto& in, Tensor& o) {
           Tensor cos = Tensor::in(*c.arena, {9, 16}, DType::f32);
           ops::rope_tables(c, in[0], {8, 8, 8, 8}, 10000.0, ops::RopeMath::f64, cos, o);
         }},
        {"euler_update", {x, y}, {m, d},
         [](Context& c, const auto& in, Tensor& o) { ops::copy(c, in[0], o); ops::euler_update(c, o, in[1], -0.2871f); }},
    };
    for (const float apg : {0.0f, 1.0f, 0.5f})
      cases.push_back({"guided_velocity", {gx, gc, gu}, {192, 32}, [apg](Context& c, const auto& in, Tensor& o) {
                         ops::guided_velocity(c, in[0], in[1], in[2], o, 0.7455466f, 7.0f, apg, 3, 50);
                       }, /*inner_rounding=*/true});
    for (bool causal : {false, true})
      cases.push_back({causal ? "attention causal padded" : "attention padded", {aq, ak, av, valid}, {s, 4 * hd},
                       [causal](Context& c, const auto& in, Tensor& o) {
                         ops::attention(c, in[0], in[1], in[2], o, 16, 0.25f, {causal, &in[3], 2});
                       }, /*inner_rounding=*/true});
    cases.push_back({"attention band", {aq, ak, av}, {s, 4 * hd}, [](Context& c, const auto& in, Tensor& o) {
                       ops::attention(c, in[0], in[1], in[2], o, 16, 0.25f, {false, nullptr, 2, 0.0f, Rounding::once, 17});
                     }, /*inner_rounding=*/true});
    cases.push_back({"differential_attention", {aq, ak, aq2, ak2, av}, {s, 4 * hd}, [](Context& c, const auto& in, Tensor& o) {
                       ops::differential_attention(c, in[0], in[1], in[2], in[3], in[4], o, 16, 0.25f, {false, nullptr, 2});
                     }, /*inner_rounding=*/true});
    for (Rounding r : {Rounding::once, Rounding::each_step}) {
      const std::string tag = r == Rounding::once ? " (once)" : " (each step)";
      cases.push_back({"group_norm + silu" + tag, {gn_x, g}, {2, 8, 6, 5}, [r](Context& c, const auto& in, Tensor& o) {
                         ops::group_norm(c, in[0], in[1].reshape({d}).rows(0, 8), in[1].reshape({d}).rows(8, 16), o, 4, 1e-6f,
                                         true, r);
                       }});
      cases.push_back({"attention softcap" + tag, {aq, ak, av, valid}, {s, 4 * hd}, [r](Context& c, const auto& in, Tensor& o) {
                         ops::attention(c, in[0], in[1], in[2], o, 16, 0.25f, {false, &in[3], 1, 5.0f, r});
                       }, /*inner_rounding=*/true});
      cases.push_back({"glu silu" + tag, {x, y}, {m, d},
                       [r](Context& c, const auto& in, Tensor& o) { ops::glu(c, in[0], in[1], o, ops::Activation::silu, r); }});
      cases.push_back({"glu sin_pi" + tag, {x, y}, {m, d},
                       [r](Context& c, const auto& in, Tensor& o) { ops::glu(c, in[0], in[1], o, ops::Activation::sin_pi, r); }});
      cases.push_back({"add_gated" + tag, {x, y, g}, {m, d}, [r](Context& c, const auto& in, Tensor& o) {
                         ops::copy(c, in[0], o);
                         ops::add_gated(c, o, in[1], &in[2], r);
                       }});
      cases.push_back({"modulate" + tag, {x, g, g2}, {m, d},
                       [r](Context& c, const auto& in, Tensor& o) { ops::modulate(c, in[0], in[1], in[1], o, r); }});
      cases.push_back({"layer_norm_modulate" + tag, {x, g}, {m, d},
                       [r](Context& c, const auto& in, Tensor& o) { ops::layer_norm_modulate(c, in[0], in[1], in[1], o, 1e-6f, r); }});
      cases.push_back({"rms_norm per head" + tag, {x, g}, {m, d}, [r](Context& c, const auto& in, Tensor& o) {
                         ops::rms_norm(c, in[0], in[1].reshape({d}).rows(0, 32), o, 1e-6f, 32, r);
                       }});
      cases.push_back({"gate_sigmoid" + tag, {x}, {m, d},
                       [r](Context& c, const auto& in, Tensor& o) { ops::gate_sigmoid(c, in[0], o, r); }});
      cases.push_back({"affine" + tag, {x, g}, {m, d},
                       [r](Context& c, const auto& in, Tensor& o) { ops::affine(c, in[0], in[1], in[1], o, r); }});
      for (const auto style : {ops::RopeStyle::interleaved, ops::RopeStyle::half})
        cases.push_back({std::string("rope ") + (style == ops::RopeStyle::half ? "half" : "interleaved") + tag,
                         {x, tables}, {m, d}, [r, style](Context& c, const auto& in, Tensor& o) {
                           ops::copy(c, in[0], o);
                           ops::rope(c, o, in[1], in[1], 32, style, r);  // 12 of 16 pairs per head turn
                         }});
      cases.push_back({"dyt" + tag, {x, g}, {m, d}, [r](Context& c, const auto& in, Tensor& o) {
                         ops::dyt(c, in[0], in[1].cols(0, 1), in[1].reshape({d}), in[1].reshape({d}), o, r);
                       }, /*inner_rounding=*/true});
    }
    // The image's bytes: the same on both backends, to the level.
    {
      const Tensor image = random({1, 3, 6, 5});
      Arena host_arena, device_arena(size_t(1) << 20, false, gpu);
      Context ref{&host_arena, act, nullptr, false, &reference_backend()};
      Context dev{&device_arena, act, nullptr, false, &gpu};
      Tensor want = Tensor::heap({6, 5, 3}, DType::u8), got = to_device(gpu, want);
      ops::image_to_rgb8(ref, image, want);
      ops::image_to_rgb8(dev, to_device(gpu, image), got);
      EXPECT_EQ(to_f32_vector(to_host(got)), to_f32_vector(want)) << "image_to_rgb8";
    }
    Arena host_arena, device_arena(size_t(64) << 20, false, gpu);
    Context ref{&host_arena, act, nullptr, false, &reference_backend()};
    Context dev{&device_arena, act, nullptr, false, &gpu};
    for (const Case& k : cases) {
      Tensor want = Tensor::heap(k.out, act);
      std::memset(want.data, 0xff, want.nbytes());  // NaN: an output the op leaves unwritten shows
      k.run(ref, k.inputs, want);
      std::vector<Tensor> on_gpu;
      for (const Tensor& t : k.inputs) on_gpu.push_back(to_device(gpu, t));
      Tensor poison = Tensor::heap(k.out, act);
      std::memset(poison.data, 0xff, poison.nbytes());
      Tensor out = to_device(gpu, poison);
      k.run(dev, on_gpu, out);
      const Tensor got = to_host(out);
      const Agreement a = agreement(got, want);
      std::printf("[ measure ] cuda %s %s: rel L2 %.2e, %.3f%% differ, worst %.2f ulp\n", k.name.c_str(),
                  dtype_name(act).data(), a.rel_l2, 100 * a.differing, a.worst_ulps);
      EXPECT_TRUE(within_bound(a, act, k.inner_rounding)) << k.name;
    }
  }
}

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
      const auto dit = flux2::Transformer::load(ModelDir::open(test::fixture(variant), true, &gpu));
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
      const auto vae = flux2::VaeDecoder::load(ModelDir::open(test::fixture(variant), true, &gpu));
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
  for (const Run& run : {Run{"klein_tiny_a", "klein_tiny_a_ref.safetensors", "klein_tiny_a_ref.json", false},
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
    std::printf("[ measure ] cuda %s: mean |d| to the bf16 reference %.3f, its disagreement %.3f\n", run.ref_file.c_str(),
                ours, disagreement);
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

#else
TEST(CudaOps, NeedTheCudaBackend) { GTEST_SKIP() << "built without the CUDA backend (no nvcc at configure time)"; }
#endif

}  // namespace
}  // namespace apus
