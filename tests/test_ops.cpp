// Every op of the CPU backend against the reference backend (src/ops/ref: plain f64 loops with
// the op contract's roundings), in each activation dtype and on the f32 path AVX2-only CPUs take,
// on fresh random inputs (seed printed) with poisoned outputs, as ggml's test-backend-ops checks
// every backend against the CPU.
//
// The bound is what the arithmetic allows. f32: relative L2 2e-6 (fp32 accumulation against
// f64). bf16: both backends round the same values at the same places, so they may differ only
// where fp32 and f64 land on opposite sides of a bf16 rounding boundary: at most 1 % of elements
// differing at all, each by at most two bf16 ulps (a flipped intermediate rounding reaches the
// output through the next step: 1.5 ulp measured through GroupNorm's SiLU). An op that drops a
// rounding rule differs in 12-70 % of its elements, which the RoundingRules test shows for each.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/vec.h"
#include "ops/ops.h"
#include "op_bounds.h"
#include "test_util.h"

namespace apus {
namespace {

using ops::Rounding;

// (activation dtype, native bf16 kernels): the second runs the f32 path AVX2-only CPUs take.
class Ops : public ::testing::TestWithParam<std::tuple<DType, bool>> {
 protected:
  void SetUp() override {
    act = std::get<0>(GetParam());
    ctx = Context{&arena, act};
    ref = Context{&arena, act, nullptr, false, &reference_backend()};
    cpu::native_bf16_knob.set(std::get<1>(GetParam()) ? 0 : 1);
  }
  void TearDown() override { cpu::native_bf16_knob.set(0); }
  // Fresh random values stored in `dt` (the activation dtype by default).
  Tensor random(Shape s, float scale = 1.0f, DType dt = DType(255)) {
    if (dt == DType(255)) dt = act;
    Tensor t = Tensor::heap(std::move(s), dt);
    std::normal_distribution<float> dist(0.0f, scale);
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = dist(rng);
      if (dt == DType::bf16) t.ptr<uint16_t>()[i] = f32_to_bf16(v);
      else t.ptr<float>()[i] = v;
    }
    return t;
  }
  Tensor poisoned(Shape s) {
    Tensor t = Tensor::heap(std::move(s), act);
    std::memset(t.data, 0xff, t.nbytes());  // NaN in f32 and bf16
    return t;
  }
  static Tensor clone(const Tensor& t) {
    Tensor c = Tensor::heap(t.shape, t.dtype);
    std::memcpy(c.data, t.data, t.nbytes());
    return c;
  }
  // Runs `op(context, out)` on the CPU and on the reference backend, each into its own poisoned
  // (or given) output, and holds the two to the bound.
  template <typename Op>
  Agreement run_both(const char* name, const Tensor& out, Op&& op, bool inner_rounding = false) {
    Tensor mine = clone(out), theirs = clone(out);
    op(ctx, mine);
    op(ref, theirs);
    for (float v : to_f32_vector(mine)) {
      EXPECT_TRUE(std::isfinite(v)) << name << ": output left unwritten or NaN";
      if (!std::isfinite(v)) break;
    }
    const Agreement g = agreement(mine, theirs);
    std::printf("[ measure ] %s %s: rel L2 %.2e, %.3f%% differ, worst %.2f ulp\n", name,
                dtype_name(act).data(), g.rel_l2, 100 * g.differing, g.worst_ulps);
    EXPECT_TRUE(within_bound(g, act, inner_rounding)) << name << ": rel L2 " << g.rel_l2 << ", " << g.differing
                                        << " differ, worst " << g.worst_ulps << " ulp";
    return g;
  }
  DType act = DType::f32;
  std::mt19937 rng{test::test_seed()};
  Arena arena;
  Context ctx, ref;
};

TEST_P(Ops, LinearWithBiasAndViews) {
  const int64_t m = 37, k = 70, n = 45;
  const Tensor xt = random({m, k + 9});  // x is a column view of a wider tensor
  const Tensor wt = random({n, k}, 0.1f, DType::bf16), bt = random({n}, 1.0f, DType::bf16);
  // y is a column view too: the 5 columns left of it must stay as they are (zeros).
  Tensor out = poisoned({m, n + 5});
  for (int64_t r = 0; r < m; ++r) std::memset(out.row(r), 0, 5 * dtype_size(act));
  run_both("linear", out, [&](Context& c, Tensor& y) {
    Tensor yv = y.cols(5, 5 + n);
    ops::linear(c, xt.cols(9, 9 + k), wt, &bt, yv);
  });
}

TEST_P(Ops, LayerNormModulate) {
  const int64_t m = 9, d = 96;
  const Tensor xt = random({m, d}, 3.0f), sht = random({1, d}), sct = random({1, d}, 0.5f);
  for (Rounding r : {Rounding::once, Rounding::each_step})
    run_both("layer_norm_modulate", poisoned({m, d}), [&](Context& c, Tensor& y) {
      ops::layer_norm_modulate(c, xt, sht, sct, y, 1e-6f, r);
    });
}

TEST_P(Ops, ModulatePerSampleAndGateSigmoid) {
  const int64_t m = 10, d = 96;  // two samples of five rows, each with its own vectors
  const Tensor xt = random({m, d + 7}, 2.0f), sht = random({2, d}), sct = random({2, d}, 0.5f);
  for (Rounding r : {Rounding::once, Rounding::each_step}) {
    run_both("modulate", poisoned({m, d}), [&](Context& c, Tensor& y) {
      ops::modulate(c, xt.cols(7, 7 + d), sht, sct, y, r);
    });
    run_both("gate_sigmoid", poisoned({2, d}), [&](Context& c, Tensor& y) {
      ops::gate_sigmoid(c, xt.rows(0, 2).cols(3, 3 + d), y, r);
    });
  }
}

TEST_P(Ops, RmsNormPerHead) {
  const int64_t m = 11, g = 16, d = 4 * g;
  const Tensor xt = random({m, d}, 2.0f), wt = random({g}, 1.0f, DType::bf16);
  for (Rounding r : {Rounding::once, Rounding::each_step})
    run_both("rms_norm", poisoned({m, d}), [&](Context& c, Tensor& y) {
      ops::rms_norm(c, xt, wt, y, 1e-6f, g, r);
    });
}

TEST_P(Ops, RopeBothStyles) {
  const int64_t s = 7, hd = 16, half = hd / 2, d = 3 * hd;
  const Tensor xt = random({s, d});
  Tensor cos = Tensor::heap({s, half}, DType::f32), sin = Tensor::heap({s, half}, DType::f32);
  for (int64_t i = 0; i < s * half; ++i) {
    const double a = double(rng() % 1000) / 100.0;
    cos.ptr<float>()[i] = float(std::cos(a));
    sin.ptr<float>()[i] = float(std::sin(a));
  }
  for (auto style : {ops::RopeStyle::interleaved, ops::RopeStyle::half})
    for (Rounding r : {Rounding::once, Rounding::each_step})
      run_both("rope", xt, [&](Context& c, Tensor& x) { ops::rope(c, x, cos, sin, hd, style, r); });
  // Partial RoPE (Stable Audio): a table half as wide turns the first half of each head; the
  // rest must come out as it went in.
  Tensor pcos = Tensor::heap({s, half / 2}, DType::f32), psin = Tensor::heap({s, half / 2}, DType::f32);
  for (int64_t r = 0; r < s; ++r)
    for (int64_t j = 0; j < half / 2; ++j) {
      pcos.ptr<float>()[r * half / 2 + j] = cos.ptr<float>()[r * half + j];
      psin.ptr<float>()[r * half / 2 + j] = sin.ptr<float>()[r * half + j];
    }
  const Tensor before = clone(xt);
  Tensor turned = clone(xt);
  ops::rope(ctx, turned, pcos, psin, hd, ops::RopeStyle::half, Rounding::once);
  for (int64_t r = 0; r < s; ++r)
    for (int64_t h = 0; h < d; h += hd)
      for (int64_t i = half; i < hd; ++i)
        ASSERT_EQ(std::memcmp(static_cast<const char*>(turned.row(r)) + (h + i) * dtype_size(act),
                              static_cast<const char*>(before.row(r)) + (h + i) * dtype_size(act),
                              dtype_size(act)), 0) << "partial rope touched channel " << i;
  EXPECT_NE(to_f32_vector(turned), to_f32_vector(before));
  for (Rounding r : {Rounding::once, Rounding::each_step})
    run_both("rope partial", xt, [&](Context& c, Tensor& x) {
      ops::rope(c, x, pcos, psin, hd, ops::RopeStyle::half, r);
    });
}

TEST_P(Ops, AttentionCausalPaddedGrouped) {
  // 300 rows: two full 128-row query blocks and a partial one.
  const int64_t s = 300, d = 16, hq = 4, hk = 2;
  const Tensor qt = random({s, hq * d}), kt = random({s, hk * d}), vt = random({s, hk * d});
  Tensor valid = Tensor::heap({s}, DType::i64);
  for (int64_t j = 0; j < s; ++j) valid.ptr<int64_t>()[j] = j < 250;
  for (bool causal : {false, true})
    run_both("attention", poisoned({s, hq * d}), [&](Context& c, Tensor& o) {
      ops::attention(c, qt, kt, vt, o, d, 0.25f, {causal, &valid});
    }, /*inner_rounding=*/true);
  // A band |i - j| <= 17 (SAME's decoder), alone and with padding, per sample of a batch of two.
  for (const Tensor* keys : {static_cast<const Tensor*>(nullptr), static_cast<const Tensor*>(&valid)})
    run_both("attention band", poisoned({s, hq * d}), [&](Context& c, Tensor& o) {
      ops::attention(c, qt, kt, vt, o, d, 0.25f, {false, keys, 2, 0.0f, Rounding::once, 17});
    }, /*inner_rounding=*/true);
  // Gemma's scores: capped at 5 (small enough that tanh bends these scores), formed in fp32 or
  // rounded step by step as eager PyTorch does in bf16.
  for (Rounding r : {Rounding::once, Rounding::each_step})
    run_both("attention softcap", poisoned({s, hq * d}), [&](Context& c, Tensor& o) {
      ops::attention(c, qt, kt, vt, o, d, 0.25f, {false, &valid, 1, 5.0f, r});
    }, /*inner_rounding=*/true);
}

TEST_P(Ops, DifferentialAttentionIsTheDifferenceOfTwo) {
  const int64_t s = 150, d = 64, h = 2;  // two samples of 75 rows
  const Tensor qt = random({s, h * d}), kt = random({s, h * d}), q2 = random({s, h * d}),
               k2 = random({s, h * d}), vt = random({s, h * d});
  run_both("differential_attention", poisoned({s, h * d}), [&](Context& c, Tensor& o) {
    ops::differential_attention(c, qt, kt, q2, k2, vt, o, d, 0.125f, {false, nullptr, 2});
  }, /*inner_rounding=*/true);
  // SAME's band |i - j| <= 17, per sample of the two.
  run_both("differential_attention band", poisoned({s, h * d}), [&](Context& c, Tensor& o) {
    ops::differential_attention(c, qt, kt, q2, k2, vt, o, d, 0.125f, {false, nullptr, 2, 0.0f, Rounding::once, 17});
  }, /*inner_rounding=*/true);
  // The same from two attention ops and a subtraction in the activation dtype.
  Tensor a = poisoned({s, h * d}), b = poisoned({s, h * d}), diff = poisoned({s, h * d});
  ops::attention(ctx, qt, kt, vt, a, d, 0.125f, {false, nullptr, 2});
  ops::attention(ctx, q2, k2, vt, b, d, 0.125f, {false, nullptr, 2});
  ops::differential_attention(ctx, qt, kt, q2, k2, vt, diff, d, 0.125f, {false, nullptr, 2});
  const auto av = to_f32_vector(a), bv = to_f32_vector(b), dv = to_f32_vector(diff);
  for (size_t i = 0; i < dv.size(); ++i)
    ASSERT_EQ(dv[i], round_as(act, av[i] - bv[i])) << "element " << i;
}

TEST_P(Ops, SiluMulSiluAndGatedAdd) {
  const int64_t m = 13, f = 40;
  const Tensor at = random({m, f}, 2.0f), bt = random({m, f});
  for (Rounding r : {Rounding::once, Rounding::each_step})
    for (auto act : {ops::Activation::silu, ops::Activation::gelu_tanh})
      run_both(act == ops::Activation::silu ? "glu silu" : "glu gelu_tanh", poisoned({m, f}),
               [&](Context& c, Tensor& y) { ops::glu(c, at, bt, y, act, r); });
  for (Rounding r : {Rounding::once, Rounding::each_step})
    run_both("glu sin_pi", poisoned({m, f}), [&](Context& c, Tensor& y) {
      ops::glu(c, at, bt, y, ops::Activation::sin_pi, r);
    });
  run_both("silu", poisoned({m, f}), [&](Context& c, Tensor& y) { ops::silu(c, at, y); });
  // DyT ends in gamma * tanh + beta, which cancels to near zero where beta meets -gamma tanh: there
  // fp32 against f64 is an inner rounding (one element measured 187 "ulps" of a 5e-9 result), so
  // it is held to the relative L2 bound, over enough elements that one flipped rounding of a
  // large output stays a small share of it. Such outputs gather in the columns whose beta nearly
  // cancels gamma tanh, so the share of differing elements moves by whole columns: a wide row
  // (192 distinct per-head parameters, not 24) keeps one unlucky column near 0.5 % of the output
  // (seed 1153404673 put 1.2 % of a 96-wide per-head case over the 1 % bound).
  const int64_t dm = 16, df = 768;
  const Tensor dx = random({dm, df}, 2.0f), alpha = random({1}, 2.0f, DType::f32), gamma = random({df}),
               beta = random({df}), head_gamma = random({df / 4}), head_beta = random({df / 4});
  for (Rounding r : {Rounding::once, Rounding::each_step}) {
    run_both("dyt", poisoned({dm, df}), [&](Context& c, Tensor& y) {
      ops::dyt(c, dx, alpha, gamma, beta, y, r);
    }, /*inner_rounding=*/true);
    run_both("dyt per head", poisoned({dm, df}), [&](Context& c, Tensor& y) {
      ops::dyt(c, dx, alpha, head_gamma, head_beta, y, r);
    }, /*inner_rounding=*/true);
  }
  const Tensor xt = random({m, f}), yt = random({m, f}), gt = random({1, f});
  for (Rounding r : {Rounding::once, Rounding::each_step}) {
    run_both("add_gated", xt, [&](Context& c, Tensor& x) { ops::add_gated(c, x, yt, &gt, r); });
    run_both("add", xt, [&](Context& c, Tensor& x) { ops::add_gated(c, x, yt, nullptr, r); });
  }
}

TEST_P(Ops, EulerCopyTranspose) {
  const int64_t m = 21, n = 33;
  const Tensor xt = random({m, n}), vt = random({m, n});
  run_both("euler_update", xt, [&](Context& c, Tensor& x) { ops::euler_update(c, x, vt, -0.2871f); });
  const Tensor noise = random({m, n}, 1.0f, DType::f32);
  run_both("pingpong_update", xt, [&](Context& c, Tensor& x) {
    ops::pingpong_update(c, x, vt, noise, 0.8909032f, 0.7455466f);
  });
  // blend with a weight per row (quarters as an inpainting mask gives, and any value in [0, 1] as
  // a scheduler's sigma), with one weight for every row, and in place over either operand.
  const int64_t bm = 24, bn = 40;
  const Tensor ba = random({bm, bn}), bb = random({bm, bn});
  Tensor row_w = Tensor::heap({bm}, DType::f32), one_w = Tensor::heap({1}, DType::f32);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t r = 0; r < bm; ++r) row_w.ptr<float>()[r] = r % 2 ? float(r % 5) / 4 : unit(rng);
  one_w.ptr<float>()[0] = 0.8751057f;
  run_both("blend", poisoned({bm, bn}), [&](Context& c, Tensor& y) { ops::blend(c, ba, bb, row_w, y); });
  run_both("blend (one weight)", poisoned({bm, bn}), [&](Context& c, Tensor& y) { ops::blend(c, ba, bb, one_w, y); });
  run_both("blend (into a)", ba, [&](Context& c, Tensor& y) { ops::blend(c, y, bb, row_w, y); });
  run_both("blend (into b)", bb, [&](Context& c, Tensor& y) { ops::blend(c, ba, y, one_w, y); });
  // Guidance over a batch of three samples of 64 frames, 14 of them padding; APG off, full, half.
  // The projection's fp32 reductions flip an inner bf16 rounding now and then, which the scale
  // carries to the output as a 2-ulp difference: over 6144 outputs one such flip stays inside the
  // relative L2 bound (over 336 it did not: seed 2337988239).
  const Tensor gx = random({192, 32}, 1.0f, DType::f32), gc = random({192, 32}), gu = random({192, 32});
  for (const float apg : {0.0f, 1.0f, 0.5f})
    run_both("guided_velocity", poisoned({192, 32}), [&](Context& c, Tensor& y) {
      ops::guided_velocity(c, gx, gc, gu, y, 0.7455466f, 7.0f, apg, 3, 50);
    }, /*inner_rounding=*/true);
  run_both("copy", poisoned({m, n}), [&](Context& c, Tensor& y) { ops::copy(c, xt, y); });
  run_both("transpose", poisoned({n, m}), [&](Context& c, Tensor& y) { ops::transpose(c, xt, y); });
  // copy converts: f32 values into the activation dtype and back.
  const Tensor wide = random({m, n}, 1.0f, DType::f32);
  run_both("copy (convert)", poisoned({m, n}), [&](Context& c, Tensor& y) { ops::copy(c, wide, y); });
}

TEST_P(Ops, Conv2dGroupNormUpsample) {
  const int64_t ci = 8, co = 6, h = 9, wd = 7;
  const Tensor xt = random({1, ci, h, wd});
  const Tensor wt = random({co, ci, 3, 3}, 0.2f, DType::bf16), bt = random({co}, 1.0f, DType::bf16);
  for (int64_t stride : {1, 2}) {
    const int64_t ho = (h + 2 - 3) / stride + 1, wo = (wd + 2 - 3) / stride + 1;
    run_both("conv2d", poisoned({1, co, ho, wo}), [&](Context& c, Tensor& y) {
      ops::conv2d(c, xt, wt, &bt, y, stride, 1, 1);
    });
  }
  // The encoder's downsampling: stride 2, no padding before, one row and column after. An even
  // input as in the VAE, and an odd one whose last row and column the padding is needed for; large
  // enough (384 outputs) that one bf16 rounding flip stays inside the bound's 1 %.
  for (const int64_t side : {16, 17}) {
    const Tensor sq = random({1, ci, side, side});
    const int64_t o = (side + 1 - 3) / 2 + 1;
    run_both("conv2d pad (0, 1) stride 2", poisoned({1, co, o, o}), [&](Context& c, Tensor& y) {
      ops::conv2d(c, sq, wt, &bt, y, 2, 0, 1);
    });
  }
  const Tensor w1 = random({co, ci, 1, 1}, 0.3f, DType::bf16);
  run_both("conv2d 1x1", poisoned({1, co, h, wd}), [&](Context& c, Tensor& y) {
    ops::conv2d(c, xt, w1, nullptr, y, 1, 0, 0);
  });
  const Tensor gw = random({ci}, 1.0f, DType::bf16), gb = random({ci}, 1.0f, DType::bf16);
  const Tensor big = random({1, ci, h, wd}, 3.0f);
  for (bool fuse : {false, true})
    for (Rounding r : {Rounding::once, Rounding::each_step})
      run_both("group_norm", poisoned({1, ci, h, wd}), [&](Context& c, Tensor& y) {
        ops::group_norm(c, big, gw, gb, y, 4, 1e-6f, fuse, r);
      });
  run_both("upsample_nearest2x", poisoned({1, ci, 2 * h, 2 * wd}), [&](Context& c, Tensor& y) {
    ops::upsample_nearest2x(c, xt, y);
  });
}

TEST_P(Ops, TablesEmbeddingAffinePermute) {
  // RoPE tables: Qwen's one axis in f32, FLUX's four axes in f64, from 2-D positions.
  const int64_t s = 37;
  Tensor pos1 = Tensor::heap({s, 1}, DType::i64), pos4 = Tensor::heap({s, 4}, DType::i64);
  for (int64_t i = 0; i < s; ++i) pos1.ptr<int64_t>()[i] = i * 13;
  for (int64_t i = 0; i < 4 * s; ++i) pos4.ptr<int64_t>()[i] = int64_t(rng() % 4096);
  auto tables = [&](const char* name, const Tensor& pos, std::vector<int64_t> axes, double theta,
                    ops::RopeMath math) {
    int64_t d = 0;
    for (int64_t a : axes) d += a;
    Tensor cos = Tensor::heap({s, d / 2}, DType::f32), sin = Tensor::heap({s, d / 2}, DType::f32);
    Tensor cr = clone(cos), sr = clone(sin);
    std::memset(cos.data, 0xff, cos.nbytes());
    std::memset(sin.data, 0xff, sin.nbytes());
    ops::rope_tables(ctx, pos, axes, theta, math, cos, sin);
    ops::rope_tables(ref, pos, axes, theta, math, cr, sr);
    // Transcendentals of the same float angle: libm's float and double results agree to an ulp.
    EXPECT_LT(test::rel_l2(to_f32_vector(cos), to_f32_vector(cr)), 2e-7) << name;
    EXPECT_LT(test::rel_l2(to_f32_vector(sin), to_f32_vector(sr)), 2e-7) << name;
  };
  tables("qwen", pos1, {128}, 1e6, ops::RopeMath::f32);
  tables("flux", pos4, {32, 32, 32, 32}, 2000, ops::RopeMath::f64);

  run_both("timestep_embedding", poisoned({1, 256}), [&](Context& c, Tensor& y) {
    ops::timestep_embedding(c, 738.5f, y);
  });
  Tensor freqs = Tensor::heap({64}, DType::f32);
  for (int64_t i = 0; i < 64; ++i)
    freqs.ptr<float>()[i] = float(std::exp(std::log(0.5) + double(i) / 63 * (std::log(1e4) - std::log(0.5))));
  for (const float t : {0.0f, 0.078125f, 0.6937f, 1.0f})
    run_both("fourier_features", poisoned({1, 128}), [&](Context& c, Tensor& y) {
      ops::fourier_features(c, t, freqs, y);
    });

  const Tensor table = random({50, 24}, 1.0f, DType::bf16);
  Tensor ids = Tensor::heap({9}, DType::i32);
  for (int64_t i = 0; i < 9; ++i) ids.ptr<int32_t>()[i] = int32_t(rng() % 50);
  run_both("embedding", poisoned({9, 24}), [&](Context& c, Tensor& y) { ops::embedding(c, table, ids, y); });
  ids.ptr<int32_t>()[4] = 50;
  Tensor y = poisoned({9, 24});
  test::expect_error([&] { ops::embedding(ctx, table, ids, y); }, {"token id 50", "50 rows"});

  const Tensor x = random({12, 16}, 2.0f), scale = random({16}), shift = random({16});
  for (Rounding r : {Rounding::once, Rounding::each_step})
    run_both("affine", poisoned({12, 16}), [&](Context& c, Tensor& out) {
      ops::affine(c, x, scale, shift, out, r);
    });

  const Tensor g = random({3, 4, 5, 2, 2});
  run_both("permute", poisoned({5, 3, 2, 4, 2}), [&](Context& c, Tensor& out) {
    ops::permute(c, g, out, {2, 0, 3, 1, 4});
  });
  // The permutation is the one it claims: spot-check elements against the index map.
  Tensor out = poisoned({5, 3, 2, 4, 2});
  ops::permute(ctx, g, out, {2, 0, 3, 1, 4});
  for (int k = 0; k < 50; ++k) {
    const int64_t a = rng() % 3, b = rng() % 4, cc = rng() % 5, d = rng() % 2, e = rng() % 2;
    EXPECT_EQ(load_f32(out, (((cc * 3 + a) * 2 + d) * 4 + b) * 2 + e),
              load_f32(g, (((a * 4 + b) * 5 + cc) * 2 + d) * 2 + e));
  }
}

TEST_P(Ops, ImageToRgb8) {
  const Tensor image = random({1, 3, 5, 7}, 0.8f);
  Tensor mine = Tensor::heap({5, 7, 3}, DType::u8), theirs = Tensor::heap({5, 7, 3}, DType::u8);
  std::memset(mine.data, 0xab, mine.nbytes());
  ops::image_to_rgb8(ctx, image, mine);
  ops::image_to_rgb8(ref, image, theirs);
  EXPECT_EQ(std::memcmp(mine.data, theirs.data, mine.nbytes()), 0);
  Tensor bad = clone(image);
  if (act == DType::bf16) bad.ptr<uint16_t>()[17] = f32_to_bf16(NAN);
  else bad.ptr<float>()[17] = NAN;
  test::expect_error([&] { ops::image_to_rgb8(ctx, bad, mine); }, {"image_to_rgb8", "finite"});
}

// A batch lies sample after sample along the rows (or N): the ops that see samples (attention,
// per-sample modulation and gates, RoPE tables shared by the samples, NCHW ops) give each sample
// of a B = 2 call exactly what a B = 1 call on that sample gives, and agree with the reference.
TEST_P(Ops, BatchOfTwoEqualsTwoSingleSamples) {
  auto rows = [](const Tensor& t, int64_t b, int64_t n) {
    return to_f32_vector(clone(t.rows(b * n, (b + 1) * n)));
  };
  // Attention with a different key mask per sample, causal and not.
  const int64_t s = 70, d = 16, hq = 4, hk = 2;
  const Tensor q = random({2 * s, hq * d}), k = random({2 * s, hk * d}), v = random({2 * s, hk * d});
  Tensor valid = Tensor::heap({2 * s}, DType::i64);
  for (int64_t j = 0; j < 2 * s; ++j) valid.ptr<int64_t>()[j] = j < s ? j < 50 : j < s + 61;  // 50 and 61 real keys
  for (bool causal : {false, true}) {
    const ops::AttentionOptions both{causal, &valid, 2};
    run_both("attention batch 2", poisoned({2 * s, hq * d}), [&](Context& c, Tensor& o) {
      ops::attention(c, q, k, v, o, d, 0.25f, both);
    }, /*inner_rounding=*/true);
    Tensor o2 = poisoned({2 * s, hq * d});
    ops::attention(ctx, q, k, v, o2, d, 0.25f, both);
    for (int64_t b = 0; b < 2; ++b) {
      Tensor o1 = poisoned({s, hq * d});
      const Tensor sample_valid = valid.rows(b * s, (b + 1) * s);
      ops::attention(ctx, q.rows(b * s, (b + 1) * s), k.rows(b * s, (b + 1) * s),
                     v.rows(b * s, (b + 1) * s), o1, d, 0.25f, {causal, &sample_valid, 1});
      EXPECT_EQ(rows(o2, b, s), to_f32_vector(o1)) << "attention sample " << b;
    }
  }
  // Per-sample modulation and gates ([2, D] as a column view of a wider tensor), RoPE shared.
  const int64_t n = 9, dm = 32;
  const Tensor x = random({2 * n, dm}, 2.0f), mod = random({2, 3 * dm}, 0.5f), y = random({2 * n, dm});
  const Tensor shift = mod.cols(0, dm), scale = mod.cols(dm, 2 * dm), gate = mod.cols(2 * dm, 3 * dm);
  run_both("layer_norm_modulate batch 2", poisoned({2 * n, dm}), [&](Context& c, Tensor& out) {
    ops::layer_norm_modulate(c, x, shift, scale, out, 1e-6f, Rounding::each_step);
  });
  run_both("add_gated batch 2", x, [&](Context& c, Tensor& out) {
    ops::add_gated(c, out, y, &gate, Rounding::each_step);
  });
  Tensor cos = Tensor::heap({n, dm / 4}, DType::f32), sin = Tensor::heap({n, dm / 4}, DType::f32);
  for (int64_t i = 0; i < cos.numel(); ++i) {
    cos.ptr<float>()[i] = float(std::cos(0.1 * double(i)));
    sin.ptr<float>()[i] = float(std::sin(0.1 * double(i)));
  }
  run_both("rope batch 2", x, [&](Context& c, Tensor& out) {
    ops::rope(c, out, cos, sin, dm / 2, ops::RopeStyle::half, Rounding::each_step);
  });
  Tensor ln2 = poisoned({2 * n, dm}), xg = clone(x), xr = clone(x);
  ops::layer_norm_modulate(ctx, x, shift, scale, ln2, 1e-6f, Rounding::each_step);
  ops::add_gated(ctx, xg, y, &gate, Rounding::each_step);
  ops::rope(ctx, xr, cos, sin, dm / 2, ops::RopeStyle::half, Rounding::each_step);
  for (int64_t b = 0; b < 2; ++b) {
    Tensor ln1 = poisoned({n, dm});
    ops::layer_norm_modulate(ctx, x.rows(b * n, (b + 1) * n), shift.rows(b, b + 1),
                             scale.rows(b, b + 1), ln1, 1e-6f, Rounding::each_step);
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
  const Tensor img = random({2, 8, 6, 5}, 2.0f), w = random({4, 8, 3, 3}, 0.2f, DType::bf16);
  const Tensor gw = random({8}, 1.0f, DType::bf16), gb = random({8}, 1.0f, DType::bf16);
  run_both("conv2d N=2", poisoned({2, 4, 6, 5}), [&](Context& c, Tensor& out) {
    ops::conv2d(c, img, w, nullptr, out, 1, 1, 1);
  });
  run_both("group_norm N=2", poisoned({2, 8, 6, 5}), [&](Context& c, Tensor& out) {
    ops::group_norm(c, img, gw, gb, out, 4, 1e-6f, true, Rounding::each_step);
  });
  run_both("upsample N=2", poisoned({2, 8, 12, 10}), [&](Context& c, Tensor& out) {
    ops::upsample_nearest2x(c, img, out);
  });
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
      {"layer_norm_modulate", [&](Context& c, Tensor& o, Rounding r) {
         ops::layer_norm_modulate(c, x, g, g, o, 1e-6f, r); }, poisoned({m, d})},
      {"rms_norm", [&](Context& c, Tensor& o, Rounding r) {
         ops::rms_norm(c, x, g.reshape({d}), o, 1e-6f, d, r); }, poisoned({m, d})},
      {"rope", [&](Context& c, Tensor& o, Rounding r) {
         ops::rope(c, o, cos, sin, d / 2, ops::RopeStyle::half, r); }, x},
      {"glu", [&](Context& c, Tensor& o, Rounding r) {
         ops::glu(c, x, y, o, ops::Activation::gelu_tanh, r); }, poisoned({m, d})},
      {"add_gated", [&](Context& c, Tensor& o, Rounding r) { ops::add_gated(c, o, y, &g, r); }, x},
      {"group_norm", [&](Context& c, Tensor& o, Rounding r) {
         ops::group_norm(c, img, gw, gb, o, 4, 1e-6f, true, r); }, poisoned({1, 8, 6, 5})},
      {"modulate", [&](Context& c, Tensor& o, Rounding r) {
         ops::modulate(c, x, g, g, o, r); }, poisoned({m, d})},
      {"dyt", [&](Context& c, Tensor& o, Rounding r) {
         ops::dyt(c, x, alpha, g.reshape({d}), g.reshape({d}), o, r); }, poisoned({m, d})},
      {"glu sin_pi", [&](Context& c, Tensor& o, Rounding r) {
         ops::glu(c, x, y, o, ops::Activation::sin_pi, r); }, poisoned({m, d})},
      {"gate_sigmoid", [&](Context& c, Tensor& o, Rounding r) {
         ops::gate_sigmoid(c, x, o, r); }, poisoned({m, d})},
      {"affine", [&](Context& c, Tensor& o, Rounding r) {
         ops::affine(c, x, g, g, o, r); }, poisoned({m, d})},
      {"attention scores", [&](Context& c, Tensor& o, Rounding r) {
         ops::attention(c, x, y, y, o, d / 4, 0.5f, {false, nullptr, 1, 5.0f, r}); },
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
    Tensor u = Tensor::heap(t.shape, t.dtype);
    std::memcpy(u.data, t.data, t.nbytes());
    const int64_t at = pick(rng);
    if (u.dtype == DType::bf16) u.ptr<uint16_t>()[at] = f32_to_bf16(bad);
    else u.ptr<float>()[at] = bad;
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
  cpu::f16_to_f32_row(all.data(), out.data(), int64_t(all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = f16_to_f32(uint16_t(i));
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(out[i])) << i;
    else EXPECT_EQ(std::memcmp(&out[i], &want, 4), 0) << std::hex << i << " " << out[i] << " " << want;
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, Ops,
                         ::testing::Values(std::make_tuple(DType::f32, true),
                                           std::make_tuple(DType::bf16, true),
                                           std::make_tuple(DType::bf16, false)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "" : "_widened");
                         });

}  // namespace
}  // namespace apus
