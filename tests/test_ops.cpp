// Every CPU op against a plain double-precision reference, in both activation dtypes, on
// fresh random inputs with poisoned outputs (in the spirit of ggml's test-backend-ops).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/vec.h"
#include "ops/ops.h"
#include "test_util.h"

namespace apus {
namespace {

// Per-op bound on relative L2 error. fp32: accumulation-order noise only. bf16: the output is
// rounded once (2^-9 relative) plus the reference's own intermediate roundings, a few ulps.
double bound(DType dt) { return dt == DType::f32 ? 2e-6 : 8.0 / 256.0; }

// (activation dtype, native bf16 kernels): the second runs the f32 path AVX2-only CPUs take.
class Ops : public ::testing::TestWithParam<std::tuple<DType, bool>> {
 protected:
  void SetUp() override {
    ctx = Context{&arena, std::get<0>(GetParam())};
    cpu::allow_native_bf16 = std::get<1>(GetParam());
  }
  void TearDown() override { cpu::allow_native_bf16 = true; }
  // Fresh random values, stored in `dt`; returns the tensor and the values it really holds.
  Tensor random(Shape s, std::vector<double>* held, float scale = 1.0f, DType dt = DType(255)) {
    if (dt == DType(255)) dt = ctx.act;
    Tensor t = Tensor::heap(std::move(s), dt);
    std::normal_distribution<float> dist(0.0f, scale);
    held->resize(size_t(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = dist(rng);
      if (dt == DType::bf16) t.ptr<uint16_t>()[i] = f32_to_bf16(v);
      else t.ptr<float>()[i] = v;
      (*held)[size_t(i)] = load_f32(t, i);
    }
    return t;
  }
  Tensor poisoned(Shape s) {
    Tensor t = Tensor::heap(std::move(s), ctx.act);
    std::memset(t.data, 0xff, t.nbytes());  // NaN in f32 and bf16
    return t;
  }
  void check(const Tensor& out, const std::vector<double>& want, const char* op) {
    const auto got = to_f32_vector(out);
    std::vector<float> w(want.begin(), want.end());
    for (float g : got) ASSERT_TRUE(std::isfinite(g)) << op << ": output left unwritten or NaN";
    const double err = test::rel_l2(got, w);
    EXPECT_LT(err, bound(ctx.act)) << op << " rel L2 " << err;
  }
  std::mt19937 rng{test::test_seed()};
  Arena arena;
  Context ctx;
};

TEST_P(Ops, LinearWithBiasAndViews) {
  std::vector<double> x, w, b;
  const int64_t m = 37, k = 70, n = 45;
  Tensor xt = random({m, k + 9}, &x);  // x is a column view of a wider tensor
  Tensor wt = random({n, k}, &w, 0.1f, DType::bf16);
  Tensor bt = random({n}, &b, 1.0f, DType::bf16);
  Tensor yt = poisoned({m, n + 5});
  Tensor xv = xt.cols(9, 9 + k), yv = yt.cols(5, 5 + n);
  ops::linear(ctx, xv, wt, &bt, yv);
  std::vector<double> want(size_t(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = b[size_t(j)];
      for (int64_t q = 0; q < k; ++q) s += x[size_t(i * (k + 9) + 9 + q)] * w[size_t(j * k + q)];
      want[size_t(i * n + j)] = s;
    }
  Tensor packed = Tensor::heap({m, n}, ctx.act);
  ops::copy(ctx, yv, packed);
  check(packed, want, "linear");
}

TEST_P(Ops, LayerNormModulate) {
  std::vector<double> x, sh, sc;
  const int64_t m = 9, d = 96;
  Tensor xt = random({m, d}, &x, 3.0f), sht = random({1, d}, &sh), sct = random({1, d}, &sc, 0.5f);
  Tensor yt = poisoned({m, d});
  ops::layer_norm_modulate(ctx, xt, sht, sct, yt, 1e-6f);
  std::vector<double> want(x.size());
  for (int64_t i = 0; i < m; ++i) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < d; ++j) mean += x[size_t(i * d + j)] / d;
    for (int64_t j = 0; j < d; ++j) var += std::pow(x[size_t(i * d + j)] - mean, 2) / d;
    for (int64_t j = 0; j < d; ++j)
      want[size_t(i * d + j)] = (x[size_t(i * d + j)] - mean) / std::sqrt(var + 1e-6) * (1 + sc[j]) + sh[j];
  }
  check(yt, want, "layer_norm_modulate");
}

TEST_P(Ops, RmsNormPerHeadBothRoundingModes) {
  for (bool round_first : {false, true}) {
    std::vector<double> x, w;
    const int64_t m = 11, g = 16, d = 4 * g;
    Tensor xt = random({m, d}, &x, 2.0f), wt = random({g}, &w, 1.0f, DType::bf16);
    Tensor yt = poisoned({m, d});
    ops::rms_norm(ctx, xt, wt, yt, 1e-6f, g, round_first);
    std::vector<double> want(x.size());
    for (int64_t i = 0; i < m * d; i += g) {
      double ss = 0;
      for (int64_t j = 0; j < g; ++j) ss += x[size_t(i + j)] * x[size_t(i + j)] / g;
      for (int64_t j = 0; j < g; ++j) want[size_t(i + j)] = x[size_t(i + j)] / std::sqrt(ss + 1e-6) * w[j];
    }
    check(yt, want, "rms_norm");
  }
}

TEST_P(Ops, RopeBothStyles) {
  for (auto style : {ops::RopeStyle::interleaved, ops::RopeStyle::half}) {
    std::vector<double> x, dummy;
    const int64_t s = 7, hd = 16, half = hd / 2, d = 3 * hd;
    Tensor xt = random({s, d}, &x);
    Tensor cos = Tensor::heap({s, half}, DType::f32), sin = Tensor::heap({s, half}, DType::f32);
    for (int64_t i = 0; i < s * half; ++i) {
      const double a = double(rng() % 1000) / 100.0;
      cos.ptr<float>()[i] = float(std::cos(a));
      sin.ptr<float>()[i] = float(std::sin(a));
    }
    std::vector<double> want(x.size());
    for (int64_t r = 0; r < s; ++r)
      for (int64_t h = 0; h < d; h += hd)
        for (int64_t j = 0; j < half; ++j) {
          const int64_t i0 = style == ops::RopeStyle::interleaved ? 2 * j : j;
          const int64_t i1 = style == ops::RopeStyle::interleaved ? 2 * j + 1 : j + half;
          const double c = cos.ptr<float>()[r * half + j], sn = sin.ptr<float>()[r * half + j];
          const double x0 = x[size_t(r * d + h + i0)], x1 = x[size_t(r * d + h + i1)];
          want[size_t(r * d + h + i0)] = x0 * c - x1 * sn;
          want[size_t(r * d + h + i1)] = x1 * c + x0 * sn;
        }
    ops::rope(ctx, xt, cos, sin, hd, style);
    check(xt, want, "rope");
  }
}

TEST_P(Ops, AttentionCausalPaddedGrouped) {
  std::vector<double> q, k, v;
  const int64_t s = 300, d = 16, hq = 4, hk = 2;  // 300 rows: two full 128-row query blocks and a partial one
  Tensor qt = random({s, hq * d}, &q), kt = random({s, hk * d}, &k), vt = random({s, hk * d}, &v);
  std::vector<int64_t> valid(size_t(s), 1);
  for (int64_t j = 250; j < s; ++j) valid[size_t(j)] = 0;
  Tensor ot = poisoned({s, hq * d});
  const float scale = 0.25f;
  ops::attention(ctx, qt, kt, vt, ot, d, scale, {true, valid.data()});
  std::vector<double> want(size_t(s * hq * d));
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t g = h / (hq / hk);
    for (int64_t i = 0; i < s; ++i) {
      std::vector<double> p(size_t(s), 0.0);
      double mx = -1e300, sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        if (!valid[size_t(j)]) continue;
        double dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += q[size_t(i * hq * d + h * d + e)] * k[size_t(j * hk * d + g * d + e)];
        p[size_t(j)] = dot * scale;
        mx = std::max(mx, p[size_t(j)]);
      }
      for (int64_t j = 0; j <= i; ++j)
        if (valid[size_t(j)]) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - mx));
      for (int64_t e = 0; e < d; ++e) {
        double o = 0;
        for (int64_t j = 0; j <= i; ++j)
          if (valid[size_t(j)]) o += p[size_t(j)] / sum * v[size_t(j * hk * d + g * d + e)];
        want[size_t(i * hq * d + h * d + e)] = o;
      }
    }
  }
  check(ot, want, "attention");
}

TEST_P(Ops, SiluMulAndGatedAdd) {
  std::vector<double> a, b, x, y, g;
  const int64_t m = 13, f = 40;
  Tensor at = random({m, f}, &a, 2.0f), bt = random({m, f}, &b);
  Tensor out = poisoned({m, f});
  ops::silu_mul(ctx, at, bt, out);
  std::vector<double> want(a.size());
  for (size_t i = 0; i < a.size(); ++i) want[i] = a[i] / (1 + std::exp(-a[i])) * b[i];
  check(out, want, "silu_mul");

  Tensor xt = random({m, f}, &x), yt = random({m, f}, &y), gt = random({1, f}, &g);
  ops::add_gated(ctx, xt, yt, &gt);
  for (size_t i = 0; i < x.size(); ++i) want[i] = x[i] + g[i % size_t(f)] * y[i];
  check(xt, want, "add_gated");
}

TEST_P(Ops, Conv2dGroupNormUpsample) {
  std::vector<double> x, w, b, gw, gb;
  const int64_t ci = 8, co = 6, h = 9, wd = 7;
  Tensor xt = random({1, ci, h, wd}, &x);
  Tensor wt = random({co, ci, 3, 3}, &w, 0.2f, DType::bf16), bt = random({co}, &b, 1.0f, DType::bf16);
  for (int64_t stride : {1, 2}) {
    const int64_t ho = (h + 2 - 3) / stride + 1, wo = (wd + 2 - 3) / stride + 1;
    Tensor yt = poisoned({1, co, ho, wo});
    ops::conv2d(ctx, xt, wt, &bt, yt, stride, 1);
    std::vector<double> want(size_t(co * ho * wo));
    for (int64_t o = 0; o < co; ++o)
      for (int64_t r = 0; r < ho; ++r)
        for (int64_t c = 0; c < wo; ++c) {
          double s = b[size_t(o)];
          for (int64_t i = 0; i < ci; ++i)
            for (int64_t kr = 0; kr < 3; ++kr)
              for (int64_t kc = 0; kc < 3; ++kc) {
                const int64_t rr = r * stride + kr - 1, cc = c * stride + kc - 1;
                if (rr < 0 || rr >= h || cc < 0 || cc >= wd) continue;
                s += x[size_t((i * h + rr) * wd + cc)] * w[size_t(((o * ci + i) * 3 + kr) * 3 + kc)];
              }
          want[size_t((o * ho + r) * wo + c)] = s;
        }
    check(yt, want, "conv2d");
  }

  const int64_t groups = 4, per = ci / groups;
  Tensor gwt = random({ci}, &gw, 1.0f, DType::bf16), gbt = random({ci}, &gb, 1.0f, DType::bf16);
  Tensor gn = poisoned({1, ci, h, wd});
  ops::group_norm(ctx, xt, gwt, gbt, gn, groups, 1e-6f, true);
  std::vector<double> want(x.size());
  for (int64_t g = 0; g < groups; ++g) {
    const size_t begin = size_t(g * per * h * wd), n = size_t(per * h * wd);
    double mean = 0, var = 0;
    for (size_t i = 0; i < n; ++i) mean += x[begin + i] / double(n);
    for (size_t i = 0; i < n; ++i) var += std::pow(x[begin + i] - mean, 2) / double(n);
    for (size_t i = 0; i < n; ++i) {
      const size_t ch = size_t(g * per) + i / size_t(h * wd);
      const double y = (x[begin + i] - mean) / std::sqrt(var + 1e-6) * gw[ch] + gb[ch];
      want[begin + i] = y / (1 + std::exp(-y));
    }
  }
  check(gn, want, "group_norm+silu");

  Tensor up = poisoned({1, ci, 2 * h, 2 * wd});
  ops::upsample_nearest2x(ctx, xt, up);
  std::vector<double> upw(size_t(up.numel()));
  for (int64_t c = 0; c < ci; ++c)
    for (int64_t r = 0; r < 2 * h; ++r)
      for (int64_t q = 0; q < 2 * wd; ++q)
        upw[size_t((c * 2 * h + r) * 2 * wd + q)] = x[size_t((c * h + r / 2) * wd + q / 2)];
  check(up, upw, "upsample_nearest2x");
}

// The blocked-layout conv keeps re-laid weights per weight buffer. Weights freed and replaced by
// others at the very same address (a model unloaded, the next one mapped there) must not meet
// the stale copy.
TEST_P(Ops, ConvReLaidWeightsDieWithTheirOwner) {
  const int64_t ci = 16, co = 16;
  std::vector<double> x, w1, w2;
  Tensor xt = random({1, ci, 8, 8}, &x);
  const Tensor a = random({co, ci, 3, 3}, &w1, 0.2f, DType::bf16);
  const Tensor b = random({co, ci, 3, 3}, &w2, 0.2f, DType::bf16);
  std::shared_ptr<void> buffer(std::aligned_alloc(64, a.nbytes() + 64), std::free);
  auto weight_at_buffer = [&](const Tensor& values) {
    std::memcpy(buffer.get(), values.data, values.nbytes());
    Tensor t = values;
    t.data = buffer.get();
    t.owner = std::make_shared<int>(0);  // a fresh owner: a new mapping of the same address
    return t;
  };
  auto conv = [&](const Tensor& w, cpu::ConvLayout layout) {
    cpu::conv_layout = layout;
    Tensor y = poisoned({1, co, 8, 8});
    ops::conv2d(ctx, xt, w, nullptr, y, 1, 1);
    cpu::conv_layout = cpu::ConvLayout::blocked;
    return to_f32_vector(y);
  };
  {
    const Tensor first = weight_at_buffer(a);
    conv(first, cpu::ConvLayout::blocked);
  }
  const Tensor second = weight_at_buffer(b);
  const auto want = conv(second, cpu::ConvLayout::plain);
  const double err = test::rel_l2(conv(second, cpu::ConvLayout::blocked), want);
  EXPECT_LT(err, bound(ctx.act)) << "blocked conv used weights of a released buffer";
}

TEST_P(Ops, AllFiniteFindsEveryNonFiniteValue) {
  std::vector<double> x;
  Tensor t = random({29, 70}, &x);
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
  std::vector<double> x;
  const int64_t m = 9, k = 48, n = 20;
  Tensor xt = random({m, k}, &x);
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
  ops::rms_norm(ctx, xt, g16, r16, 1e-6f, k, false);
  ops::rms_norm(ctx, xt, to_dtype(g16, DType::f32), r32, 1e-6f, k, false);
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
