#include "models/sa3/same_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "io/media/resample.h"

namespace apus::sa3 {

void prepare_clip(const AudioClip& clip, const std::string& what, int64_t rate, int64_t channels, int64_t length,
                  float* out) {
  // The words decode_audio uses for an empty file, so a clip says the same by any route.
  APUS_CHECK(!clip.samples.empty(), what, ": holds no audio");
  APUS_CHECK(clip.channels >= 1 && clip.sample_rate > 0 && clip.samples.size() % size_t(clip.channels) == 0, what, ": ",
             clip.samples.size(), " samples at ", clip.sample_rate, " Hz are not whole frames of ", clip.channels,
             " channels");
  const int64_t in_frames = int64_t(clip.samples.size()) / clip.channels;
  std::vector<std::vector<float>> planes(size_t(clip.channels), std::vector<float>(size_t(in_frames)));
  for (int64_t i = 0; i < in_frames; ++i)
    for (int j = 0; j < clip.channels; ++j) {
      const float v = clip.samples[size_t(i * clip.channels + j)];
      APUS_CHECK(std::isfinite(v), what, ": sample ", i, " is not a finite number");
      planes[size_t(j)][size_t(i)] = v;
    }
  planes = resample(planes, clip.sample_rate, int(rate), length);
  const int64_t n = std::min(int64_t(planes[0].size()), length);
  std::fill(out, out + channels * length, 0.0f);
  for (int64_t k = 0; k < channels; ++k)
    for (int64_t i = 0; i < n; ++i) {
      float v = 0;
      if (channels == 1) {
        for (const auto& p : planes) v += p[size_t(i)];
        v /= float(planes.size());
      } else {
        v = planes[size_t(std::min<int64_t>(k, int64_t(planes.size()) - 1))][size_t(i)];
      }
      out[k * length + i] = v;
    }
}

SameEncoder SameEncoder::load(const SameConfig& config, WeightLoader weights, DType compute) {
  SameEncoder m(std::move(weights));
  m.cfg_ = config;
  const SameConfig& c = m.cfg_;
  const int64_t d = c.dim, latent = c.latent_dim;
  // What the model computes with; what it derives values from at load it reads as stored (m.weights_).
  const WeightLoader converted = m.weights_.with(std::make_shared<ConvertTo>(compute));
  const std::string b0 = "encoder.blocks.0.";
  m.mapping_ = weight_normed_mapping(m.weights_, compute, b0 + "mapping", d, c.patch_width(), c.mapping_kernel);
  m.mapping_bias_ = converted.get(b0 + "mapping.bias", {d});
  m.new_token_ = converted.get(b0 + "new_tokens", {1, 1, d});
  m.transformer_ = SameTransformer::load(c, converted, b0);
  m.proj_ = converted.get("encoder.proj.weight", {latent, d});
  m.proj_bias_ = converted.get("encoder.proj.bias", {latent});
  // The bottleneck's parameters as the model's dtype holds them; dividing by running_std becomes a
  // product with its fp32 reciprocal.
  const Tensor scale = m.weights_.host("bottleneck.scale", {1, latent, 1});
  const Tensor bias = m.weights_.host("bottleneck.bias", {1, latent, 1});
  const float std = bottleneck_std(m.weights_, compute);
  for (Tensor* t : {&m.scale_, &m.bias_, &m.inv_std_, &m.zeros_}) *t = Tensor::heap({latent}, DType::f32);
  // Computed on the host, then placed.
  for (int64_t i = 0; i < latent; ++i) {
    const bool data = scale.data != nullptr;
    m.scale_.ptr<float>()[i] = data ? round_as(compute, load_f32(scale, i)) : 1.0f;
    m.bias_.ptr<float>()[i] = data ? round_as(compute, load_f32(bias, i)) : 0.0f;
    m.inv_std_.ptr<float>()[i] = 1.0f / std;
    m.zeros_.ptr<float>()[i] = 0.0f;
  }
  for (Tensor* t : {&m.scale_, &m.bias_, &m.inv_std_, &m.zeros_}) *t = converted.place(*t);
  return m;
}

Tensor SameEncoder::encode(Context& c, const Tensor& audio, bool chunked) const {
  const int64_t batch = audio.shape[0], spl = cfg_.samples_per_latent();
  APUS_CHECK(
      audio.rank() == 3 && audio.shape[1] == cfg_.audio_channels && audio.shape[2] % spl == 0 && audio.shape[2] > 0,
      "SAME encoder: audio ", shape_str(audio.shape), " is not B x ", cfg_.audio_channels,
      " channels x whole latents of ", spl, " samples");
  const int64_t frames = audio.shape[2] / spl, ch = cfg_.audio_channels;
  if (!chunked || frames < kSameChunk) return encode_piece(c, audio);
  Tensor latents = ops::empty(c, {batch * frames, cfg_.latent_dim}, c.act);
  const Tensor planes = audio.reshape({batch * ch, frames * spl});
  for (const SameChunk& k : same_chunks(frames)) {
    ArenaScope scope(*c.arena);
    Tensor piece = Tensor::in(*c.arena, {batch, ch, kSameChunk * spl}, audio.dtype);
    Tensor piece_planes = piece.reshape({batch * ch, kSameChunk * spl});
    ops::copy(c, planes.cols(k.start * spl, (k.start + kSameChunk) * spl), piece_planes);
    const Tensor encoded = encode_piece(c, piece);
    for (int64_t b = 0; b < batch; ++b) {
      Tensor dst = latents.rows(b * frames + k.start + k.lo, b * frames + k.start + k.hi);
      ops::copy(c, encoded.rows(b * kSameChunk + k.lo, b * kSameChunk + k.hi), dst);
    }
  }
  return latents;
}

Tensor SameEncoder::encode_piece(Context& c, const Tensor& audio) const {
  const SameConfig& g = cfg_;
  const int64_t batch = audio.shape[0], d = g.dim, group = g.stride + 1;
  const int64_t patches = audio.shape[2] / g.patch_size, frames = patches / g.stride, width = g.patch_width();
  Tensor latents = ops::empty(c, {batch * frames, g.latent_dim}, c.act);
  ArenaScope scope(*c.arena);
  CostScope encoder_scope(c, "same_encoder");
  std::optional<CostScope> part(std::in_place, c, "embed");
  // Patch l of a sample holds, channel after channel, that channel's samples l*P .. (l+1)*P.
  Tensor x = Tensor::in(*c.arena, {batch * patches, width}, c.act);
  {
    ArenaScope cast_scope(*c.arena);
    Tensor a = audio;
    if (audio.dtype != c.act) {
      a = Tensor::in(*c.arena, audio.shape, c.act);
      ops::copy(c, audio, a);
    }
    for (int64_t b = 0; b < batch; ++b) {
      const Tensor src = a.reshape({batch * g.audio_channels, patches * g.patch_size})
                             .rows(b * g.audio_channels, (b + 1) * g.audio_channels)
                             .reshape({g.audio_channels, patches, g.patch_size});
      Tensor dst = x.rows(b * patches, (b + 1) * patches).reshape({patches, g.audio_channels, g.patch_size});
      ops::permute(c, src, dst, {1, 0, 2});
    }
  }
  // The mapping to the transformer's width, then each group of `stride` patches followed by the
  // learned summary token: one gather from [mapped rows; summary token].
  Tensor table = Tensor::in(*c.arena, {batch * patches + 1, d}, c.act);
  Tensor mapped = table.rows(0, batch * patches);
  {
    ArenaScope taps_scope(*c.arena);
    ops::linear(c, g.mapping_kernel == 1 ? x : conv_taps(c, x, batch), mapping_, &mapping_bias_, mapped);
  }
  Tensor summary = table.rows(batch * patches, batch * patches + 1);
  ops::copy(c, new_token_.reshape({1, d}), summary);
  const Tensor ids = ops::host_filled(c, {batch * frames * group}, DType::i32, [&](Tensor& t) {
    for (int64_t r = 0; r < batch * frames; ++r)
      for (int64_t j = 0; j < group; ++j)
        t.ptr<int32_t>()[r * group + j] = j < g.stride ? int32_t(r * g.stride + j) : int32_t(batch * patches);
  });
  Tensor tokens = Tensor::in(*c.arena, {batch * frames * group, d}, c.act);
  ops::embedding(c, table, ids, tokens);
  part.reset();
  transformer_.run(c, tokens, batch);

  CostScope out_scope(c, "out");
  // Each group's summary token, projected to the latent width, through the bottleneck.
  Tensor kept = Tensor::in(*c.arena, {batch * frames, d}, c.act);
  ops::copy(c, tokens.reshape({batch * frames, group * d}).cols(g.stride * d, group * d), kept);
  Tensor projected = Tensor::in(*c.arena, {batch * frames, g.latent_dim}, c.act);
  ops::linear(c, kept, proj_, &proj_bias_, projected);
  ops::affine(c, projected, scale_, bias_, projected, ops::Rounding::each_step);
  ops::affine(c, projected, inv_std_, zeros_, latents, ops::Rounding::each_step);
  return latents;
}

}  // namespace apus::sa3
