#include "models/flux2/text_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "models/common/feature_split.h"
#include "models/common/text_inputs.h"

namespace apus::flux2 {

TextEncoderConfig TextEncoderConfig::read(const Config& c) {
  TextEncoderConfig t{};
  t.hidden = c.get_size("hidden_size");
  t.layers = c.get_size("num_hidden_layers");
  t.heads = c.get_size("num_attention_heads");
  t.kv_heads = c.get_size("num_key_value_heads", t.heads, 1);
  t.head_dim = c.get_size("head_dim", t.hidden / t.heads, 2);
  t.intermediate = c.get_size("intermediate_size");
  t.vocab = c.get_size("vocab_size");
  APUS_CHECK(t.head_dim % 2 == 0, c.path, ": head_dim ", t.head_dim, " must be even for RoPE");
  t.eps = float(c.get_positive("rms_norm_eps", 1e-6));
  // transformers 5 moved rope_theta into rope_parameters; older configs keep it at the top.
  if (c.has("rope_parameters")) {
    const Config rope = c.object("rope_parameters");
    t.rope_theta = rope.get_positive("rope_theta");
    const std::string type = rope.get_string("rope_type", "default");
    APUS_CHECK(type == "default", c.path, ": rope_type '", type, "' is not supported");
  } else {
    t.rope_theta = c.get_positive("rope_theta");
  }
  APUS_CHECK(!c.get_bool("attention_bias", false), c.path, ": attention_bias is not supported");
  APUS_CHECK(!c.has("rope_scaling"), c.path, ": rope_scaling ", c.at("rope_scaling").dump(),
             " is not supported (plain RoPE only)");
  const std::string act = c.get_string("hidden_act", "silu");
  APUS_CHECK(act == "silu", c.path, ": hidden_act '", act, "' is not supported (expected silu)");
  // Sliding-window attention: off unless use_sliding_window, then from max_window_layers on (or
  // as layer_types lists); only full attention is implemented.
  APUS_CHECK(!c.get_bool("use_sliding_window", false), c.path,
             ": use_sliding_window true is not supported (full attention only)");
  if (c.has("layer_types"))
    for (const Json& type : c.at("layer_types"))
      APUS_CHECK(type == "full_attention", c.path, ": layer_types entry ", type.dump(),
                 " is not supported (full_attention only)");
  APUS_CHECK(c.get_double("attention_dropout", 0.0) >= 0, c.path, ": attention_dropout must not be negative");
  // What leaves the encoder's hidden states unchanged: dropout (off in inference), the window
  // settings while use_sliding_window is false, positions beyond the pipeline's 512 tokens, the
  // LM head's tying (the head is not run), the cache, special token ids (the tokenizer pads), and
  // transformers' generic fields.
  c.no_effect({"sliding_window",
               "max_window_layers",
               "max_position_embeddings",
               "tie_word_embeddings",
               "use_cache",
               "initializer_range",
               "pad_token_id",
               "bos_token_id",
               "eos_token_id",
               "transformers_version",
               "architectures",
               "output_hidden_states",
               "return_dict",
               "dtype",
               "torch_dtype",
               "chunk_size_feed_forward",
               "is_encoder_decoder",
               "id2label",
               "label2id",
               "problem_type"});
  APUS_CHECK(t.heads % t.kv_heads == 0, c.path, ": num_attention_heads ", t.heads,
             " is not a multiple of num_key_value_heads ", t.kv_heads);
  return t;
}

TextEncoder TextEncoder::load(const Config& config, WeightLoader weights, const std::vector<int>& taps,
                              const ProcessGroup* tensor_ranks) {
  TextEncoder m(std::move(weights));
  if (tensor_ranks && tensor_ranks->size() > 1) m.held_ranks_ = tensor_ranks;
  m.cfg_ = TextEncoderConfig::read(config);
  m.taps_ = taps;
  const auto& c = m.cfg_;
  const int deepest = *std::max_element(taps.begin(), taps.end());
  APUS_CHECK(deepest >= 1 && deepest <= c.layers, config.path, ": hidden-state tap ", deepest, " needs ", deepest,
             " layers, the config has ", c.layers);
  const WeightLoader& w = m.weights_;
  const std::string root = w.contains("model.embed_tokens.weight") ? "model." : "";
  const int64_t h = c.hidden, qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  m.embed_ = w.get(root + "embed_tokens.weight", {c.vocab, h});
  if (deepest == c.layers) m.final_norm_ = w.get(root + "norm.weight", {h});
  for (int i = 0; i < deepest; ++i) {
    const std::string p = root + "layers." + std::to_string(i) + ".";
    Layer l;
    l.in_norm = w.get(p + "input_layernorm.weight", {h});
    l.q = held_features(w, m.held_ranks_, p + "self_attn.q_proj.weight", {qd, h});
    l.k = held_features(w, m.held_ranks_, p + "self_attn.k_proj.weight", {kvd, h});
    l.v = held_features(w, m.held_ranks_, p + "self_attn.v_proj.weight", {kvd, h});
    l.o = held_features(w, m.held_ranks_, p + "self_attn.o_proj.weight", {h, qd});
    l.q_norm = w.get(p + "self_attn.q_norm.weight", {c.head_dim});
    l.k_norm = w.get(p + "self_attn.k_norm.weight", {c.head_dim});
    l.post_norm = w.get(p + "post_attention_layernorm.weight", {h});
    l.gate = held_features(w, m.held_ranks_, p + "mlp.gate_proj.weight", {c.intermediate, h});
    l.up = held_features(w, m.held_ranks_, p + "mlp.up_proj.weight", {c.intermediate, h});
    l.down = held_features(w, m.held_ranks_, p + "mlp.down_proj.weight", {h, c.intermediate});
    m.layers_.push_back(l);
  }
  return m;
}

Tensor TextEncoder::encode(Context& c, const std::vector<int32_t>& ids, const std::vector<int64_t>& attention_mask,
                           int64_t batch, const ProcessGroup* ranks) const {
  ArenaScope scope(*c.arena);
  CostScope text_scope(c, "text");
  const auto& cf = cfg_;
  APUS_CHECK(batch >= 1 && ids.size() % size_t(batch) == 0 && attention_mask.size() == ids.size(),
             "text encoder: ", ids.size(), " ids and ", attention_mask.size(), " mask entries for ", batch, " samples");
  const int64_t rows = int64_t(ids.size()), h = cf.hidden, d = cf.head_dim;
  const int64_t qd = cf.heads * d, kvd = cf.kv_heads * d;

  TextInputs in = embed_text(c, embed_, ids, batch, d, cf.rope_theta);
  Tensor& x = in.x;
  const Tensor &cos = in.cos, &sin = in.sin;

  Tensor out = ops::empty(c, {rows, int64_t(taps_.size()) * h}, c.act);
  LayerBuffers buffers = layer_buffers(c, rows, h, qd, kvd, cf.intermediate);
  auto& [normed, q, k, v, attn, proj, gate, up] = buffers;
  const Tensor key_valid = key_mask(c, attention_mask);
  const ops::AttentionOptions mask{true, &key_valid, batch};
  APUS_CHECK(!held_ranks_ || ranks == held_ranks_, "text encoder: its linears hold a share of their features ",
             "(loaded split over ", held_ranks_ ? held_ranks_->size() : 0, " ranks): it encodes over those ranks");
  FeatureSplit split{ranks, held_ranks_ != nullptr};
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    CostScope layer_scope(c, "layer." + std::to_string(i));
    mark_depth_boundary(c, x);
    std::optional<CostScope> part(std::in_place, c, "attn");
    ops::rms_norm(c, x, l.in_norm, normed, cf.eps, h, ops::Rounding::each_step);
    linear(c, &split, normed, l.q, nullptr, q, "the text encoder's q features");
    linear(c, &split, normed, l.k, nullptr, k, "the text encoder's k features");
    linear(c, &split, normed, l.v, nullptr, v, "the text encoder's v features");
    ops::rms_norm(c, q, l.q_norm, q, cf.eps, d, ops::Rounding::each_step);
    ops::rms_norm(c, k, l.k_norm, k, cf.eps, d, ops::Rounding::each_step);
    ops::rope(c, q, cos, sin, d, ops::RopeStyle::half, ops::Rounding::each_step);
    ops::rope(c, k, cos, sin, d, ops::RopeStyle::half, ops::Rounding::each_step);
    ops::attention(c, q, k, v, attn, d, 1.0f / std::sqrt(float(d)), mask);
    {
      RowParallel row(c);
      linear(c, &split, attn, l.o, nullptr, proj, "the text encoder's attention outputs");
    }
    ops::add_gated(c, x, proj, nullptr, ops::Rounding::each_step);
    part.emplace(c, "mlp");
    ops::rms_norm(c, x, l.post_norm, normed, cf.eps, h, ops::Rounding::each_step);
    linear(c, &split, normed, l.gate, nullptr, gate, "the text encoder's gate features");
    linear(c, &split, normed, l.up, nullptr, up, "the text encoder's up features");
    ops::glu(c, gate, up, gate, ops::Activation::silu, ops::Rounding::each_step);
    {
      RowParallel row(c);
      linear(c, &split, gate, l.down, nullptr, proj, "the text encoder's MLP outputs");
    }
    ops::add_gated(c, x, proj, nullptr, ops::Rounding::each_step);
    // hidden_states[k] of the reference is the output of layer k - 1, except the last,
    // hidden_states[layers]: transformers puts the final norm's output there (last_hidden_state).
    const bool last = final_norm_.defined() && int64_t(i) + 1 == cf.layers;
    if (last) ops::rms_norm(c, x, final_norm_, normed, cf.eps, h, ops::Rounding::each_step);
    for (size_t j = 0; j < taps_.size(); ++j)
      if (taps_[j] == int(i) + 1) {
        Tensor dst = out.cols(int64_t(j) * h, int64_t(j + 1) * h);
        ops::copy(c, last ? normed : x, dst);
      }
  }
  // Under cfg, Ulysses and tensor every rank computes ~1/N of each linear, the outputs all-gathered.
  if (c.cost) {
    c.cost->mark_parts(h);
    c.cost->mark_gather(split.gathered);
  }
  return out;
}

}  // namespace apus::flux2
