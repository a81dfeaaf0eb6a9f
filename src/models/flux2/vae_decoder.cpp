#include "models/flux2/vae_decoder.h"

#include <optional>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace apus::flux2 {

namespace {

// diffusers' Decoder fixes every GroupNorm eps (resnets, mid-block attention, conv_norm_out) at
// 1e-6 in code; the config has no key for it.
constexpr float kNormEps = 1e-6f;

// Leading part of a ping-pong buffer viewed with a smaller shape.
Tensor slot(const Tensor& buffer, Shape s) {
  APUS_CHECK(shape_numel(s) <= buffer.numel(), "vae: activation ", shape_str(s),
             " exceeds the planned buffer of ", buffer.numel());
  Tensor t = buffer;
  t.shape = std::move(s);
  return t;
}

}  // namespace

VaeConfig VaeConfig::read(const Config& c) {
  VaeConfig v{};
  v.latent_channels = c.get_size("latent_channels");
  v.out_channels = c.get_size("out_channels", 3, 1);
  v.layers_per_block = c.get_size("layers_per_block", 2, 1);
  v.groups = c.get_size("norm_num_groups", 32, 1);
  const bool own = c.json.contains("decoder_block_out_channels") &&
                   !c.json["decoder_block_out_channels"].is_null();
  v.block_out = c.get_sizes(own ? "decoder_block_out_channels" : "block_out_channels");
  for (int64_t ch : v.block_out)
    APUS_CHECK(ch % v.groups == 0, c.path, ": ", ch, " channels do not split into norm_num_groups ",
               v.groups);
  v.mid_attention = c.get_bool("mid_block_add_attention", true);
  v.post_quant_conv = c.get_bool("use_post_quant_conv", true);
  v.bn_eps = c.get_positive("batch_norm_eps", 1e-4);
  const std::vector<int64_t> patch =
      c.json.contains("patch_size") ? c.get_ints("patch_size") : std::vector<int64_t>{2, 2};
  // The pipeline's _unpatchify_latents hard-codes 2x2 whatever the config says.
  APUS_CHECK(patch == std::vector<int64_t>({2, 2}), c.path, ": patch_size must be [2, 2]");
  v.patch = 2;
  APUS_CHECK(!v.block_out.empty(), c.path, ": block_out_channels is empty");
  const std::string act = c.get_string("act_fn", "silu");
  APUS_CHECK(act == "silu", c.path, ": act_fn '", act, "' is not supported (expected silu)");
  if (c.json.contains("up_block_types")) {
    const Json& types = c.json["up_block_types"];
    APUS_CHECK(types.is_array() && types.size() == v.block_out.size(), c.path,
               ": up_block_types must list one block per block_out_channels entry");
    for (const Json& t : types)
      APUS_CHECK(t == "UpDecoderBlock2D", c.path, ": up block ", t.dump(),
                 " is not supported (expected UpDecoderBlock2D)");
  }
  return v;
}

VaeDecoder VaeDecoder::load(const ModelDir& dir) {
  VaeDecoder m;
  m.cfg_ = VaeConfig::read(dir.config("vae"));
  m.weights_ = dir.weights("vae");
  const VaeConfig& c = m.cfg_;
  const WeightSet& w = m.weights_;
  auto norm = [&](const std::string& p, int64_t ch) {
    return Norm{w.get(p + ".weight", {ch}), w.get(p + ".bias", {ch})};
  };
  auto conv = [&](const std::string& p, int64_t out, int64_t in, int64_t k, Tensor& wt, Tensor& b) {
    wt = w.get(p + ".weight", {out, in, k, k});
    b = w.get(p + ".bias", {out});
  };
  auto resnet = [&](const std::string& p, int64_t in, int64_t out) {
    Resnet r;
    r.norm1 = norm(p + ".norm1", in);
    conv(p + ".conv1", out, in, 3, r.conv1_w, r.conv1_b);
    r.norm2 = norm(p + ".norm2", out);
    conv(p + ".conv2", out, out, 3, r.conv2_w, r.conv2_b);
    if (in != out) conv(p + ".conv_shortcut", out, in, 1, r.shortcut_w, r.shortcut_b);
    return r;
  };
  const int64_t lat = c.latent_channels, mid = c.block_out.back();
  const Tensor& mean = w.get("bn.running_mean", {c.packed_channels()});
  const Tensor& var = w.get("bn.running_var", {c.packed_channels()});
  for (const DType dt : {DType::f32, DType::bf16}) {
    Denorm& d = dt == DType::f32 ? m.denorm_f32_ : m.denorm_bf16_;
    const int64_t pc = c.packed_channels();
    if (!mean.data) {  // counting mode: shapes only
      d.mean = d.std = Tensor::shape_only({pc}, DType::f32);
      continue;
    }
    d.mean = Tensor::heap({pc}, DType::f32);
    d.std = Tensor::heap({pc}, DType::f32);
    const float eps = round_as(dt, float(c.bn_eps));
    for (int64_t f = 0; f < pc; ++f) {
      d.mean.ptr<float>()[f] = round_as(dt, load_f32(mean, f));
      d.std.ptr<float>()[f] = round_as(dt, std::sqrt(round_as(dt, load_f32(var, f) + eps)));
    }
  }
  if (c.post_quant_conv) conv("post_quant_conv", lat, lat, 1, m.post_quant_w_, m.post_quant_b_);
  conv("decoder.conv_in", mid, lat, 3, m.conv_in_w_, m.conv_in_b_);
  m.mid_in_ = resnet("decoder.mid_block.resnets.0", mid, mid);
  if (c.mid_attention) {
    const std::string p = "decoder.mid_block.attentions.0.";
    Attention& a = m.mid_attn_;
    a.norm = norm(p + "group_norm", mid);
    struct Linear {
      const char* name;
      Tensor* weight;
      Tensor* bias;
    };
    for (const Linear& l :
         {Linear{"to_q", &a.q_w, &a.q_b}, Linear{"to_k", &a.k_w, &a.k_b},
          Linear{"to_v", &a.v_w, &a.v_b}, Linear{"to_out.0", &a.out_w, &a.out_b}}) {
      *l.weight = w.get(p + l.name + ".weight", {mid, mid});
      *l.bias = w.get(p + l.name + ".bias", {mid});
    }
  }
  m.mid_out_ = resnet("decoder.mid_block.resnets.1", mid, mid);
  const int64_t n = int64_t(c.block_out.size());
  int64_t in = mid;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t out = c.block_out[size_t(n - 1 - i)];
    const std::string p = "decoder.up_blocks." + std::to_string(i);
    UpBlock b;
    for (int64_t j = 0; j <= c.layers_per_block; ++j)
      b.resnets.push_back(resnet(p + ".resnets." + std::to_string(j), j == 0 ? in : out, out));
    if (i + 1 < n) conv(p + ".upsamplers.0.conv", out, out, 3, b.up_w, b.up_b);
    m.up_.push_back(std::move(b));
    in = out;
  }
  m.norm_out_ = norm("decoder.conv_norm_out", c.block_out[0]);
  conv("decoder.conv_out", c.out_channels, c.block_out[0], 3, m.conv_out_w_, m.conv_out_b_);
  return m;
}

void VaeDecoder::unpack_latents(Context& c, const Tensor& packed, int64_t h, int64_t w,
                                Tensor& latents) const {
  const int64_t pc = cfg_.packed_channels(), p = cfg_.patch, lh = p * h, lw = p * w;
  const int64_t n = latents.shape[0];
  APUS_CHECK(packed.shape == Shape({n * h * w, pc}) && packed.contiguous() &&
                 latents.shape == Shape({n, cfg_.latent_channels, lh, lw}) &&
                 latents.dtype == c.act,
             "vae: packed latents ", shape_str(packed.shape), " for ", n, " samples of a ", h,
             "x", w, " grid, latents ", shape_str(latents.shape), "; expected [", n * h * w, ", ",
             pc, "]");
  const Denorm& d = c.act == DType::bf16 ? denorm_bf16_ : denorm_f32_;
  ArenaScope scope(*c.arena);
  // The pipeline casts the batch-norm statistics to the latents' dtype and evaluates
  // x * std + mean there, two rounded ops.
  Tensor x = Tensor::in(*c.arena, packed.shape, c.act);
  ops::affine(c, packed, d.std, d.mean, x, ops::Rounding::each_step);
  // Token (y, x) feature f = ch*p*p + pi*p + pj lands on latent pixel (ch, p*y + pi, p*x + pj):
  // [N, h, w, C, p, p] -> [N, C, h, p, w, p].
  const int64_t ch = cfg_.latent_channels;
  Tensor grid = latents.reshape({n, ch, h, p, w, p});
  ops::permute(c, x.reshape({n, h, w, ch, p, p}), grid, {0, 3, 1, 4, 2, 5});
}

int64_t VaeDecoder::max_activation(int64_t lh, int64_t lw) const {
  const int64_t n = int64_t(cfg_.block_out.size());
  int64_t area = lh * lw;
  int64_t most = std::max(cfg_.latent_channels, cfg_.block_out.back()) * area;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t out = cfg_.block_out[size_t(n - 1 - i)];
    if (i + 1 < n) area *= 4;
    most = std::max(most, out * area);
  }
  return most;
}

void VaeDecoder::resnet(Context& c, const Resnet& r, const Tensor& x, Tensor& y) const {
  ArenaScope scope(*c.arena);
  const int64_t hw = x.shape[2] * x.shape[3], out = y.shape[1];
  Tensor n1 = Tensor::in(*c.arena, x.shape, c.act);
  ops::group_norm(c, x, r.norm1.weight, r.norm1.bias, n1, cfg_.groups, kNormEps, true,
                  ops::Rounding::each_step);
  Tensor h1 = Tensor::in(*c.arena, y.shape, c.act);
  ops::conv2d(c, n1, r.conv1_w, &r.conv1_b, h1, 1, 1);
  Tensor n2 = Tensor::in(*c.arena, y.shape, c.act);
  ops::group_norm(c, h1, r.norm2.weight, r.norm2.bias, n2, cfg_.groups, kNormEps, true,
                  ops::Rounding::each_step);
  ops::conv2d(c, n2, r.conv2_w, &r.conv2_b, y, 1, 1);
  const int64_t planes = y.shape[0] * out;  // every sample's channels
  Tensor sum = y.reshape({planes, hw});
  if (r.shortcut_w.defined()) {
    Tensor s = Tensor::in(*c.arena, y.shape, c.act);
    ops::conv2d(c, x, r.shortcut_w, &r.shortcut_b, s, 1, 0);
    ops::add_gated(c, sum, s.reshape({planes, hw}), nullptr, ops::Rounding::each_step);
  } else {
    ops::add_gated(c, sum, x.reshape({planes, hw}), nullptr, ops::Rounding::each_step);
  }
}

// One head over all H*W positions, head_dim = channels (AttnProcessor2_0 with group_norm and a
// residual connection; rescale_output_factor is 1 in the Decoder).
void VaeDecoder::attention(Context& c, const Attention& a, const Tensor& x, Tensor& y) const {
  ArenaScope scope(*c.arena);
  const int64_t n = x.shape[0], ch = x.shape[1], hw = x.shape[2] * x.shape[3];
  Tensor normed = Tensor::in(*c.arena, x.shape, c.act);
  ops::group_norm(c, x, a.norm.weight, a.norm.bias, normed, cfg_.groups, kNormEps, false,
                  ops::Rounding::each_step);
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

void VaeDecoder::decode(Context& c, const Tensor& packed, int64_t h, int64_t w,
                        Tensor& image) const {
  const int64_t s = cfg_.pixels_per_token(), batch = image.shape[0];
  APUS_CHECK(image.shape == Shape({batch, cfg_.out_channels, h * s, w * s}) && image.dtype == c.act,
             "vae: image ", shape_str(image.shape), " ", dtype_name(image.dtype), " for a ", h, "x",
             w, " token grid; expected [N, ", cfg_.out_channels, ", ", h * s, ", ", w * s, "] ",
             dtype_name(c.act));
  ArenaScope scope(*c.arena);
  CostScope vae_scope(c, "vae");
  std::optional<CostScope> part(std::in_place, c, "mid");
  const int64_t lh = cfg_.patch * h, lw = cfg_.patch * w, n = int64_t(cfg_.block_out.size());
  // Each stage reads one buffer and writes the other; stage scratch sits above both and is
  // released at the end of the stage.
  const int64_t cap = batch * max_activation(lh, lw);
  const Tensor bufs[2] = {Tensor::in(*c.arena, {cap}, c.act), Tensor::in(*c.arena, {cap}, c.act)};
  int at = 0;
  Tensor x = slot(bufs[at], {batch, cfg_.latent_channels, lh, lw});
  auto next = [&](int64_t ch, int64_t hh, int64_t ww) {
    at ^= 1;
    return slot(bufs[at], {batch, ch, hh, ww});
  };
  unpack_latents(c, packed, h, w, x);
  if (cfg_.post_quant_conv) {
    Tensor y = next(cfg_.latent_channels, lh, lw);
    ops::conv2d(c, x, post_quant_w_, &post_quant_b_, y, 1, 0);
    x = y;
  }
  const int64_t mid = cfg_.block_out.back();
  Tensor y = next(mid, lh, lw);
  ops::conv2d(c, x, conv_in_w_, &conv_in_b_, y, 1, 1);
  x = y;
  y = next(mid, lh, lw);
  resnet(c, mid_in_, x, y);
  x = y;
  if (cfg_.mid_attention) {
    y = next(mid, lh, lw);
    attention(c, mid_attn_, x, y);
    x = y;
  }
  y = next(mid, lh, lw);
  resnet(c, mid_out_, x, y);
  x = y;
  for (int64_t i = 0; i < n; ++i) {
    part.emplace(c, "up." + std::to_string(i));
    const int64_t out = cfg_.block_out[size_t(n - 1 - i)], hh = x.shape[2], ww = x.shape[3];
    for (const Resnet& r : up_[size_t(i)].resnets) {
      y = next(out, hh, ww);
      resnet(c, r, x, y);
      x = y;
    }
    if (up_[size_t(i)].up_w.defined()) {
      ArenaScope stage(*c.arena);
      Tensor wide = Tensor::in(*c.arena, {batch, out, 2 * hh, 2 * ww}, c.act);
      ops::upsample_nearest2x(c, x, wide);
      y = next(out, 2 * hh, 2 * ww);
      ops::conv2d(c, wide, up_[size_t(i)].up_w, &up_[size_t(i)].up_b, y, 1, 1);
      x = y;
    }
  }
  part.emplace(c, "out");
  Tensor normed = Tensor::in(*c.arena, x.shape, c.act);
  ops::group_norm(c, x, norm_out_.weight, norm_out_.bias, normed, cfg_.groups, kNormEps, true,
                  ops::Rounding::each_step);
  ops::conv2d(c, normed, conv_out_w_, &conv_out_b_, image, 1, 1);
}

}  // namespace apus::flux2
