#include "models/sa3/same_decoder.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"

namespace apus::sa3 {

namespace {

// A one-entry list (one resampling level, as SAME-L and SAME-S have) read as its value.
int64_t single_level(const Config& c, const std::string& key, int64_t fallback) {
  if (!c.json.contains(key)) return fallback;
  const std::vector<int64_t> v = c.get_ints(key);
  APUS_CHECK(v.size() == 1, c.path, ": '", key, "' has ", v.size(),
             " levels; SAME-L and SAME-S have one (several levels are not supported)");
  APUS_CHECK(v[0] >= 0 && v[0] <= (int64_t(1) << 24), c.path, ": '", key, "' is ", v[0],
             ", out of range");
  return v[0];
}

}  // namespace

SameConfig SameConfig::read(const Config& c) {
  SameConfig s{};
  s.audio_channels = c.get_size("audio_channels", 2, 1);
  s.patch_size = c.get_size("patch_size", 256, 1);
  s.latent_dim = c.get_size("latent_dim", 256, 1);
  const int64_t channels = c.get_size("encoder_channels", 128, 1);
  s.dim = channels * std::max<int64_t>(1, single_level(c, "encoder_c_mults", 6));
  s.stride = std::max<int64_t>(1, single_level(c, "encoder_strides", 16));
  s.depth = std::max<int64_t>(1, single_level(c, "encoder_transformer_depths", 6));
  s.sin_blocks = single_level(c, "decoder_sinusoidal_blocks", 0);
  s.head_dim = std::min(c.get_size("dim_heads", 64, 1), s.dim);
  APUS_CHECK(s.dim % s.head_dim == 0, c.path, ": model width ", s.dim,
             " is not a multiple of dim_heads ", s.head_dim);
  APUS_CHECK(s.head_dim / 2 >= 2 && (s.head_dim / 2) % 2 == 0, c.path, ": dim_heads ", s.head_dim,
             " leaves no even RoPE width (head_dim / 2)");
  s.ff_inner = s.dim * c.get_size("ff_mult", 3, 1);
  // The official band: sliding_window latents on either side, each a group of stride + 1 tokens.
  s.window = c.get_size("sliding_window", 1, 0) * (s.stride + 1);
  APUS_CHECK(s.window > 0, c.path, ": sliding_window 0 means SAME-S's chunked attention, which ",
             "is not supported yet");
  s.sample_rate = c.get_size("sampling_rate", 44100, 1);
  s.differential = c.get_bool("use_differential_attention", true);
  return s;
}

SameDecoder SameDecoder::load(const std::string& dir, DType compute, bool load_weights) {
  return load(SameConfig::read(read_config(dir + "/config.json")),
              ParamSource::diffusers(load_weights ? WeightSet::open_dir(dir) : WeightSet::shapes_only()),
              compute);
}

SameDecoder SameDecoder::load(const SameConfig& config, ParamSource source, DType compute) {
  SameDecoder m;
  m.cfg_ = config;
  m.source_ = std::move(source);
  const SameConfig& c = m.cfg_;
  const int64_t d = c.dim, hd = c.head_dim, out = c.audio_channels * c.patch_size;
  const ParamLoader params(m.source_, compute, m.owned_);
  auto param = [&](const std::string& name, const Shape& shape) { return params.get(name, shape); };
  auto norm = [&](const std::string& p, int64_t width) {
    return Norm{param(p + ".alpha", {1}), param(p + ".gamma", {width}), param(p + ".beta", {width})};
  };
  const Tensor& running_std = params.raw("bottleneck.running_std", {1});
  m.scale_ = Tensor::heap({c.latent_dim}, DType::f32);
  m.zeros_ = Tensor::heap({c.latent_dim}, DType::f32);
  for (int64_t i = 0; i < c.latent_dim; ++i) {
    m.scale_.ptr<float>()[i] = running_std.data ? round_as(compute, load_f32(running_std, 0)) : 1.0f;
    m.zeros_.ptr<float>()[i] = 0.0f;
  }
  m.proj_ = param("decoder.proj.weight", {d, c.latent_dim});
  m.proj_bias_ = param("decoder.proj.bias", {d});
  const std::string b0 = "decoder.blocks.0.";
  m.new_token_ = param(b0 + "new_tokens", {1, 1, d});
  // The weight-normed mapping W[o] = g[o] v[o] / ||v[o]||, formed once in double.
  // W[o, :, :] = g[o] v[o] / ||v[o]|| over the input channels and taps (torch's weight_norm,
  // dim 0), formed once in double; laid out [out, k * d] tap-major to meet the taps side by side.
  const int64_t kt = c.mapping_kernel;
  const Tensor& g = params.raw(b0 + "mapping.weight_g", {out, 1, 1});
  const Tensor& v = params.raw(b0 + "mapping.weight_v", {out, d, kt});
  if (v.data) {
    Tensor mapping = Tensor::heap({out, kt * d}, DType::f32);
    for (int64_t o = 0; o < out; ++o) {
      double ss = 0;
      for (int64_t i = 0; i < d * kt; ++i) ss += double(load_f32(v, o * d * kt + i)) * load_f32(v, o * d * kt + i);
      APUS_CHECK(ss > 0, "SAME decoder: mapping.weight_v row ", o, " is all zeros (weight norm undefined)");
      const double scale = double(load_f32(g, o)) / std::sqrt(ss);
      for (int64_t i = 0; i < d; ++i)
        for (int64_t t = 0; t < kt; ++t)
          mapping.ptr<float>()[o * kt * d + t * d + i] = float(scale * load_f32(v, (o * d + i) * kt + t));
    }
    m.owned_.push_back(compute == DType::f32 ? mapping : to_dtype(mapping, compute));
    m.mapping_ = m.owned_.back();
  } else {
    m.mapping_ = Tensor::shape_only({out, kt * d}, DType::bf16);
  }
  m.mapping_bias_ = param(b0 + "mapping.bias", {out});
  const int64_t qkv = (c.differential ? 5 : 3) * d;
  for (int64_t i = 0; i < c.depth; ++i) {
    const std::string p = b0 + "transformers." + std::to_string(i) + ".";
    Block b;
    b.attn_norm = norm(p + "norm_attn", d);
    b.ff_norm = norm(p + "norm_ff", d);
    b.q_norm = norm(p + "attn.q_norm", hd);
    b.k_norm = norm(p + "attn.k_norm", hd);
    b.to_qkv = params.fused_qkv(p + "attn.to_qkv.weight", qkv / d, d, d);
    b.to_out = param(p + "attn.to_out.weight", {d, d});
    b.ff_in = param(p + "ff.proj_in.weight", {2 * c.ff_inner, d});
    b.ff_in_bias = param(p + "ff.proj_in.bias", {2 * c.ff_inner});
    b.ff_out = param(p + "ff.proj_out.weight", {d, c.ff_inner});
    b.ff_out_bias = param(p + "ff.proj_out.bias", {d});
    m.blocks_.push_back(b);
  }
  return m;
}

void SameDecoder::block(Context& c, const Block& b, int64_t index, Tensor& x,
                        const ops::AttentionOptions& attn, const Tensor& cos, const Tensor& sin) const {
  ArenaScope scope(*c.arena);
  const SameConfig& g = cfg_;
  const int64_t rows = x.shape[0], d = g.dim, hd = g.head_dim, f = g.ff_inner;
  const int64_t nq = g.differential ? 2 : 1;
  Tensor normed = Tensor::in(*c.arena, {rows, d}, c.act);
  Tensor proj = Tensor::in(*c.arena, {rows, d}, c.act);
  std::optional<CostScope> part(std::in_place, c, "attn");
  ops::dyt(c, x, b.attn_norm.alpha, b.attn_norm.gamma, b.attn_norm.beta, normed, ops::Rounding::each_step);
  {
    ArenaScope attn_scope(*c.arena);
    Tensor qkv = Tensor::in(*c.arena, {rows, (2 * nq + 1) * d}, c.act);
    ops::linear(c, normed, b.to_qkv, nullptr, qkv);
    Tensor q = qkv.cols(0, nq * d), k = qkv.cols(nq * d, 2 * nq * d);
    ops::dyt(c, q, b.q_norm.alpha, b.q_norm.gamma, b.q_norm.beta, q, ops::Rounding::each_step);
    ops::dyt(c, k, b.k_norm.alpha, b.k_norm.gamma, b.k_norm.beta, k, ops::Rounding::each_step);
    ops::rope(c, q, cos, sin, hd, ops::RopeStyle::half, ops::Rounding::once);
    ops::rope(c, k, cos, sin, hd, ops::RopeStyle::half, ops::Rounding::once);
    const Tensor v = qkv.cols(2 * nq * d, (2 * nq + 1) * d);
    Tensor out = Tensor::in(*c.arena, {rows, d}, c.act);
    const float scale = 1.0f / std::sqrt(float(hd));
    if (g.differential)
      ops::differential_attention(c, q.cols(0, d), k.cols(0, d), q.cols(d, 2 * d), k.cols(d, 2 * d),
                                  v, out, hd, scale, attn);
    else
      ops::attention(c, q, k, v, out, hd, scale, attn);
    RowParallel row(c);
    ops::linear(c, out, b.to_out, nullptr, proj);
  }
  ops::add_gated(c, x, proj, nullptr, ops::Rounding::each_step);

  part.emplace(c, "ff");
  ops::dyt(c, x, b.ff_norm.alpha, b.ff_norm.gamma, b.ff_norm.beta, normed, ops::Rounding::each_step);
  {
    ArenaScope ff_scope(*c.arena);
    Tensor up = Tensor::in(*c.arena, {rows, 2 * f}, c.act), act = Tensor::in(*c.arena, {rows, f}, c.act);
    ops::linear(c, normed, b.ff_in, &b.ff_in_bias, up);
    // The official rule: the last sin_blocks blocks use sin(pi x), the others SiLU.
    const bool sinusoidal = g.depth - index < g.sin_blocks;
    ops::glu(c, up.cols(f, 2 * f), up.cols(0, f), act,
             sinusoidal ? ops::Activation::sin_pi : ops::Activation::silu, ops::Rounding::each_step);
    RowParallel row(c);
    ops::linear(c, act, b.ff_out, &b.ff_out_bias, proj);
  }
  ops::add_gated(c, x, proj, nullptr, ops::Rounding::each_step);
}

namespace {

constexpr int64_t kChunk = 128, kOverlap = 32;  // the official decode_audio's defaults

// Each sample's next draw of rows x cols normals, laid out [B*rows, cols] (f32, arena), scaled by
// `scale` factors one after another in fp32 as the reference multiplies them. transposed: the
// draw fills cols x rows planes (torch's (C, T) order) and lands transposed.
Tensor draw(Context& c, std::vector<TorchGenerator>& gens, int64_t rows, int64_t cols,
            std::initializer_list<float> scales, bool transposed) {
  const int64_t b = int64_t(gens.size());
  Tensor out = Tensor::in(*c.arena, {b * rows, cols}, DType::f32);
  if (c.count_only) return out;
  Tensor plane = Tensor::in(*c.arena, {rows * cols}, DType::f32);
  for (int64_t s = 0; s < b; ++s) {
    float* p = plane.ptr<float>();
    gens[size_t(s)].randn(p, rows * cols);
    for (int64_t i = 0; i < rows * cols; ++i)
      for (const float k : scales) p[i] *= k;
    Tensor dst = out.rows(s * rows, (s + 1) * rows);
    if (transposed) ops::transpose(c, plane.reshape({cols, rows}), dst);
    else std::memcpy(dst.data, p, size_t(rows * cols) * sizeof(float));
  }
  return out;
}

}  // namespace

Tensor SameDecoder::decode(Context& c, const Tensor& latents, int64_t batch, bool chunked,
                           const DecodeNoise& noise) const {
  const int64_t frames = latents.shape[0] / std::max<int64_t>(batch, 1);
  if (!chunked || frames < kChunk) return decode_piece(c, latents, batch, noise);
  // Chunks every 96 latents, the last anchored at the end; each decoded on its own (RoPE from 0,
  // fresh noise), then the overlaps trimmed by 16 latents on every inner edge, the last chunk
  // written last.
  std::vector<int64_t> starts;
  for (int64_t s = 0; s + kChunk <= frames; s += kChunk - kOverlap) starts.push_back(s);
  if (starts.back() != frames - kChunk) starts.push_back(frames - kChunk);
  const int64_t spl = cfg_.samples_per_latent(), ch = cfg_.audio_channels, half = kOverlap / 2;
  Tensor audio = ops::empty(c, {batch, ch, frames * spl}, c.act);
  Tensor out = audio.reshape({batch * ch, frames * spl});
  for (size_t i = 0; i < starts.size(); ++i) {
    ArenaScope scope(*c.arena);
    const int64_t s = starts[i];
    Tensor piece = Tensor::in(*c.arena, {batch * kChunk, cfg_.latent_dim}, latents.dtype);
    for (int64_t b = 0; b < batch; ++b) {
      Tensor rows = piece.rows(b * kChunk, (b + 1) * kChunk);
      ops::copy(c, latents.rows(b * frames + s, b * frames + s + kChunk), rows);
    }
    const Tensor decoded = decode_piece(c, piece, batch, noise).reshape({batch * ch, kChunk * spl});
    const int64_t lo = i == 0 ? 0 : half, hi = i + 1 == starts.size() ? kChunk : kChunk - half;
    Tensor dst = out.cols((s + lo) * spl, (s + hi) * spl);
    ops::copy(c, decoded.cols(lo * spl, hi * spl), dst);
  }
  return audio;
}

Tensor SameDecoder::decode_piece(Context& c, const Tensor& latents, int64_t batch,
                                 const DecodeNoise& noise) const {
  ArenaScope scope(*c.arena);
  const SameConfig& g = cfg_;
  const int64_t d = g.dim, group = g.stride + 1;
  APUS_CHECK(batch >= 1 && latents.rank() == 2 && latents.shape[1] == g.latent_dim &&
                 latents.shape[0] % batch == 0 && latents.shape[0] > 0,
             "SAME decoder: latents ", shape_str(latents.shape), " are not ", batch,
             " x frames of ", g.latent_dim, " channels");
  const int64_t frames = latents.shape[0] / batch, tokens = frames * group;
  CostScope decoder_scope(c, "same_decoder");
  std::optional<CostScope> part(std::in_place, c, "embed");
  // Bottleneck decode (x running_std), the projection, then each latent's token followed by
  // `stride` copies of the learned placeholder: one gather from [projected rows; placeholder].
  Tensor scaled = Tensor::in(*c.arena, {batch * frames, g.latent_dim}, c.act);
  ops::affine(c, latents, scale_, zeros_, scaled, ops::Rounding::each_step);
  APUS_CHECK(!noise.any() || int64_t(noise.generators->size()) == batch, "SAME decoder: ",
             noise.any() ? noise.generators->size() : 0, " noise generators for a batch of ", batch);
  if (noise.any() && noise.bottleneck) {
    const Tensor n = draw(c, *noise.generators, frames, g.latent_dim, {scale_.ptr<float>()[0], 1e-3f}, true);
    ops::add_gated(c, scaled, n, nullptr, ops::Rounding::each_step);
  }
  Tensor table = Tensor::in(*c.arena, {batch * frames + 1, d}, c.act);
  Tensor projected = table.rows(0, batch * frames);
  ops::linear(c, scaled, proj_, &proj_bias_, projected);
  Tensor placeholder = table.rows(batch * frames, batch * frames + 1);
  ops::copy(c, new_token_.reshape({1, d}), placeholder);
  Tensor ids = Tensor::in(*c.arena, {batch * tokens}, DType::i32);
  if (!c.count_only)
    for (int64_t r = 0; r < batch * frames; ++r)
      for (int64_t j = 0; j < group; ++j)
        ids.ptr<int32_t>()[r * group + j] = j == 0 ? int32_t(r) : int32_t(batch * frames);
  Tensor x = Tensor::in(*c.arena, {batch * tokens, d}, c.act);
  ops::embedding(c, table, ids, x);
  if (noise.any() && noise.mask > 0) {
    const Tensor n = draw(c, *noise.generators, frames, g.stride * d, {noise.mask}, false);
    Tensor placeholders = x.reshape({batch * frames, group * d}).cols(d, group * d);
    ops::add_gated(c, placeholders, n, nullptr, ops::Rounding::each_step);
  }

  // RoPE over the tokens one attention sees (a sample's N, or one chunk's), half of each head
  // turned.
  const bool chunked_attention = g.window == 0;
  const int64_t seen = chunked_attention ? g.chunk_tokens : tokens;
  APUS_CHECK(!chunked_attention || (tokens % seen == 0), "SAME decoder: ", frames,
             " latents do not fill whole attention chunks of ", seen / group,
             " (the official pipeline's canvases do)");
  Tensor positions = Tensor::in(*c.arena, {seen, 1}, DType::i64);
  if (!c.count_only)
    for (int64_t i = 0; i < seen; ++i) positions.ptr<int64_t>()[i] = i;
  Tensor cos = Tensor::in(*c.arena, {seen, g.head_dim / 4}, DType::f32);
  Tensor sin = Tensor::in(*c.arena, {seen, g.head_dim / 4}, DType::f32);
  ops::rope_tables(c, positions, {g.head_dim / 2}, 10000.0, ops::RopeMath::f32, cos, sin);
  part.reset();
  auto run_blocks = [&](Tensor& h, int64_t from, int64_t to) {
    const int64_t attend_batch = chunked_attention ? h.shape[0] / seen : batch;
    const ops::AttentionOptions attn{false, nullptr, attend_batch, 0.0f, ops::Rounding::once, g.window};
    for (int64_t i = from; i < to; ++i) {
      CostScope block_scope(c, "block." + std::to_string(i));
      mark_depth_boundary(c, h);
      block(c, blocks_[size_t(i)], i, h, attn, cos, sin);
    }
  };
  const int64_t split = chunked_attention && g.midpoint_shift ? g.depth / 2 : g.depth;
  run_blocks(x, 0, split);
  if (split < g.depth) {
    // The second half on chunks shifted by half a chunk: each sample's first and last half chunk
    // repeated at its ends, cropped off after.
    const int64_t shift = seen / 2, n = tokens + 2 * shift;
    ArenaScope shifted_scope(*c.arena);
    Tensor shifted = Tensor::in(*c.arena, {batch * n, d}, c.act);
    for (int64_t b = 0; b < batch; ++b) {
      const Tensor sample = x.rows(b * tokens, (b + 1) * tokens);
      Tensor head = shifted.rows(b * n, b * n + shift), body = shifted.rows(b * n + shift, b * n + shift + tokens),
             tail = shifted.rows(b * n + shift + tokens, (b + 1) * n);
      ops::copy(c, sample.rows(0, shift), head);
      ops::copy(c, sample, body);
      ops::copy(c, sample.rows(tokens - shift, tokens), tail);
    }
    run_blocks(shifted, split, g.depth);
    for (int64_t b = 0; b < batch; ++b) {
      Tensor sample = x.rows(b * tokens, (b + 1) * tokens);
      ops::copy(c, shifted.rows(b * n + shift, b * n + shift + tokens), sample);
    }
  }

  CostScope out_scope(c, "out");
  // The placeholders of every group (the latent's own token dropped), the mapping to patches,
  // then the unpatch: sample b's patch l, channel ch holds samples l*P .. (l+1)*P of ch.
  Tensor kept = Tensor::in(*c.arena, {batch * frames * g.stride, d}, c.act);
  Tensor kept_view = kept.reshape({batch * frames, g.stride * d});
  ops::copy(c, x.reshape({batch * frames, group * d}).cols(d, group * d), kept_view);
  const int64_t patches = frames * g.stride, out = g.audio_channels * g.patch_size;
  Tensor mapped = Tensor::in(*c.arena, {batch * patches, out}, c.act);
  if (g.mapping_kernel == 1) {
    ops::linear(c, kept, mapping_, &mapping_bias_, mapped);
  } else {
    // A kernel-3 convolution along each sample's placeholders, zero-padded at its ends: one GEMM
    // over [x(t-1), x(t), x(t+1)] side by side (the weight laid out to match at load).
    Tensor taps = Tensor::in(*c.arena, {batch * patches, 3 * d}, c.act);
    Tensor zero = Tensor::in(*c.arena, {1, d}, c.act);
    if (!c.count_only) std::memset(zero.data, 0, zero.nbytes());
    for (int64_t b = 0; b < batch; ++b) {
      const Tensor src = kept.rows(b * patches, (b + 1) * patches);
      Tensor dst = taps.rows(b * patches, (b + 1) * patches);
      Tensor prev = dst.rows(1, patches).cols(0, d), prev_edge = dst.rows(0, 1).cols(0, d);
      Tensor mid = dst.cols(d, 2 * d);
      Tensor next = dst.rows(0, patches - 1).cols(2 * d, 3 * d), next_edge = dst.rows(patches - 1, patches).cols(2 * d, 3 * d);
      ops::copy(c, src.rows(0, patches - 1), prev);
      ops::copy(c, zero, prev_edge);
      ops::copy(c, src, mid);
      ops::copy(c, src.rows(1, patches), next);
      ops::copy(c, zero, next_edge);
    }
    ops::linear(c, taps, mapping_, &mapping_bias_, mapped);
  }
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
