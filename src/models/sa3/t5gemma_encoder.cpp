#include "models/sa3/t5gemma_encoder.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "models/common/feature_split.h"
#include "models/common/text_inputs.h"

namespace apus::sa3 {

namespace {
int dtype_slot(DType dt) { return dt == DType::bf16 ? 1 : 0; }
}  // namespace

T5GemmaConfig T5GemmaConfig::read(const Config& file) {
  // T5GemmaConfig holds the encoder's settings as its "encoder" object; the module's own config
  // file is flat.
  const Config c = file.has("encoder") ? file.object("encoder") : file;
  T5GemmaConfig t{};
  t.vocab = c.get_size("vocab_size");
  t.hidden = c.get_size("hidden_size");
  t.intermediate = c.get_size("intermediate_size");
  t.layers = c.get_size("num_hidden_layers");
  t.heads = c.get_size("num_attention_heads");
  t.kv_heads = c.get_size("num_key_value_heads", t.heads, 1);
  t.head_dim = c.get_size("head_dim", t.hidden / t.heads, 2);
  APUS_CHECK(t.head_dim % 2 == 0 && t.heads % t.kv_heads == 0, c.path, ": head_dim ", t.head_dim,
             " must be even and num_attention_heads ", t.heads, " a multiple of num_key_value_heads ", t.kv_heads);
  t.eps = float(c.get_positive("rms_norm_eps", 1e-6));
  const std::string act = c.get_string("hidden_activation", "gelu_pytorch_tanh");
  APUS_CHECK(act == "gelu_pytorch_tanh", c.path, ": hidden_activation '", act,
             "' is not supported (expected gelu_pytorch_tanh)");
  APUS_CHECK(!c.get_bool("attention_bias", false), c.path, ": attention_bias is not supported");
  const Config rope = c.object("rope_parameters");
  APUS_CHECK(rope.get_string("rope_type", "default") == "default", c.path,
             ": rope_type is not supported (expected default)");
  t.rope_theta = rope.get_positive("rope_theta");
  t.attention_scale = float(std::pow(c.get_positive("query_pre_attn_scalar"), -0.5));
  t.softcap = float(c.has("attn_logit_softcapping") ? c.get_positive("attn_logit_softcapping") : 0.0);
  t.sliding_window = c.get_size("sliding_window", 0, 0);
  t.sliding.assign(size_t(t.layers), false);
  if (c.has("layer_types")) {
    const Json& types = c.at("layer_types");
    APUS_CHECK(types.is_array() && types.size() >= size_t(t.layers), c.path, ": layer_types must name every layer");
    for (int64_t i = 0; i < t.layers; ++i) {
      const Json& ty = types[size_t(i)];
      APUS_CHECK(ty == "sliding_attention" || ty == "full_attention", c.path, ": layer_types[", i, "] is ", ty.dump(),
                 ", expected sliding_attention or full_attention");
      t.sliding[size_t(i)] = ty == "sliding_attention";
    }
  }
  // What leaves the encoder's hidden states unchanged: the decoder's settings and final logit cap
  // (only the encoder runs), dropout (off in inference), positions past the pipeline's 256 tokens,
  // the cache, special token ids (the tokenizer places them), the LM head's tying, and
  // transformers' generic fields.
  file.no_effect({"decoder", "dropout_rate", "classifier_dropout_rate", "attention_dropout", "tie_word_embeddings",
                  "is_encoder_decoder", "transformers_version", "architectures", "output_hidden_states", "return_dict",
                  "dtype", "torch_dtype", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
                  "vocab_size"});
  APUS_CHECK(!c.get_bool("is_decoder", false), c.path, ": is_decoder true: the encoder's settings describe a decoder");
  c.no_effect({"max_position_embeddings",
               "initializer_range",
               "use_cache",
               "pad_token_id",
               "eos_token_id",
               "bos_token_id",
               "tie_word_embeddings",
               "attention_dropout",
               "final_logit_softcapping",
               "is_encoder_decoder",
               "transformers_version",
               "architectures",
               "output_hidden_states",
               "return_dict",
               "dtype",
               "torch_dtype",
               "chunk_size_feed_forward",
               "id2label",
               "label2id",
               "problem_type"});
  return t;
}

T5GemmaEncoder::Norm T5GemmaEncoder::norm(const std::string& name) const {
  const Tensor w = weights_.host(name, {cfg_.hidden});
  Norm n;
  for (const DType dt : {DType::f32, DType::bf16}) {
    Tensor& s = n.scale[dtype_slot(dt)];
    if (!w.data) {  // counting mode
      s = Tensor::shape_only({cfg_.hidden}, DType::f32);
      continue;
    }
    s = Tensor::heap({cfg_.hidden}, DType::f32);
    for (int64_t i = 0; i < cfg_.hidden; ++i) s.ptr<float>()[i] = 1.0f + round_as(dt, load_f32(w, i));
    s = weights_.place(s);
  }
  return n;
}

T5GemmaEncoder T5GemmaEncoder::load(const T5GemmaConfig& config, WeightLoader weights,
                                    const ProcessGroup* tensor_ranks) {
  T5GemmaEncoder m(std::move(weights));
  if (tensor_ranks && tensor_ranks->size() > 1) m.held_ranks_ = tensor_ranks;
  m.cfg_ = config;
  const auto& c = m.cfg_;
  const WeightLoader& w = m.weights_;
  const std::string p = w.contains("encoder.embed_tokens.weight") ? "encoder." : "model.encoder.";
  m.embed_ = w.get(p + "embed_tokens.weight", {c.vocab, c.hidden});
  const int64_t qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = p + "layers." + std::to_string(i) + ".";
    Layer L;
    L.pre_attn = m.norm(l + "pre_self_attn_layernorm.weight");
    L.post_attn = m.norm(l + "post_self_attn_layernorm.weight");
    L.pre_ff = m.norm(l + "pre_feedforward_layernorm.weight");
    L.post_ff = m.norm(l + "post_feedforward_layernorm.weight");
    L.q = held_features(w, m.held_ranks_, l + "self_attn.q_proj.weight", {qd, c.hidden});
    L.k = held_features(w, m.held_ranks_, l + "self_attn.k_proj.weight", {kvd, c.hidden});
    L.v = held_features(w, m.held_ranks_, l + "self_attn.v_proj.weight", {kvd, c.hidden});
    L.o = held_features(w, m.held_ranks_, l + "self_attn.o_proj.weight", {c.hidden, qd});
    L.gate = held_features(w, m.held_ranks_, l + "mlp.gate_proj.weight", {c.intermediate, c.hidden});
    L.up = held_features(w, m.held_ranks_, l + "mlp.up_proj.weight", {c.intermediate, c.hidden});
    L.down = held_features(w, m.held_ranks_, l + "mlp.down_proj.weight", {c.hidden, c.intermediate});
    m.layers_.push_back(L);
  }
  m.final_norm_ = m.norm(p + "norm.weight");
  // The embeddings are scaled by sqrt(hidden) held in the activation dtype.
  for (const DType dt : {DType::f32, DType::bf16}) {
    Tensor& s = m.embed_scale_[dtype_slot(dt)];
    s = Tensor::heap({c.hidden}, DType::f32);
    std::fill_n(s.ptr<float>(), c.hidden, round_as(dt, float(std::sqrt(double(c.hidden)))));
    s = w.place(s);
  }
  m.zeros_ = Tensor::heap({c.hidden}, DType::f32);
  std::fill_n(m.zeros_.ptr<float>(), c.hidden, 0.0f);
  m.zeros_ = w.place(m.zeros_);
  return m;
}

Tensor T5GemmaEncoder::encode(Context& c, const std::vector<int32_t>& ids, const std::vector<int64_t>& mask,
                              int64_t batch, const ProcessGroup* ranks) const {
  ArenaScope scope(*c.arena);
  CostScope text_scope(c, "t5gemma");
  const auto& cf = cfg_;
  APUS_CHECK(batch >= 1 && ids.size() % size_t(batch) == 0 && mask.size() == ids.size(), "t5gemma: ", ids.size(),
             " ids and ", mask.size(), " mask entries for ", batch, " samples");
  const int64_t rows = int64_t(ids.size()), t = rows / batch, h = cf.hidden, d = cf.head_dim;
  const int64_t qd = cf.heads * d, kvd = cf.kv_heads * d;
  for (int64_t i = 0; i < cf.layers; ++i)
    APUS_CHECK(!cf.sliding[size_t(i)] || cf.sliding_window >= t, "t5gemma: layer ", i, " slides a window of ",
               cf.sliding_window, " over ", t, " tokens; windows shorter than the sequence are not supported");
  const int slot = dtype_slot(c.act);
  const auto once = ops::Rounding::once, each = ops::Rounding::each_step;

  TextInputs in = embed_text(c, embed_, ids, batch, d, cf.rope_theta);
  Tensor& x = in.x;
  const Tensor &cos = in.cos, &sin = in.sin;
  ops::affine(c, x, embed_scale_[slot], zeros_, x, each);  // Gemma scales embeddings by sqrt(h)

  LayerBuffers buffers = layer_buffers(c, rows, h, qd, kvd, cf.intermediate);
  auto& [normed, q, k, v, attn, proj, gate, up] = buffers;
  // Eager attention in the activation dtype: scores rounded step by step, capped, key-padding mask.
  const Tensor key_valid = key_mask(c, mask);
  const ops::AttentionOptions options{false, &key_valid, batch, cf.softcap, each};
  APUS_CHECK(!held_ranks_ || ranks == held_ranks_, "t5gemma: its linears hold a share of their features (loaded ",
             "split over ", held_ranks_ ? held_ranks_->size() : 0, " ranks): it encodes over those ranks");
  FeatureSplit split{ranks, held_ranks_ != nullptr};
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    CostScope layer_scope(c, "layer." + std::to_string(i));
    mark_depth_boundary(c, x);
    std::optional<CostScope> part(std::in_place, c, "attn");
    ops::rms_norm(c, x, l.pre_attn.scale[slot], normed, cf.eps, h, once);
    linear(c, &split, normed, l.q, nullptr, q, "the text encoder's q features");
    linear(c, &split, normed, l.k, nullptr, k, "the text encoder's k features");
    linear(c, &split, normed, l.v, nullptr, v, "the text encoder's v features");
    ops::rope(c, q, cos, sin, d, ops::RopeStyle::half, each);
    ops::rope(c, k, cos, sin, d, ops::RopeStyle::half, each);
    ops::attention(c, q, k, v, attn, d, cf.attention_scale, options);
    {
      RowParallel row(c);
      linear(c, &split, attn, l.o, nullptr, proj, "the text encoder's attention outputs");
    }
    ops::rms_norm(c, proj, l.post_attn.scale[slot], proj, cf.eps, h, once);
    ops::add_gated(c, x, proj, nullptr, each);
    part.emplace(c, "mlp");
    ops::rms_norm(c, x, l.pre_ff.scale[slot], normed, cf.eps, h, once);
    linear(c, &split, normed, l.gate, nullptr, gate, "the text encoder's gate features");
    linear(c, &split, normed, l.up, nullptr, up, "the text encoder's up features");
    ops::glu(c, gate, up, gate, ops::Activation::gelu_tanh, each);
    {
      RowParallel row(c);
      linear(c, &split, gate, l.down, nullptr, proj, "the text encoder's MLP outputs");
    }
    ops::rms_norm(c, proj, l.post_ff.scale[slot], proj, cf.eps, h, once);
    ops::add_gated(c, x, proj, nullptr, each);
  }
  CostScope final_scope(c, "final");
  Tensor out = ops::empty(c, {rows, h}, c.act);
  ops::rms_norm(c, x, final_norm_.scale[slot], out, cf.eps, h, once);
  // Under cfg and Ulysses every rank computes ~1/N of each linear, the outputs all-gathered.
  if (c.cost) {
    c.cost->mark_parts(h);
    c.cost->mark_gather(split.gathered);
  }
  return out;
}

}  // namespace apus::sa3
