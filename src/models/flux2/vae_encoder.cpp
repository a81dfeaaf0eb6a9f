#include "models/flux2/vae_encoder.h"

#include "core/error.h"

namespace apus::flux2 {

VaeEncoder VaeEncoder::load(const Config& config, WeightLoader weights) {
  VaeEncoder m(std::move(weights));
  m.cfg_ = VaeConfig::read(config);
  const VaeConfig& c = m.cfg_;
  const WeightLoader& w = m.weights_;
  const std::vector<int64_t>& blocks = c.encoder_block_out;
  const int64_t n = int64_t(blocks.size()), mid = blocks.back(), moments = 2 * c.latent_channels;
  vae::load_conv(w, "encoder.conv_in", blocks[0], c.in_channels, 3, m.conv_in_w_, m.conv_in_b_);
  int64_t in = blocks[0];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t out = blocks[size_t(i)];
    const std::string p = "encoder.down_blocks." + std::to_string(i);
    DownBlock b;
    for (int64_t j = 0; j < c.layers_per_block; ++j)
      b.resnets.push_back(vae::load_resnet(w, p + ".resnets." + std::to_string(j), j == 0 ? in : out, out));
    if (i + 1 < n) vae::load_conv(w, p + ".downsamplers.0.conv", out, out, 3, b.down_w, b.down_b);
    m.down_.push_back(std::move(b));
    in = out;
  }
  m.mid_in_ = vae::load_resnet(w, "encoder.mid_block.resnets.0", mid, mid);
  if (c.mid_attention) m.mid_attn_ = vae::load_attention(w, "encoder.mid_block.attentions.0.", mid);
  m.mid_out_ = vae::load_resnet(w, "encoder.mid_block.resnets.1", mid, mid);
  m.norm_out_ = vae::load_norm(w, "encoder.conv_norm_out", mid);
  vae::load_conv(w, "encoder.conv_out", moments, mid, 3, m.conv_out_w_, m.conv_out_b_);
  if (c.quant_conv) vae::load_conv(w, "quant_conv", moments, moments, 1, m.quant_w_, m.quant_b_);
  const int64_t pc = c.packed_channels();
  for (const DType dt : {DType::f32, DType::bf16}) {
    const vae::BatchNormStats stats = vae::batch_norm_stats(w, pc, c.bn_eps, dt);
    Normalise& z = dt == DType::f32 ? m.norm_f32_ : m.norm_bf16_;
    if (!stats.mean.data) {
      z.ones = z.neg_mean = z.inv_std = z.zeros = Tensor::shape_only({pc}, DType::f32);
      continue;
    }
    z.ones = Tensor::heap({pc}, DType::f32);
    z.neg_mean = Tensor::heap({pc}, DType::f32);
    z.inv_std = Tensor::heap({pc}, DType::f32);
    z.zeros = Tensor::heap({pc}, DType::f32);
    for (int64_t f = 0; f < pc; ++f) {
      z.ones.ptr<float>()[f] = 1.0f;
      z.neg_mean.ptr<float>()[f] = -stats.mean.ptr<float>()[f];
      z.inv_std.ptr<float>()[f] = 1.0f / stats.std.ptr<float>()[f];
      z.zeros.ptr<float>()[f] = 0.0f;
    }
    for (Tensor* t : {&z.ones, &z.neg_mean, &z.inv_std, &z.zeros}) *t = w.place(*t);
  }
  return m;
}

void VaeEncoder::encode(Context& c, const Tensor& image, Tensor& packed) const {
  const int64_t s = cfg_.pixels_per_token(), ih = image.shape.size() == 4 ? image.shape[2] : 0,
                iw = image.shape.size() == 4 ? image.shape[3] : 0;
  APUS_CHECK(image.rank() == 4 && image.shape[0] == 1 && image.shape[1] == cfg_.in_channels && ih % s == 0 &&
                 iw % s == 0 && ih > 0 && iw > 0 && image.dtype == c.act,
             "vae encoder: image ", shape_str(image.shape), " ", dtype_name(image.dtype), "; expected [1, ",
             cfg_.in_channels, ", H, W] ", dtype_name(c.act), " with H and W multiples of ", s);
  const int64_t h = ih / s, w = iw / s, lat = cfg_.latent_channels, p = cfg_.patch;
  APUS_CHECK(packed.shape == Shape({h * w, cfg_.packed_channels()}) && packed.dtype == c.act, "vae encoder: packed ",
             shape_str(packed.shape), "; expected [", h * w, ", ", cfg_.packed_channels(), "]");
  ArenaScope scope(*c.arena);
  CostScope vae_scope(c, "vae_encoder");
  const std::vector<int64_t>& blocks = cfg_.encoder_block_out;
  const int64_t n = int64_t(blocks.size()), mid = blocks.back();
  Tensor x = Tensor::in(*c.arena, {1, blocks[0], ih, iw}, c.act);
  ops::conv2d(c, image, conv_in_w_, &conv_in_b_, x, 1, 1, 1);
  for (int64_t i = 0; i < n; ++i) {
    CostScope block(c, "down." + std::to_string(i));
    const int64_t out = blocks[size_t(i)], hh = x.shape[2], ww = x.shape[3];
    for (const vae::Resnet& r : down_[size_t(i)].resnets) {
      Tensor y = Tensor::in(*c.arena, {1, out, hh, ww}, c.act);
      vae::resnet(c, r, cfg_.groups, x, y);
      x = y;
    }
    if (down_[size_t(i)].down_w.defined()) {
      // Downsample2D pads (0, 1, 0, 1), then a 3x3 stride-2 conv without padding of its own.
      Tensor y = Tensor::in(*c.arena, {1, out, hh / 2, ww / 2}, c.act);
      ops::conv2d(c, x, down_[size_t(i)].down_w, &down_[size_t(i)].down_b, y, 2, 0, 1);
      x = y;
    }
  }
  {
    CostScope part(c, "mid");
    const int64_t hh = x.shape[2], ww = x.shape[3];
    Tensor y = Tensor::in(*c.arena, {1, mid, hh, ww}, c.act);
    vae::resnet(c, mid_in_, cfg_.groups, x, y);
    x = y;
    if (cfg_.mid_attention) {
      y = Tensor::in(*c.arena, {1, mid, hh, ww}, c.act);
      vae::attention(c, mid_attn_, cfg_.groups, x, y);
      x = y;
    }
    y = Tensor::in(*c.arena, {1, mid, hh, ww}, c.act);
    vae::resnet(c, mid_out_, cfg_.groups, x, y);
    x = y;
  }
  CostScope part(c, "out");
  const int64_t lh = x.shape[2], lw = x.shape[3];
  Tensor normed = Tensor::in(*c.arena, x.shape, c.act);
  ops::group_norm(c, x, norm_out_.weight, norm_out_.bias, normed, cfg_.groups, vae::kNormEps, true,
                  ops::Rounding::each_step);
  Tensor moments = Tensor::in(*c.arena, {1, 2 * lat, lh, lw}, c.act);
  ops::conv2d(c, normed, conv_out_w_, &conv_out_b_, moments, 1, 1, 1);
  if (cfg_.quant_conv) {
    Tensor q = Tensor::in(*c.arena, moments.shape, c.act);
    ops::conv2d(c, moments, quant_w_, &quant_b_, q, 1, 0, 0);
    moments = q;
  }
  // The distribution's mode is its mean, the first latent_channels planes. Patchified and packed
  // in one permute: [C, h, p, w, p] -> [h, w, C, p, p], token (y, x) feature ch*p*p + pi*p + pj.
  const Tensor mean = moments.reshape({2 * lat, lh * lw}).rows(0, lat);
  Tensor tokens = Tensor::in(*c.arena, {h * w, cfg_.packed_channels()}, c.act);
  Tensor token_grid = tokens.reshape({h, w, lat, p, p});
  ops::permute(c, mean.reshape({lat, h, p, w, p}), token_grid, {1, 3, 0, 2, 4});
  // (x - mean) / std as the pipeline's two eager ops: the difference rounded, then the quotient
  // (as a product with 1/std in fp32, rounded once).
  const Normalise& z = c.act == DType::bf16 ? norm_bf16_ : norm_f32_;
  Tensor centred = Tensor::in(*c.arena, tokens.shape, c.act);
  ops::affine(c, tokens, z.ones, z.neg_mean, centred, ops::Rounding::once);
  ops::affine(c, centred, z.inv_std, z.zeros, packed, ops::Rounding::once);
}

}  // namespace apus::flux2
