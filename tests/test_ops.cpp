// The CPU backend's op properties beyond the op table (test_op_table.cpp, which holds every op of
// every backend to the reference backend): batching, partial RoPE, differential attention as two
// attentions, each rounding rule visible to the table's bound, the front end's refusals, the
// conv's re-laid weights, all_finite, f16 weights, the vectorised exp and f16 conversion. In each
// activation dtype and on the f32 path AVX2-only CPUs take, on fresh random inputs (seed printed).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/variants.h"
#include "op_bounds.h"
#include "op_inputs.h"
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/vec.h"
#include "ops/ops.h"
#include "test_util.h"

namespace apus {
namespace {

using ops::Rounding;

// (activation dtype, native bf16 kernels): the second runs the f32 path AVX2-only CPUs take.
class Ops : public ::testing::TestWithParam<std::tuple<DType, bool>>, protected test::OpInputs {
 protected:
  Ops() : OpInputs(std::get<0>(GetParam())) {}
  void SetUp() override { cpu::native_bf16_knob.set(std::get<1>(GetParam()) ? 0 : 1); }
  void TearDown() override { cpu::native_bf16_knob.set(0); }
  Arena arena;
  Context ctx{&arena, act};
  Context ref{&arena, act, nullptr, false, &reference_backend()};
};

// Partial RoPE (Stable Audio): a table half as wide turns the first half of each head; the rest
// must come out as it went in.
TEST_P(Ops, PartialRopeLeavesTheRestOfEachHead) {
  const int64_t s = 7, hd = 16, half = hd / 2, d = 3 * hd;
  const Tensor xt = random({s, d});
  Tensor pcos = Tensor::heap({s, half / 2}, DType::f32), psin = Tensor::heap({s, half / 2}, DType::f32);
  for (int64_t i = 0; i < s * half / 2; ++i) {
    const double a = double(rng() % 1000) / 100.0;
    pcos.ptr<float>()[i] = float(std::cos(a));
    psin.ptr<float>()[i] = float(std::sin(a));
  }
  const Tensor before = clone(xt);
  Tensor turned = clone(xt);
  ops::rope(ctx, turned, pcos, psin, hd, ops::RopeStyle::half, Rounding::once);
  for (int64_t r = 0; r < s; ++r)
    for (int64_t h = 0; h < d; h += hd)
      for (int64_t i = half; i < hd; ++i)
        ASSERT_EQ(std::memcmp(static_cast<const char*>(turned.row(r)) + (h + i) * dtype_size(act),
                              static_cast<const char*>(before.row(r)) + (h + i) * dtype_size(act), dtype_size(act)),
                  0)
            << "partial rope touched channel " << i;
  EXPECT_NE(to_f32_vector(turned), to_f32_vector(before));
}

// differential_attention is what two attention ops and a subtraction give, element for element.
TEST_P(Ops, DifferentialAttentionIsTheDifferenceOfTwo) {
  const int64_t s = 150, d = 64, h = 2;  // two samples of 75 rows
  const Tensor qt = random({s, h * d}), kt = random({s, h * d}), q2 = random({s, h * d}), k2 = random({s, h * d}),
               vt = random({s, h * d});
  // Two attention ops and a subtraction in the activation dtype.
  Tensor a = poisoned({s, h * d}), b = poisoned({s, h * d}), diff = poisoned({s, h * d});
  ops::attention(ctx, qt, kt, vt, a, d, 0.125f, {false, nullptr, 2});
  ops::attention(ctx, q2, k2, vt, b, d, 0.125f, {false, nullptr, 2});
  ops::differential_attention(ctx, qt, kt, q2, k2, vt, diff, d, 0.125f, {false, nullptr, 2});
  const auto av = to_f32_vector(a), bv = to_f32_vector(b), dv = to_f32_vector(diff);
  for (size_t i = 0; i < dv.size(); ++i) ASSERT_EQ(dv[i], round_as(act, av[i] - bv[i])) << "element " << i;
}

TEST_P(Ops, EmbeddingRefusesIdsOutsideTheTable) {
  const Tensor table = random({50, 24}, 1.0f, DType::bf16);
  Tensor ids = Tensor::heap({9}, DType::i32);
  for (int64_t i = 0; i < 9; ++i) ids.ptr<int32_t>()[i] = int32_t(rng() % 50);
  ids.ptr<int32_t>()[4] = 50;
  Tensor y = poisoned({9, 24});
  test::expect_error([&] { ops::embedding(ctx, table, ids, y); }, {"token id 50", "50 rows"});
}

// The permutation is the one it claims: elements spot-checked against the index map.
TEST_P(Ops, PermuteMovesEachElementWhereItsAxesSay) {
  const Tensor g = random({3, 4, 5, 2, 2});
  Tensor out = poisoned({5, 3, 2, 4, 2});
  ops::permute(ctx, g, out, {2, 0, 3, 1, 4});
  for (int k = 0; k < 50; ++k) {
    const int64_t a = rng() % 3, b = rng() % 4, cc = rng() % 5, d = rng() % 2, e = rng() % 2;
    EXPECT_EQ(load_f32(out, (((cc * 3 + a) * 2 + d) * 4 + b) * 2 + e),
              load_f32(g, (((a * 4 + b) * 5 + cc) * 2 + d) * 2 + e));
  }
}

TEST_P(Ops, ImageToRgb8RefusesANonFinitePixel) {
  Tensor image = random({1, 3, 5, 7}, 0.8f), rgb = Tensor::heap({5, 7, 3}, DType::u8);
  store(image, 17, NAN);
  test::expect_error([&] { ops::image_to_rgb8(ctx, image, rgb); }, {"image_to_rgb8", "finite"});
}

// A batch lies sample after sample along the rows (or N): the ops that see samples (attention,
// per-sample modulation and gates, RoPE tables shared by the samples, NCHW ops) give each sample
// of a B = 2 call exactly what a B = 1 call on that sample gives (the op table holds the same
// batched calls to the reference).
TEST_P(Ops, BatchOfTwoEqualsTwoSingleSamples) {
  auto rows = [](const Tensor& t, int64_t b, int64_t n) { return to_f32_vector(clone(t.rows(b * n, (b + 1) * n))); };
  // Attention with a different key mask per sample, causal and not.
  const int64_t s = 70, d = 16, hq = 4, hk = 2;
  const Tensor q = random({2 * s, hq * d}), k = random({2 * s, hk * d}), v = random({2 * s, hk * d});
  Tensor valid = Tensor::heap({2 * s}, DType::i64);
  for (int64_t j = 0; j < 2 * s; ++j) valid.ptr<int64_t>()[j] = j < s ? j < 50 : j < s + 61;  // 50 and 61 real keys
  for (bool causal : {false, true}) {
    const ops::AttentionOptions both{causal, &valid, 2};
    Tensor o2 = poisoned({2 * s, hq * d});
    ops::attention(ctx, q, k, v, o2, d, 0.25f, both);
    for (int64_t b = 0; b < 2; ++b) {
      Tensor o1 = poisoned({s, hq * d});
      const Tensor sample_valid = valid.rows(b * s, (b + 1) * s);
      ops::attention(ctx, q.rows(b * s, (b + 1) * s), k.rows(b * s, (b + 1) * s), v.rows(b * s, (b + 1) * s), o1, d,
                     0.25f, {causal, &sample_valid, 1});
      EXPECT_EQ(rows(o2, b, s), to_f32_vector(o1)) << "attention sample " << b;
    }
  }
  // Per-sample modulation and gates ([2, D] as a column view of a wider tensor), RoPE shared.
  const int64_t n = 9, dm = 32;
  const Tensor x = random({2 * n, dm}, 2.0f), mod = random({2, 3 * dm}, 0.5f), y = random({2 * n, dm});
  const Tensor shift = mod.cols(0, dm), scale = mod.cols(dm, 2 * dm), gate = mod.cols(2 * dm, 3 * dm);
  Tensor cos = Tensor::heap({n, dm / 4}, DType::f32), sin = Tensor::heap({n, dm / 4}, DType::f32);
  for (int64_t i = 0; i < cos.numel(); ++i) {
    cos.ptr<float>()[i] = float(std::cos(0.1 * double(i)));
    sin.ptr<float>()[i] = float(std::sin(0.1 * double(i)));
  }
  Tensor ln2 = poisoned({2 * n, dm}), xg = clone(x), xr = clone(x);
  ops::layer_norm_modulate(ctx, x, shift, scale, ln2, 1e-6f, Rounding::each_step);
  ops::add_gated(ctx, xg, y, &gate, Rounding::each_step);
  ops::rope(ctx, xr, cos, sin, dm / 2, ops::RopeStyle::half, Rounding::each_step);
  for (int64_t b = 0; b < 2; ++b) {
    Tensor ln1 = poisoned({n, dm});
    ops::layer_norm_modulate(ctx, x.rows(b * n, (b + 1) * n), shift.rows(b, b + 1), scale.rows(b, b + 1), ln1, 1e-6f,
                             Rounding::each_step);
    EXPECT_EQ(rows(ln2, b, n), to_f32_vector(ln1)) << "layer_norm_modulate sample " << b;
    Tensor g1 = clone(x.rows(b * n, (b + 1) * n));
    const Tensor gate1 = gate.rows(b, b + 1);
    ops::add_gated(ctx, g1, y.rows(b * n, (b + 1) * n), &gate1, Rounding::each_step);
    EXPECT_EQ(rows(xg, b, n), to_f32_vector(g1)) << "add_gated sample " << b;
    Tensor r1 = clone(x.rows(b * n, (b + 1) * n));
    ops::rope(ctx, r1, cos, sin, dm / 2, ops::RopeStyle::half, Rounding::each_step);
    EXPECT_EQ(rows(xr, b, n), to_f32_vector(r1)) << "rope sample " << b;
  }
  // NCHW with N = 2.
  const Tensor img = random({2, 8, 6, 5}, 2.0f);
  const Tensor gw = random({8}, 1.0f, DType::bf16), gb = random({8}, 1.0f, DType::bf16);
  Tensor gn2 = poisoned({2, 8, 6, 5});
  ops::group_norm(ctx, img, gw, gb, gn2, 4, 1e-6f, true, Rounding::each_step);
  const int64_t plane = 8 * 6 * 5;
  for (int64_t b = 0; b < 2; ++b) {
    Tensor one = clone(img.reshape({2, plane}).rows(b, b + 1)).reshape({1, 8, 6, 5});
    Tensor gn1 = poisoned({1, 8, 6, 5});
    ops::group_norm(ctx, one, gw, gb, gn1, 4, 1e-6f, true, Rounding::each_step);
    EXPECT_EQ(rows(gn2.reshape({2, plane}), b, 1), to_f32_vector(gn1)) << "group_norm sample " << b;
  }
}

// Each rounding rule matters: the CPU run with one rule against the reference run with the
// other falls outside the bf16 bound. This is what makes the bound able to catch a backend that
// drops a rule.
TEST_P(Ops, RoundingRulesAreVisibleToTheBound) {
  if (act != DType::bf16) GTEST_SKIP() << "roundings to f32 change nothing";
  const int64_t m = 16, d = 64;
  const Tensor x = random({m, d}, 2.0f), y = random({m, d}), g = random({1, d}, 0.7f);
  Tensor cos = Tensor::heap({m, d / 4}, DType::f32), sin = Tensor::heap({m, d / 4}, DType::f32);
  for (int64_t i = 0; i < cos.numel(); ++i) {
    cos.ptr<float>()[i] = float(std::cos(0.37 * double(i)));
    sin.ptr<float>()[i] = float(std::sin(0.37 * double(i)));
  }
  const Tensor img = random({1, 8, 6, 5}, 2.0f), gw = random({8}), gb = random({8});
  // DyT's alpha away from 0: a small one leaves tanh near the identity, where its roundings
  // coincide (a random one of 0.01 made the two rules agree on 99 % of the outputs).
  Tensor alpha = Tensor::heap({1}, act);
  if (act == DType::bf16) alpha.ptr<uint16_t>()[0] = f32_to_bf16(1.1f);
  struct Rule {
    const char* name;
    std::function<void(Context&, Tensor&, Rounding)> run;
    Tensor out;
  };
  const std::vector<Rule> rules = {
      {"layer_norm_modulate",
       [&](Context& c, Tensor& o, Rounding r) { ops::layer_norm_modulate(c, x, g, g, o, 1e-6f, r); }, poisoned({m, d})},
      {"rms_norm", [&](Context& c, Tensor& o, Rounding r) { ops::rms_norm(c, x, g.reshape({d}), o, 1e-6f, d, r); },
       poisoned({m, d})},
      {"rope", [&](Context& c, Tensor& o, Rounding r) { ops::rope(c, o, cos, sin, d / 2, ops::RopeStyle::half, r); },
       x},
      {"glu", [&](Context& c, Tensor& o, Rounding r) { ops::glu(c, x, y, o, ops::Activation::gelu_tanh, r); },
       poisoned({m, d})},
      {"add_gated", [&](Context& c, Tensor& o, Rounding r) { ops::add_gated(c, o, y, &g, r); }, x},
      {"group_norm", [&](Context& c, Tensor& o, Rounding r) { ops::group_norm(c, img, gw, gb, o, 4, 1e-6f, true, r); },
       poisoned({1, 8, 6, 5})},
      {"modulate", [&](Context& c, Tensor& o, Rounding r) { ops::modulate(c, x, g, g, o, r); }, poisoned({m, d})},
      {"dyt", [&](Context& c, Tensor& o, Rounding r) { ops::dyt(c, x, alpha, g.reshape({d}), g.reshape({d}), o, r); },
       poisoned({m, d})},
      {"glu sin_pi", [&](Context& c, Tensor& o, Rounding r) { ops::glu(c, x, y, o, ops::Activation::sin_pi, r); },
       poisoned({m, d})},
      {"gate_sigmoid", [&](Context& c, Tensor& o, Rounding r) { ops::gate_sigmoid(c, x, o, r); }, poisoned({m, d})},
      {"affine", [&](Context& c, Tensor& o, Rounding r) { ops::affine(c, x, g, g, o, r); }, poisoned({m, d})},
      {"attention scores",
       [&](Context& c, Tensor& o, Rounding r) {
         ops::attention(c, x, y, y, o, d / 4, 0.5f, {false, nullptr, 1, 5.0f, r});
       },
       poisoned({m, d})},
  };
  for (const Rule& rule : rules)
    for (Rounding mine : {Rounding::once, Rounding::each_step}) {
      const Rounding theirs = mine == Rounding::once ? Rounding::each_step : Rounding::once;
      Tensor a = clone(rule.out), b = clone(rule.out);
      rule.run(ctx, a, mine);
      rule.run(ref, b, theirs);
      const Agreement gap = agreement(a, b);
      std::printf("[ measure ] %s with the other rule: %.1f%% differ\n", rule.name, 100 * gap.differing);
      EXPECT_FALSE(within_bound(gap, act)) << rule.name << ": dropping the rule goes unnoticed";
    }
}

TEST_P(Ops, OperandOnAnotherDeviceIsRefused) {
  Tensor x = random({4, 8}), y = poisoned({4, 8});
  Tensor foreign = x;
  foreign.device = Device::cuda;
  test::expect_error([&] { ops::copy(ctx, foreign, y); }, {"copy", "cuda:0", "cpu backend"});
  foreign.device = Device::cpu;
  foreign.ordinal = 1;
  test::expect_error([&] { ops::silu(ctx, x, foreign); }, {"silu", "cpu:1"});
  const Tensor w = random({8, 8}, 1.0f, DType::bf16);
  Tensor wf = w;
  wf.device = Device::cuda;
  test::expect_error([&] { ops::linear(ctx, x, wf, nullptr, y); }, {"linear", "cuda"});
}

// A backend that runs part of the list: the CPU's kernels, but it says it does not run conv2d.
class WithoutConv2d final : public HostBackend {
 public:
  WithoutConv2d() : HostBackend("partial") {}
  bool supports(ops::OpId op) const override { return op != ops::OpId::conv2d; }
#define APUS_CPU_OP(ret, name, params, args) \
  ret name params override { return cpu::name args; }
  APUS_OPS(APUS_CPU_OP)
#undef APUS_CPU_OP
};

// The front end refuses an op the backend does not run, by name, before the backend sees it (the
// operands here are ones conv2d would run on); the ops it runs still run.
TEST(OpFrontEnd, AnOpTheBackendDoesNotRunIsRefusedByName) {
  WithoutConv2d partial;
  Arena arena;
  Context c{&arena, DType::f32, nullptr, false, &partial};
  Tensor x = Tensor::heap({1, 2, 4, 4}, DType::f32), w = Tensor::heap({2, 2, 3, 3}, DType::f32),
         y = Tensor::heap({1, 2, 4, 4}, DType::f32);
  std::memset(x.data, 0, x.nbytes());
  std::memset(w.data, 0, w.nbytes());
  test::expect_error([&] { ops::conv2d(c, x, w, nullptr, y, 1, 1, 1); }, {"backend partial does not run op conv2d"});
  ops::silu(c, x, y);
  EXPECT_EQ(to_f32_vector(y), to_f32_vector(x));
}

// The blocked-layout conv keeps re-laid weights per weight buffer. Weights freed and replaced by
// others at the very same address (a model unloaded, the next one mapped there) must not meet
// the stale copy.
TEST_P(Ops, ConvReLaidWeightsDieWithTheirOwner) {
  const int64_t ci = 16, co = 16;
  Tensor xt = random({1, ci, 8, 8});
  const Tensor a = random({co, ci, 3, 3}, 0.2f, DType::bf16);
  const Tensor b = random({co, ci, 3, 3}, 0.2f, DType::bf16);
  std::shared_ptr<void> buffer(std::aligned_alloc(64, a.nbytes() + 64), std::free);
  auto weight_at_buffer = [&](const Tensor& values) {
    std::memcpy(buffer.get(), values.data, values.nbytes());
    Tensor t = values;
    t.data = buffer.get();
    t.owner = std::make_shared<int>(0);  // a fresh owner: a new mapping of the same address
    return t;
  };
  auto conv = [&](const Tensor& w, const char* layout) {
    cpu::conv_layout_knob.set(cpu::conv_layout_knob.index_of(layout));
    Tensor y = poisoned({1, co, 8, 8});
    ops::conv2d(ctx, xt, w, nullptr, y, 1, 1, 1);
    cpu::conv_layout_knob.set(0);
    return to_f32_vector(y);
  };
  {
    const Tensor first = weight_at_buffer(a);
    conv(first, "blocked");
  }
  const Tensor second = weight_at_buffer(b);
  const auto want = conv(second, "plain");
  const double err = test::rel_l2(conv(second, "blocked"), want);
  EXPECT_LT(err, act == DType::f32 ? 2e-6 : 8.0 / 256) << "blocked conv used weights of a released buffer";
}

TEST_P(Ops, AllFiniteFindsEveryNonFiniteValue) {
  Tensor t = random({29, 70});
  EXPECT_TRUE(ops::all_finite(ctx, t));
  EXPECT_TRUE(ops::all_finite(ctx, t.cols(3, 50)));
  std::uniform_int_distribution<int64_t> pick(0, t.numel() - 1);
  for (const float bad : {NAN, INFINITY, -INFINITY}) {
    Tensor u = clone(t);
    const int64_t at = pick(rng);
    store(u, at, bad);
    EXPECT_FALSE(ops::all_finite(ctx, u)) << bad << " at " << at;
    // A column view sees it only when the column is inside the view.
    const int64_t col = at % 70;
    EXPECT_EQ(ops::all_finite(ctx, u.cols(3, 50)), col < 3 || col >= 50) << at;
    EXPECT_FALSE(ops::all_finite(ctx, u.reshape({1, 29, 70})));  // any rank
  }
}

// f16 weights are read by every kernel: a linear and an RMSNorm over f16 weights equal the same
// ops over those weights widened to f32 exactly, in each activation dtype.
TEST_P(Ops, F16WeightsReadExactly) {
  const int64_t m = 9, k = 48, n = 20;
  Tensor xt = random({m, k});
  std::uniform_int_distribution<int> bits(0, 0xffff);
  Tensor w16 = Tensor::heap({n, k}, DType::f16);
  for (int64_t i = 0; i < w16.numel(); ++i) {
    // Exponents 8..17 (values ~2^-7..2^2) and subnormal-free, random mantissa and sign.
    const int b = bits(rng);
    w16.ptr<uint16_t>()[i] = uint16_t((b & 0x83ff) | ((8 + (b >> 10) % 10) << 10));
  }
  Tensor w32 = to_dtype(w16, DType::f32);
  Tensor y16 = poisoned({m, n}), y32 = poisoned({m, n});
  ops::linear(ctx, xt, w16, nullptr, y16);
  ops::linear(ctx, xt, w32.dtype == ctx.act ? w32 : to_dtype(w32, ctx.act), nullptr, y32);
  EXPECT_EQ(to_f32_vector(y16), to_f32_vector(y32));
  Tensor g16 = Tensor::heap({k}, DType::f16);
  std::memcpy(g16.data, w16.data, g16.nbytes());
  Tensor r16 = poisoned({m, k}), r32 = poisoned({m, k});
  ops::rms_norm(ctx, xt, g16, r16, 1e-6f, k, Rounding::once);
  ops::rms_norm(ctx, xt, to_dtype(g16, DType::f32), r32, 1e-6f, k, Rounding::once);
  EXPECT_EQ(to_f32_vector(r16), to_f32_vector(r32));
}

// The widened GEMM (CPUs without bf16 dot products) computes each row from that row alone: a batch
// must equal its requests run one by one, and threads must not move bits. Both kernels, at shapes
// off every block size (rows past a 6-row micro-panel and a 72-row block, columns past a 16-wide
// panel, an inner dimension past a 256 block), with a bias.
TEST(WidenedGemm, ARowsBitsDoNotDependOnTheRowsBesideIt) {
  Knob& native = find_knob("cpu.native_bf16");
  Knob& kernel = find_knob("cpu.widened_gemm");
  native.set(native.index_of("off"));
  const int64_t m = 150, k = 300, n = 70;
  for (const char* choice : {"onednn", "avx2"}) {
    if (std::string(choice) == "avx2" && !cpu::sgemm_avx2_supported()) continue;
    SCOPED_TRACE(choice);
    kernel.set(kernel.index_of(choice));
    test::OpInputs in(DType::bf16);
    Arena arena;
    Context ctx{&arena, DType::bf16};
    const Tensor x = in.random({m, k}), w = in.random({n, k}, 0.1f), bias = in.random({n});
    Tensor all = in.poisoned({m, n});
    ops::linear(ctx, x, w, &bias, all);
    const std::vector<float> want = to_f32_vector(all);
    for (const int64_t rows : {int64_t(1), int64_t(7), int64_t(64), int64_t(73)})
      for (int64_t r0 = 0; r0 < m; r0 += rows) {
        const int64_t r1 = std::min(m, r0 + rows);
        Tensor part = in.poisoned({r1 - r0, n});
        ops::linear(ctx, x.rows(r0, r1), w, &bias, part);
        const std::vector<float> got = to_f32_vector(part);
        ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin() + r0 * n))
            << "rows " << r0 << ".." << r1 << " in calls of " << rows;
      }
    // One thread (OMP_NUM_THREADS=1, as MPI ranks run): a team of one is no active parallel
    // region, and the tiles must still not tile themselves again (they recursed until the stack
    // ran out before session 36).
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    Tensor alone = in.poisoned({m, n});
    ops::linear(ctx, x, w, &bias, alone);
    omp_set_num_threads(threads);
    EXPECT_EQ(to_f32_vector(alone), want) << "one thread";
  }
  kernel.set(0);
  native.set(0);
}

// The widened attention kernel (attention without a band where bf16 is widened) computes each
// query row from its own scores: the query block it lands in (the block size), the samples of a
// batch beside it and a second term must not move its bits. Causal and not, grouped heads, padded
// keys, a head of 80 (past a 16-wide panel) and 300 keys (past the kernel's 256 block of P·V).
TEST(WidenedAttention, ARowsBitsDoNotDependOnItsQueryBlockOrBatch) {
  if (!cpu::sgemm_avx2_supported()) GTEST_SKIP() << "no AVX2 and FMA";
  KnobScope widened("cpu.native_bf16", "off");
  KnobScope direct("cpu.attention", "direct");
  const int64_t s = 300, d = 80, hq = 4, hk = 2;
  test::OpInputs in(DType::bf16);
  Arena arena;
  Context ctx{&arena, DType::bf16};
  const Tensor q = in.random({2 * s, hq * d}), k = in.random({2 * s, hk * d}), v = in.random({2 * s, hk * d});
  Tensor valid = Tensor::heap({2 * s}, DType::i64);
  for (int64_t j = 0; j < 2 * s; ++j) valid.ptr<int64_t>()[j] = j % s < 260;
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    auto attend = [&](const char* block, int64_t batch) {
      KnobScope rows("cpu.attention_block", block);
      Tensor o = in.poisoned({2 * s, hq * d});
      ops::attention(ctx, q, k, v, o, d, 0.125f, {causal, &valid, batch});
      return to_f32_vector(o);
    };
    const std::vector<float> want = attend("128", 2);
    for (const char* block : {"32", "512"}) EXPECT_EQ(attend(block, 2), want) << "blocks of " << block;
    // The first sample alone.
    Tensor first = in.poisoned({s, hq * d});
    const Tensor first_valid = valid.rows(0, s);
    ops::attention(ctx, q.rows(0, s), k.rows(0, s), v.rows(0, s), first, d, 0.125f, {causal, &first_valid});
    const std::vector<float> alone = to_f32_vector(first);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), want.begin())) << "the first sample of a batch of two";
  }
}

// silu(x) = x / (1 + exp(-x)) inherits the exp's relative error where exp(-x) dominates (x < 0),
// so this bounds the vectorised exp over the whole clamped range. With ln2's low part applied
// before its high part the worst case is ~60 ulp; in the right order a few.
TEST(OpsRows, SiluAndItsExpStayWithinAFewUlp) {
  const int64_t n = 200001;
  std::vector<float> x(static_cast<size_t>(n)), y;
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = -86.0f + 172.0f * float(i) / float(n - 1);
  y = x;
  cpu::silu_row(y.data(), n);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double xi = x[size_t(i)], want = xi / (1.0 + std::exp(-xi));
    if (want == 0) continue;
    const double ulp = std::ldexp(1.0, std::ilogb(float(want)) - 23);  // float ulp at want
    worst = std::max(worst, std::fabs(double(y[size_t(i)]) - want) / ulp);
  }
  std::printf("[ measure ] silu worst error %.2f ulp\n", worst);
  EXPECT_LT(worst, 8.0);
}

TEST(OpsRows, F16ConversionIsExactForEveryHalf) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  std::vector<float> out(all.size(), 0.0f);
  f16_to_f32_row(all.data(), out.data(), int64_t(all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = f16_to_f32(uint16_t(i));
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(out[i])) << i;
    else EXPECT_EQ(std::memcmp(&out[i], &want, 4), 0) << std::hex << i << " " << out[i] << " " << want;
  }
}

// f32_to_f16 against the exact value, for every half and for the floats between two neighbours:
// the midpoint goes to the even one, a float either side of it to the nearer one; past the
// largest half's midpoint, infinity (the recipes' F16 GGUF fixtures and apus synth use it).
TEST(OpsRows, F16RoundingIsToNearestEven) {
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const float x = f16_to_f32(uint16_t(h));
    ASSERT_EQ(f32_to_f16(x), h) << std::hex << h;
    ASSERT_EQ(f32_to_f16(-x), h | 0x8000u) << std::hex << h;
    const double next = h + 1 < 0x7c00u ? double(f16_to_f32(uint16_t(h + 1))) : 65536.0;
    const float mid = float((double(x) + next) / 2);  // exact in float: halves carry 11 bits
    ASSERT_EQ(f32_to_f16(mid), (h & 1) ? h + 1 : h) << std::hex << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 1e9f)), h + 1) << std::hex << h;
  }
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7c00u);
  EXPECT_EQ(f32_to_f16(1e-9f), 0u);
  EXPECT_EQ(f32_to_f16(std::nanf("")) & 0x7e00u, 0x7e00u);
}

// Weights converted at load (sa3.cpp's F16 GGUFs): every half, through the chunks to_dtype spreads
// over the cores, to f32 exactly and to bf16 as f32_to_bf16 rounds the exact value.
TEST(OpsRows, F16TensorsConvertExactlyAtLoad) {
  const int64_t n = 3 * 65536 + 5;  // several chunks and a ragged end
  Tensor halves = Tensor::heap({n}, DType::f16);
  for (int64_t i = 0; i < n; ++i) halves.ptr<uint16_t>()[i] = uint16_t(i * 40503);
  const Tensor wide = to_dtype(halves, DType::f32), narrow = to_dtype(halves, DType::bf16);
  for (int64_t i = 0; i < n; ++i) {
    const float want = f16_to_f32(halves.ptr<uint16_t>()[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(wide.ptr<float>()[i])) << i;
      EXPECT_TRUE(std::isnan(bf16_to_f32(narrow.ptr<uint16_t>()[i]))) << i;
      continue;
    }
    EXPECT_EQ(std::memcmp(&wide.ptr<float>()[i], &want, 4), 0) << i;
    EXPECT_EQ(narrow.ptr<uint16_t>()[i], f32_to_bf16(want)) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, Ops,
                         ::testing::Values(std::make_tuple(DType::f32, true), std::make_tuple(DType::bf16, true),
                                           std::make_tuple(DType::bf16, false)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "" : "_widened");
                         });

}  // namespace
}  // namespace apus
