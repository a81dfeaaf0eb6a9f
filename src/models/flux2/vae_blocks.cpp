#include "models/flux2/vae_blocks.h"

#include <cmath>

namespace apus::flux2::vae {

Norm load_norm(const WeightLoader& w, const std::string& prefix, int64_t channels) {
  return Norm{w.get(prefix + ".weight", {channels}), w.get(prefix + ".bias", {channels})};
}

void load_conv(const WeightLoader& w, const std::string& prefix, int64_t out, int64_t in, int64_t k, Tensor& weight,
               Tensor& bias) {
  weight = w.get(prefix + ".weight", {out, in, k, k});
  bias = w.get(prefix + ".bias", {out});
}

BatchNormStats batch_norm_stats(const WeightLoader& w, int64_t channels, double eps, DType dt) {
  const Tensor mean = w.host("bn.running_mean", {channels});
  const Tensor var = w.host("bn.running_var", {channels});
  BatchNormStats s;
  if (!mean.data) {
    s.mean = s.std = Tensor::shape_only({channels}, DType::f32);
    return s;
  }
  s.mean = Tensor::heap({channels}, DType::f32);
  s.std = Tensor::heap({channels}, DType::f32);
  const float e = round_as(dt, float(eps));
  for (int64_t f = 0; f < channels; ++f) {
    s.mean.ptr<float>()[f] = round_as(dt, load_f32(mean, f));
    s.std.ptr<float>()[f] = round_as(dt, std::sqrt(round_as(dt, load_f32(var, f) + e)));
  }
  return s;
}

Resnet load_resnet(const WeightLoader& w, const std::string& prefix, int64_t in, int64_t out) {
  Resnet r;
  r.norm1 = load_norm(w, prefix + ".norm1", in);
  load_conv(w, prefix + ".conv1", out, in, 3, r.conv1_w, r.conv1_b);
  r.norm2 = load_norm(w, prefix + ".norm2", out);
  load_conv(w, prefix + ".conv2", out, out, 3, r.conv2_w, r.conv2_b);
  if (in != out) load_conv(w, prefix + ".conv_shortcut", out, in, 1, r.shortcut_w, r.shortcut_b);
  return r;
}

Attention load_attention(const WeightLoader& w, const std::string& prefix, int64_t channels) {
  Attention a;
  a.norm = load_norm(w, prefix + "group_norm", channels);
  struct Linear {
    const char* name;
    Tensor* weight;
    Tensor* bias;
  };
  for (const Linear& l : {Linear{"to_q", &a.q_w, &a.q_b}, Linear{"to_k", &a.k_w, &a.k_b},
                          Linear{"to_v", &a.v_w, &a.v_b}, Linear{"to_out.0", &a.out_w, &a.out_b}}) {
    *l.weight = w.get(prefix + l.name + ".weight", {channels, channels});
    *l.bias = w.get(prefix + l.name + ".bias", {channels});
  }
  return a;
}

void conv(Context& c, FeatureSplit* split, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
          int64_t stride, int64_t pad, int64_t pad_end) {
  const int64_t samples = y.shape[0], out = y.shape[1], h = y.shape[2], wd = y.shape[3];
  split_features(c, split, y, samples, out, h * wd, "the VAE's convolution outputs",
                 [&](int64_t first, int64_t count, Tensor& part) {
                   Tensor planes = part.reshape({samples, count, h, wd});
                   if (count == out) return ops::conv2d(c, x, w, bias, planes, stride, pad, pad_end);
                   const Tensor b = bias ? bias->rows(first, first + count) : Tensor{};
                   ops::conv2d(c, x, w.rows(first, first + count), bias ? &b : nullptr, planes, stride, pad, pad_end);
                 });
}

void resnet(Context& c, const Resnet& r, int64_t groups, const Tensor& x, Tensor& y, FeatureSplit* split) {
  ArenaScope scope(*c.arena);
  const int64_t hw = x.shape[2] * x.shape[3], out = y.shape[1];
  Tensor n1 = Tensor::in(*c.arena, x.shape, c.act);
  ops::group_norm(c, x, r.norm1.weight, r.norm1.bias, n1, groups, kNormEps, true, ops::Rounding::each_step);
  Tensor h1 = Tensor::in(*c.arena, y.shape, c.act);
  conv(c, split, n1, r.conv1_w, &r.conv1_b, h1, 1, 1, 1);
  Tensor n2 = Tensor::in(*c.arena, y.shape, c.act);
  ops::group_norm(c, h1, r.norm2.weight, r.norm2.bias, n2, groups, kNormEps, true, ops::Rounding::each_step);
  conv(c, split, n2, r.conv2_w, &r.conv2_b, y, 1, 1, 1);
  const int64_t planes = y.shape[0] * out;  // every sample's channels
  Tensor sum = y.reshape({planes, hw});
  if (r.shortcut_w.defined()) {
    Tensor s = Tensor::in(*c.arena, y.shape, c.act);
    conv(c, split, x, r.shortcut_w, &r.shortcut_b, s, 1, 0, 0);
    ops::add_gated(c, sum, s.reshape({planes, hw}), nullptr, ops::Rounding::each_step);
  } else {
    ops::add_gated(c, sum, x.reshape({planes, hw}), nullptr, ops::Rounding::each_step);
  }
}

void attention(Context& c, const Attention& a, int64_t groups, const Tensor& x, Tensor& y) {
  ArenaScope scope(*c.arena);
  const int64_t n = x.shape[0], ch = x.shape[1], hw = x.shape[2] * x.shape[3];
  Tensor normed = Tensor::in(*c.arena, x.shape, c.act);
  ops::group_norm(c, x, a.norm.weight, a.norm.bias, normed, groups, kNormEps, false, ops::Rounding::each_step);
  // Channel planes to token rows, sample by sample: [N, C, HW] -> [N, HW, C].
  Tensor tokens = Tensor::in(*c.arena, {n * hw, ch}, c.act);
  Tensor token_view = tokens.reshape({n, hw, ch});
  ops::permute(c, normed.reshape({n, ch, hw}), token_view, {0, 2, 1});
  Tensor q = Tensor::in(*c.arena, {n * hw, ch}, c.act), k = Tensor::in(*c.arena, {n * hw, ch}, c.act),
         v = Tensor::in(*c.arena, {n * hw, ch}, c.act);
  ops::linear(c, tokens, a.q_w, &a.q_b, q);
  ops::linear(c, tokens, a.k_w, &a.k_b, k);
  ops::linear(c, tokens, a.v_w, &a.v_b, v);
  Tensor attn = Tensor::in(*c.arena, {n * hw, ch}, c.act);
  // SDPA's default scale, computed in double as torch does before narrowing it.
  ops::attention(c, q, k, v, attn, ch, float(1.0 / std::sqrt(double(ch))), {false, nullptr, n});
  Tensor proj = Tensor::in(*c.arena, {n * hw, ch}, c.act);
  ops::linear(c, attn, a.out_w, &a.out_b, proj);
  Tensor plane_view = y.reshape({n, ch, hw});
  ops::permute(c, proj.reshape({n, hw, ch}), plane_view, {0, 2, 1});
  Tensor planes = y.reshape({n * ch, hw});
  ops::add_gated(c, planes, x.reshape({n * ch, hw}), nullptr, ops::Rounding::each_step);
}

}  // namespace apus::flux2::vae
