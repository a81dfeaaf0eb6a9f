#include "models/flux2/vae_decoder.h"

#include <optional>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace apus::flux2 {

namespace {

// Leading part of a ping-pong buffer viewed with a smaller shape.
Tensor slot(const Tensor& buffer, Shape s) {
  APUS_CHECK(shape_numel(s) <= buffer.numel(), "vae: activation ", shape_str(s), " exceeds the planned buffer of ",
             buffer.numel());
  Tensor t = buffer;
  t.shape = std::move(s);
  return t;
}

}  // namespace

VaeConfig VaeConfig::read(const Config& c) {
  VaeConfig v{};
  v.latent_channels = c.get_size("latent_channels");
  v.in_channels = c.get_size("in_channels", 3, 1);
  v.out_channels = c.get_size("out_channels", 3, 1);
  v.layers_per_block = c.get_size("layers_per_block", 2, 1);
  v.groups = c.get_size("norm_num_groups", 32, 1);
  const bool own = c.has("decoder_block_out_channels");
  v.block_out = c.get_sizes(own ? "decoder_block_out_channels" : "block_out_channels");
  v.encoder_block_out = c.get_sizes("block_out_channels");
  for (const auto* blocks : {&v.block_out, &v.encoder_block_out})
    for (int64_t ch : *blocks)
      APUS_CHECK(ch % v.groups == 0, c.path, ": ", ch, " channels do not split into norm_num_groups ", v.groups);
  v.mid_attention = c.get_bool("mid_block_add_attention", true);
  v.quant_conv = c.get_bool("use_quant_conv", true);
  v.post_quant_conv = c.get_bool("use_post_quant_conv", true);
  v.bn_eps = c.get_positive("batch_norm_eps", 1e-4);
  const std::vector<int64_t> patch = c.has("patch_size") ? c.get_ints("patch_size") : std::vector<int64_t>{2, 2};
  // The pipeline's _unpatchify_latents hard-codes 2x2 whatever the config says.
  APUS_CHECK(patch == std::vector<int64_t>({2, 2}), c.path, ": patch_size must be [2, 2]");
  v.patch = 2;
  APUS_CHECK(!v.block_out.empty(), c.path, ": block_out_channels is empty");
  const std::string act = c.get_string("act_fn", "silu");
  APUS_CHECK(act == "silu", c.path, ": act_fn '", act, "' is not supported (expected silu)");
  if (c.has("down_block_types")) {
    const Json& types = c.at("down_block_types");
    APUS_CHECK(types.is_array() && types.size() == v.encoder_block_out.size(), c.path,
               ": down_block_types must list one block per block_out_channels entry");
    for (const Json& t : types)
      APUS_CHECK(t == "DownEncoderBlock2D", c.path, ": down block ", t.dump(),
                 " is not supported (expected DownEncoderBlock2D)");
  }
  if (c.has("up_block_types")) {
    const Json& types = c.at("up_block_types");
    APUS_CHECK(types.is_array() && types.size() == v.block_out.size(), c.path,
               ": up_block_types must list one block per block_out_channels entry");
    for (const Json& t : types)
      APUS_CHECK(t == "UpDecoderBlock2D", c.path, ": up block ", t.dump(),
                 " is not supported (expected UpDecoderBlock2D)");
  }
  // The training-time settings: the sample size images were trained at and the batch-norm
  // statistics' momentum (the stored running statistics are what inference reads).
  c.no_effect({"sample_size", "batch_norm_momentum"});
  return v;
}

VaeDecoder VaeDecoder::load(const Config& config, WeightLoader weights) {
  VaeDecoder m(std::move(weights));
  m.cfg_ = VaeConfig::read(config);
  const VaeConfig& c = m.cfg_;
  const WeightLoader& w = m.weights_;
  const int64_t lat = c.latent_channels, mid = c.block_out.back();
  for (const DType dt : {DType::f32, DType::bf16}) {
    const vae::BatchNormStats s = vae::batch_norm_stats(w, c.packed_channels(), c.bn_eps, dt);
    (dt == DType::f32 ? m.stats_f32_ : m.stats_bf16_) = {w.place(s.mean), w.place(s.std)};
  }
  if (c.post_quant_conv) vae::load_conv(w, "post_quant_conv", lat, lat, 1, m.post_quant_w_, m.post_quant_b_);
  vae::load_conv(w, "decoder.conv_in", mid, lat, 3, m.conv_in_w_, m.conv_in_b_);
  m.mid_in_ = vae::load_resnet(w, "decoder.mid_block.resnets.0", mid, mid);
  if (c.mid_attention) m.mid_attn_ = vae::load_attention(w, "decoder.mid_block.attentions.0.", mid);
  m.mid_out_ = vae::load_resnet(w, "decoder.mid_block.resnets.1", mid, mid);
  const int64_t n = int64_t(c.block_out.size());
  int64_t in = mid;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t out = c.block_out[size_t(n - 1 - i)];
    const std::string p = "decoder.up_blocks." + std::to_string(i);
    UpBlock b;
    for (int64_t j = 0; j <= c.layers_per_block; ++j)
      b.resnets.push_back(vae::load_resnet(w, p + ".resnets." + std::to_string(j), j == 0 ? in : out, out));
    if (i + 1 < n) vae::load_conv(w, p + ".upsamplers.0.conv", out, out, 3, b.up_w, b.up_b);
    m.up_.push_back(std::move(b));
    in = out;
  }
  m.norm_out_ = vae::load_norm(w, "decoder.conv_norm_out", c.block_out[0]);
  vae::load_conv(w, "decoder.conv_out", c.out_channels, c.block_out[0], 3, m.conv_out_w_, m.conv_out_b_);
  return m;
}

void VaeDecoder::unpack_latents(Context& c, const Tensor& packed, int64_t h, int64_t w, Tensor& latents) const {
  const int64_t pc = cfg_.packed_channels(), p = cfg_.patch, lh = p * h, lw = p * w;
  const int64_t n = latents.shape[0];
  APUS_CHECK(packed.shape == Shape({n * h * w, pc}) && packed.contiguous() &&
                 latents.shape == Shape({n, cfg_.latent_channels, lh, lw}) && latents.dtype == c.act,
             "vae: packed latents ", shape_str(packed.shape), " for ", n, " samples of a ", h, "x", w,
             " grid, latents ", shape_str(latents.shape), "; expected [", n * h * w, ", ", pc, "]");
  const vae::BatchNormStats& d = c.act == DType::bf16 ? stats_bf16_ : stats_f32_;
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

void VaeDecoder::decode(Context& c, const Tensor& packed, int64_t h, int64_t w, Tensor& image,
                        const ProcessGroup* ranks) const {
  const int64_t s = cfg_.pixels_per_token(), batch = image.shape[0];
  APUS_CHECK(image.shape == Shape({batch, cfg_.out_channels, h * s, w * s}) && image.dtype == c.act, "vae: image ",
             shape_str(image.shape), " ", dtype_name(image.dtype), " for a ", h, "x", w, " token grid; expected [N, ",
             cfg_.out_channels, ", ", h * s, ", ", w * s, "] ", dtype_name(c.act));
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
  FeatureSplit split{ranks};
  unpack_latents(c, packed, h, w, x);
  if (cfg_.post_quant_conv) {
    Tensor y = next(cfg_.latent_channels, lh, lw);
    vae::conv(c, &split, x, post_quant_w_, &post_quant_b_, y, 1, 0, 0);
    x = y;
  }
  const int64_t mid = cfg_.block_out.back();
  Tensor y = next(mid, lh, lw);
  vae::conv(c, &split, x, conv_in_w_, &conv_in_b_, y, 1, 1, 1);
  x = y;
  y = next(mid, lh, lw);
  vae::resnet(c, mid_in_, cfg_.groups, x, y, &split);
  x = y;
  if (cfg_.mid_attention) {
    y = next(mid, lh, lw);
    vae::attention(c, mid_attn_, cfg_.groups, x, y);
    x = y;
  }
  y = next(mid, lh, lw);
  vae::resnet(c, mid_out_, cfg_.groups, x, y, &split);
  x = y;
  for (int64_t i = 0; i < n; ++i) {
    part.emplace(c, "up." + std::to_string(i));
    const int64_t out = cfg_.block_out[size_t(n - 1 - i)], hh = x.shape[2], ww = x.shape[3];
    for (const vae::Resnet& r : up_[size_t(i)].resnets) {
      y = next(out, hh, ww);
      vae::resnet(c, r, cfg_.groups, x, y, &split);
      x = y;
    }
    if (up_[size_t(i)].up_w.defined()) {
      ArenaScope stage(*c.arena);
      Tensor wide = Tensor::in(*c.arena, {batch, out, 2 * hh, 2 * ww}, c.act);
      ops::upsample_nearest2x(c, x, wide);
      y = next(out, 2 * hh, 2 * ww);
      vae::conv(c, &split, wide, up_[size_t(i)].up_w, &up_[size_t(i)].up_b, y, 1, 1, 1);
      x = y;
    }
  }
  part.emplace(c, "out");
  Tensor normed = Tensor::in(*c.arena, x.shape, c.act);
  ops::group_norm(c, x, norm_out_.weight, norm_out_.bias, normed, cfg_.groups, vae::kNormEps, true,
                  ops::Rounding::each_step);
  vae::conv(c, &split, normed, conv_out_w_, &conv_out_b_, image, 1, 1, 1);
  // Under cfg or Ulysses every rank computes ~1/N of each convolution (the channels of the
  // outermost blocks stand for all of them), the outputs all-gathered.
  if (c.cost) {
    c.cost->mark_parts(cfg_.block_out.front());
    c.cost->mark_gather(split.gathered);
  }
}

}  // namespace apus::flux2
