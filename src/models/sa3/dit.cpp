#include "models/sa3/dit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "models/sa3/fourier.h"

namespace apus::sa3 {

DitConfig DitConfig::read_sizes(const Config& c, const DitConfig& defaults) {
  DitConfig d = defaults;
  d.io_channels = c.get_size("io_channels", defaults.io_channels, 1);
  APUS_CHECK(c.get_int("patch_size", 1) == 1, c.path, ": 'patch_size' ", c.get_int("patch_size", 1),
             " is not supported (every published model uses 1)");
  d.dim = c.get_size("embed_dim", defaults.dim, 1);
  d.depth = c.get_size("depth", defaults.depth, 1);
  d.heads = c.get_size("num_heads", defaults.heads, 1);
  d.derive_heads(c.path);
  d.cond_dim = c.get_size("cond_token_dim", defaults.cond_dim, 1);
  d.global_dim = c.get_size("global_cond_dim", defaults.global_dim, 1);
  d.local_dim = c.get_size("local_add_cond_dim", defaults.local_dim, 1);
  d.timestep_features = c.get_size("timestep_features_dim", 256, 2);
  APUS_CHECK(d.timestep_features % 2 == 0, c.path, ": timestep_features_dim ", d.timestep_features,
             " must be even (cos and sin halves)");
  return d;
}

DitConfig DitConfig::read(const Config& c) {
  // StableAudio3DiTModel's defaults: the medium model.
  DitConfig defaults{};
  defaults.io_channels = 256;
  defaults.dim = 1536;
  defaults.depth = 24;
  defaults.heads = 24;
  defaults.cond_dim = defaults.global_dim = 768;
  defaults.local_dim = 257;
  DitConfig d = read_sizes(c, defaults);
  const double mult = c.get_double("ff_mult", 4.0);
  APUS_CHECK(mult > 0 && mult <= 64, c.path, ": ff_mult ", mult, " out of range");
  d.ff_inner = int64_t(double(d.dim) * mult);
  d.memory_tokens = c.get_size("num_memory_tokens", 64, 0);
  d.differential = c.get_bool("use_differential_attention", true);
  return d;
}

void DitConfig::derive_heads(const std::string& where) {
  APUS_CHECK(dim % heads == 0, where, ": embed_dim ", dim, " is not a multiple of num_heads ", heads);
  head_dim = dim / heads;
  // The official ContinuousTransformer turns max(head_dim / 2, 32) channels of each head.
  rope_dim = std::max<int64_t>(head_dim / 2, 32);
  APUS_CHECK(rope_dim <= head_dim && rope_dim % 2 == 0, where, ": head dimension ", head_dim,
             " is too small for the official RoPE width ", rope_dim);
}

TensorSplit tensor_split(const DitConfig& c, const ProcessGroup* tensor_ranks) {
  return TensorSplit(tensor_ranks, c.heads, c.head_dim, c.dim, c.ff_inner);
}

std::map<std::string, std::vector<Share>> held_rows(const DitConfig& c, const TensorSplit& split) {
  std::map<std::string, std::vector<Share>> rows;
  if (!split.splits()) return rows;
  const int64_t d = c.dim, f = c.ff_inner, nq = c.differential ? 2 : 1;
  // A fused projection of `terms` parts of width d, each split by heads (q, q2, k, k2, v).
  auto head_terms = [&](int64_t terms) {
    std::vector<Share> held;
    for (int64_t j = 0; j < terms; ++j) held.push_back(split.rows(split.heads(), j * d));
    return held;
  };
  const std::vector<Share> features{split.rows(split.hidden())};
  // The feed-forward's fused projection: the two halves its GLU multiplies.
  const std::vector<Share> halves{split.rows(split.mlp()), split.rows(split.mlp(), f)};
  for (int64_t i = 0; i < c.depth; ++i) {
    const std::string p = "transformer_blocks." + std::to_string(i) + ".";
    rows[p + "self_attn.to_qkv.weight"] = head_terms(2 * nq + 1);
    rows[p + "cross_attn.to_q.weight"] = head_terms(nq);
    rows[p + "cross_attn.to_kv.weight"] = head_terms(nq + 1);
    rows[p + "ff.proj_in.weight"] = rows[p + "ff.proj_in.bias"] = halves;
    for (const char* n :
         {"self_attn.to_out.weight", "cross_attn.to_out.weight", "ff.proj_out.weight", "ff.proj_out.bias",
          "to_local_embed.0.weight", "to_local_embed.0.bias", "to_local_embed.2.weight", "to_local_embed.2.bias"})
      rows[p + n] = features;
  }
  return rows;
}

Dit Dit::load(const DitConfig& config, WeightLoader weights, DType compute, const ProcessGroup* tensor_ranks) {
  Dit m(std::move(weights));
  m.cfg_ = config;
  const DitConfig& c = m.cfg_;
  const int64_t d = c.dim, hd = c.head_dim, f = c.ff_inner;
  m.split_ = tensor_split(c, tensor_ranks);
  const TensorSplit& split = m.split_;
  // What the model computes with; what it derives values from at load it reads as stored (m.weights_).
  const WeightLoader converted = m.weights_.with(std::make_shared<ConvertTo>(compute));
  auto gemm = [&](const std::string& name, const Shape& shape) { return converted.get(name, shape); };
  auto& vec = gemm;
  const std::map<std::string, std::vector<Share>> rows = held_rows(c, split);
  // A block linear or its bias: this rank's rows of it under a tensor split, else the whole tensor.
  auto block = [&](const std::string& name, const Shape& shape) { return split.fetch(converted, rows, name, shape); };
  m.time_1_ = gemm("to_timestep_embed.0.weight", {d, c.timestep_features});
  m.time_1_bias_ = vec("to_timestep_embed.0.bias", {d});
  m.time_2_ = gemm("to_timestep_embed.2.weight", {d, d});
  m.time_2_bias_ = vec("to_timestep_embed.2.bias", {d});
  m.cond_1_ = gemm("to_cond_embed.0.weight", {d, c.cond_dim});
  m.cond_2_ = gemm("to_cond_embed.2.weight", {d, d});
  m.global_1_ = gemm("to_global_embed.0.weight", {d, c.global_dim});
  m.global_2_ = gemm("to_global_embed.2.weight", {d, d});
  m.mod_1_ = gemm("global_cond_embedder.0.weight", {d, d});
  m.mod_1_bias_ = vec("global_cond_embedder.0.bias", {d});
  m.mod_2_ = gemm("global_cond_embedder.2.weight", {6 * d, d});
  m.mod_2_bias_ = vec("global_cond_embedder.2.bias", {6 * d});
  m.pre_conv_ =
      gemm("preprocess_conv.weight", {c.io_channels, c.io_channels, 1}).reshape({c.io_channels, c.io_channels});
  m.post_conv_ =
      gemm("postprocess_conv.weight", {c.io_channels, c.io_channels, 1}).reshape({c.io_channels, c.io_channels});
  m.proj_in_ = gemm("proj_in.weight", {d, c.io_channels});
  m.proj_out_ = gemm("proj_out.weight", {c.io_channels, d});
  if (c.memory_tokens > 0) m.memory_ = vec("memory_tokens", {c.memory_tokens, d});
  m.padding_ = vec("prompt_padding_embedding", {c.cond_dim});
  // The checkpoint stores the RoPE inverse frequencies the official module registers as an fp32
  // buffer; apus computes them (10000^(-2j/rope_dim) in fp32) and refuses a checkpoint whose buffer
  // says otherwise. A checkpoint saved in bf16 or f16 holds them rounded to its dtype, up to half
  // that dtype's ulp away. The official load copies the rounded values into the fp32 buffer; apus
  // keeps the fp32 ones, as it keeps them in every 16-bit run (docs/DESIGN.md, Precision). sa3.cpp's
  // GGUF files drop the buffer.
  const Tensor inv_freq = m.weights_.contains("rotary_pos_emb.inv_freq")
                              ? m.weights_.host("rotary_pos_emb.inv_freq", {c.rope_dim / 2})
                              : Tensor::shape_only({c.rope_dim / 2}, DType::f32);
  // A 16-bit buffer is within one of its ulps of the frequency: the official module computed in
  // that dtype (the power and the reciprocal each rounded) lands up to one ulp away, a bf16 copy of
  // the fp32 buffer half an ulp (an element 0.96 ulp off, 0.558594 for 0.562341, was once refused).
  const int mantissa = inv_freq.dtype == DType::bf16 ? 7 : inv_freq.dtype == DType::f16 ? 10 : -1;
  if (inv_freq.data)
    for (int64_t j = 0; j < c.rope_dim / 2; ++j) {
      const float expected = 1.0f / std::pow(10000.0f, float(2 * j) / float(c.rope_dim));
      const float ulp = mantissa < 0 ? 0.0f : std::ldexp(1.0f, std::ilogb(expected) - mantissa);
      APUS_CHECK(std::fabs(load_f32(inv_freq, j) - expected) <= ulp + 1e-6f * expected,
                 m.weights_.where("rotary_pos_emb.inv_freq"), ": element ", j, " is ", load_f32(inv_freq, j),
                 ", expected ", expected, " (RoPE base 10000 over ", c.rope_dim, " channels, stored as ",
                 dtype_name(inv_freq.dtype), ")");
    }
  m.time_freqs_ = converted.place(expo_fourier_frequencies(c.timestep_features / 2, 0.5, 10000.0));
  Tensor ones = Tensor::heap({6 * d}, DType::f32);
  std::fill_n(ones.ptr<float>(), 6 * d, 1.0f);
  m.ones_ = converted.place(ones);
  const int64_t qkv = (c.differential ? 5 : 3) * d, nq = c.differential ? 2 : 1;
  for (int64_t i = 0; i < c.depth; ++i) {
    const std::string p = "transformer_blocks." + std::to_string(i) + ".";
    Block b;
    b.pre_norm = vec(p + "pre_norm.gamma", {d});
    b.cross_norm = vec(p + "cross_attend_norm.gamma", {d});
    b.ff_norm = vec(p + "ff_norm.gamma", {d});
    b.scale_shift_gate = vec(p + "to_scale_shift_gate", {6 * d});
    b.to_qkv = block(p + "self_attn.to_qkv.weight", {qkv, d});
    b.to_out = block(p + "self_attn.to_out.weight", {d, d});
    b.q_norm = vec(p + "self_attn.q_norm.gamma", {hd});
    b.k_norm = vec(p + "self_attn.k_norm.gamma", {hd});
    b.cross_q = block(p + "cross_attn.to_q.weight", {nq * d, d});
    b.cross_kv = block(p + "cross_attn.to_kv.weight", {(nq + 1) * d, d});
    b.cross_out = block(p + "cross_attn.to_out.weight", {d, d});
    b.cross_q_norm = vec(p + "cross_attn.q_norm.gamma", {hd});
    b.cross_k_norm = vec(p + "cross_attn.k_norm.gamma", {hd});
    b.ff_in = block(p + "ff.proj_in.weight", {2 * f, d});
    b.ff_in_bias = block(p + "ff.proj_in.bias", {2 * f});
    b.ff_out = block(p + "ff.proj_out.weight", {d, f});
    b.ff_out_bias = block(p + "ff.proj_out.bias", {d});
    b.local_1 = block(p + "to_local_embed.0.weight", {d, c.local_dim});
    b.local_1_bias = block(p + "to_local_embed.0.bias", {d});
    b.local_2 = block(p + "to_local_embed.2.weight", {d, d});
    b.local_2_bias = block(p + "to_local_embed.2.bias", {d});
    m.blocks_.push_back(b);
  }
  return m;
}

DitPrologue DitPrologue::samples(int64_t first, int64_t count) const {
  DitPrologue p = *this;
  p.batch = count;
  // Each per-sample tensor holds `batch` equal runs of rows.
  auto mine = [&](const Tensor& t) {
    const int64_t per = t.shape[0] / batch;
    return t.rows(first * per, (first + count) * per);
  };
  p.global = mine(global);
  for (std::vector<Tensor>* list : {&p.cross_k, &p.cross_v, &p.local})
    for (Tensor& t : *list)
      if (t.defined()) t = mine(t);
  return p;
}

DitPrologue DitPrologue::rank_share(Context& c, const SequenceSplit& split) const {
  const int rank = split.group->rank();
  const Share mem = split.share(0, rank), own = split.share(1, rank);
  APUS_CHECK(split.runs.size() == 2 && split.runs[0] == memory.count && split.runs[1] == frames,
             "dit: a sequence split of ", split.tokens(), " tokens for a prologue of ", memory.count, " + ", frames);
  DitPrologue p = *this;
  p.sequence = split;
  p.memory = mem;
  p.frames = own.count;
  // The padding is the last frames: this rank's are the end of its share.
  p.valid_frames = std::clamp<int64_t>(valid_frames - own.first, 0, own.count);
  p.local.clear();
  for (const Tensor& t : local) {
    Tensor mine = ops::empty(c, {batch * own.count, t.shape[1]}, t.dtype);
    for (int64_t b = 0; b < batch && own.count > 0; ++b) {
      Tensor to = mine.rows(b * own.count, (b + 1) * own.count);
      ops::copy(c, t.rows(b * frames + own.first, b * frames + own.first + own.count), to);
    }
    p.local.push_back(mine);
  }
  for (const auto& [from, to] : {std::pair{&cos, &p.cos}, std::pair{&sin, &p.sin}}) {
    *to = ops::empty(c, {mem.count + own.count, from->shape[1]}, from->dtype);
    Tensor head = to->rows(0, mem.count), tail = to->rows(mem.count, mem.count + own.count);
    if (mem.count > 0) ops::copy(c, from->rows(mem.first, mem.first + mem.count), head);
    if (own.count > 0) ops::copy(c, from->rows(memory.count + own.first, memory.count + own.first + own.count), tail);
  }
  return p;
}

void Dit::mlp(Context& c, const Tensor& x, const Tensor& w1, const Tensor* b1, const Tensor& w2, const Tensor* b2,
              Tensor& y) const {
  ArenaScope scope(*c.arena);
  Tensor hidden = Tensor::in(*c.arena, {x.shape[0], w1.shape[0]}, c.act);
  ops::linear(c, x, w1, b1, hidden);
  ops::silu(c, hidden, hidden);
  ops::linear(c, hidden, w2, b2, y);
}

void Dit::local_embedding(Context& c, const Block& b, const Tensor& local, Tensor& y) const {
  ArenaScope scope(*c.arena);
  FeatureSplit split{split_.ranks(), true};
  Tensor hidden = Tensor::in(*c.arena, {local.shape[0], cfg_.dim}, c.act);
  linear(c, &split, local, b.local_1, &b.local_1_bias, hidden, "the local conditioning's features");
  ops::silu(c, hidden, hidden);
  RowParallel row(c);  // under a tensor split its input is gathered, as a block's output projections'
  linear(c, &split, hidden, b.local_2, &b.local_2_bias, y, "the local conditioning's embedding");
}

DitPrologue Dit::prologue(Context& c, const Tensor& cross, const std::vector<int64_t>& cross_valid,
                          const Tensor& global, const Tensor& local, int64_t valid_frames) const {
  const DitConfig& g = cfg_;
  const int64_t batch = global.shape[0], d = g.dim, hd = g.head_dim;
  APUS_CHECK(global.rank() == 2 && global.shape[1] == g.global_dim && batch >= 1, "dit: global condition ",
             shape_str(global.shape), " is not B x global_cond_dim ", g.global_dim);
  APUS_CHECK(cross.rank() == 2 && cross.shape[1] == g.cond_dim && cross.shape[0] % batch == 0 &&
                 int64_t(cross_valid.size()) == cross.shape[0],
             "dit: cross tokens ", shape_str(cross.shape), " (", cross_valid.size(), " mask entries) are not ", batch,
             " x tokens of cond_token_dim ", g.cond_dim);
  APUS_CHECK(local.rank() == 2 && local.shape[1] == g.local_dim && local.shape[0] % batch == 0,
             "dit: local conditioning ", shape_str(local.shape), " is not B x frames x ", g.local_dim);
  const int64_t ctx = cross.shape[0] / batch;
  DitPrologue p;
  p.batch = batch;
  p.frames = local.shape[0] / batch;
  p.valid_frames = valid_frames > 0 ? valid_frames : p.frames;
  p.memory = {0, g.memory_tokens};
  APUS_CHECK(p.valid_frames <= p.frames, "dit: ", p.valid_frames, " valid frames of ", p.frames);
  CostScope scope(c, "dit/prologue");
  ArenaScope arena(*c.arena);

  // Padded text positions take the learned padding embedding, then to_cond_embed projects: a
  // gather from the tokens with the padding row appended (the same three ops whatever the mask).
  const int64_t rows = batch * ctx;
  Tensor table = Tensor::in(*c.arena, {rows + 1, g.cond_dim}, c.act);
  Tensor table_tokens = table.rows(0, rows), table_padding = table.rows(rows, rows + 1);
  ops::copy(c, cross, table_tokens);
  ops::copy(c, padding_.reshape({1, g.cond_dim}), table_padding);
  const Tensor ids = ops::host_filled(c, {rows}, DType::i32, [&](Tensor& t) {
    for (int64_t r = 0; r < rows; ++r) t.ptr<int32_t>()[r] = int32_t(cross_valid[size_t(r)] ? r : rows);
  });
  Tensor tokens = Tensor::in(*c.arena, {rows, g.cond_dim}, c.act);
  ops::embedding(c, table, ids, tokens);
  Tensor context = Tensor::in(*c.arena, {batch * ctx, d}, c.act);
  mlp(c, tokens, cond_1_, nullptr, cond_2_, nullptr, context);
  p.global = ops::empty(c, {batch, d}, c.act);
  mlp(c, global, global_1_, nullptr, global_2_, nullptr, p.global);

  // Cross-attention keys (normed) and values, and the local conditioning: fixed for the request.
  // Under a tensor split, this rank's heads' keys and values (none for a rank without heads).
  const int64_t nq = g.differential ? 2 : 1, hq = split_.cols(split_.heads());
  for (const Block& b : blocks_) {
    Tensor k, v;
    if (hq > 0) {
      Tensor kv = Tensor::in(*c.arena, {batch * ctx, (nq + 1) * hq}, c.act);
      ops::linear(c, context, b.cross_kv, nullptr, kv);
      k = ops::empty(c, {batch * ctx, nq * hq}, c.act);
      v = ops::empty(c, {batch * ctx, hq}, c.act);
      ops::rms_norm(c, kv.cols(0, nq * hq), b.cross_k_norm, k, g.qk_norm_eps, hd, ops::Rounding::once);
      ops::copy(c, kv.cols(nq * hq, (nq + 1) * hq), v);
    }
    p.cross_k.push_back(k);
    p.cross_v.push_back(v);
    Tensor emb = ops::empty(c, {batch * p.frames, d}, c.act);
    local_embedding(c, b, local, emb);
    p.local.push_back(emb);
  }
  // RoPE over memory tokens and frames, one sample's positions 0..N-1, fp32 angles.
  const int64_t n = g.memory_tokens + p.frames;
  const Tensor positions = ops::host_filled(c, {n, 1}, DType::i64, [&](Tensor& t) {
    for (int64_t i = 0; i < n; ++i) t.ptr<int64_t>()[i] = i;
  });
  if (p.frames > p.valid_frames) p.padding_zeros = ops::zeros(c, {p.frames - p.valid_frames, d}, c.act);
  p.cos = ops::empty(c, {n, g.rope_dim / 2}, DType::f32);
  p.sin = ops::empty(c, {n, g.rope_dim / 2}, DType::f32);
  ops::rope_tables(c, positions, {g.rope_dim}, 10000.0, ops::RopeMath::f32, p.cos, p.sin);
  return p;
}

void Dit::block(Context& c, const Block& b, size_t index, const DitPrologue& pro, Tensor& x, const Tensor& mod) const {
  ArenaScope scope(*c.arena);
  const DitConfig& g = cfg_;
  const int64_t batch = pro.batch, rows = x.shape[0], n = rows / batch, d = g.dim, hd = g.head_dim;
  const int64_t nq = g.differential ? 2 : 1;
  // This rank's columns of each q, k, v term (its heads) and its feed-forward features; all of
  // them without a tensor split.
  const int64_t hq = split_.cols(split_.heads()), fm = split_.cols(split_.mlp());
  const float scale = 1.0f / std::sqrt(float(hd));
  // This block's (scale, shift, gate) x (self-attention, feed-forward), [B, 6D]: its own bias
  // plus the shared modulation.
  Tensor m = Tensor::in(*c.arena, {batch, 6 * d}, c.act);
  ops::affine(c, mod, ones_, b.scale_shift_gate, m, ops::Rounding::each_step);
  auto chunk = [&](int j) { return m.cols(j * d, (j + 1) * d); };
  Tensor gate = Tensor::in(*c.arena, {batch, d}, c.act);
  Tensor normed = Tensor::in(*c.arena, {rows, d}, c.act);
  Tensor attn = Tensor::in(*c.arena, {rows, d}, c.act), proj = Tensor::in(*c.arena, {rows, d}, c.act);
  auto norm_modulated = [&](const Tensor& gamma, int scale_chunk) {
    ops::rms_norm(c, x, gamma, normed, g.norm_eps, d, ops::Rounding::once);
    ops::modulate(c, normed, chunk(scale_chunk + 1), chunk(scale_chunk), normed, ops::Rounding::each_step);
  };
  // Attention over q (and q2), k (and k2) terms of width hq each, into out [rows, hq].
  auto attend = [&](const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const ops::AttentionOptions opts{false, nullptr, batch};
    if (g.differential)
      ops::differential_attention(c, q.cols(0, hq), k.cols(0, hq), q.cols(hq, 2 * hq), k.cols(hq, 2 * hq), v, out, hd,
                                  scale, opts);
    else ops::attention(c, q, k, v, out, hd, scale, opts);
  };

  std::optional<CostScope> part(std::in_place, c, "self_attn");
  norm_modulated(b.pre_norm, 0);
  {
    TensorSplit::Columns heads(c, split_, attn, {split_.heads()});
    if (hq > 0) {  // a rank may hold no heads (more ranks than heads)
      Tensor qkv = Tensor::in(*c.arena, {rows, (2 * nq + 1) * hq}, c.act);
      ops::linear(c, normed, b.to_qkv, nullptr, qkv);
      Tensor q = qkv.cols(0, nq * hq), k = qkv.cols(nq * hq, 2 * nq * hq);
      ops::rms_norm(c, q, b.q_norm, q, g.qk_norm_eps, hd, ops::Rounding::once);
      ops::rms_norm(c, k, b.k_norm, k, g.qk_norm_eps, hd, ops::Rounding::once);
      ops::rope(c, q, pro.cos, pro.sin, hd, ops::RopeStyle::half, ops::Rounding::once);
      ops::rope(c, k, pro.cos, pro.sin, hd, ops::RopeStyle::half, ops::Rounding::once);
      Tensor v = qkv.cols(2 * nq * hq, (2 * nq + 1) * hq);
      const int64_t padded = pro.frames - pro.valid_frames;
      if (padded > 0) {
        for (int64_t s = 0; s < batch; ++s) {
          Tensor rows = v.rows((s + 1) * n - padded, (s + 1) * n);
          ops::copy(c, pro.padding_zeros.rows(0, padded).cols(0, hq), rows);
        }
      }
      if (pro.sequence) {
        // The query and key terms (two each for the differential attention), each of width hq.
        std::vector<Tensor> terms;
        for (const Tensor* t : {&q, &k})
          for (int64_t term = 0; term < nq; ++term) terms.push_back(t->cols(term * hq, (term + 1) * hq));
        std::vector<const Tensor*> qs, ks;
        for (int64_t term = 0; term < nq; ++term) {
          qs.push_back(&terms[size_t(term)]);
          ks.push_back(&terms[size_t(nq + term)]);
        }
        sequence_attention(c, *pro.sequence, qs, ks, v, heads.mine(), hd, scale, {false, nullptr, batch});
      } else {
        attend(q, k, v, heads.mine());
      }
    }
    heads.gather("the self-attention's heads");
  }
  split_.project(c, attn, b.to_out, nullptr, proj, "the self-attention's projection");
  ops::gate_sigmoid(c, chunk(2), gate, ops::Rounding::each_step);
  ops::add_gated(c, x, proj, &gate, ops::Rounding::each_step);

  part.emplace(c, "cross_attn");
  ops::rms_norm(c, x, b.cross_norm, normed, g.norm_eps, d, ops::Rounding::once);
  {
    TensorSplit::Columns heads(c, split_, attn, {split_.heads()});
    if (hq > 0) {
      Tensor q = Tensor::in(*c.arena, {rows, nq * hq}, c.act);
      ops::linear(c, normed, b.cross_q, nullptr, q);
      ops::rms_norm(c, q, b.cross_q_norm, q, g.qk_norm_eps, hd, ops::Rounding::once);
      attend(q, pro.cross_k[index], pro.cross_v[index], heads.mine());
    }
    heads.gather("the cross-attention's heads");
  }
  split_.project(c, attn, b.cross_out, nullptr, proj, "the cross-attention's projection");
  ops::add_gated(c, x, proj, nullptr, ops::Rounding::each_step);

  // Local conditioning on the frames, not the memory tokens.
  part.emplace(c, "local");
  const int64_t mem = pro.memory.count, frames = n - mem;
  for (int64_t s = 0; s < batch; ++s) {
    Tensor audio = x.rows(s * n + mem, (s + 1) * n);
    ops::add_gated(c, audio, pro.local[index].rows(s * frames, (s + 1) * frames), nullptr, ops::Rounding::each_step);
  }

  part.emplace(c, "ff");
  norm_modulated(b.ff_norm, 3);
  {
    const int64_t f = g.ff_inner;
    Tensor up = Tensor::in(*c.arena, {rows, 2 * fm}, c.act), act = Tensor::in(*c.arena, {rows, f}, c.act);
    TensorSplit::Columns features(c, split_, act, {split_.mlp()});
    ops::linear(c, normed, b.ff_in, &b.ff_in_bias, up);
    ops::glu(c, up.cols(fm, 2 * fm), up.cols(0, fm), features.mine(), ops::Activation::silu, ops::Rounding::each_step);
    features.gather("the feed-forward's features");
    split_.project(c, act, b.ff_out, &b.ff_out_bias, proj, "the feed-forward's projection");
  }
  ops::gate_sigmoid(c, chunk(5), gate, ops::Rounding::each_step);
  ops::add_gated(c, x, proj, &gate, ops::Rounding::each_step);
}

void Dit::forward(Context& c, const DitPrologue& pro, const Tensor& x, float t, Tensor& velocity) const {
  ArenaScope scope(*c.arena);
  const DitConfig& g = cfg_;
  const int64_t batch = pro.batch, frames = pro.frames, mem = pro.memory.count, n = mem + frames;
  const int64_t d = g.dim, io = g.io_channels;
  APUS_CHECK(x.rank() == 2 && x.shape[0] == batch * frames && x.shape[1] == io && velocity.shape == x.shape,
             "dit: latents ", shape_str(x.shape), " / velocity ", shape_str(velocity.shape), " are not ", batch, " x ",
             frames, " frames of ", io, " channels");
  CostScope dit_scope(c, "dit");
  std::optional<CostScope> part(std::in_place, c, "embed");
  // Timestep: fp32 Fourier features of t, then the MLP; added to the global condition and
  // expanded into the shared modulation [B, 6D].
  Tensor features = Tensor::in(*c.arena, {1, g.timestep_features}, c.act);
  ops::fourier_features(c, t, time_freqs_, features);
  Tensor temb = Tensor::in(*c.arena, {1, d}, c.act);
  mlp(c, features, time_1_, &time_1_bias_, time_2_, &time_2_bias_, temb);
  Tensor global = Tensor::in(*c.arena, {batch, d}, c.act);
  for (int64_t s = 0; s < batch; ++s) {
    Tensor row = global.rows(s, s + 1);
    ops::copy(c, pro.global.rows(s, s + 1), row);
    ops::add_gated(c, row, temb, nullptr, ops::Rounding::each_step);
  }
  Tensor mod = Tensor::in(*c.arena, {batch, 6 * d}, c.act);
  mlp(c, global, mod_1_, &mod_1_bias_, mod_2_, &mod_2_bias_, mod);

  // x + preprocess_conv(x), projected in after the memory tokens of each sample.
  Tensor pre = Tensor::in(*c.arena, {batch * frames, io}, c.act);
  ops::linear(c, x, pre_conv_, nullptr, pre);
  ops::add_gated(c, pre, x, nullptr, ops::Rounding::each_step);
  Tensor hidden = Tensor::in(*c.arena, {batch * n, d}, c.act);
  for (int64_t s = 0; s < batch; ++s) {
    Tensor audio = hidden.rows(s * n + mem, (s + 1) * n);
    ops::linear(c, pre.rows(s * frames, (s + 1) * frames), proj_in_, nullptr, audio);
    if (mem > 0) {
      Tensor memory = hidden.rows(s * n, s * n + mem);
      ops::copy(c, memory_.rows(pro.memory.first, pro.memory.first + mem), memory);
    }
  }
  part.reset();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    CostScope block_scope(c, "block." + std::to_string(i));
    mark_depth_boundary(c, hidden);
    block(c, blocks_[i], i, pro, hidden, mod);
  }
  CostScope final_scope(c, "final");
  // Memory tokens dropped; velocity = h + postprocess_conv(h).
  for (int64_t s = 0; s < batch; ++s) {
    Tensor out = velocity.rows(s * frames, (s + 1) * frames);
    ops::linear(c, hidden.rows(s * n + mem, (s + 1) * n), proj_out_, nullptr, out);
  }
  Tensor post = Tensor::in(*c.arena, {batch * frames, io}, c.act);
  ops::linear(c, velocity, post_conv_, nullptr, post);
  ops::add_gated(c, velocity, post, nullptr, ops::Rounding::each_step);
}

}  // namespace apus::sa3
