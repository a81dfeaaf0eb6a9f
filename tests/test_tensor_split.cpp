// Tensor parallelism (issue 43; models/common/tensor_split.h) without MPI: klein's transformer
// and Stable Audio 3's DiTs (differential and plain attention) opened over 2 and 3 ranks that are
// threads of this process, each loading its rows of the block weights, compute one process's
// velocity bit for bit (f32 and bf16, plain and through the int8 tier's transform, one rank
// holding no heads at 3 ranks), hold their share of the parameters, and the bytes their exchanges
// send are what counting says. A weight's rows fetched on their own are the whole weight's rows.
// A model holding whole weights refuses a tensor split, and one opened split refuses any other.
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "core/share.h"
#include "io/model_dir.h"
#include "io/weights/quant_weights.h"
#include "io/weights/weight_source.h"
#include "models/flux2/klein.h"
#include "models/flux2/transformer.h"
#include "models/sa3/dit.h"
#include "models/sa3/same_decoder.h"
#include "ops/adapters.h"
#include "ops/cpu/cpu_ops.h"
#include "pipeline/registry.h"
#include "pipeline/sa3/sa3_model.h"
#include "sa3_fixtures.h"
#include "test_util.h"
#include "thread_ranks.h"

namespace apus {
namespace {

using test::ThreadRanks;
using test::WidenedBf16;

Tensor seeded(const Shape& shape, DType dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Tensor t = Tensor::heap(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = normal(rng);
  return to_dtype(t, dt);
}

// What run(context) sends to the other ranks, counted: run in a count-only context of `dt`.
template <typename Run> double counted_bytes(DType dt, Run&& run) {
  CostLog log;
  Arena counting;
  Context n{&counting, dt};
  n.count_only = true;
  n.cost = &log;
  run(n);
  return log.sent();
}

// One step on a 2 x 3 grid and 5 text tokens, two samples; `seed` draws the inputs.
std::vector<float> velocity(const flux2::Transformer& dit, DType dt, uint32_t seed, double* counted_sent = nullptr) {
  const auto& cfg = dit.config();
  const int64_t t = 5, l = 6, batch = 2;
  Arena arena;
  Context c{&arena, dt};
  const auto pro = dit.prologue(c, seeded({batch * t, cfg.joint_dim}, dt, seed), flux2::text_position_ids(t),
                                flux2::image_position_ids(2, 3));
  Tensor v = ops::empty(c, {batch * l, cfg.out_channels}, dt);
  dit.forward(c, pro, seeded({batch * l, cfg.in_channels}, dt, seed + 1), 625.0f, v);
  if (counted_sent)
    *counted_sent = counted_bytes(dt, [&](Context& n) {
      const auto counted = dit.prologue(n, Tensor::shape_only({batch * t, cfg.joint_dim}, dt),
                                        Tensor::shape_only({t, 4}, DType::i64), Tensor::shape_only({l, 4}, DType::i64));
      Tensor w = Tensor::shape_only({batch * l, cfg.out_channels}, dt);
      dit.forward(n, counted, Tensor::shape_only({batch * l, cfg.in_channels}, dt), 625.0f, w);
    });
  return to_f32_vector(v);
}

// The weights the ranks are checked on: as stored, as Q8_0 blocks, and through the int8 tier where
// this CPU runs it.
std::vector<std::pair<const char*, std::shared_ptr<const WeightTransform>>> weight_tiers() {
  std::vector<std::pair<const char*, std::shared_ptr<const WeightTransform>>> tiers{
      {"as stored", nullptr}, {"q8_0", quant_linears(Quant::q8_0, nullptr)}};
  if (quant_linears(Quant::int8, nullptr)) tiers.emplace_back("int8 tier", quant_linears(Quant::int8, nullptr));
  return tiers;
}

// Over n ranks that are threads: each loads its share (load(its rank)) and computes run(model,
// &counted bytes). Every rank's output must be `expected` bit for bit, its bytes sent the count's,
// its parameters fewer than the whole model's `whole`; returns the parameters all ranks hold.
template <typename Load, typename Run>
int64_t check_ranks(int n, const std::vector<float>& expected, int64_t whole, Load&& load, Run&& run) {
  ThreadRanks all(n);
  std::vector<std::unique_ptr<ThreadRanks::Rank>> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(std::make_unique<ThreadRanks::Rank>(all, r));
  const size_t ranks_n = static_cast<size_t>(n);
  std::vector<std::vector<float>> got(ranks_n);
  std::vector<int64_t> parameters(ranks_n);
  std::vector<double> counted(ranks_n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      const auto mine = load(ranks[size_t(r)].get());
      parameters[size_t(r)] = mine.parameter_count();
      got[size_t(r)] = run(mine, &counted[size_t(r)]);
    });
  for (std::thread& t : threads) t.join();
  int64_t held = 0;
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(std::memcmp(got[size_t(r)].data(), expected.data(), expected.size() * sizeof(float)), 0)
        << "rank " << r << "'s output is not one process's";
    EXPECT_GT(ranks[size_t(r)]->sent, 0) << "rank " << r << " sent nothing";
    EXPECT_EQ(ranks[size_t(r)]->all_to_alls, 0) << "rank " << r << ": a tensor split exchanges no all-to-all";
    EXPECT_EQ(ranks[size_t(r)]->sent, counted[size_t(r)]) << "rank " << r << ": bytes sent against the count";
    EXPECT_LT(parameters[size_t(r)], whole) << "rank " << r << " holds every parameter";
    held += parameters[size_t(r)];
  }
  return held;
}

TEST(TensorSplit, RanksComputeOneProcessVelocityHoldingTheirShareOfTheWeights) {
  const WidenedBf16 widened;
  const ModelDir dir = ModelDir::open(test::fixture("klein_tiny_a"));
  const Config config = dir.config("transformer");
  const uint32_t seed = test::test_seed();
  for (const auto& [tier, transform] : weight_tiers()) {
    auto weights = [&] { return transform ? dir.weights("transformer").with(transform) : dir.weights("transformer"); };
    const auto whole = flux2::Transformer::load(config, weights());
    for (const DType dt : {DType::f32, DType::bf16}) {
      const std::vector<float> expected = velocity(whole, dt, seed);
      for (const int n : {2, 3}) {
        SCOPED_TRACE(std::string(tier) + ", " + std::string(dtype_name(dt)) + ", " + std::to_string(n) + " ranks");
        const int64_t held = check_ranks(
            n, expected, whole.parameter_count(),
            [&](const ProcessGroup* rank) { return flux2::Transformer::load(config, weights(), rank); },
            [&](const flux2::Transformer& mine, double* counted) { return velocity(mine, dt, seed, counted); });
        // The blocks' linears are dealt out once; the rest (embedders, modulation, norms) is held by
        // every rank.
        const auto& c = whole.config();
        const int64_t h = c.hidden, f = c.mlp_hidden;
        const int64_t block_linears =
            c.num_double * 2 * (4 * h * h + 2 * f * h + h * f) + c.num_single * ((3 * h + 2 * f) * h + h * (h + f));
        EXPECT_EQ(held, whole.parameter_count() + (n - 1) * (whole.parameter_count() - block_linears));
      }
    }
  }
}

// One SA3 DiT step on two samples of 9 frames (the last 2 the canvas's padding) with random local
// conditioning (as inpainting) and 6 text tokens, the second sample's last 2 padded; `seed` draws
// the inputs.
std::vector<float> sa3_velocity(const sa3::Dit& dit, DType dt, uint32_t seed, double* counted_sent = nullptr) {
  const auto& cfg = dit.config();
  const int64_t batch = 2, tokens = 6, frames = 9, valid = 7;
  std::vector<int64_t> cross_valid(size_t(batch * tokens), 1);
  cross_valid[size_t(2 * tokens - 1)] = cross_valid[size_t(2 * tokens - 2)] = 0;
  auto run = [&](Context& c, auto input) {
    const auto pro = dit.prologue(c, input({batch * tokens, cfg.cond_dim}, 0), cross_valid,
                                  input({batch, cfg.global_dim}, 1), input({batch * frames, cfg.local_dim}, 2), valid);
    Tensor v = ops::empty(c, {batch * frames, cfg.io_channels}, dt);
    dit.forward(c, pro, input({batch * frames, cfg.io_channels}, 3), 0.7f, v);
    return v;
  };
  Arena arena;
  Context c{&arena, dt};
  const Tensor v = run(c, [&](const Shape& shape, uint32_t i) { return seeded(shape, dt, seed + i); });
  if (counted_sent)
    *counted_sent = counted_bytes(
        dt, [&](Context& n) { run(n, [&](const Shape& shape, uint32_t) { return Tensor::shape_only(shape, dt); }); });
  return to_f32_vector(v);
}

TEST(TensorSplit, Sa3RanksComputeOneProcessVelocityHoldingTheirShareOfTheWeights) {
  const WidenedBf16 widened;
  const uint32_t seed = test::test_seed();
  for (const char* variant : {"dit_diff", "dit_plain"}) {
    const std::string dir = test::fixture(std::string("sa3_tiny/") + variant);
    const auto config = sa3::DitConfig::read(read_config(dir + "/config.json"));
    for (const auto& [tier, transform] : weight_tiers()) {
      auto weights = [&] { return transform ? test::weights_in(dir).with(transform) : test::weights_in(dir); };
      for (const DType dt : {DType::f32, DType::bf16}) {
        const auto whole = sa3::Dit::load(config, weights(), dt);
        const std::vector<float> expected = sa3_velocity(whole, dt, seed);
        for (const int n : {2, 3}) {
          SCOPED_TRACE(std::string(variant) + ", " + tier + ", " + std::string(dtype_name(dt)) + ", " +
                       std::to_string(n) + " ranks");
          const int64_t held = check_ranks(
              n, expected, whole.parameter_count(),
              [&](const ProcessGroup* rank) { return sa3::Dit::load(config, weights(), dt, rank); },
              [&](const sa3::Dit& mine, double* counted) { return sa3_velocity(mine, dt, seed, counted); });
          // The blocks' linears and their biases are dealt out once; the rest (embedders,
          // modulation, norms) is held by every rank.
          const int64_t d = config.dim, f = config.ff_inner, nq = config.differential ? 2 : 1;
          const int64_t attention = (2 * nq + 1) * d * d + d * d + nq * d * d + (nq + 1) * d * d + d * d;
          const int64_t ff = 2 * f * d + 2 * f + d * f + d, local = d * config.local_dim + d + d * d + d;
          const int64_t block_linears = config.depth * (attention + ff + local);
          EXPECT_EQ(held, whole.parameter_count() + (n - 1) * (whole.parameter_count() - block_linears));
        }
      }
    }
  }
}

// SAME's decoder of two samples' 5 latents each, drawn from `seed`: its transformer holds each
// rank's share of its features.
std::vector<float> same_audio(const sa3::SameDecoder& same, DType dt, uint32_t seed, double* counted_sent = nullptr) {
  const Shape latents{2 * 5, same.config().latent_dim};
  Arena arena;
  Context c{&arena, dt};
  const Tensor audio = same.decode(c, seeded(latents, dt, seed), 2);
  if (counted_sent)
    *counted_sent = counted_bytes(dt, [&](Context& n) { same.decode(n, Tensor::shape_only(latents, dt), 2); });
  return to_f32_vector(audio);
}

TEST(TensorSplit, SameDecoderRanksDecodeOneProcessAudioHoldingTheirShareOfTheWeights) {
  const WidenedBf16 widened;
  const uint32_t seed = test::test_seed();
  const std::string dir = test::fixture("sa3_tiny/same_l");
  const auto config = sa3::SameConfig::read(read_config(dir + "/config.json"));
  // As stored, and through the int8 tier as --quant int8 scopes it on the decoder (the attention's
  // projections).
  std::vector<std::pair<const char*, std::shared_ptr<const WeightTransform>>> tiers{{"as stored", nullptr}};
  if (cpu::exact_int8_products()) tiers.emplace_back("int8 tier", same_decoder_tier(Quant::int8));
  for (const auto& [tier, transform] : tiers) {
    auto weights = [&] { return transform ? test::weights_in(dir).with(transform) : test::weights_in(dir); };
    for (const DType dt : {DType::f32, DType::bf16}) {
      const auto whole = sa3::SameDecoder::load(config, weights(), dt);
      const std::vector<float> expected = same_audio(whole, dt, seed);
      for (const int n : {2, 3}) {
        SCOPED_TRACE(std::string(tier) + ", " + std::string(dtype_name(dt)) + ", " + std::to_string(n) + " ranks");
        const int64_t held = check_ranks(
            n, expected, whole.parameter_count(),
            [&](const ProcessGroup* rank) { return sa3::SameDecoder::load(config, weights(), dt, rank); },
            [&](const sa3::SameDecoder& mine, double* counted) { return same_audio(mine, dt, seed, counted); });
        // The transformer's linears and their biases are dealt out once; the rest (the
        // projection, the mapping, the norms) is held by every rank.
        const int64_t d = config.dim, f = config.ff_inner, parts = config.differential ? 5 : 3;
        const int64_t linears = config.depth * (parts * d * d + d * d + 2 * f * d + 2 * f + d * f + d);
        EXPECT_EQ(held, whole.parameter_count() + (n - 1) * (whole.parameter_count() - linears));
      }
    }
  }
  // A decoder held split decodes every chunk on all its ranks: dealing its chunks out is refused.
  ThreadRanks all(2);
  const ThreadRanks::Rank rank(all, 0);
  const auto split = sa3::SameDecoder::load(config, test::weights_in(dir), DType::f32, &rank);
  Arena arena;
  Context c{&arena, DType::f32};
  test::expect_error(
      [&] {
        split.decode(c, Tensor::shape_only({2 * 200, config.latent_dim}, DType::f32), 2, true, {}, &rank);
      },
      {"a decoder loaded split over ranks", "its chunks are not dealt out"});
}

// A LoKr on a weight held as some of its rows adds exactly those rows' part of the whole term: a
// LoRA's up factor is cut, a LoKr's Kronecker term formed whole and its held rows kept.
TEST(TensorSplit, AdaptersCutToHeldRowsAddThoseRowsOfTheWholeTerm) {
  const uint32_t seed = test::test_seed();
  const int64_t n = 3, a = 2, c = 3, p = 4, q = 5;  // x [n, c q]; ΔW = kron([a, c], [p, q]): [8, 15]
  auto factor = [&](int64_t rows, int64_t cols, uint32_t s) {
    return Factor{Tensor{}, seeded({rows, cols}, DType::f32, s)};
  };
  LowRank lokr;
  lokr.outer = factor(a, c, seed);
  lokr.inner = Factor{seeded({2, q}, DType::f32, seed + 1), seeded({p, 2}, DType::f32, seed + 2)};
  lokr.scale = 0.7f;
  lokr.source = "lokr";
  LowRank lora;
  lora.inner = Factor{seeded({3, c * q}, DType::f32, seed + 3), seeded({a * p, 3}, DType::f32, seed + 4)};
  lora.source = "lora";
  const std::string name = "w";
  const std::vector<Share> held{{1, 3}, {6, 2}, {4, 0}};
  const Tensor x = seeded({n, c * q}, DType::f32, seed + 5);
  // y [n, rows] = x's adapters' terms on a weight named `name` of `rows` rows as held.
  auto adapted = [&](const Adapters& adapters, int64_t rows) {
    Arena arena;
    Context ctx{&arena, DType::f32};
    Tensor w = Tensor::shape_only({rows, c * q}, DType::f32);
    w.weight_name = &name;
    Tensor y = ops::zeros(ctx, {n, rows}, DType::f32);
    const AdapterScope scope(ctx, &adapters);
    ops::apply_adapters(ctx, x, w, nullptr, y);
    return to_f32_vector(y);
  };
  Adapters whole, cut;
  for (Adapters* adapters : {&whole, &cut}) {
    adapters->add(name, {a * p, c * q}, lokr);
    adapters->add(name, {a * p, c * q}, lora);
  }
  cut.keep_rows(name, held);
  const std::vector<float> all = adapted(whole, a * p), mine = adapted(cut, 5);
  for (int64_t i = 0; i < n; ++i) {
    int64_t col = 0;
    for (const Share& s : held)
      for (int64_t r = s.first; r < s.first + s.count; ++r, ++col)
        EXPECT_EQ(mine[size_t(i * 5 + col)], all[size_t(i * a * p + r)]) << "sample " << i << ", row " << r;
  }
}

TEST(TensorSplit, RowsFetchedOnTheirOwnAreTheWholeWeightsRows) {
  const ModelDir dir = ModelDir::open(test::fixture("klein_tiny_a"));
  const auto source = open_weights(dir.component("transformer"));
  const std::string name = "single_transformer_blocks.1.attn.to_qkv_mlp_proj.weight";
  const auto cfg = flux2::TransformerConfig::read(dir.config("transformer"));
  const Shape shape{3 * cfg.hidden + 2 * cfg.mlp_hidden, cfg.hidden};
  const Tensor whole = to_dtype(source->fetch(name, shape), DType::f32);
  std::mt19937 rng(test::test_seed());
  const std::vector<Share> rows{
      {std::uniform_int_distribution<int64_t>(0, 9)(rng), 7}, {0, 1}, {shape[0] - 3, 3}, {5, 0}};
  const Tensor part = to_dtype(source->fetch_rows(name, shape, rows), DType::f32);
  ASSERT_EQ(part.shape, Shape({11, shape[1]}));
  int64_t at = 0;
  for (const Share& r : rows)
    for (int64_t i = 0; i < r.count; ++i, ++at)
      EXPECT_EQ(std::memcmp(part.rows(at, at + 1).data, whole.rows(r.first + i, r.first + i + 1).data,
                            size_t(shape[1]) * sizeof(float)),
                0)
          << "row " << at;
  EXPECT_THROW(source->fetch_rows(name, shape, {{shape[0] - 1, 2}}), Error);
}

// What counting `r` says on the model at `path` opened with its weights split over `split` (or
// whole): empty when it is taken.
template <typename Model, typename Request>
std::string count_refusal(const std::string& path, const ProcessGroup* split, const Request& r) {
  ModelParts parts;
  parts.model = path;
  parts.tensor_ranks = split;
  try {
    Model::open(parts, Weights::none)->count(r);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// A 32x32 image as `parallel` over `ranks` on klein_tiny_a.
std::string refusal(const ProcessGroup* split, Parallel parallel, const ProcessGroup* ranks) {
  ImageRequest r;
  r.prompt = "a fox";
  r.width = r.height = 32;
  r.parallel = {parallel, ranks};
  return count_refusal<ImageModel>(test::fixture("klein_tiny_a"), split, r);
}

// The same for a guided Stable Audio 3 clip on the tiny pipeline.
std::string audio_refusal(const ProcessGroup* split, Parallel parallel, const ProcessGroup* ranks) {
  AudioRequest r;
  r.prompt = "rain";
  r.seconds = 1;
  r.cfg = 4;
  r.parallel = {parallel, ranks};
  return count_refusal<AudioModel>(test::pipeline_dir(), split, r);
}

TEST(TensorSplit, AModelTakesTensorOnlyWhenOpenedSplitAndThenOnlyTensor) {
  ThreadRanks all(2), others(2);
  const ThreadRanks::Rank rank(all, 1), other(others, 1);
  for (auto* refused : {&refusal, &audio_refusal}) {
    SCOPED_TRACE(refused == &refusal ? "klein" : "Stable Audio 3");
    EXPECT_EQ(refused(&rank, Parallel::tensor, &rank), "");
    EXPECT_EQ(refused(&rank, Parallel::none, nullptr), "") << "none on a split model is tensor over its ranks";
    EXPECT_EQ(refused(nullptr, Parallel::ulysses, &rank), "");
    EXPECT_NE(refused(nullptr, Parallel::tensor, &rank).find("this one holds its weights whole"), std::string::npos);
    for (const Parallel p : {Parallel::cfg, Parallel::ulysses})
      EXPECT_NE(refused(&rank, p, &rank).find("every request runs as parallel tensor over them, not "),
                std::string::npos);
    EXPECT_NE(refused(&rank, Parallel::tensor, &other).find("not tensor over other ranks"), std::string::npos);
  }
}

}  // namespace
}  // namespace apus
