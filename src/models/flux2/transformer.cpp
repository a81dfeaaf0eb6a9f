#include "models/flux2/transformer.h"

#include <cmath>
#include <optional>

#include "core/error.h"

namespace apus::flux2 {

TransformerConfig TransformerConfig::read(const Config& c) {
  TransformerConfig t{};
  t.in_channels = c.get_size("in_channels");
  t.out_channels = c.get_size("out_channels", t.in_channels, 1);
  t.heads = c.get_size("num_attention_heads");
  t.head_dim = c.get_size("attention_head_dim");
  t.hidden = t.heads * t.head_dim;
  t.num_double = c.get_size("num_layers");
  t.num_single = c.get_size("num_single_layers");
  t.joint_dim = c.get_size("joint_attention_dim");
  const double mlp_ratio = c.get_double("mlp_ratio", 3.0);
  APUS_CHECK(mlp_ratio > 0 && mlp_ratio <= 64, c.path, ": mlp_ratio ", mlp_ratio, " out of range");
  t.mlp_hidden = int64_t(double(t.hidden) * mlp_ratio);
  t.timestep_channels = c.get_size("timestep_guidance_channels", 256, 2);
  t.axes_dims = c.get_sizes("axes_dims_rope");
  t.rope_theta = c.get_positive("rope_theta", 2000);
  t.eps = float(c.get_positive("eps", 1e-6));
  APUS_CHECK(c.get_int("patch_size", 1) == 1, c.path, ": patch_size ", c.get_int("patch_size", 1),
             " is not supported (expected 1)");
  APUS_CHECK(!c.get_bool("guidance_embeds", false), c.path,
             ": guidance_embeds true is not supported (klein is guidance-distilled without it)");
  int64_t rope_sum = 0;
  for (int64_t d : t.axes_dims) {
    APUS_CHECK(d % 2 == 0, c.path, ": axes_dims_rope entry ", d, " must be even (rotated pairs)");
    rope_sum += d;
  }
  APUS_CHECK(rope_sum == t.head_dim && t.axes_dims.size() == 4, c.path, ": axes_dims_rope must be",
             " four axes summing to attention_head_dim ", t.head_dim);
  return t;
}

TensorSplit tensor_split(const TransformerConfig& c, const ProcessGroup* tensor_ranks) {
  return TensorSplit(tensor_ranks, c.heads, c.head_dim, c.hidden, c.mlp_hidden);
}

std::map<std::string, std::vector<Share>> held_rows(const TransformerConfig& c, const TensorSplit& split) {
  std::map<std::string, std::vector<Share>> rows;
  if (!split.splits()) return rows;
  const int64_t h = c.hidden, f = c.mlp_hidden;
  const std::vector<Share> heads{split.rows(split.heads())}, features{split.rows(split.hidden())};
  // SwiGLU's fused projection: the gate half, then the up half.
  const std::vector<Share> swiglu{split.rows(split.mlp()), split.rows(split.mlp(), f)};
  for (int64_t i = 0; i < c.num_double; ++i) {
    const std::string p = "transformer_blocks." + std::to_string(i) + ".";
    for (const char* n :
         {"attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"})
      rows[p + n + ".weight"] = heads;
    for (const char* n : {"attn.to_out.0", "attn.to_add_out", "ff.linear_out", "ff_context.linear_out"})
      rows[p + n + ".weight"] = features;
    for (const char* n : {"ff.linear_in", "ff_context.linear_in"}) rows[p + n + ".weight"] = swiglu;
  }
  // The single blocks' fused projection: q, k, v, then the MLP's gate and up halves.
  const std::vector<Share> fused{split.rows(split.heads()), split.rows(split.heads(), h),
                                 split.rows(split.heads(), 2 * h), split.rows(split.mlp(), 3 * h),
                                 split.rows(split.mlp(), 3 * h + f)};
  for (int64_t i = 0; i < c.num_single; ++i) {
    const std::string p = "single_transformer_blocks." + std::to_string(i) + ".attn.";
    rows[p + "to_qkv_mlp_proj.weight"] = fused;
    rows[p + "to_out.weight"] = features;
  }
  return rows;
}

Transformer Transformer::load(const Config& config, WeightLoader weights, const ProcessGroup* tensor_ranks) {
  Transformer m(std::move(weights));
  m.cfg_ = TransformerConfig::read(config);
  const auto& c = m.cfg_;
  const WeightLoader& w = m.weights_;
  const int64_t h = c.hidden, d = c.head_dim, f = c.mlp_hidden;
  m.split_ = tensor_split(c, tensor_ranks);
  const TensorSplit& split = m.split_;
  m.x_embedder_ = w.get("x_embedder.weight", {h, c.in_channels});
  m.context_embedder_ = w.get("context_embedder.weight", {h, c.joint_dim});
  m.time_1_ = w.get("time_guidance_embed.timestep_embedder.linear_1.weight", {h, c.timestep_channels});
  m.time_2_ = w.get("time_guidance_embed.timestep_embedder.linear_2.weight", {h, h});
  m.mod_img_ = w.get("double_stream_modulation_img.linear.weight", {6 * h, h});
  m.mod_txt_ = w.get("double_stream_modulation_txt.linear.weight", {6 * h, h});
  m.mod_single_ = w.get("single_stream_modulation.linear.weight", {3 * h, h});
  m.norm_out_ = w.get("norm_out.linear.weight", {2 * h, h});
  m.proj_out_ = w.get("proj_out.weight", {c.out_channels, h});
  const std::map<std::string, std::vector<Share>> rows = held_rows(c, split);
  // A block linear: this rank's rows of it under a tensor split, else the whole weight.
  auto block = [&](const std::string& name, const Shape& shape) { return split.fetch(w, rows, name, shape); };
  for (int64_t i = 0; i < c.num_double; ++i) {
    const std::string p = "transformer_blocks." + std::to_string(i) + ".";
    Double b;
    b.to_q = block(p + "attn.to_q.weight", {h, h});
    b.to_k = block(p + "attn.to_k.weight", {h, h});
    b.to_v = block(p + "attn.to_v.weight", {h, h});
    b.add_q = block(p + "attn.add_q_proj.weight", {h, h});
    b.add_k = block(p + "attn.add_k_proj.weight", {h, h});
    b.add_v = block(p + "attn.add_v_proj.weight", {h, h});
    b.to_out = block(p + "attn.to_out.0.weight", {h, h});
    b.to_add_out = block(p + "attn.to_add_out.weight", {h, h});
    b.norm_q = w.get(p + "attn.norm_q.weight", {d});
    b.norm_k = w.get(p + "attn.norm_k.weight", {d});
    b.norm_added_q = w.get(p + "attn.norm_added_q.weight", {d});
    b.norm_added_k = w.get(p + "attn.norm_added_k.weight", {d});
    b.ff_in = block(p + "ff.linear_in.weight", {2 * f, h});
    b.ff_out = block(p + "ff.linear_out.weight", {h, f});
    b.ff_ctx_in = block(p + "ff_context.linear_in.weight", {2 * f, h});
    b.ff_ctx_out = block(p + "ff_context.linear_out.weight", {h, f});
    m.double_.push_back(b);
  }
  for (int64_t i = 0; i < c.num_single; ++i) {
    const std::string p = "single_transformer_blocks." + std::to_string(i) + ".attn.";
    Single b;
    b.qkv_mlp = block(p + "to_qkv_mlp_proj.weight", {3 * h + 2 * f, h});
    b.out = block(p + "to_out.weight", {h, h + f});
    b.norm_q = w.get(p + "norm_q.weight", {d});
    b.norm_k = w.get(p + "norm_k.weight", {d});
    m.single_.push_back(b);
  }
  return m;
}

TransformerPrologue Transformer::prologue(Context& c, const Tensor& prompt_embeds, const Tensor& txt_ids,
                                          const Tensor& img_ids) const {
  const int64_t t = txt_ids.shape[0], l = img_ids.shape[0];
  APUS_CHECK(txt_ids.rank() == 2 && txt_ids.shape[1] == 4 && img_ids.rank() == 2 && img_ids.shape[1] == 4 &&
                 txt_ids.dtype == DType::i64 && img_ids.dtype == DType::i64,
             "transformer: position ids ", shape_str(txt_ids.shape), " and ", shape_str(img_ids.shape),
             ", expected i64 [T, 4] and [L, 4]");
  APUS_CHECK(
      prompt_embeds.rank() == 2 && prompt_embeds.shape[1] == cfg_.joint_dim && t > 0 && prompt_embeds.shape[0] % t == 0,
      "transformer: prompt embeddings ", shape_str(prompt_embeds.shape), " are not B x ", t,
      " tokens of joint_attention_dim ", cfg_.joint_dim);
  TransformerPrologue p;
  p.batch = prompt_embeds.shape[0] / t;
  CostScope scope(c, "dit/prologue");
  p.txt = ops::empty(c, {p.batch * t, cfg_.hidden}, c.act);
  ops::linear(c, prompt_embeds, context_embedder_, nullptr, p.txt);
  // Tables in float64 then rounded to f32, as the reference's Flux2PosEmbed computes them; text
  // rows first, then image rows, as the joint sequence runs.
  const int64_t half = cfg_.head_dim / 2, s = t + l;
  p.cos = ops::empty(c, {s, half}, DType::f32);
  p.sin = ops::empty(c, {s, half}, DType::f32);
  Tensor txt_cos = p.cos.rows(0, t), txt_sin = p.sin.rows(0, t);
  Tensor img_cos = p.cos.rows(t, s), img_sin = p.sin.rows(t, s);
  ops::rope_tables(c, txt_ids, cfg_.axes_dims, cfg_.rope_theta, ops::RopeMath::f64, txt_cos, txt_sin);
  ops::rope_tables(c, img_ids, cfg_.axes_dims, cfg_.rope_theta, ops::RopeMath::f64, img_cos, img_sin);
  return p;
}

TransformerPrologue TransformerPrologue::samples(int64_t first, int64_t count) const {
  TransformerPrologue p = *this;
  const int64_t t = txt.shape[0] / batch;
  p.batch = count;
  p.txt = txt.rows(first * t, (first + count) * t);
  return p;
}

TransformerPrologue TransformerPrologue::rank_share(Context& c, const SequenceSplit& split) const {
  const int rank = split.group->rank();
  const Share text = split.share(0, rank), image = split.share(1, rank);
  const int64_t t = txt.shape[0] / batch;
  APUS_CHECK(split.runs.size() == 2 && split.runs[0] == t && split.runs[1] == cos.shape[0] - t,
             "transformer: a sequence split of ", split.tokens(), " tokens for a prologue of ", t, " + ",
             cos.shape[0] - t);
  TransformerPrologue p;
  p.batch = batch;
  p.sequence = split;
  p.txt = ops::empty(c, {batch * text.count, txt.shape[1]}, txt.dtype);
  for (int64_t b = 0; b < batch && text.count > 0; ++b) {
    Tensor to = p.txt.rows(b * text.count, (b + 1) * text.count);
    ops::copy(c, txt.rows(b * t + text.first, b * t + text.first + text.count), to);
  }
  for (const auto& [from, to] : {std::pair{&cos, &p.cos}, std::pair{&sin, &p.sin}}) {
    *to = ops::empty(c, {text.count + image.count, from->shape[1]}, from->dtype);
    Tensor head = to->rows(0, text.count), tail = to->rows(text.count, text.count + image.count);
    if (text.count > 0) ops::copy(c, from->rows(text.first, text.first + text.count), head);
    if (image.count > 0) ops::copy(c, from->rows(t + image.first, t + image.first + image.count), tail);
  }
  return p;
}

void Transformer::joint_attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                  const TransformerPrologue& pro, int64_t t, const BlockKv& kv) const {
  const int64_t d = cfg_.head_dim, batch = pro.batch;
  const float scale = 1.0f / std::sqrt(float(d));
  if (pro.sequence) {
    // The references' own pass runs whole on every rank (reference_kv), so every rank holds their
    // keys and values for every head; each sample's sequence takes them after its text.
    APUS_CHECK(!kv.keep, "transformer: the references' own pass is not split over ranks");
    const ExtraKeys references =
        kv.attend ? ExtraKeys{&kv.attend->k, &kv.attend->v, pro.sequence->runs[0]} : ExtraKeys{};
    sequence_attention(c, *pro.sequence, {&q}, {&k}, v, out, d, scale, {false, nullptr, batch}, references);
    return;
  }
  if (kv.keep) {
    ops::copy(c, k, kv.keep->k);
    ops::copy(c, v, kv.keep->v);
  }
  if (!kv.attend) {
    ops::attention(c, q, k, v, out, d, scale, {false, nullptr, batch});
    return;
  }
  // Each sample's keys and values as [txt; references; img], the order the KV pipeline's joint
  // sequence has them in.
  ArenaScope arena(*c.arena);
  const int64_t s = q.shape[0] / batch, r = kv.attend->k.shape[0], sk = s + r, h = q.shape[1];
  Tensor k_all = Tensor::in(*c.arena, {batch * sk, h}, c.act), v_all = Tensor::in(*c.arena, {batch * sk, h}, c.act);
  auto assemble = [&](const Tensor& from, const Tensor& refs, Tensor& to) {
    for (int64_t i = 0; i < batch; ++i) {
      Tensor txt = to.rows(i * sk, i * sk + t), ref = to.rows(i * sk + t, i * sk + t + r),
             img = to.rows(i * sk + t + r, (i + 1) * sk);
      if (t > 0) ops::copy(c, from.rows(i * s, i * s + t), txt);
      ops::copy(c, refs, ref);
      ops::copy(c, from.rows(i * s + t, (i + 1) * s), img);
    }
  };
  assemble(k, kv.attend->k, k_all);
  assemble(v, kv.attend->v, v_all);
  ops::attention(c, q, k_all, v_all, out, d, scale, {false, nullptr, batch});
}

void Transformer::double_block(Context& c, const Double& b, Tensor& hidden, int64_t t, int64_t batch,
                               const Modulation& m, const TransformerPrologue& pro, const BlockKv& kv) const {
  const Tensor &mod_img = m.img, &mod_txt = m.txt;
  ArenaScope scope(*c.arena);
  const int64_t rows = hidden.shape[0], s = rows / batch, h = cfg_.hidden, d = cfg_.head_dim, f = cfg_.mlp_hidden;
  // This rank's q, k, v columns (its heads) and MLP features; all of them without a tensor split.
  const int64_t hq = split_.cols(split_.heads()), fm = split_.cols(split_.mlp());
  // Sample i holds rows [i*s, (i+1)*s): its text, then its image. The streams have their own
  // weights, so stream ops run per sample; the joint ops (rope, attention) run on all rows. The
  // references' own pass has no text (t = 0).
  auto txt_of = [&](const Tensor& x, int64_t i) { return x.rows(i * s, i * s + t); };
  auto img_of = [&](const Tensor& x, int64_t i) { return x.rows(i * s + t, (i + 1) * s); };
  auto mod = [h](const Tensor& m, int j) { return m.cols(j * h, (j + 1) * h); };
  Tensor normed = Tensor::in(*c.arena, {rows, h}, c.act);
  // normed <- LN(x) * (1 + scale) + shift for both streams of sample i, shift and scale being
  // chunks j and j + 1 of each stream's modulation.
  auto modulate = [&](int64_t i, int j) {
    Tensor n_img = img_of(normed, i), n_txt = txt_of(normed, i);
    ops::layer_norm_modulate(c, img_of(hidden, i), mod(mod_img, j), mod(mod_img, j + 1), n_img, cfg_.eps,
                             ops::Rounding::each_step);
    if (t > 0)
      ops::layer_norm_modulate(c, txt_of(hidden, i), mod(mod_txt, j), mod(mod_txt, j + 1), n_txt, cfg_.eps,
                               ops::Rounding::each_step);
  };
  // Both streams' rows of `x` through their linears (`img` and `txt`), sample by sample, into `y`.
  auto streams = [&](const Tensor& x, const Tensor& img, const Tensor& txt, Tensor& y) {
    for (int64_t i = 0; i < batch; ++i) {
      Tensor y_img = img_of(y, i), y_txt = txt_of(y, i);
      ops::linear(c, img_of(x, i), img, nullptr, y_img);
      if (t > 0) ops::linear(c, txt_of(x, i), txt, nullptr, y_txt);
    }
  };
  // The residual stream of both streams += gate * y, the gates chunk j of each stream's modulation.
  auto add_gated = [&](const Tensor& y, int j) {
    const Tensor g_img = mod(mod_img, j), g_txt = mod(mod_txt, j);
    for (int64_t i = 0; i < batch; ++i) {
      Tensor img = img_of(hidden, i), txt = txt_of(hidden, i);
      ops::add_gated(c, img, img_of(y, i), &g_img, ops::Rounding::each_step);
      if (t > 0) ops::add_gated(c, txt, txt_of(y, i), &g_txt, ops::Rounding::each_step);
    }
  };
  std::optional<CostScope> part(std::in_place, c, "attn");
  Tensor attn = Tensor::in(*c.arena, {rows, h}, c.act);
  TensorSplit::Columns heads(c, split_, attn, {split_.heads()});
  if (hq > 0) {  // a rank may hold no heads (more ranks than heads)
    // q, k, v of both streams land in one joint [txt; img] buffer per sample: the concat costs
    // nothing.
    Tensor q = Tensor::in(*c.arena, {rows, hq}, c.act), k = Tensor::in(*c.arena, {rows, hq}, c.act),
           v = Tensor::in(*c.arena, {rows, hq}, c.act);
    for (int64_t i = 0; i < batch; ++i) modulate(i, 0);
    streams(normed, b.to_q, b.add_q, q);
    streams(normed, b.to_k, b.add_k, k);
    streams(normed, b.to_v, b.add_v, v);
    for (int64_t i = 0; i < batch; ++i) {
      Tensor q_img = img_of(q, i), k_img = img_of(k, i), q_txt = txt_of(q, i), k_txt = txt_of(k, i);
      ops::rms_norm(c, q_img, b.norm_q, q_img, cfg_.eps, d, ops::Rounding::once);
      ops::rms_norm(c, k_img, b.norm_k, k_img, cfg_.eps, d, ops::Rounding::once);
      if (t == 0) continue;
      ops::rms_norm(c, q_txt, b.norm_added_q, q_txt, cfg_.eps, d, ops::Rounding::once);
      ops::rms_norm(c, k_txt, b.norm_added_k, k_txt, cfg_.eps, d, ops::Rounding::once);
    }
    ops::rope(c, q, pro.cos, pro.sin, d, ops::RopeStyle::interleaved, ops::Rounding::once);
    ops::rope(c, k, pro.cos, pro.sin, d, ops::RopeStyle::interleaved, ops::Rounding::once);
    joint_attention(c, q, k, v, heads.mine(), pro, t, kv);
  }
  heads.gather("the attention's heads");

  Tensor proj = Tensor::in(*c.arena, {rows, h}, c.act);
  TensorSplit::Columns attn_out(c, split_, proj, {split_.hidden()});
  {
    RowParallel row(c);
    streams(attn, b.to_out, b.to_add_out, attn_out.mine());
  }
  attn_out.gather("the attention's projection");
  add_gated(proj, 2);

  // Feed-forward: SwiGLU over the two halves of one fused projection.
  part.emplace(c, "ff");
  Tensor up = Tensor::in(*c.arena, {rows, 2 * fm}, c.act);
  Tensor act = Tensor::in(*c.arena, {rows, f}, c.act);
  TensorSplit::Columns features(c, split_, act, {split_.mlp()});
  for (int64_t i = 0; i < batch; ++i) modulate(i, 3);
  streams(normed, b.ff_in, b.ff_ctx_in, up);
  ops::glu(c, up.cols(0, fm), up.cols(fm, 2 * fm), features.mine(), ops::Activation::silu, ops::Rounding::each_step);
  features.gather("the feed-forward's features");
  TensorSplit::Columns ff_out(c, split_, proj, {split_.hidden()});
  {
    RowParallel row(c);
    streams(act, b.ff_out, b.ff_ctx_out, ff_out.mine());
  }
  ff_out.gather("the feed-forward's projection");
  add_gated(proj, 5);
}

void Transformer::single_block(Context& c, const Single& b, Tensor& hidden, const Tensor& mod,
                               const TransformerPrologue& pro, int64_t t, const BlockKv& kv) const {
  ArenaScope scope(*c.arena);
  const int64_t s = hidden.shape[0], h = cfg_.hidden, d = cfg_.head_dim, f = cfg_.mlp_hidden;
  // This rank's q, k, v columns (its heads) and MLP features; all of them without a tensor split.
  const int64_t hq = split_.cols(split_.heads()), fm = split_.cols(split_.mlp());
  Tensor normed = Tensor::in(*c.arena, {s, h}, c.act);
  std::optional<CostScope> part(std::in_place, c, "linear1");
  ops::layer_norm_modulate(c, hidden, mod.cols(0, h), mod.cols(h, 2 * h), normed, cfg_.eps, ops::Rounding::each_step);
  Tensor proj = Tensor::in(*c.arena, {s, 3 * hq + 2 * fm}, c.act);
  ops::linear(c, normed, b.qkv_mlp, nullptr, proj);
  // Attention output and the MLP activation fill the two halves of to_out's input directly.
  Tensor joint = Tensor::in(*c.arena, {s, h + f}, c.act);
  TensorSplit::Columns columns(c, split_, joint, {split_.heads(), split_.mlp()});
  Tensor attn = columns.mine().cols(0, hq), mlp = columns.mine().cols(hq, hq + fm);
  part.emplace(c, "attn");
  if (hq > 0) {
    Tensor q = proj.cols(0, hq), k = proj.cols(hq, 2 * hq), v = proj.cols(2 * hq, 3 * hq);
    ops::rms_norm(c, q, b.norm_q, q, cfg_.eps, d, ops::Rounding::once);
    ops::rms_norm(c, k, b.norm_k, k, cfg_.eps, d, ops::Rounding::once);
    ops::rope(c, q, pro.cos, pro.sin, d, ops::RopeStyle::interleaved, ops::Rounding::once);
    ops::rope(c, k, pro.cos, pro.sin, d, ops::RopeStyle::interleaved, ops::Rounding::once);
    joint_attention(c, q, k, v, attn, pro, t, kv);
  }
  part.emplace(c, "linear2");
  ops::glu(c, proj.cols(3 * hq, 3 * hq + fm), proj.cols(3 * hq + fm, 3 * hq + 2 * fm), mlp, ops::Activation::silu,
           ops::Rounding::each_step);
  columns.gather("the attention's heads and the MLP's features");
  Tensor out = Tensor::in(*c.arena, {s, h}, c.act);
  TensorSplit::Columns projected(c, split_, out, {split_.hidden()});
  {
    RowParallel row(c);
    ops::linear(c, joint, b.out, nullptr, projected.mine());
  }
  projected.gather("the single block's projection");
  const Tensor gate = mod.cols(2 * h, 3 * h);
  ops::add_gated(c, hidden, out, &gate, ops::Rounding::each_step);
}

Transformer::Modulation Transformer::modulation(Context& c, float tau) const {
  const int64_t h = cfg_.hidden;
  Tensor sinus_act = Tensor::in(*c.arena, {1, cfg_.timestep_channels}, c.act);
  ops::timestep_embedding(c, tau, sinus_act);
  Tensor t1 = Tensor::in(*c.arena, {1, h}, c.act), temb = Tensor::in(*c.arena, {1, h}, c.act);
  ops::linear(c, sinus_act, time_1_, nullptr, t1);
  ops::silu(c, t1, t1);
  ops::linear(c, t1, time_2_, nullptr, temb);
  Tensor temb_silu = Tensor::in(*c.arena, {1, h}, c.act);
  ops::silu(c, temb, temb_silu);
  Modulation m{Tensor::in(*c.arena, {1, 6 * h}, c.act), Tensor::in(*c.arena, {1, 6 * h}, c.act),
               Tensor::in(*c.arena, {1, 3 * h}, c.act), Tensor::in(*c.arena, {1, 2 * h}, c.act)};
  ops::linear(c, temb_silu, mod_img_, nullptr, m.img);
  ops::linear(c, temb_silu, mod_txt_, nullptr, m.txt);
  ops::linear(c, temb_silu, mod_single_, nullptr, m.single);
  ops::linear(c, temb_silu, norm_out_, nullptr, m.out);
  return m;
}

ReferenceKv Transformer::reference_kv(Context& c, const Tensor& tokens, const Tensor& ids) const {
  const int64_t r = tokens.shape[0], h = cfg_.hidden;
  APUS_CHECK(tokens.rank() == 2 && tokens.shape[1] == cfg_.in_channels && ids.rank() == 2 && ids.shape[0] == r &&
                 ids.shape[1] == 4 && r > 0,
             "transformer: reference tokens ", shape_str(tokens.shape), " at ids ", shape_str(ids.shape),
             ", expected [R, ", cfg_.in_channels, "] and [R, 4]");
  ReferenceKv kv;
  // Under a tensor split each rank keeps its own heads' keys and values.
  const int64_t hq = split_.cols(split_.heads());
  for (size_t i = 0; i < double_.size() + single_.size(); ++i)
    kv.layers.push_back({ops::empty(c, {r, hq}, c.act), ops::empty(c, {r, hq}, c.act)});
  ArenaScope scope(*c.arena);
  CostScope dit_scope(c, "dit/references");
  TransformerPrologue pro;
  pro.cos = Tensor::in(*c.arena, {r, cfg_.head_dim / 2}, DType::f32);
  pro.sin = Tensor::in(*c.arena, {r, cfg_.head_dim / 2}, DType::f32);
  ops::rope_tables(c, ids, cfg_.axes_dims, cfg_.rope_theta, ops::RopeMath::f64, pro.cos, pro.sin);
  // The pipeline's fixed reference timestep, 0: no rounding moves it.
  const Modulation m = modulation(c, 0.0f);
  Tensor hidden = Tensor::in(*c.arena, {r, h}, c.act);
  ops::linear(c, tokens, x_embedder_, nullptr, hidden);
  for (size_t i = 0; i < double_.size(); ++i) {
    CostScope block(c, "double." + std::to_string(i));
    double_block(c, double_[i], hidden, 0, 1, m, pro, {nullptr, &kv.layers[i]});
  }
  for (size_t i = 0; i < single_.size(); ++i) {
    CostScope block(c, "single." + std::to_string(i));
    single_block(c, single_[i], hidden, m.single, pro, 0, {nullptr, &kv.layers[double_.size() + i]});
  }
  return kv;
}

void Transformer::forward(Context& c, const TransformerPrologue& pro, const Tensor& latents, float timestep,
                          Tensor& velocity, const ReferenceKv* references) const {
  ArenaScope scope(*c.arena);
  const int64_t batch = pro.batch, t = pro.txt.shape[0] / batch, l = latents.shape[0] / batch;
  const int64_t s = t + l, h = cfg_.hidden;
  APUS_CHECK(latents.rank() == 2 && latents.shape[1] == cfg_.in_channels && latents.shape[0] == batch * l &&
                 pro.cos.shape[0] == s && velocity.shape == Shape({batch * l, cfg_.out_channels}),
             "transformer: latents ", shape_str(latents.shape), " / velocity ", shape_str(velocity.shape),
             " do not match the prologue (", batch, " x ", s, " tokens)");

  // The pipeline casts t to the model dtype, divides by 1000 and the model multiplies by 1000
  // again, each in the model dtype; the sinusoid (cos first) is fp32, cast back.
  const auto act_round = [&c](float v) { return round_as(c.act, v); };
  const float tau = act_round(act_round(act_round(timestep) / 1000.0f) * 1000.0f);
  APUS_CHECK(!references || references->layers.size() == double_.size() + single_.size(),
             "transformer: reference keys and values for ", references ? references->layers.size() : 0,
             " blocks, expected ", double_.size() + single_.size());
  CostScope dit_scope(c, "dit");
  std::optional<CostScope> embed_scope(std::in_place, c, "embed");
  const Modulation m = modulation(c, tau);
  const Tensor& mod_out = m.out;

  // One [txt; img] residual stream per sample for the whole forward, sample after sample.
  Tensor hidden = Tensor::in(*c.arena, {batch * s, h}, c.act);
  for (int64_t i = 0; i < batch; ++i) {
    Tensor img = hidden.rows(i * s + t, (i + 1) * s), txt = hidden.rows(i * s, i * s + t);
    ops::linear(c, latents.rows(i * l, (i + 1) * l), x_embedder_, nullptr, img);
    ops::copy(c, pro.txt.rows(i * t, (i + 1) * t), txt);
  }
  embed_scope.reset();
  for (size_t i = 0; i < double_.size(); ++i) {
    CostScope block(c, "double." + std::to_string(i));
    mark_depth_boundary(c, hidden);
    double_block(c, double_[i], hidden, t, batch, m, pro, {references ? &references->layers[i] : nullptr, nullptr});
  }
  for (size_t i = 0; i < single_.size(); ++i) {
    CostScope block(c, "single." + std::to_string(i));
    mark_depth_boundary(c, hidden);
    single_block(c, single_[i], hidden, m.single, pro, t,
                 {references ? &references->layers[double_.size() + i] : nullptr, nullptr});
  }
  CostScope final_scope(c, "final");

  // norm_out stores [scale; shift] (the reverse of the blocks' order).
  Tensor normed = Tensor::in(*c.arena, {batch * l, h}, c.act);
  for (int64_t i = 0; i < batch; ++i) {
    Tensor n = normed.rows(i * l, (i + 1) * l);
    ops::layer_norm_modulate(c, hidden.rows(i * s + t, (i + 1) * s), mod_out.cols(h, 2 * h), mod_out.cols(0, h), n,
                             cfg_.eps, ops::Rounding::each_step);
  }
  ops::linear(c, normed, proj_out_, nullptr, velocity);
}

}  // namespace apus::flux2
