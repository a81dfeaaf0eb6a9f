#include "models/sa3/same_transformer.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"

namespace apus::sa3 {

namespace {

// A one-entry list (one resampling level, as SAME-L and SAME-S have) read as its value.
int64_t single_level(const Config& c, const std::string& key, int64_t fallback) {
  if (!c.has(key)) return fallback;
  const std::vector<int64_t> v = c.get_ints(key);
  APUS_CHECK(v.size() == 1, c.path, ": '", key, "' has ", v.size(),
             " levels; SAME-L and SAME-S have one (several levels are not supported)");
  APUS_CHECK(v[0] >= 0 && v[0] <= (int64_t(1) << 24), c.path, ": '", key, "' is ", v[0], ", out of range");
  return v[0];
}

}  // namespace

SameConfig SameConfig::read(const Config& c, bool encoder) {
  SameConfig s{};
  s.audio_channels = c.get_size("audio_channels", 2, 1);
  s.patch_size = c.get_size("patch_size", 256, 1);
  s.latent_dim = c.get_size("latent_dim", 256, 1);
  const int64_t channels = c.get_size("encoder_channels", 128, 1);
  s.dim = channels * std::max<int64_t>(1, single_level(c, "encoder_c_mults", 6));
  s.stride = std::max<int64_t>(1, single_level(c, "encoder_strides", 16));
  s.depth = std::max<int64_t>(1, single_level(c, "encoder_transformer_depths", 6));
  s.sin_blocks = single_level(c, encoder ? "encoder_sinusoidal_blocks" : "decoder_sinusoidal_blocks", 0);
  s.head_dim = std::min(c.get_size("dim_heads", 64, 1), s.dim);
  APUS_CHECK(s.dim % s.head_dim == 0, c.path, ": model width ", s.dim, " is not a multiple of dim_heads ", s.head_dim);
  APUS_CHECK(s.head_dim / 2 >= 2 && (s.head_dim / 2) % 2 == 0, c.path, ": dim_heads ", s.head_dim,
             " leaves no even RoPE width (head_dim / 2)");
  s.ff_inner = s.dim * c.get_size("ff_mult", 3, 1);
  // The official band: sliding_window latents on either side, each a group of stride + 1 tokens.
  s.window = c.get_size("sliding_window", 1, 0) * (s.stride + 1);
  APUS_CHECK(s.window > 0, c.path, ": sliding_window 0 means SAME-S's chunked attention, which ",
             "diffusers' AutoencoderSAME does not hold (SAME-S loads from official checkpoints)");
  s.sample_rate = c.get_size("sampling_rate", 44100, 1);
  s.differential = c.get_bool("use_differential_attention", true);
  return s;
}

SameTransformer SameTransformer::load(const SameConfig& config, const WeightLoader& converted,
                                      const std::string& prefix, const ProcessGroup* tensor_ranks) {
  SameTransformer t;
  t.cfg_ = config;
  const int64_t d = config.dim, hd = config.head_dim, f = config.ff_inner;
  t.split_ = TensorSplit(tensor_ranks, d / hd, hd, d, f);
  const TensorSplit& split = t.split_;
  auto param = [&](const std::string& name, const Shape& shape) { return converted.get(name, shape); };
  auto held = [&](const std::string& name, const Shape& shape, const std::vector<Share>& rows) {
    return split.fetch(converted, name, shape, rows);
  };
  const int64_t parts = config.differential ? 5 : 3;
  std::vector<Share> head_terms;  // q (and q2), k (and k2), v: each d wide, split by heads
  for (int64_t j = 0; j < parts; ++j) head_terms.push_back(split.rows(split.heads(), j * d));
  const std::vector<Share> features{split.rows(split.hidden())};
  const std::vector<Share> halves{split.rows(split.mlp()), split.rows(split.mlp(), f)};
  auto norm = [&](const std::string& p, int64_t width) {
    return Norm{param(p + ".alpha", {1}), param(p + ".gamma", {width}), param(p + ".beta", {width})};
  };
  for (int64_t i = 0; i < config.depth; ++i) {
    const std::string p = prefix + "transformers." + std::to_string(i) + ".";
    Block b;
    b.attn_norm = norm(p + "norm_attn", d);
    b.ff_norm = norm(p + "norm_ff", d);
    b.q_norm = norm(p + "attn.q_norm", hd);
    b.k_norm = norm(p + "attn.k_norm", hd);
    b.to_qkv = held(p + "attn.to_qkv.weight", {parts * d, d}, head_terms);
    b.to_out = held(p + "attn.to_out.weight", {d, d}, features);
    b.ff_in = held(p + "ff.proj_in.weight", {2 * f, d}, halves);
    b.ff_in_bias = held(p + "ff.proj_in.bias", {2 * f}, halves);
    b.ff_out = held(p + "ff.proj_out.weight", {d, f}, features);
    b.ff_out_bias = held(p + "ff.proj_out.bias", {d}, features);
    t.blocks_.push_back(b);
  }
  return t;
}

void SameTransformer::block(Context& c, const Block& b, int64_t index, Tensor& x, const ops::AttentionOptions& attn,
                            const Tensor& cos, const Tensor& sin) const {
  ArenaScope scope(*c.arena);
  const SameConfig& g = cfg_;
  const int64_t rows = x.shape[0], d = g.dim, hd = g.head_dim, f = g.ff_inner;
  const int64_t nq = g.differential ? 2 : 1;
  // This rank's columns of each q, k, v term (its heads) and its feed-forward features; all of
  // them without a tensor split.
  const int64_t hq = split_.cols(split_.heads()), fm = split_.cols(split_.mlp());
  Tensor normed = Tensor::in(*c.arena, {rows, d}, c.act);
  Tensor proj = Tensor::in(*c.arena, {rows, d}, c.act);
  std::optional<CostScope> part(std::in_place, c, "attn");
  ops::dyt(c, x, b.attn_norm.alpha, b.attn_norm.gamma, b.attn_norm.beta, normed, ops::Rounding::each_step);
  {
    ArenaScope attn_scope(*c.arena);
    Tensor out = Tensor::in(*c.arena, {rows, d}, c.act);
    TensorSplit::Columns heads(c, split_, out, {split_.heads()});
    if (hq > 0) {  // a rank may hold no heads (more ranks than heads)
      Tensor qkv = Tensor::in(*c.arena, {rows, (2 * nq + 1) * hq}, c.act);
      ops::linear(c, normed, b.to_qkv, nullptr, qkv);
      Tensor q = qkv.cols(0, nq * hq), k = qkv.cols(nq * hq, 2 * nq * hq);
      ops::dyt(c, q, b.q_norm.alpha, b.q_norm.gamma, b.q_norm.beta, q, ops::Rounding::each_step);
      ops::dyt(c, k, b.k_norm.alpha, b.k_norm.gamma, b.k_norm.beta, k, ops::Rounding::each_step);
      ops::rope(c, q, cos, sin, hd, ops::RopeStyle::half, ops::Rounding::once);
      ops::rope(c, k, cos, sin, hd, ops::RopeStyle::half, ops::Rounding::once);
      const Tensor v = qkv.cols(2 * nq * hq, (2 * nq + 1) * hq);
      const float scale = 1.0f / std::sqrt(float(hd));
      if (g.differential)
        ops::differential_attention(c, q.cols(0, hq), k.cols(0, hq), q.cols(hq, 2 * hq), k.cols(hq, 2 * hq), v,
                                    heads.mine(), hd, scale, attn);
      else ops::attention(c, q, k, v, heads.mine(), hd, scale, attn);
    }
    heads.gather("SAME's attention heads");
    split_.project(c, out, b.to_out, nullptr, proj, "SAME's attention projection");
  }
  ops::add_gated(c, x, proj, nullptr, ops::Rounding::each_step);

  part.emplace(c, "ff");
  ops::dyt(c, x, b.ff_norm.alpha, b.ff_norm.gamma, b.ff_norm.beta, normed, ops::Rounding::each_step);
  {
    ArenaScope ff_scope(*c.arena);
    Tensor up = Tensor::in(*c.arena, {rows, 2 * fm}, c.act), act = Tensor::in(*c.arena, {rows, f}, c.act);
    TensorSplit::Columns features(c, split_, act, {split_.mlp()});
    ops::linear(c, normed, b.ff_in, &b.ff_in_bias, up);
    // The official rule: the last sin_blocks blocks use sin(pi x), the others SiLU.
    const bool sinusoidal = g.depth - index < g.sin_blocks;
    ops::glu(c, up.cols(fm, 2 * fm), up.cols(0, fm), features.mine(),
             sinusoidal ? ops::Activation::sin_pi : ops::Activation::silu, ops::Rounding::each_step);
    features.gather("SAME's feed-forward features");
    split_.project(c, act, b.ff_out, &b.ff_out_bias, proj, "SAME's feed-forward projection");
  }
  ops::add_gated(c, x, proj, nullptr, ops::Rounding::each_step);
}

void SameTransformer::run(Context& c, Tensor& x, int64_t batch) const {
  ArenaScope scope(*c.arena);
  const SameConfig& g = cfg_;
  const int64_t d = g.dim, tokens = x.shape[0] / batch;
  // RoPE over the tokens one attention sees (a sample's N, or one chunk's), half of each head
  // turned.
  const bool chunked = g.window == 0;
  const int64_t seen = chunked ? g.chunk_tokens : tokens;
  APUS_CHECK(!chunked || tokens % seen == 0, "SAME: ", tokens / (g.stride + 1),
             " latents do not fill whole attention chunks of ", seen / (g.stride + 1),
             " (the official pipeline's canvases do)");
  const Tensor positions = ops::host_filled(c, {seen, 1}, DType::i64, [&](Tensor& p) {
    for (int64_t i = 0; i < seen; ++i) p.ptr<int64_t>()[i] = i;
  });
  Tensor cos = Tensor::in(*c.arena, {seen, g.head_dim / 4}, DType::f32);
  Tensor sin = Tensor::in(*c.arena, {seen, g.head_dim / 4}, DType::f32);
  ops::rope_tables(c, positions, {g.head_dim / 2}, 10000.0, ops::RopeMath::f32, cos, sin);
  auto run_blocks = [&](Tensor& h, int64_t from, int64_t to) {
    const int64_t attend_batch = chunked ? h.shape[0] / seen : batch;
    const ops::AttentionOptions attn{false, nullptr, attend_batch, 0.0f, ops::Rounding::once, g.window};
    for (int64_t i = from; i < to; ++i) {
      CostScope block_scope(c, "block." + std::to_string(i));
      mark_depth_boundary(c, h);
      block(c, blocks_[size_t(i)], i, h, attn, cos, sin);
    }
  };
  const int64_t split = chunked && g.midpoint_shift ? g.depth / 2 : g.depth;
  run_blocks(x, 0, split);
  if (split == g.depth) return;
  // The second half on chunks shifted by half a chunk: each sample's first and last half chunk
  // repeated at its ends, cropped off after.
  const int64_t shift = seen / 2, n = tokens + 2 * shift;
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

Tensor weight_normed_mapping(const WeightLoader& weights, DType compute, const std::string& prefix, int64_t out,
                             int64_t in, int64_t kernel) {
  // A checkpoint may hold the weight with its norm folded in (sa3.cpp's GGUF files).
  if (!weights.contains(prefix + ".weight_v") && weights.contains(prefix + ".weight")) {
    const Tensor stored = weights.host(prefix + ".weight", {out, in, kernel});
    if (!stored.data) return Tensor::shape_only({out, kernel * in}, compute);
    const Tensor w = to_dtype(stored, DType::f32);
    Tensor mapping = Tensor::heap({out, kernel * in}, DType::f32);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t t = 0; t < kernel; ++t)
          mapping.ptr<float>()[o * kernel * in + t * in + i] = w.ptr<float>()[(o * in + i) * kernel + t];
    return weights.place(compute == DType::f32 ? mapping : to_dtype(mapping, compute));
  }
  const Tensor g = weights.host(prefix + ".weight_g", {out, 1, 1});
  const Tensor v = weights.host(prefix + ".weight_v", {out, in, kernel});
  if (!v.data) return Tensor::shape_only({out, kernel * in}, compute);
  Tensor mapping = Tensor::heap({out, kernel * in}, DType::f32);
  for (int64_t o = 0; o < out; ++o) {
    double ss = 0;
    for (int64_t i = 0; i < in * kernel; ++i) {
      const double e = load_f32(v, o * in * kernel + i);
      ss += e * e;
    }
    // Squares of stored (at most f32) values cannot overflow a double: a non-finite sum is a
    // non-finite element.
    APUS_CHECK(std::isfinite(ss), weights.where(prefix + ".weight_v"), ": row ", o,
               " holds a value that is not finite");
    APUS_CHECK(ss > 0, weights.where(prefix + ".weight_v"), ": row ", o, " is all zeros (weight norm undefined)");
    const double scale = double(load_f32(g, o)) / std::sqrt(ss);
    for (int64_t i = 0; i < in; ++i)
      for (int64_t t = 0; t < kernel; ++t)
        mapping.ptr<float>()[o * kernel * in + t * in + i] = float(scale * load_f32(v, (o * in + i) * kernel + t));
  }
  return weights.place(compute == DType::f32 ? mapping : to_dtype(mapping, compute));
}

float bottleneck_std(const WeightLoader& weights, DType compute) {
  const Tensor running_std = weights.host("bottleneck.running_std", {1});
  if (!running_std.data) return 1.0f;
  const float std = round_as(compute, load_f32(running_std, 0));
  APUS_CHECK(std::isfinite(std) && std > 0, weights.where("bottleneck.running_std"), " is ", std,
             ", expected a finite positive number (the latents' scale)");
  return std;
}

Tensor conv_taps(Context& c, const Tensor& x, int64_t batch) {
  const int64_t n = x.shape[0] / batch, d = x.shape[1];
  Tensor taps = Tensor::in(*c.arena, {batch * n, 3 * d}, x.dtype);
  const Tensor zero = ops::zeros(c, {1, d}, x.dtype);
  for (int64_t b = 0; b < batch; ++b) {
    const Tensor src = x.rows(b * n, (b + 1) * n);
    Tensor dst = taps.rows(b * n, (b + 1) * n);
    Tensor prev = dst.rows(1, n).cols(0, d), prev_edge = dst.rows(0, 1).cols(0, d);
    Tensor mid = dst.cols(d, 2 * d);
    Tensor next = dst.rows(0, n - 1).cols(2 * d, 3 * d), next_edge = dst.rows(n - 1, n).cols(2 * d, 3 * d);
    ops::copy(c, src.rows(0, n - 1), prev);
    ops::copy(c, zero, prev_edge);
    ops::copy(c, src, mid);
    ops::copy(c, src.rows(1, n), next);
    ops::copy(c, zero, next_edge);
  }
  return taps;
}

std::vector<SameChunk> same_chunks(int64_t frames) {
  std::vector<int64_t> starts;
  for (int64_t s = 0; s + kSameChunk <= frames; s += kSameChunk - kSameOverlap) starts.push_back(s);
  if (starts.back() != frames - kSameChunk) starts.push_back(frames - kSameChunk);
  std::vector<SameChunk> chunks;
  const int64_t half = kSameOverlap / 2;
  for (size_t i = 0; i < starts.size(); ++i)
    chunks.push_back({starts[i], i == 0 ? 0 : half, i + 1 == starts.size() ? kSameChunk : kSameChunk - half});
  return chunks;
}

}  // namespace apus::sa3
