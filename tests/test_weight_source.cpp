// The load-time transform hook (where LoRA merges and dequantisation go): a WeightTransform chained
// on a model's weights is applied once to every tensor the model fetches, in the order it fetches
// them, on both families (klein's transformer, which keeps what it receives; SA3's SAME decoder
// from the official checkpoint, whose view reorders the fused projection and which converts to its
// compute dtype after the transform); what the model computes is what it computes from a checkpoint
// rewritten the same way; and counting (shapes only) walks the same tensors through it.
#include <unistd.h>
#include <filesystem>
#include <random>
#include <set>

#include "core/cost.h"
#include "io/weights/renamed_source.h"
#include "io/weights/single_file.h"
#include "io/weights/weight_source.h"
#include "models/flux2/klein.h"
#include "models/flux2/transformer.h"
#include "models/sa3/same_decoder.h"
#include "pipeline/sa3/model_config.h"
#include "pipeline/sa3/official_checkpoint.h"
#include "pipeline/stage.h"
#include "sa3_fixtures.h"
#include "test_util.h"

namespace apus {
namespace {

namespace fs = std::filesystem;

// Notes every fetch it passes on.
class RecordingSource final : public WeightSource {
 public:
  explicit RecordingSource(std::shared_ptr<const WeightSource> inner) : inner_(std::move(inner)) {}
  bool contains(const std::string& name) const override { return inner_->contains(name); }
  Tensor fetch(const std::string& name, const Shape& expected) const override {
    fetched.push_back(name);
    return inner_->fetch(name, expected);
  }
  std::string where(const std::string& name) const override { return inner_->where(name); }
  size_t make_resident(const std::vector<std::string>& names) const override { return inner_->make_resident(names); }
  void release(const std::string& name) const override { inner_->release(name); }
  mutable std::vector<std::string> fetched;

 private:
  std::shared_ptr<const WeightSource> inner_;
};

// x 2 in the tensor's own dtype: exact, so a checkpoint can store the same values.
Tensor doubled(const Tensor& t) {
  Tensor f = to_dtype(t, DType::f32);
  for (int64_t i = 0; i < f.numel(); ++i) f.ptr<float>()[i] *= 2;
  return to_dtype(f, t.dtype);
}

// Doubles the named tensors and notes every tensor it is applied to.
class DoubleNamed final : public WeightTransform {
 public:
  explicit DoubleNamed(std::set<std::string> names) : names_(std::move(names)) {}
  Tensor apply(const std::string& name, const Tensor& stored) const override {
    applied.push_back(name);
    elements += stored.numel();
    saw_data |= stored.data != nullptr;
    return names_.count(name) && stored.data ? doubled(stored) : stored;
  }
  mutable std::vector<std::string> applied;
  mutable int64_t elements = 0;
  mutable bool saw_data = false;

 private:
  std::set<std::string> names_;
};

// The transform saw each tensor the model fetched exactly once, in the order the source handed
// them out, and nothing else: its element count is the model's parameter count.
void expect_once_in_fetch_order(const DoubleNamed& t, const RecordingSource& s, int64_t parameters) {
  EXPECT_EQ(t.applied, s.fetched);
  EXPECT_EQ(std::set<std::string>(t.applied.begin(), t.applied.end()).size(), t.applied.size());
  EXPECT_GT(t.applied.size(), 10u);
  EXPECT_EQ(t.elements, parameters);
}

// A copy of the safetensors file `from` as `to`, with the named tensors doubled.
void write_doubled(const std::string& from, const std::string& to, const std::set<std::string>& names) {
  const SafetensorsFile f = SafetensorsFile::open(from);
  std::vector<NamedTensor> tensors;
  for (const std::string& n : f.names()) tensors.push_back({n, names.count(n) ? doubled(f.get(n)) : f.get(n)});
  fs::create_directories(fs::path(to).parent_path());
  write_safetensors(to, tensors, f.metadata());
}

Tensor seeded(const Shape& shape, DType dt, uint32_t seed) {
  Tensor t = Tensor::heap(shape, DType::f32);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = normal(rng);
  return to_dtype(t, dt);
}

// Seeded values, or (counting) the shape alone.
Tensor input(Context& c, const Shape& shape, uint32_t seed) {
  return c.count_only ? Tensor::shape_only(shape, c.act) : seeded(shape, c.act, seed);
}

// One transformer step on a 2 x 2 grid and 8 text tokens.
Tensor klein_velocity(Context& c, const flux2::Transformer& dit) {
  const auto& cfg = dit.config();
  const int64_t t = 8, l = 4;
  const Tensor txt_ids = c.count_only ? Tensor::shape_only({t, 4}, DType::i64) : flux2::text_position_ids(t);
  const Tensor img_ids = c.count_only ? Tensor::shape_only({l, 4}, DType::i64) : flux2::image_position_ids(2, 2);
  const auto pro = dit.prologue(c, input(c, {t, cfg.joint_dim}, 1), txt_ids, img_ids);
  Tensor velocity = ops::empty(c, {l, cfg.out_channels}, c.act);
  dit.forward(c, pro, input(c, {l, cfg.in_channels}, 2), 500.0f, velocity);
  return velocity;
}

// Three latents decoded.
Tensor same_audio(Context& c, const sa3::SameDecoder& decoder) {
  return decoder.decode(c, input(c, {3, decoder.config().latent_dim}, 3), 1);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

struct Scratch {
  std::string path = ::testing::TempDir() + "apus_weight_transform_" + std::to_string(::getpid());
  Scratch() { fs::remove_all(path); }
  ~Scratch() { fs::remove_all(path); }
};

TEST(WeightTransform, KleinTransformerTakesEachTensorOnceInFetchOrder) {
  const ModelDir dir = ModelDir::open(test::fixture("klein_tiny_a"));
  const Config config = dir.config("transformer");
  const std::set<std::string> names{"single_transformer_blocks.0.attn.to_out.weight", "proj_out.weight"};
  const auto source = std::make_shared<RecordingSource>(open_weights(dir.component("transformer")));
  const auto transform = std::make_shared<DoubleNamed>(names);
  const auto dit = flux2::Transformer::load(config, WeightLoader(source).with(transform));
  expect_once_in_fetch_order(*transform, *source, dit.parameter_count());

  Scratch scratch;
  const std::string file = "/diffusion_pytorch_model.safetensors";
  write_doubled(dir.component("transformer") + file, scratch.path + file, names);
  const auto rewritten = flux2::Transformer::load(config, test::weights_in(scratch.path));
  const auto plain = flux2::Transformer::load(config, dir.weights("transformer"));
  for (const DType dt : {DType::f32, DType::bf16}) {
    Arena arena;
    Context c{&arena, dt};
    const Tensor v = klein_velocity(c, dit);
    EXPECT_TRUE(same_bytes(v, klein_velocity(c, rewritten))) << dtype_name(dt);
    EXPECT_FALSE(same_bytes(v, klein_velocity(c, plain))) << dtype_name(dt);
  }
}

// The transform sits between the official view (it sees diffusers' names and the fused projection
// in diffusers' order) and the conversion to the compute dtype; it also reaches what the decoder
// computes from its weights at load (the weight-normed mapping's gain).
TEST(WeightTransform, Sa3DecoderTakesEachTensorOnceInFetchOrder) {
  const sa3::OfficialConfig config = sa3::read_official_config(test::official_dir() + "/model_config.json");
  const std::string qkv = "decoder.blocks.0.transformers.0.attn.to_qkv.weight",
                    gain = "decoder.blocks.0.mapping.weight_g";
  auto official = [&](const std::string& root) {
    return sa3::OfficialCheckpoint::same(open_weights(root), "pretransform.model.", config.same.differential);
  };
  Scratch scratch;
  write_doubled(test::official_dir() + "/model.safetensors", scratch.path + "/model.safetensors",
                {"pretransform.model.decoder.layers.3.transformers.0.self_attn.to_qkv.weight",
                 "pretransform.model.decoder.layers.3.mapping.weight_g"});
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const auto source = std::make_shared<RecordingSource>(official(test::official_dir()));
    const auto transform = std::make_shared<DoubleNamed>(std::set<std::string>{qkv, gain});
    const auto decoder = sa3::SameDecoder::load(config.same, WeightLoader(source).with(transform), dt);
    expect_once_in_fetch_order(*transform, *source, decoder.parameter_count());
    EXPECT_NE(std::find(transform->applied.begin(), transform->applied.end(), qkv), transform->applied.end());

    const auto rewritten = sa3::SameDecoder::load(config.same, WeightLoader(official(scratch.path)), dt);
    const auto plain = sa3::SameDecoder::load(config.same, WeightLoader(official(test::official_dir())), dt);
    Arena arena;
    Context c{&arena, dt};
    const Tensor audio = same_audio(c, decoder);
    EXPECT_TRUE(same_bytes(audio, same_audio(c, rewritten)));
    EXPECT_FALSE(same_bytes(audio, same_audio(c, plain)));
  }
}

// Shapes only: the transforms are applied to the same tensors in the same order (without data),
// and the count is the count without them.
TEST(WeightTransform, CountingWalksTheSameTensorsThroughTheTransforms) {
  const ModelDir dir = ModelDir::open(test::fixture("klein_tiny_a"));
  const Config config = dir.config("transformer");
  const auto loaded = std::make_shared<DoubleNamed>(std::set<std::string>{});
  flux2::Transformer::load(config, dir.weights("transformer").with(loaded));
  const auto counted = std::make_shared<DoubleNamed>(std::set<std::string>{"proj_out.weight"});
  const auto shapes = flux2::Transformer::load(config, WeightLoader(std::make_shared<ShapesOnly>()).with(counted));
  const auto bare = flux2::Transformer::load(config, WeightLoader(std::make_shared<ShapesOnly>()));
  EXPECT_EQ(counted->applied, loaded->applied);
  EXPECT_FALSE(counted->saw_data);
  EXPECT_EQ(shapes.parameter_count(), bare.parameter_count());
  const StageCost with = count_stage("dit", 1, DType::bf16, [&](Context& c) { klein_velocity(c, shapes); });
  const StageCost without = count_stage("dit", 1, DType::bf16, [&](Context& c) { klein_velocity(c, bare); });
  EXPECT_GT(with.per_call.flops, 0);
  EXPECT_EQ(with.per_call.flops, without.per_call.flops);
  EXPECT_EQ(with.per_call.weight_bytes, without.per_call.weight_bytes);

  const sa3::OfficialConfig sa3 = sa3::read_official_config(test::official_dir() + "/model_config.json");
  auto decoder = [&](std::shared_ptr<const WeightSource> file, std::shared_ptr<DoubleNamed> t) {
    WeightLoader w(sa3::OfficialCheckpoint::same(std::move(file), "pretransform.model.", sa3.same.differential));
    return sa3::SameDecoder::load(sa3.same, t ? w.with(t) : w, DType::bf16);
  };
  const auto same_loaded = std::make_shared<DoubleNamed>(std::set<std::string>{});
  decoder(open_weights(test::official_dir()), same_loaded);
  const auto same_counted = std::make_shared<DoubleNamed>(std::set<std::string>{});
  const auto same_shapes = decoder(std::make_shared<ShapesOnly>(), same_counted);
  const auto same_bare = decoder(std::make_shared<ShapesOnly>(), nullptr);
  EXPECT_EQ(same_counted->applied, same_loaded->applied);
  EXPECT_FALSE(same_counted->saw_data);
  const StageCost same_with = count_stage("decode", 1, DType::bf16, [&](Context& c) { same_audio(c, same_shapes); });
  const StageCost same_without = count_stage("decode", 1, DType::bf16, [&](Context& c) { same_audio(c, same_bare); });
  EXPECT_GT(same_with.per_call.flops, 0);
  EXPECT_EQ(same_with.per_call.flops, same_without.per_call.flops);
  EXPECT_EQ(same_with.per_call.weight_bytes, same_without.per_call.weight_bytes);
}

// ConvertTo, SA3's conversion at load: a copy in the new dtype (the stored pages released), the
// stored tensor itself when it already has it, a data-less tensor in the new dtype when counting.
TEST(WeightTransform, ConvertToConvertsCopiesAndCounts) {
  const ConvertTo to_bf16(DType::bf16);
  const Tensor f32 = seeded({3, 5}, DType::f32, 4);
  const Tensor converted = to_bf16.apply("w", f32);
  EXPECT_EQ(converted.dtype, DType::bf16);
  EXPECT_EQ(to_f32_vector(converted), to_f32_vector(to_dtype(f32, DType::bf16)));
  EXPECT_EQ(to_bf16.apply("w", converted).data, converted.data);
  const Tensor counted = to_bf16.apply("w", Tensor::shape_only({3, 5}, DType::f32));
  EXPECT_EQ(counted.dtype, DType::bf16);
  EXPECT_EQ(counted.shape, Shape({3, 5}));
  EXPECT_EQ(counted.data, nullptr);
}

// The one renaming every format uses: each reading of a stored tensor (a row range, reordered row
// blocks, unit dimensions, a convolution from its taps, an offset) hands the stored values moved as
// it says, a renaming over a renaming composes, and the refusals name the file, the stored tensor
// and the asked name.
TEST(RenamedSource, EachReadingMovesTheStoredValuesAsItSays) {
  const uint32_t seed = test::test_seed();
  const Scratch scratch;
  fs::create_directories(scratch.path);
  const std::string path = scratch.path + "/renamed.safetensors";
  const std::map<std::string, Shape> shapes = {{"qkv", {10, 4}},    {"conv", {5, 3, 1}}, {"taps.w0", {2, 3}},
                                               {"taps.w1", {2, 3}}, {"taps.w2", {2, 3}}, {"norm", {4}}};
  std::vector<NamedTensor> tensors;
  uint32_t k = seed;
  for (const auto& [name, shape] : shapes) tensors.push_back({name, seeded(shape, DType::f32, ++k)});
  write_safetensors(path, tensors);
  const auto file = SingleFile::open(path);
  auto values = [&](const std::string& name) { return to_f32_vector(file->fetch(name, shapes.at(name))); };
  const std::vector<float> qkv = values("qkv"), conv = values("conv"), norm = values("norm");
  const RenamedSource renamed({file},
                              RenamedSource::table({
                                  {"k", {.name = "qkv", .shape = {10, 4}, .begin = 4, .end = 6}},
                                  {"blocks", {.name = "qkv", .row_blocks = {0, 3, 1, 4, 2}}},
                                  {"linear", {.name = "conv", .shape = {5, 3, 1}}},
                                  {"taps", {.name = "taps", .taps = 3}},
                                  {"norm", {.name = "norm", .offset = -1}},
                              }),
                              path);
  auto rows = [](const std::vector<float>& v, int64_t begin, int64_t end, int64_t width) {
    return std::vector<float>(v.begin() + begin * width, v.begin() + end * width);
  };
  EXPECT_EQ(to_f32_vector(renamed.fetch("k", {2, 4})), rows(qkv, 4, 6, 4));
  std::vector<float> blocks;
  for (int64_t b : {0, 3, 1, 4, 2}) {
    const std::vector<float> r = rows(qkv, 2 * b, 2 * b + 2, 4);
    blocks.insert(blocks.end(), r.begin(), r.end());
  }
  EXPECT_EQ(to_f32_vector(renamed.fetch("blocks", {10, 4})), blocks);
  EXPECT_EQ(to_f32_vector(renamed.fetch("linear", {5, 3})), conv);
  const std::vector<float> taps = to_f32_vector(renamed.fetch("taps", {2, 3, 3}));
  for (int t = 0; t < 3; ++t) {
    const std::vector<float> tap = values("taps.w" + std::to_string(t));
    for (size_t i = 0; i < tap.size(); ++i) ASSERT_EQ(taps[i * 3 + size_t(t)], tap[i]) << "tap " << t << " at " << i;
  }
  std::vector<float> less_one = norm;
  for (float& v : less_one) v -= 1;
  EXPECT_EQ(to_f32_vector(renamed.fetch("norm", {4})), less_one);
  // Counting: the asked shape, the dtype the reading hands.
  const Tensor counted = renamed.describe("norm", {4});
  EXPECT_EQ(counted.data, nullptr);
  EXPECT_EQ(counted.dtype, DType::f32);
  EXPECT_EQ(renamed.describe("k", {2, 4}).shape, Shape({2, 4}));

  EXPECT_TRUE(renamed.contains("taps"));
  EXPECT_FALSE(renamed.contains("qkv")) << "a stored name is no asked one";
  EXPECT_EQ(renamed.where("k"), path + ": tensor 'qkv' rows 4..6");
  EXPECT_EQ(renamed.where("taps"), path + ": tensor 'taps.w*'");
  test::expect_error([&] { renamed.fetch("qkv", {10, 4}); }, {path, "no tensor for 'qkv'"});
  test::expect_error(
      [&] {
        renamed.fetch("k", {3, 4});
      },
      {path, "tensor 'qkv' rows 4..6 has shape [2, 4], expected [3, 4] (for 'k')"});
  test::expect_error([&] { renamed.fetch("taps", {2, 3, 2}); }, {"a convolution of 3 taps", "(for 'taps')"});

  // A renaming over a renaming (the official checkpoint's names over sa3.cpp's): two reorders
  // compose, and a function rule maps names it was never told.
  const RenamedSource outer(
      {std::make_shared<RenamedSource>(renamed)},
      [](const std::string& asked) -> std::optional<StoredAs> {
        if (!asked.starts_with("outer.")) return std::nullopt;
        return StoredAs{.name = asked.substr(6), .row_blocks = {0, 2, 4, 1, 3}};
      },
      "outer");
  EXPECT_EQ(to_f32_vector(outer.fetch("outer.blocks", {10, 4})), qkv) << "the inverse order undoes the first";
  EXPECT_EQ(outer.where("outer.k"), path + ": tensor 'qkv' rows 4..6");
  // Over shapes alone (counting a model without files), a reorder hands the shape.
  const RenamedSource shapes_only(
      {std::make_shared<ShapesOnly>()},
      [](const std::string& asked) -> std::optional<StoredAs> {
        return StoredAs{.name = asked, .row_blocks = {1, 0}};
      },
      "no files");
  EXPECT_EQ(shapes_only.fetch("w", {4, 2}).shape, Shape({4, 2}));
}

}  // namespace
}  // namespace apus
