// The safetensors reader and model-directory loader on good and hostile input.
#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "io/model_dir.h"
#include "io/weights/safetensors.h"
#include "test_util.h"

namespace apus {
namespace {

using test::expect_error;

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "apus_" + std::to_string(::getpid()) + "_" + name;
}

void write_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header;
  f << std::string(data_bytes, '\0');
}

TEST(Safetensors, RoundTripsEveryDtype) {
  std::mt19937 rng(test::test_seed());
  std::vector<NamedTensor> tensors;
  for (DType t : {DType::f32, DType::bf16, DType::i64, DType::u8}) {
    Tensor x = Tensor::heap({3, 5}, t);
    for (size_t i = 0; i < x.nbytes(); ++i) x.ptr<uint8_t>()[i] = uint8_t(rng());
    tensors.push_back({"t_" + std::string(dtype_name(t)), x});
  }
  const std::string path = temp_path("roundtrip.safetensors");
  write_safetensors(path, tensors, {{"format", "pt"}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  for (const auto& [name, t] : tensors) {
    const Tensor& r = f.get(name);
    EXPECT_EQ(r.dtype, t.dtype);
    EXPECT_EQ(r.shape, t.shape);
    EXPECT_EQ(0, std::memcmp(r.data, t.data, t.nbytes())) << name;
  }
  std::remove(path.c_str());
}

// Tensors packed back to back: an f32 one after a 2-byte one is not 4-aligned in the mapping (a
// kohya LoRA's bf16 alpha before f32 factors). It reads as its bytes from aligned memory, and a
// copy is never a view whose pages could be dropped.
TEST(Safetensors, TensorsNotAlignedToTheirElementsAreReadFromAlignedCopies) {
  std::mt19937 rng(test::test_seed());
  Tensor alpha = Tensor::heap({}, DType::bf16), factor = Tensor::heap({3, 5}, DType::f32);
  alpha.ptr<uint16_t>()[0] = 0x4000;
  for (int64_t i = 0; i < factor.numel(); ++i) factor.ptr<float>()[i] = float(rng() % 1000) / 7.0f;
  const std::string path = temp_path("packed.safetensors");
  write_safetensors(path, {{"a.alpha", alpha}, {"b.lora_down.weight", factor}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  const Tensor& r = f.get("b.lora_down.weight");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(r.data) % 4, 0u);
  EXPECT_FALSE(f.maps(r));
  EXPECT_TRUE(f.maps(f.get("a.alpha")));
  for (int64_t i = 0; i < factor.numel(); ++i) EXPECT_EQ(load_f32(r, i), factor.ptr<float>()[i]) << i;
  std::remove(path.c_str());
}

TEST(Safetensors, RejectsHostileHeaders) {
  const std::string p = temp_path("bad.safetensors");
  struct Bad {
    std::string header;
    size_t data;
    std::string expect;
  };
  const std::vector<Bad> cases = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "truncated"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "overlap"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "expected 12"},
      {R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8, "unsupported dtype"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "non-negative"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8, "overflow"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "end before they begin"},
      {R"({"a":{"dtype":"F32","shape":[2]}})", 8, "data_offsets"},
      {R"({"a":)", 8, "not a valid JSON"},
      {R"([1,2])", 8, "not a valid JSON object"},
  };
  for (const auto& c : cases) {
    write_raw(p, c.header, c.data);
    expect_error([&] { SafetensorsFile::open(p); }, {p, c.expect});
  }
  std::remove(p.c_str());
}

TEST(Safetensors, RejectsTruncatedFiles) {
  const std::string p = temp_path("trunc.safetensors");
  {
    std::ofstream f(p, std::ios::binary);
    f << "abc";
  }
  expect_error([&] { SafetensorsFile::open(p); }, {p, "truncated"});
  {
    std::ofstream f(p, std::ios::binary);
    const uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
  }
  expect_error([&] { SafetensorsFile::open(p); }, {p, "not a safetensors file", "past the file's end"});
  // A valid file cut short inside its data section: named truncated, with how much of it is there
  // and the tensor reaching furthest.
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})";
  write_raw(p, header, 24);
  const size_t whole = std::filesystem::file_size(p);
  std::filesystem::resize_file(p, whole - 13);
  expect_error([&] { SafetensorsFile::open(p); },
               {p + ": truncated: " + std::to_string(whole - 13) + " of " + std::to_string(whole) +
                " bytes (tensor 'b' needs bytes up to " + std::to_string(whole) + ")"});
  std::remove(p.c_str());
  expect_error([&] { SafetensorsFile::open(p); }, {p, "cannot open"});
}

TEST(Safetensors, MissingTensorAndWrongShapeNameTheFile) {
  const auto w = open_weights(test::fixture("klein_tiny_a/transformer"));
  expect_error([&] { w->fetch("no.such.weight", {1}); }, {"no.such.weight", "diffusion_pytorch_model"});
  expect_error([&] { w->fetch("proj_out.weight", {1, 2}); }, {"proj_out.weight", "expected [1, 2]"});
}

TEST(Safetensors, WeightWithTheWrongDtypeIsRejected) {
  const std::string d = temp_path("dtype_lie");
  std::filesystem::create_directories(d);
  Tensor ids = Tensor::heap({4, 2}, DType::i64);
  std::memset(ids.data, 0, ids.nbytes());
  write_safetensors(d + "/diffusion_pytorch_model.safetensors", {{"proj_out.weight", ids}});
  const auto w = open_weights(d);
  expect_error([&] { w->fetch("proj_out.weight", {4, 2}); }, {"proj_out.weight", "dtype i64"});
  std::filesystem::remove_all(d);
}

TEST(ModelDir, ShardedIndexResolvesEveryTensor) {
  const auto w = SafetensorsFolder::open(test::fixture("klein_tiny_a/text_encoder"));
  const Json index = read_json(test::fixture("klein_tiny_a/text_encoder/model.safetensors.index.json"));
  EXPECT_EQ(w->names().size(), index["weight_map"].size());
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it)
    EXPECT_TRUE(w->stored(it.key()).data) << it.key();
}

TEST(ModelDir, BadDirectoriesGiveOneLineErrors) {
  expect_error([] { ModelDir::open("/nonexistent/model"); }, {"/nonexistent/model", "does not exist"});
  const std::string d = temp_path("model");
  std::filesystem::create_directories(d);
  expect_error([&] { ModelDir::open(d); }, {d + "/model_index.json", "cannot open"});
  { std::ofstream(d + "/model_index.json") << "{\"a\": "; }
  expect_error([&] { ModelDir::open(d); }, {"model_index.json", "malformed JSON"});
  { std::ofstream(d + "/model_index.json") << "{}"; }
  expect_error([&] { ModelDir::open(d); }, {"model_index.json", "_class_name"});
  { std::ofstream(d + "/model_index.json") << "[1, 2]"; }
  expect_error([&] { ModelDir::open(d); }, {"model_index.json", "expected an object", "array"});
  { std::ofstream(d + "/model_index.json") << R"({"_class_name": "SomePipeline"})"; }
  const ModelDir m = ModelDir::open(d);
  expect_error([&] { m.component("transformer"); }, {"transformer", "missing"});
  std::filesystem::create_directories(d + "/vae");
  expect_error([&] { m.weights("vae"); }, {"vae", "no weights found"});
  { std::ofstream(d + "/vae/config.json") << R"({"latent_channels": "many"})"; }
  expect_error([&] { m.config("vae").get_int("latent_channels"); },
               {"vae/config.json", "latent_channels", "expected an integer"});
  std::filesystem::remove_all(d);
}

}  // namespace
}  // namespace apus
