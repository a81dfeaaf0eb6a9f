// Hostile and broken inputs, each on a corrupted copy of a fixture model that the test builds:
// apus must end with one `error:` line naming the file, key or stage, exit status 1, no output
// file, and never an abort, a hang or a silent wrong image.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>

#include "core/parallel.h"
#include "io/files.h"
#include "io/media/png.h"
#include "test_util.h"
#include "text/bpe_tokenizer.h"

namespace apus {
namespace {

namespace fs = std::filesystem;

const std::string kPrompt = "a red fox in tall grass";

// A private copy of the klein_tiny_a fixture model.
struct ModelCopy {
  std::string dir;
  ModelCopy() {
    dir = ::testing::TempDir() + "apus_robust_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++);
    fs::remove_all(dir);
    fs::copy(test::fixture("klein_tiny_a"), dir, fs::copy_options::recursive);
  }
  ~ModelCopy() { fs::remove_all(dir); }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string path(const std::string& rel) const { return dir + "/" + rel; }
  std::string text(const std::string& rel) const {
    std::ifstream f(path(rel));
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  void write_text(const std::string& rel, const std::string& body) const {
    fs::remove(path(rel));  // copies of read-only fixtures stay read-only; replace the file
    std::ofstream(path(rel)) << body;
  }
  // Replaces the first occurrence of `from` in a text file (the test fails if it is absent).
  void edit(const std::string& rel, const std::string& from, const std::string& to) const {
    std::string s = text(rel);
    const size_t at = s.find(from);
    ASSERT_NE(at, std::string::npos) << rel << " lacks " << from;
    write_text(rel, s.replace(at, from.size(), to));
  }
  // Rewrites one tensor of a single-file safetensors component through `change`.
  template <typename Change> void edit_tensor(const std::string& rel, const std::string& name, Change&& change) const {
    std::vector<NamedTensor> tensors;
    {
      const SafetensorsFile f = SafetensorsFile::open(path(rel));
      for (const auto& n : f.names()) {
        const Tensor& t = f.get(n);
        Tensor copy = Tensor::heap(t.shape, t.dtype);
        std::memcpy(copy.data, t.data, t.nbytes());
        if (n == name) copy = change(copy);
        tensors.push_back({n, copy});
      }
    }
    fs::remove(path(rel));
    write_safetensors(path(rel), tensors);
  }
};

std::string render_args(const std::string& model, const std::string& out) {
  return "image --model " + model + " --prompt " + test::shell_quote(kPrompt) + " -W 64 -H 48 --seed 7 -o " + out;
}

std::string temp_out(const std::string& name) {
  return ::testing::TempDir() + "apus_robust_" + std::to_string(::getpid()) + "_" + name;
}

// Exactly one line, `error: ...` naming every fragment, exit status 1, no output file.
void expect_refused(const test::CliRun& r, const std::string& out, std::initializer_list<std::string> fragments) {
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_EQ(r.output.rfind("error: ", 0), 0u) << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << r.output;
  for (const auto& f : fragments) EXPECT_NE(r.output.find(f), std::string::npos) << f << "\n" << r.output;
  EXPECT_FALSE(fs::exists(out)) << out;
}

// The same run ends in one error line but may have printed progress first.
void expect_refused_after_progress(const test::CliRun& r, const std::string& out,
                                   std::initializer_list<std::string> fragments) {
  EXPECT_EQ(r.status, 1) << r.output;
  const size_t last = r.output.rfind("error: ");
  ASSERT_NE(last, std::string::npos) << r.output;
  const std::string error = r.output.substr(last);
  EXPECT_EQ(error.find('\n'), error.size() - 1) << r.output;
  for (const auto& f : fragments) EXPECT_NE(error.find(f), std::string::npos) << f << "\n" << r.output;
  EXPECT_FALSE(fs::exists(out)) << out;
}

TEST(Robustness, Fp16WeightsRunAndGiveTheSameImage) {
  const std::string base = temp_out("fp16_base.png"), out = temp_out("fp16.png");
  ASSERT_EQ(test::run_cli(render_args(test::fixture("klein_tiny_a"), base)).status, 0);
  ModelCopy m;
  bool lossless = true;
  m.edit_tensor("transformer/diffusion_pytorch_model.safetensors", "proj_out.weight", [&](const Tensor& t) {
    Tensor h = Tensor::heap(t.shape, DType::f16);
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = load_f32(t, i);
      h.ptr<uint16_t>()[i] = test::f16_bits(v);
      lossless &= f16_to_f32(h.ptr<uint16_t>()[i]) == v;
    }
    return h;
  });
  ASSERT_TRUE(lossless) << "the fixture's proj_out.weight is not exactly representable in f16";
  const test::CliRun r = test::run_cli(render_args(m.dir, out));
  ASSERT_EQ(r.status, 0) << r.output;
  // The pipeline runs in bf16, so f16 weights holding bf16 values give the very same image.
  EXPECT_EQ(read_png(out).rgb, read_png(base).rgb);
  fs::remove(out);
  fs::remove(base);
}

// A knob from the environment (APUS_KNOBS) that names no knob, no choice of it, or is not
// NAME=CHOICE is refused in one line naming the variable and the item, before any model loads; a
// good one lets the request render; `apus --help` names the variable.
TEST(Robustness, KnobsFromTheEnvironmentAreCheckedByName) {
  const std::string out = temp_out("knobs.png");
  expect_refused(test::run_cli(render_args(test::fixture("klein_tiny_a"), out), "APUS_KNOBS=cpu.nope=on "), out,
                 {"APUS_KNOBS", "cpu.nope", "cpu.native_bf16"});
  expect_refused(test::run_cli(render_args(test::fixture("klein_tiny_a"), out), "APUS_KNOBS=cpu.native_bf16=maybe "),
                 out, {"APUS_KNOBS", "maybe", "on, off"});
  expect_refused(test::run_cli(render_args(test::fixture("klein_tiny_a"), out), "APUS_KNOBS=cpu.native_bf16 "), out,
                 {"APUS_KNOBS", "'cpu.native_bf16' is not NAME=CHOICE"});
  const test::CliRun r =
      test::run_cli(render_args(test::fixture("klein_tiny_a"), out), "APUS_KNOBS=cpu.native_bf16=off ");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(out));
  fs::remove(out);
  EXPECT_NE(test::run_cli("--help").output.find("APUS_KNOBS=NAME=CHOICE"), std::string::npos) << "--help names it";
}

TEST(Robustness, UnsupportedWeightDtypeIsRefusedNamingTheTensor) {
  ModelCopy m;
  m.edit_tensor("transformer/diffusion_pytorch_model.safetensors", "proj_out.weight", [](const Tensor& t) {
    Tensor q = Tensor::heap(t.shape, DType::i8);
    std::memset(q.data, 1, q.nbytes());
    return q;
  });
  const std::string out = temp_out("i8.png");
  expect_refused_after_progress(test::run_cli(render_args(m.dir, out)), out, {"proj_out.weight", "dtype i8"});
}

TEST(Robustness, NonFiniteWeightStopsTheRequestNamingTheStage) {
  for (const float bad : {NAN, INFINITY}) {
    ModelCopy m;
    m.edit_tensor("transformer/diffusion_pytorch_model.safetensors", "proj_out.weight", [&](const Tensor& t) {
      Tensor c = t;
      c.ptr<uint16_t>()[3] = f32_to_bf16(bad);
      return c;
    });
    const std::string out = temp_out("nan_weight.png");
    expect_refused_after_progress(test::run_cli(render_args(m.dir, out)), out, {"transformer step 1/4", "NaN or Inf"});
  }
  ModelCopy m;
  m.edit_tensor("text_encoder/model-00001-of-00003.safetensors", "model.embed_tokens.weight", [&](const Tensor& t) {
    Tensor c = t;
    for (int64_t i = 0; i < c.numel(); ++i) c.ptr<uint16_t>()[i] = f32_to_bf16(NAN);
    return c;
  });
  const std::string out = temp_out("nan_text.png");
  expect_refused_after_progress(test::run_cli(render_args(m.dir, out)), out, {"text encoder", "NaN or Inf"});
}

// NaN queries used to vanish in the softmax (its maximum skipped NaN, so the row came out as a
// fully masked one: zeros) and the request rendered; torch propagates them. An all-NaN query
// projection, a query norm's NaN scale (double and single blocks) and one NaN row in the query
// third of a single block's fused projection each stop the request, in bf16 and fp32.
TEST(Robustness, NanQueriesStopTheRequestNamingTheStage) {
  const std::string file = "transformer/diffusion_pytorch_model.safetensors";
  struct Spoil {
    std::string tensor;
    int64_t rows;  // leading rows made NaN (0: all)
  };
  for (const Spoil& spoil :
       {Spoil{"transformer_blocks.0.attn.to_q.weight", 0}, Spoil{"transformer_blocks.0.attn.norm_q.weight", 0},
        Spoil{"single_transformer_blocks.0.attn.norm_q.weight", 0},
        Spoil{"single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight", 1}})
    for (const std::string precision : {"bf16", "fp32"}) {
      SCOPED_TRACE(spoil.tensor + " " + precision);
      ModelCopy m;
      m.edit_tensor(file, spoil.tensor, [&](const Tensor& t) {
        Tensor c = t;
        const int64_t n = spoil.rows ? spoil.rows * t.shape.back() : t.numel();
        for (int64_t i = 0; i < n; ++i) c.ptr<uint16_t>()[i] = f32_to_bf16(NAN);
        return c;
      });
      const std::string out = temp_out("nan_query.png");
      expect_refused_after_progress(test::run_cli(render_args(m.dir, out) + " --precision " + precision), out,
                                    {"transformer step 1/4", "NaN or Inf"});
    }
}

TEST(Robustness, NonFiniteNoiseFileIsRefusedNamingTheFile) {
  const std::string noise = temp_out("nan_noise.safetensors"), out = temp_out("nan_noise.png");
  Tensor n = Tensor::heap({1, 128, 3, 4}, DType::f32);
  for (int64_t i = 0; i < n.numel(); ++i) n.ptr<float>()[i] = 0.5f;
  n.ptr<float>()[17] = NAN;
  write_safetensors(noise, {{"noise", n}});
  expect_refused(test::run_cli("image --model " + test::fixture("klein_tiny_a") + " --prompt hi -W 64 -H 48 --noise " +
                               noise + " -o " + out),
                 out, {noise, "non-finite", "element 17"});
  fs::remove(noise);
  // A PNG given as the noise: said to be no safetensors file (once "header length 727905341920923785
  // runs past the end of the file").
  const std::string png = test::fixture("klein_tiny_a_edit/ref0.png");
  expect_refused(test::run_cli("image --model " + test::fixture("klein_tiny_a") + " --prompt hi -W 64 -H 48 --noise " +
                               png + " -o " + out),
                 out, {png, "not a safetensors file", "past the file's end"});
}

TEST(Robustness, MeaninglessConfigValuesAreRefusedNamingFileAndKey) {
  struct Case {
    std::string file, from, to, key;
  };
  const std::vector<Case> cases = {
      {"transformer/config.json", "\"eps\": 1e-06", "\"eps\": -1e-06", "'eps'"},
      {"transformer/config.json", "\"rope_theta\": 2000", "\"rope_theta\": 0", "'rope_theta'"},
      {"transformer/config.json", "\"num_layers\": 2", "\"num_layers\": 0", "'num_layers'"},
      {"text_encoder/config.json", "\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": -0.5", "'rms_norm_eps'"},
      {"text_encoder/config.json", "\"rope_theta\": 1000000.0", "\"rope_theta\": -1.0", "'rope_theta'"},
      {"vae/config.json", "\"batch_norm_eps\": 0.0001", "\"batch_norm_eps\": -0.0001", "'batch_norm_eps'"},
  };
  for (const Case& c : cases) {
    ModelCopy m;
    m.edit(c.file, c.from, c.to);
    const std::string out = temp_out("config.png");
    expect_refused(test::run_cli(render_args(m.dir, out)), out, {c.file, c.key});
  }
}

// Values that fit each config alone but not the pipeline: once blamed on another component
// ("vae: packed latents ...", the transformer's joint_attention_dim for a text encoder's width) or
// a shape error naming neither file; now both files and keys are named when the model opens.
TEST(Robustness, ConfigsThatDisagreeAreRefusedNamingBothFilesAndKeys) {
  struct Case {
    std::string file, from, to;
    std::vector<std::string> names;
  };
  const std::vector<Case> cases = {
      {"transformer/config.json",
       "\"in_channels\": 128",
       "\"in_channels\": 16777216",
       {"transformer/config.json in_channels is 16777216", "vae/config.json latent_channels 32"}},
      {"text_encoder/config.json",
       "\"hidden_size\": 32",
       "\"hidden_size\": 33",
       {"text_encoder/config.json hidden_size 33", "transformer/config.json joint_attention_dim is 96"}},
      {"vae/config.json",
       "\"latent_channels\": 32",
       "\"latent_channels\": 31",
       {"transformer/config.json in_channels is 128", "vae/config.json latent_channels 31"}},
      {"transformer/config.json",
       "\"joint_attention_dim\": 96",
       "\"joint_attention_dim\": 97",
       {"text_encoder/config.json hidden_size 32", "joint_attention_dim is 97"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.to);
    ModelCopy m;
    m.edit(c.file, c.from, c.to);
    const std::string out = temp_out("disagree.png");
    const test::CliRun r = test::run_cli(render_args(m.dir, out));
    expect_refused(r, out, {});
    for (const std::string& name : c.names) EXPECT_NE(r.output.find(name), std::string::npos) << r.output;
  }
}

// The prompt is checked before the chat template wraps it: the offset is the user's own byte.
TEST(Robustness, InvalidUtf8InThePromptNamesThePromptAndItsOwnOffset) {
  const std::string out = temp_out("utf8.png");
  const test::CliRun r = test::run_cli("image --model " + test::fixture("klein_tiny_a") + " --prompt " +
                                       test::shell_quote("abc\xff def") + " -W 64 -H 48 -o " + out);
  expect_refused(r, out, {});
  EXPECT_EQ(r.output, "error: the prompt is not valid UTF-8 (byte offset 3)\n");
}

TEST(Robustness, NumberBeyondDoubleRangeInAnyJsonNamesTheFile) {
  for (const std::string rel :
       {"model_index.json", "transformer/config.json", "vae/config.json", "scheduler/scheduler_config.json",
        "text_encoder/model.safetensors.index.json", "tokenizer/tokenizer.json"}) {
    ModelCopy m;
    m.edit(rel, "{", "{\"apus_overflow\": 1e999, ");
    const std::string out = temp_out("overflow.png");
    // Weight indexes are read when their model loads, after the seed is printed.
    expect_refused_after_progress(test::run_cli(render_args(m.dir, out)), out, {m.path(rel)});
  }
  // The loader itself: the apus::Error contract, not a library exception.
  ModelCopy m;
  m.edit("tokenizer/tokenizer.json", "{", "{\"apus_overflow\": 1e999, ");
  test::expect_error([&] { BpeTokenizer::load(m.path("tokenizer/tokenizer.json")); }, {"tokenizer.json"});
}

TEST(Robustness, HugeTokenIdNeitherAllocatesNorPassesTheLoad) {
  ModelCopy m;
  const std::string rel = "tokenizer/tokenizer.json";
  const std::string body = m.text(rel);
  const size_t at = body.find("\"id\": 2621,");  // an added token the prompt does not use
  ASSERT_NE(at, std::string::npos);
  m.write_text(rel, std::string(body).replace(at, 10, "\"id\": 2147483647"));
  const auto t0 = std::chrono::steady_clock::now();
  const BpeTokenizer tok = BpeTokenizer::load(m.path(rel));
  EXPECT_EQ(tok.max_id(), 2147483647);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  const std::string out = temp_out("huge_id.png");
  expect_refused(test::run_cli(render_args(m.dir, out)), out, {"tokenizer.json", "2147483647", "vocab_size"});
}

TEST(Robustness, NonRegularWeightFilesAreRefusedWithoutBlocking) {
  const std::string rel = "transformer/diffusion_pytorch_model.safetensors";
  {
    ModelCopy m;
    fs::remove(m.path(rel));
    ASSERT_EQ(::mkfifo(m.path(rel).c_str(), 0600), 0);
    const std::string out = temp_out("fifo.png");
    // timeout turns a regression (blocking in open) into a failure instead of a hang.
    expect_refused_after_progress(test::run_cli(render_args(m.dir, out), "timeout 60 "), out,
                                  {rel, "FIFO", "expected a regular file"});
  }
  ModelCopy m;
  fs::remove(m.path(rel));
  fs::create_directory(m.path(rel));
  const std::string out = temp_out("dir.png");
  expect_refused_after_progress(test::run_cli(render_args(m.dir, out)), out,
                                {rel, "directory", "expected a regular file"});
}

TEST(Robustness, ModelIndexMustNameTheKleinPipelineAndClasses) {
  struct Case {
    std::string from, to;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"\"Flux2KleinPipeline\"", "\"StableDiffusionPipeline\"", {"StableDiffusionPipeline", "_class_name"}},
      {"\"Flux2Transformer2DModel\"", "\"FluxTransformer2DModel\"", {"transformer", "FluxTransformer2DModel"}},
      {"\"is_distilled\": true", "\"is_distilled\": \"yes\"", {"is_distilled", "expected true or false"}},
  };
  for (const Case& c : cases) {
    ModelCopy m;
    m.edit("model_index.json", c.from, c.to);
    const std::string out = temp_out("index.png");
    const test::CliRun r = test::run_cli(render_args(m.dir, out));
    expect_refused(r, out, {"model_index.json"});
    for (const auto& e : c.expect) EXPECT_NE(r.output.find(e), std::string::npos) << r.output;
  }
  ModelCopy m;
  m.write_text("model_index.json", "[\"Flux2KleinPipeline\"]");
  const std::string out = temp_out("index.png");
  expect_refused(test::run_cli(render_args(m.dir, out)), out, {"model_index.json", "array"});
}

TEST(Robustness, ConcurrentWritersToOnePathLeaveAValidPng) {
  const std::string out = temp_out("shared.png");
  const std::string args = render_args(test::fixture("klein_tiny_a"), out);
  for (int round = 0; round < 3; ++round) {
    // Passive OpenMP waiting: two spinning pools on two cores would starve each other.
    const std::string env = "OMP_WAIT_POLICY=passive ";
    auto a = std::async(std::launch::async, [&] { return test::run_cli(args, env); });
    auto b = std::async(std::launch::async, [&] { return test::run_cli(args, env); });
    const test::CliRun ra = a.get(), rb = b.get();
    ASSERT_EQ(ra.status, 0) << ra.output;
    ASSERT_EQ(rb.status, 0) << rb.output;
    const PngImage png = read_png(out);  // throws on a torn file
    EXPECT_EQ(png.width, 64);
    EXPECT_EQ(png.height, 48);
  }
  // No temporary files are left beside the output.
  for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))
    EXPECT_EQ(e.path().filename().string().find("." + fs::path(out).filename().string() + "."), std::string::npos)
        << e.path();
  fs::remove(out);
}

TEST(Robustness, UnwritableOutputNamesThePathAndTheReason) {
  const std::string out = "/nonexistent_dir_apus/out.png";
  const test::CliRun r = test::run_cli(render_args(test::fixture("klein_tiny_a"), out));
  expect_refused_after_progress(r, out, {out, "No such file or directory"});
}

// A scratch folder holding, in place of an output file, each kind of node the atomic rename
// must never replace: a FIFO, a directory and (where this process may make one) a character
// device like /dev/full (1, 7), made here so that a regression replaces a copy, not /dev/full.
struct NonRegularOutputs {
  std::string dir = temp_out("nodes");
  struct Node {
    std::string path, kind;
    mode_t type;
  };
  std::vector<Node> nodes;
  NonRegularOutputs() {
    fs::remove_all(dir);
    fs::create_directories(dir);
    EXPECT_EQ(::mkfifo((dir + "/fifo.png").c_str(), 0600), 0);
    nodes.push_back({dir + "/fifo.png", "is a FIFO, not a regular file", S_IFIFO});
    fs::create_directory(dir + "/folder.png");
    nodes.push_back({dir + "/folder.png", "is a directory, not a regular file", S_IFDIR});
    if (::mknod((dir + "/full.png").c_str(), S_IFCHR | 0600, makedev(1, 7)) == 0)
      nodes.push_back({dir + "/full.png", "is a character device, not a regular file", S_IFCHR});
    else std::printf("[ note    ] no character device case: mknod: %s\n", std::strerror(errno));
  }
  ~NonRegularOutputs() { fs::remove_all(dir); }
  // The node is still what it was: nothing was renamed over it.
  static void expect_intact(const Node& n) {
    struct stat st {};
    ASSERT_EQ(::lstat(n.path.c_str(), &st), 0) << n.path;
    EXPECT_EQ(st.st_mode & S_IFMT, n.type) << n.path << " was replaced";
  }
};

// Exactly one line, `error: ...` with every fragment, exit status 1: nothing ran before it.
void expect_refused_up_front(const test::CliRun& r, std::initializer_list<std::string> fragments) {
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_EQ(r.output.rfind("error: ", 0), 0u) << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << r.output;
  for (const auto& f : fragments) EXPECT_NE(r.output.find(f), std::string::npos) << f << "\n" << r.output;
}

TEST(Robustness, OutputsThatAreNotRegularFilesAreRefusedBeforeAnyWork) {
  const NonRegularOutputs outputs;
  const std::string image = "image --model " + test::fixture("klein_tiny_a") + " -p hi -W 64 -H 48 --seed 7 ";
  // Refused before any model is opened, so the model folder is never read.
  const std::string audio = "audio --model " + test::fixture("sa3_tiny/original") + " -p hi --seconds 1 ";
  const std::string png = temp_out("unused.png"), json = temp_out("unused.json");
  for (const auto& n : outputs.nodes) {
    for (const std::string& args :
         {image + "-o " + n.path, image + "-o " + png + " --trace " + n.path, audio + "-o " + n.path,
          audio + "-o " + temp_out("unused.wav") + " --trace " + n.path,
          "bench --model " + test::fixture("klein_tiny_a") + " -W 64 -H 48 --json " + n.path,
          "bench --model " + test::fixture("klein_tiny_a") + " -W 64 -H 48 --chart " + n.path}) {
      // timeout: opening a FIFO for writing would block until a reader came.
      expect_refused_up_front(test::run_cli(args, "timeout 60 "), {n.path, n.kind});
      NonRegularOutputs::expect_intact(n);
    }
  }
  EXPECT_FALSE(fs::exists(png));
  // An empty name is refused naming the option, not written as "" after the whole run.
  for (const auto& [args, flag] :
       {std::pair{image + "-o ''", "-o"}, std::pair{image + "-o " + png + " --trace ''", "--trace"},
        std::pair{audio + "-o ''", "-o"}, std::pair{audio + "--init-audio ''", "--init-audio"},
        std::pair{image + "--noise ''", "--noise"}, std::pair{image + "--image ''", "--image"},
        std::pair{"bench --model " + test::fixture("klein_tiny_a") + " --json ''", "--json"}})
    expect_refused_up_front(test::run_cli(args), {std::string(flag) + ": an empty file name"});
}

TEST(Robustness, AtomicFileRefusesANodeThatTookThePathBeforeTheRename) {
  const std::string path = temp_out("raced.png");
  fs::remove(path);
  AtomicFile f(path);
  f.write("abc", 3);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);  // appears while the file is being written
  test::expect_error([&] { f.commit(); }, {path, "is a FIFO, not a regular file"});
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the rename replaced the FIFO";
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path()))
    EXPECT_EQ(e.path().filename().string().find("." + fs::path(path).filename().string() + "."), std::string::npos)
        << "temporary left: " << e.path();
  fs::remove(path);
  test::expect_error([] { AtomicFile empty(""); }, {"an empty output path"});
}

TEST(Robustness, AtomicFileLeavesNothingUnlessCommitted) {
  const std::string path = temp_out("atomic.bin");
  {
    AtomicFile f(path);
    f.write("abc", 3);
  }
  EXPECT_FALSE(fs::exists(path));
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path()))
    EXPECT_EQ(e.path().filename().string().find(".apus_robust_" + std::to_string(::getpid()) + "_atomic.bin."),
              std::string::npos);
  {
    AtomicFile f(path);
    f.write("abc", 3);
    f.commit();
  }
  EXPECT_EQ(read_file(path), "abc");
  fs::remove(path);
}

TEST(Robustness, AddressSpaceLimitIsHonouredUpFront) {
  if (test::kSanitized) GTEST_SKIP() << "sanitizer shadow memory cannot live under ulimit -v";
  const std::string out = temp_out("ulimit.png");
  // A tiny render under 200 MB of address space: refused cleanly, not a segfault in oneDNN.
  const test::CliRun tiny = test::run_cli(render_args(test::fixture("klein_tiny_a"), out), "ulimit -v 200000; ");
  expect_refused(tiny, out, {"address space", "ulimit -v"});
  // A 4096x4096 request under 2 GB fails before any work.
  const std::string published = std::string(APUS_FIXTURES) + "/../../data/flux2-klein-4b";
  const auto t0 = std::chrono::steady_clock::now();
  const test::CliRun big =
      test::run_cli("image --model " + published + " --prompt hi -W 4096 -H 4096 -o " + out, "ulimit -v 2000000; ");
  expect_refused(big, out, {"address space"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  // Counting mode needs no activation memory, even for the largest size the engine takes.
  const test::CliRun roof = test::run_cli("roofline -W 4096 -H 4096 --steps 1 --json", "ulimit -v 2000000; ");
  EXPECT_EQ(roof.status, 0) << roof.output.substr(0, 500);
}

TEST(Robustness, ExceptionInsideAParallelRegionReachesTheCaller) {
  std::atomic<int64_t> ran{0};
  test::expect_error(
      [&] {
        parallel_for(1000, [&](int64_t i) {
          ++ran;
          if (i == 500) fail("iteration ", i, " failed");
        });
      },
      {"iteration 500 failed"});
  EXPECT_GE(ran.load(), 1);
  test::expect_error(
      [&] {
        parallel_for(
            64,
            [&](int64_t i) {
              if (i % 7 == 3) fail("dynamic ", i);
            },
            Schedule::dynamic);
      },
      {"dynamic "});
}

}  // namespace
}  // namespace apus
