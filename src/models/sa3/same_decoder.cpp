#include "models/sa3/same_decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "core/variants.h"
#include "models/common/exchange.h"
#include "ops/backend.h"

namespace apus::sa3 {

SameDecoder SameDecoder::load(const SameConfig& config, WeightLoader weights, DType compute,
                              const ProcessGroup* tensor_ranks) {
  SameDecoder m(std::move(weights));
  m.cfg_ = config;
  const SameConfig& c = m.cfg_;
  const int64_t d = c.dim, out = c.patch_width();
  // What the model computes with; what it derives values from at load it reads as stored (m.weights_).
  const WeightLoader converted = m.weights_.with(std::make_shared<ConvertTo>(compute));
  auto param = [&](const std::string& name, const Shape& shape) { return converted.get(name, shape); };
  m.noise_scale_ = bottleneck_std(m.weights_, compute);
  Tensor scale = Tensor::heap({c.latent_dim}, DType::f32), zeros = Tensor::heap({c.latent_dim}, DType::f32);
  std::fill_n(scale.ptr<float>(), c.latent_dim, m.noise_scale_);
  std::fill_n(zeros.ptr<float>(), c.latent_dim, 0.0f);
  m.scale_ = converted.place(scale);
  m.zeros_ = converted.place(zeros);
  m.proj_ = param("decoder.proj.weight", {d, c.latent_dim});
  m.proj_bias_ = param("decoder.proj.bias", {d});
  const std::string b0 = "decoder.blocks.0.";
  m.new_token_ = param(b0 + "new_tokens", {1, 1, d});
  m.mapping_ = weight_normed_mapping(m.weights_, compute, b0 + "mapping", out, d, c.mapping_kernel);
  m.mapping_bias_ = param(b0 + "mapping.bias", {out});
  m.transformer_ = SameTransformer::load(c, converted, b0, tensor_ranks);
  return m;
}

Knob decode_chunks_knob("sa3.decode_chunks",
                        "SAME's chunked decode on a device: a rank's chunks in passes of up to 16 (each chunk a "
                        "sample of the batch), or one chunk a pass (what the CPU always does)",
                        {"together", "apart"});

namespace {

enum DecodeChunks { kTogether, kApart };
constexpr int64_t kChunksAPass = 16;  // bounds a pass's activations for long clips (380 s: 45 chunks)

// Sample s's next draw of rows x cols normals into its rows of `out` [B*rows, cols] (f32, arena),
// scaled by `scale` factors one after another in fp32 as the reference multiplies them.
// transposed: the draw fills a cols x rows plane (torch's (C, T) order) and lands transposed.
void draw(Context& c, const DecodeNoise& noise, int64_t s, int64_t rows, int64_t cols,
          std::initializer_list<float> scales, bool transposed, Tensor& out) {
  const Tensor plane =
      ops::host_filled(c, {transposed ? cols : rows, transposed ? rows : cols}, DType::f32, [&](Tensor& t) {
        float* p = t.ptr<float>();
        noise.draw(s, p, rows * cols);
        for (int64_t i = 0; i < rows * cols; ++i)
          for (const float k : scales) p[i] *= k;
      });
  Tensor dst = out.rows(s * rows, (s + 1) * rows);
  if (transposed) ops::transpose(c, plane, dst);
  else ops::copy(c, plane, dst);
}

}  // namespace

DecodeNoise DecodeNoise::from(bool bottleneck, float mask, std::vector<TorchGenerator>& generators) {
  DecodeNoise n;
  n.bottleneck = bottleneck;
  n.mask = mask;
  n.samples = int64_t(generators.size());
  n.draw = [&generators](int64_t s, float* out, int64_t count) { generators[size_t(s)].randn(out, count); };
  return n;
}

std::vector<int64_t> same_noise_draws(const SameConfig& config, int64_t frames, bool chunked,
                                      const DecodeNoise& noise) {
  // As decode() cuts the latents: whole, or the official chunks.
  const bool whole = !chunked || frames < kSameChunk;
  const size_t pieces = whole ? 1 : same_chunks(frames).size();
  const int64_t n = whole ? frames : kSameChunk;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < pieces; ++i) {
    if (noise.bottleneck) sizes.push_back(n * config.latent_dim);
    if (noise.mask > 0) sizes.push_back(n * config.stride * config.dim);
  }
  return sizes;
}

Tensor SameDecoder::decode(Context& c, const Tensor& latents, int64_t batch, bool chunked, const DecodeNoise& noise,
                           const ProcessGroup* ranks) const {
  APUS_CHECK(!transformer_.split() || !ranks || ranks->size() == 1,
             "SAME: a decoder loaded split over ranks (parallel ",
             "tensor) decodes every chunk on all of them; its chunks are not dealt out");
  const int64_t frames = latents.shape[0] / std::max<int64_t>(batch, 1);
  if (!chunked || frames < kSameChunk) return decode_piece(c, latents, batch, noise);
  // Each chunk decoded on its own (RoPE from 0, fresh noise), its overlaps trimmed.
  const int64_t spl = cfg_.samples_per_latent(), ch = cfg_.audio_channels;
  Tensor audio = ops::empty(c, {batch, ch, frames * spl}, c.act);
  Tensor out = audio.reshape({batch * ch, frames * spl});
  const std::vector<SameChunk> chunks = same_chunks(frames);
  if (c.cost) {
    c.cost->mark_parts(int64_t(chunks.size()));
    c.cost->mark_gather(double(audio.nbytes()));
  }
  const bool split = ranks && ranks->size() > 1;
  const Share mine =
      split ? share_of(int64_t(chunks.size()), ranks->rank(), ranks->size()) : Share{0, int64_t(chunks.size())};
  // Each sample's noise is drawn chunk after chunk: a rank's first chunk draws after every earlier
  // chunk's draws, made here and dropped.
  if (noise.any() && mine.first > 0 && !c.count_only) {
    const std::vector<int64_t> sizes = same_noise_draws(cfg_, frames, true, noise);
    const size_t earlier = sizes.size() / chunks.size() * size_t(mine.first);
    std::vector<float> dropped;
    for (int64_t s = 0; s < noise.samples; ++s)
      for (size_t i = 0; i < earlier; ++i) {
        dropped.resize(size_t(sizes[i]));
        noise.draw(s, dropped.data(), sizes[i]);
      }
  }
  // On a device the chunks go through in passes of several, each chunk a sample of the pass's
  // batch (it attends within itself, its RoPE from 0, its noise its own): one launch of each op for
  // all of them, where a chunk a pass left the GPU idle between small kernels. The CPU's kernels
  // are full at one chunk, and a pass would hold every chunk's activations: one at a time there.
  const bool device = c.backend && c.backend->device() != Device::cpu;
  const int64_t per_pass = device && decode_chunks_knob.value() == kTogether ? kChunksAPass : 1;
  if (device) decode_chunks_knob.took(per_pass > 1 ? kTogether : kApart);
  for (int64_t first = mine.first; first < mine.first + mine.count; first += per_pass) {
    const int64_t count = std::min(per_pass, mine.first + mine.count - first);
    ArenaScope scope(*c.arena);
    // Pass sample (i, b): chunk first + i of sample b, its draws from b's generator, chunk after chunk.
    Tensor piece = Tensor::in(*c.arena, {count * batch * kSameChunk, cfg_.latent_dim}, latents.dtype);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t start = b * frames + chunks[size_t(first + i)].start, at = (i * batch + b) * kSameChunk;
        Tensor rows = piece.rows(at, at + kSameChunk);
        ops::copy(c, latents.rows(start, start + kSameChunk), rows);
      }
    DecodeNoise pass = noise;
    pass.samples = count * batch;
    if (noise.any()) pass.draw = [&noise, batch](int64_t s, float* p, int64_t n) { noise.draw(s % batch, p, n); };
    const Tensor decoded = decode_piece(c, piece, count * batch, pass).reshape({count * batch * ch, kSameChunk * spl});
    for (int64_t i = 0; i < count; ++i) {
      const SameChunk& k = chunks[size_t(first + i)];
      Tensor dst = out.cols((k.start + k.lo) * spl, (k.start + k.hi) * spl);
      ops::copy(c, decoded.rows(i * batch * ch, (i + 1) * batch * ch).cols(k.lo * spl, k.hi * spl), dst);
    }
  }
  if (split) gather_chunks(c, *ranks, chunks, out);
  return audio;
}

void SameDecoder::gather_chunks(Context& c, const ProcessGroup& ranks, const std::vector<SameChunk>& chunks,
                                Tensor& out) const {
  // Each chunk's trimmed audio [rows, its samples] one after another, so that a rank's chunks are
  // one part; gathered, then put in place.
  const int64_t spl = cfg_.samples_per_latent(), rows = out.shape[0];
  const int n = ranks.size();
  std::vector<int64_t> at{0};
  for (const SameChunk& k : chunks) at.push_back(at.back() + rows * (k.hi - k.lo) * spl);
  ArenaScope scope(*c.arena);
  Tensor flat = Tensor::in(*c.arena, {at.back()}, out.dtype);
  auto region = [&](size_t i) {
    return flat.rows(at[i], at[i + 1]).reshape({rows, (chunks[i].hi - chunks[i].lo) * spl});
  };
  auto columns = [&](size_t i) {
    return out.cols((chunks[i].start + chunks[i].lo) * spl, (chunks[i].start + chunks[i].hi) * spl);
  };
  std::vector<size_t> bytes;
  for (int r = 0; r < n; ++r) {
    const Share s = share_of(int64_t(chunks.size()), r, n);
    bytes.push_back(dtype_bytes(out.dtype, at[size_t(s.first + s.count)] - at[size_t(s.first)]));
  }
  const Share mine = share_of(int64_t(chunks.size()), ranks.rank(), n);
  for (int64_t i = mine.first; i < mine.first + mine.count; ++i) {
    Tensor to = region(size_t(i));
    ops::copy(c, columns(size_t(i)), to);
  }
  all_gather(c, ranks, flat.data, bytes, "the decoder's chunks");
  if (c.count_only) return;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (int64_t(i) >= mine.first && int64_t(i) < mine.first + mine.count) continue;
    Tensor to = columns(i);
    ops::copy(c, region(i), to);
  }
}

Tensor SameDecoder::decode_piece(Context& c, const Tensor& latents, int64_t batch, const DecodeNoise& noise) const {
  ArenaScope scope(*c.arena);
  const SameConfig& g = cfg_;
  const int64_t d = g.dim, group = g.stride + 1;
  APUS_CHECK(batch >= 1 && latents.rank() == 2 && latents.shape[1] == g.latent_dim && latents.shape[0] % batch == 0 &&
                 latents.shape[0] > 0,
             "SAME decoder: latents ", shape_str(latents.shape), " are not ", batch, " x frames of ", g.latent_dim,
             " channels");
  const int64_t frames = latents.shape[0] / batch, tokens = frames * group;
  CostScope decoder_scope(c, "same_decoder");
  std::optional<CostScope> part(std::in_place, c, "embed");
  // Bottleneck decode (x running_std), the projection, then each latent's token followed by
  // `stride` copies of the learned placeholder: one gather from [projected rows; placeholder].
  Tensor scaled = Tensor::in(*c.arena, {batch * frames, g.latent_dim}, c.act);
  ops::affine(c, latents, scale_, zeros_, scaled, ops::Rounding::each_step);
  APUS_CHECK(!noise.any() || noise.samples == batch, "SAME decoder: noise for ", noise.samples, " samples, a batch of ",
             batch);
  // Each sample's draws in its generator's order, the bottleneck's then the placeholders' (a
  // sample may be a later chunk of an earlier one's generator: decode()).
  const bool bottleneck_noise = noise.any() && noise.bottleneck, mask_noise = noise.any() && noise.mask > 0;
  Tensor bottleneck, mask;
  if (bottleneck_noise) bottleneck = Tensor::in(*c.arena, {batch * frames, g.latent_dim}, DType::f32);
  if (mask_noise) mask = Tensor::in(*c.arena, {batch * frames, g.stride * d}, DType::f32);
  for (int64_t s = 0; s < batch; ++s) {
    if (bottleneck_noise) draw(c, noise, s, frames, g.latent_dim, {noise_scale_, 1e-3f}, true, bottleneck);
    if (mask_noise) draw(c, noise, s, frames, g.stride * d, {noise.mask}, false, mask);
  }
  if (bottleneck_noise) ops::add_gated(c, scaled, bottleneck, nullptr, ops::Rounding::each_step);
  Tensor table = Tensor::in(*c.arena, {batch * frames + 1, d}, c.act);
  Tensor projected = table.rows(0, batch * frames);
  ops::linear(c, scaled, proj_, &proj_bias_, projected);
  Tensor placeholder = table.rows(batch * frames, batch * frames + 1);
  ops::copy(c, new_token_.reshape({1, d}), placeholder);
  const Tensor ids = ops::host_filled(c, {batch * tokens}, DType::i32, [&](Tensor& t) {
    for (int64_t r = 0; r < batch * frames; ++r)
      for (int64_t j = 0; j < group; ++j)
        t.ptr<int32_t>()[r * group + j] = j == 0 ? int32_t(r) : int32_t(batch * frames);
  });
  Tensor x = Tensor::in(*c.arena, {batch * tokens, d}, c.act);
  ops::embedding(c, table, ids, x);
  if (mask_noise) {
    Tensor placeholders = x.reshape({batch * frames, group * d}).cols(d, group * d);
    ops::add_gated(c, placeholders, mask, nullptr, ops::Rounding::each_step);
  }

  part.reset();
  transformer_.run(c, x, batch);

  CostScope out_scope(c, "out");
  // The placeholders of every group (the latent's own token dropped), the mapping to patches,
  // then the unpatch: sample b's patch l, channel ch holds samples l*P .. (l+1)*P of ch.
  Tensor kept = Tensor::in(*c.arena, {batch * frames * g.stride, d}, c.act);
  Tensor kept_view = kept.reshape({batch * frames, g.stride * d});
  ops::copy(c, x.reshape({batch * frames, group * d}).cols(d, group * d), kept_view);
  const int64_t patches = frames * g.stride, out = g.audio_channels * g.patch_size;
  Tensor mapped = Tensor::in(*c.arena, {batch * patches, out}, c.act);
  // Kernel 3: a convolution along each sample's placeholders, zero-padded at its ends.
  ops::linear(c, g.mapping_kernel == 1 ? kept : conv_taps(c, kept, batch), mapping_, &mapping_bias_, mapped);
  Tensor audio = ops::empty(c, {batch, g.audio_channels, patches * g.patch_size}, c.act);
  for (int64_t b = 0; b < batch; ++b) {
    Tensor src = mapped.rows(b * patches, (b + 1) * patches).reshape({patches, g.audio_channels, g.patch_size});
    Tensor dst = audio.reshape({batch * g.audio_channels, patches * g.patch_size})
                     .rows(b * g.audio_channels, (b + 1) * g.audio_channels)
                     .reshape({g.audio_channels, patches, g.patch_size});
    ops::permute(c, src, dst, {1, 0, 2});
  }
  return audio;
}

}  // namespace apus::sa3
