// `apus synth`: the published klein layout satisfies every loader, --like reproduces a
// checkpoint's layout byte for byte with new values, and runs on synthesized weights stay finite.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "io/weights/synth.h"
#include "models/flux2/klein.h"
#include "models/flux2/text_encoder.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "sampling/flow_match.h"
#include "test_util.h"
#include "text/klein_prompt.h"

namespace apus {
namespace {

using test::expect_error;

namespace fs = std::filesystem;

// A fresh folder removed with everything in it when the test ends.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name)
      : path(::testing::TempDir() + "apus_synth_" + std::to_string(::getpid()) + "_" + name) {
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string read_bytes(const std::string& path, size_t limit = size_t(-1)) {
  std::ifstream f(path, std::ios::binary);
  std::string s;
  char buf[1 << 16];
  while (s.size() < limit && f.read(buf, sizeof buf).gcount() > 0) s.append(buf, size_t(f.gcount()));
  return s.substr(0, std::min(limit, s.size()));
}

// The 8-byte length and the JSON header: the whole layout of a safetensors file.
std::string header_bytes(const std::string& path) {
  const std::string head = read_bytes(path, 8);
  uint64_t n = 0;
  std::memcpy(&n, head.data(), 8);
  return read_bytes(path, 8 + size_t(n));
}

std::vector<std::string> files_under(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(e.path().lexically_relative(dir).generic_string());
  std::sort(out.begin(), out.end());
  return out;
}

int run(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Returns the largest magnitude, or NaN at the first non-finite element.
double max_abs_or_nan(const Tensor& t) {
  double m = 0;
  for (float v : to_f32_vector(t)) {
    if (!std::isfinite(v)) return NAN;
    m = std::max(m, double(std::fabs(v)));
  }
  return m;
}

// The pipeline's stages one by one (bf16, 4 steps), asserting each output is finite.
void expect_finite_run(const std::string& model_dir, int width, int height) {
  Arena arena;
  Context ctx{&arena, DType::bf16};
  const ModelDir dir = ModelDir::open(model_dir);
  const BpeTokenizer tok = BpeTokenizer::load(dir.component("tokenizer") + "/tokenizer.json");
  std::vector<int32_t> mask32;
  const std::vector<int32_t> ids = encode_klein_prompt(tok, "a red fox in tall grass", 512, &mask32);
  Tensor embeds;
  {
    const auto enc = test::load_stage<flux2::TextEncoder>(dir, "text_encoder", std::vector<int>{9, 18, 27});
    embeds = enc.encode(ctx, ids, std::vector<int64_t>(mask32.begin(), mask32.end()));
  }
  double m = max_abs_or_nan(embeds);
  ASSERT_TRUE(std::isfinite(m)) << "text encoder output";
  std::printf("[ measure ] text encoder max |x| %.3g\n", m);

  const auto dit = test::load_stage<flux2::Transformer>(dir, "transformer");
  const auto& cfg = dit.config();
  const int64_t h = height / 16, w = width / 16, l = h * w;
  const Tensor txt_ids = flux2::text_position_ids(512), img_ids = flux2::image_position_ids(h, w);
  const auto pro = dit.prologue(ctx, embeds, txt_ids, img_ids);
  Tensor x = Tensor::heap({l, cfg.in_channels}, DType::bf16);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < x.numel(); ++i) x.ptr<uint16_t>()[i] = f32_to_bf16(normal(rng));
  const FlowSchedule sched =
      flow_match_schedule(dir.config("scheduler", "scheduler_config.json"), 4, flux2_empirical_mu(l, 4));
  Tensor v = Tensor::heap({l, cfg.out_channels}, DType::bf16);
  for (size_t i = 0; i < 4; ++i) {
    dit.forward(ctx, pro, x, sched.timesteps[i], v);
    m = max_abs_or_nan(v);
    ASSERT_TRUE(std::isfinite(m)) << "velocity at step " << i + 1;
    std::printf("[ measure ] step %zu velocity max |v| %.3g\n", i + 1, m);
    euler_step(ctx, x, v, sched.sigmas[i], sched.sigmas[i + 1]);
  }
  const auto vae = test::load_stage<flux2::VaeDecoder>(dir, "vae");
  Tensor image = Tensor::heap({1, 3, height, width}, DType::bf16);
  vae.decode(ctx, x, h, w, image);
  m = max_abs_or_nan(image);
  ASSERT_TRUE(std::isfinite(m)) << "decoded image";
  std::printf("[ measure ] vae image max |x| %.3g\n", m);
}

TEST(Synth, KleinLayoutSatisfiesEveryLoader) {
  const std::string tpl = published_layout_dir("flux2-klein-4b");
  const Json manifest = read_json(tpl + "/manifest.json");
  std::map<std::string, int64_t> params;
  for (const Json& f : manifest["files"]) {
    const std::string comp = f["path"].get<std::string>().substr(0, f["path"].get<std::string>().find('/'));
    for (const Json& t : f["tensors"]) params[comp] += shape_numel(t["shape"].get<Shape>());
  }
  // Parameter counts of the official classes at published size (tools/oracle/make_klein_manifest.py).
  EXPECT_EQ(params["transformer"], 3875544576);
  EXPECT_EQ(params["text_encoder"], 4022468096);  // lm_head is tied to embed_tokens, not stored
  EXPECT_EQ(params["transformer"], manifest["parameters"]["transformer"].get<int64_t>());

  // Full size, but only headers: the data is a hole in a sparse file.
  TempDir out("layout");
  synth_checkpoint(tpl, out.path, 0, {}, /*layout_only=*/true);
  const ModelDir dir = ModelDir::open(out.path);
  const auto dit = test::load_stage<flux2::Transformer>(dir, "transformer");
  EXPECT_EQ(dit.config().hidden, 3072);
  EXPECT_EQ(dit.config().num_double, 5);
  EXPECT_EQ(dit.config().num_single, 20);
  EXPECT_EQ(dit.config().joint_dim, 7680);
  EXPECT_EQ(SafetensorsFolder::open(dir.component("transformer"))->names().size(), 169u);
  const auto enc = test::load_stage<flux2::TextEncoder>(dir, "text_encoder", std::vector<int>{9, 18, 27});
  EXPECT_EQ(enc.config().hidden * 3, dit.config().joint_dim);
  EXPECT_EQ(enc.config().vocab, 151936);
  const auto vae = test::load_stage<flux2::VaeDecoder>(dir, "vae");
  EXPECT_EQ(vae.config().packed_channels(), dit.config().in_channels);
  EXPECT_EQ(vae.config().pixels_per_token(), 16);

  EXPECT_EQ(files_under(out.path),
            (std::vector<std::string>{
                "model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
                "text_encoder/generation_config.json", "text_encoder/model-00001-of-00002.safetensors",
                "text_encoder/model-00002-of-00002.safetensors", "text_encoder/model.safetensors.index.json",
                "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "transformer/config.json",
                "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
                "vae/diffusion_pytorch_model.safetensors"}));
  const SafetensorsFile te1 = SafetensorsFile::open(out.path + "/text_encoder/model-00001-of-00002.safetensors");
  EXPECT_EQ(te1.get("model.embed_tokens.weight").shape, Shape({151936, 2560}));
  EXPECT_EQ(te1.metadata().at("format"), "pt");
  EXPECT_EQ(fs::file_size(out.path + "/transformer/diffusion_pytorch_model.safetensors"),
            header_bytes(out.path + "/transformer/diffusion_pytorch_model.safetensors").size() + 7751089152u);
}

TEST(Synth, LikeKeepsTheLayoutAndDrawsNewValues) {
  const std::string src = test::fixture("klein_tiny_a");
  TempDir a("like_a"), b("like_b"), c("like_c");
  std::vector<std::string> lines;
  synth_checkpoint(src, a.path, 7, [&](const std::string& s) { lines.push_back(s); });
  EXPECT_GE(lines.size(), 2u);
  ASSERT_EQ(files_under(a.path), files_under(src));
  int weight_files = 0;
  for (const std::string& rel : files_under(src)) {
    const std::string o = src + "/" + rel, n = a.path + "/" + rel;
    if (rel.size() < 12 || rel.substr(rel.size() - 12) != ".safetensors") {
      EXPECT_EQ(read_bytes(n), read_bytes(o)) << rel;
      continue;
    }
    ++weight_files;
    // Same names, dtypes, shapes, order and metadata, down to the header's bytes.
    EXPECT_EQ(header_bytes(n), header_bytes(o)) << rel;
    EXPECT_EQ(fs::file_size(n), fs::file_size(o)) << rel;
    const SafetensorsFile fo = SafetensorsFile::open(o), fn = SafetensorsFile::open(n);
    ASSERT_EQ(fn.names(), fo.names()) << rel;
    for (const std::string& name : fo.names()) {
      const Tensor &to = fo.get(name), &tn = fn.get(name);
      ASSERT_EQ(tn.dtype, to.dtype) << name;
      ASSERT_EQ(tn.shape, to.shape) << name;
      if (tn.dtype != DType::bf16) {
        EXPECT_EQ(load_f32(tn, 0), 0.0f) << name;  // bn.num_batches_tracked
        continue;
      }
      const std::vector<float> v = to_f32_vector(tn);
      if (name.size() >= 11 && name.substr(name.size() - 11) == "running_var") {
        for (float x : v) ASSERT_EQ(x, 1.0f) << name;
      } else if (name.size() >= 12 && name.substr(name.size() - 12) == "running_mean") {
        for (float x : v) ASSERT_EQ(x, 0.0f) << name;
      } else if (tn.rank() >= 2) {
        const double bound = std::sqrt(3.0 * double(tn.shape[0]) / double(tn.numel())) * 1.01;
        double sq = 0;
        for (float x : v) {
          ASSERT_TRUE(std::isfinite(x) && std::fabs(x) <= bound) << name << " " << x;
          sq += double(x) * x;
        }
        EXPECT_NEAR(std::sqrt(sq / double(v.size())), bound / 1.01 / std::sqrt(3.0), 0.1 * bound) << name;
        EXPECT_NE(0, std::memcmp(tn.data, to.data, tn.nbytes())) << name;
      }
    }
  }
  EXPECT_EQ(weight_files, 5);

  // Values depend on the seed alone.
  synth_checkpoint(src, b.path, 7, {});
  synth_checkpoint(src, c.path, 8, {});
  const std::string t = "/transformer/diffusion_pytorch_model.safetensors";
  EXPECT_EQ(read_bytes(b.path + t), read_bytes(a.path + t));
  EXPECT_NE(read_bytes(c.path + t), read_bytes(a.path + t));
}

// A Hugging Face snapshot links every file to its blob: --like keeps the links' own names.
TEST(Synth, LikeKeepsTheNamesOfLinkedFiles) {
  TempDir src("linked_src"), out("linked_out");
  fs::create_directories(src.path + "/transformer");
  for (const char* rel :
       {"model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"})
    fs::create_symlink(fs::absolute(test::fixture(std::string("klein_tiny_a/") + rel)), src.path + "/" + rel);
  synth_checkpoint(src.path, out.path, 1, {});
  EXPECT_EQ(files_under(out.path), files_under(src.path));
  EXPECT_EQ(header_bytes(out.path + "/transformer/diffusion_pytorch_model.safetensors"),
            header_bytes(test::fixture("klein_tiny_a/transformer/diffusion_pytorch_model.safetensors")));
}

// An on-demand checkpoint's seed file is read like any config: a bad one is refused naming it.
TEST(Synth, OnDemandSeedFileIsChecked) {
  TempDir out("on_demand_seed");
  synth_on_demand(test::fixture("klein_tiny_a"), out.path, 3, {});
  const std::string marker = out.path + "/" + kSyntheticValuesFile;
  EXPECT_EQ(read_bytes(marker), "{\"seed\":3}");
  // Layout only: the weight files take (almost) no disk space.
  struct stat st {};
  ASSERT_EQ(::stat((out.path + "/transformer/diffusion_pytorch_model.safetensors").c_str(), &st), 0);
  EXPECT_LT(uint64_t(st.st_blocks) * 512, uint64_t(st.st_size) / 4);
  for (const char* bad : {"{\"seed\": -1}", "{\"seed\": \"7\"}", "[7]", "{"}) {
    fs::remove(marker);
    std::ofstream(marker) << bad;
    expect_error([&] { open_weights(out.path + "/transformer"); }, {kSyntheticValuesFile});
  }
}

TEST(Synth, LikeFillsF16AndF32AtTheInitScale) {
  TempDir src("like_dtypes_src"), out("like_dtypes_out");
  fs::create_directories(src.path);
  std::vector<NamedTensor> tensors;
  for (auto [name, dt] : {std::pair{"w16.weight", DType::f16}, std::pair{"w32.weight", DType::f32}}) {
    Tensor x = Tensor::heap({96, 64}, dt);
    std::memset(x.data, 0, x.nbytes());
    tensors.push_back({name, x});
  }
  Tensor steps = Tensor::heap({}, DType::i64);
  std::memset(steps.data, 0x7f, steps.nbytes());
  tensors.push_back({"steps", steps});
  write_safetensors(src.path + "/weights.safetensors", tensors, {{"format", "pt"}});
  synth_checkpoint(src.path, out.path, 1, {});
  const SafetensorsFile f = SafetensorsFile::open(out.path + "/weights.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.get("steps").ptr<int64_t>()[0], 0);
  for (const char* name : {"w16.weight", "w32.weight"}) {
    const std::vector<float> v = to_f32_vector(f.get(name));
    double sum = 0, sq = 0, mx = 0;
    for (float x : v) {
      sum += x;
      sq += double(x) * x;
      mx = std::max(mx, double(std::fabs(x)));
    }
    const double n = double(v.size());
    EXPECT_NEAR(sum / n, 0.0, 0.01) << name;
    EXPECT_NEAR(std::sqrt(sq / n), 1.0 / 8.0, 0.005) << name;  // 1/sqrt(fan_in 64)
    EXPECT_LE(mx, std::sqrt(3.0) / 8.0 * 1.001) << name;
  }
}

TEST(Synth, ErrorsNameThePath) {
  TempDir empty("empty"), out("err_out");
  fs::create_directories(empty.path);
  expect_error([&] { synth_checkpoint(empty.path, out.path, 0, {}); }, {empty.path, "manifest.json", "safetensors"});
  expect_error([&] { synth_checkpoint(empty.path + "/nope", out.path, 0, {}); },
               {empty.path + "/nope", "not a directory"});

  const std::string file = empty.path + "/plain_file";
  std::ofstream(file) << "x";
  expect_error([&] { synth_checkpoint(test::fixture("klein_tiny_a"), file + "/sub", 0, {}); }, {file + "/sub"});
  expect_error([&] { synth_checkpoint(test::fixture("klein_tiny_a"), test::fixture("klein_tiny_a/out"), 0, {}); },
               {"inside the template"});

  const char* old = std::getenv("APUS_DATA_DIR");
  const std::string saved = old ? old : "";
  ::setenv("APUS_DATA_DIR", empty.path.c_str(), 1);
  expect_error([&] { synth_published("flux2-klein-4b", out.path, 0, {}); },
               {empty.path + "/flux2-klein-4b/manifest.json", "APUS_DATA_DIR"});
  if (old) ::setenv("APUS_DATA_DIR", saved.c_str(), 1);
  else ::unsetenv("APUS_DATA_DIR");
  EXPECT_FALSE(fs::exists(out.path));
}

TEST(Synth, StagesStayFiniteOnSynthesizedTinyWeights) {
  TempDir out("finite");
  synth_checkpoint(test::fixture("klein_tiny_a"), out.path, 5, {});
  expect_finite_run(out.path, 64, 48);
}

// The full-size check: point APUS_SYNTH_DIR at the output of `apus synth --model flux2-klein-4b`.
TEST(Synth, StagesStayFiniteOnFullSizeSynth) {
  const char* dir = std::getenv("APUS_SYNTH_DIR");
  if (!dir) GTEST_SKIP() << "set APUS_SYNTH_DIR to a folder written by apus synth --model flux2-klein-4b";
  expect_finite_run(dir, 256, 256);
}

TEST(Synth, CliSynthLikeThenImage) {
  TempDir out("cli");
  const std::string cli = APUS_CLI, src = test::fixture("klein_tiny_a");
  EXPECT_NE(run(cli + " synth --model flux2-klein-4b --like " + src + " --out " + out.path + " 2>/dev/null"), 0);
  ASSERT_EQ(run(cli + " synth --like " + src + " --out " + out.path + " --seed 3 2>/dev/null"), 0);
  const std::string png = out.path + "/fox.png";
  ASSERT_EQ(run(cli + " image --model " + out.path + " -p 'a red fox' -W 64 -H 48 -s 1 -o " + png + " 2>/dev/null"), 0);
  EXPECT_EQ(read_bytes(png, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

}  // namespace
}  // namespace apus
