#include "pipeline/sa3/model_config.h"

#include <algorithm>
#include <set>

#include "core/error.h"

namespace apus::sa3 {

namespace {

// A Config's path is "FILE (KEY PATH)" below the top level: `path` one step ("model", "[0]") deeper.
std::string below(const std::string& path, const std::string& step) {
  const size_t open = path.find(" (");
  if (open == std::string::npos) return path + " (" + step + ")";
  const std::string where = path.substr(open + 2, path.size() - open - 3);
  return path.substr(0, open) + " (" + where + (step[0] == '[' ? "" : ".") + step + ")";
}

// The object under `key`, as a Config whose messages name the file and the key path.
Config object(const Config& c, const std::string& key) {
  APUS_CHECK(c.json.contains(key) && c.json[key].is_object(), c.path, ": missing object '", key, "'");
  return {below(c.path, key), c.json[key]};
}

// Every key of c is one apus honours or one whose value it checks; anything else is refused.
void known_keys(const Config& c, const std::set<std::string>& keys) {
  for (auto it = c.json.begin(); it != c.json.end(); ++it)
    APUS_CHECK(keys.count(it.key()), c.path, ": '", it.key(), "' is not a setting apus supports");
}

void require_string(const Config& c, const std::string& key, const std::string& fallback, const std::string& expected,
                    const std::string& why) {
  const std::string v = c.get_string(key, fallback);
  APUS_CHECK(v == expected, c.path, ": '", key, "' is \"", v, "\", expected \"", expected, "\" (", why, ")");
}

void require_bool(const Config& c, const std::string& key, bool fallback, bool expected, const std::string& why) {
  APUS_CHECK(c.get_bool(key, fallback) == expected, c.path, ": '", key, "' ", expected ? "false" : "true",
             " is not supported (", why, ")");
}

std::vector<std::string> strings(const Config& c, const std::string& key) {
  std::vector<std::string> out;
  if (!c.json.contains(key) || c.json[key].is_null()) return out;
  APUS_CHECK(c.json[key].is_array(), c.path, ": '", key, "' must be a list");
  for (const Json& v : c.json[key]) {
    APUS_CHECK(v.is_string(), c.path, ": '", key, "' must list strings");
    out.push_back(v.get<std::string>());
  }
  return out;
}

int64_t one_level(const Config& c, const std::string& key) {
  const std::vector<int64_t> v = c.get_sizes(key);
  APUS_CHECK(v.size() == 1, c.path, ": '", key, "' has ", v.size(), " levels; one is supported");
  return v[0];
}

DitConfig read_dit(const Config& diffusion, bool& euler) {
  require_string(diffusion, "type", "dit", "dit", "Stable Audio 3's transformer");
  const std::string objective = diffusion.get_string("diffusion_objective", "v");
  APUS_CHECK(objective == "rf_denoiser" || objective == "rectified_flow", diffusion.path,
             ": 'diffusion_objective' is \"", objective, "\"; expected rf_denoiser (the distilled ",
             "models, ping-pong) or rectified_flow (the -base models, Euler)");
  euler = objective == "rectified_flow";
  const auto ids = [&](const char* key) { return strings(diffusion, key); };
  APUS_CHECK(ids("cross_attention_cond_ids") == std::vector<std::string>({"prompt", "seconds_total"}) &&
                 ids("global_cond_ids") == std::vector<std::string>({"seconds_total"}),
             diffusion.path, ": conditioning ids other than cross [prompt, seconds_total] and global ",
             "[seconds_total] are not supported");
  const auto local = ids("local_add_cond_ids");
  APUS_CHECK(local == std::vector<std::string>({"inpaint_mask", "inpaint_masked_input"}), diffusion.path,
             ": 'local_add_cond_ids' must be [inpaint_mask, inpaint_masked_input]");
  for (const char* key : {"input_concat_ids", "prepend_cond_ids", "modular_local_cond_configs"})
    APUS_CHECK(ids(key).empty(), diffusion.path, ": '", key, "' is not supported");
  APUS_CHECK(!diffusion.json.contains("sampling_distribution_shift_options") ||
                 diffusion.json["sampling_distribution_shift_options"].is_null(),
             diffusion.path, ": 'sampling_distribution_shift_options' is not supported (the published ",
             "models sample on the default log-SNR line)");
  // Training-only settings: they do not change what inference computes.
  known_keys(diffusion, {"type", "diffusion_objective", "cross_attention_cond_ids", "global_cond_ids",
                         "local_add_cond_ids", "input_concat_ids", "prepend_cond_ids", "modular_local_cond_configs",
                         "sampling_distribution_shift_options", "distribution_shift_options", "mask_padding_attention",
                         "use_effective_length_for_schedule", "config"});

  const Config c = object(diffusion, "config");
  // DiffusionTransformer's defaults (its conditioning widths 0: absent means none, refused).
  DitConfig defaults{};
  defaults.io_channels = 32;
  defaults.dim = 768;
  defaults.depth = 12;
  defaults.heads = 8;
  DitConfig d = DitConfig::read_sizes(c, defaults);
  d.memory_tokens = c.get_size("num_memory_tokens", 0, 0);
  require_string(c, "global_cond_type", "prepend", "adaLN", "the published DiTs modulate with it");
  require_string(c, "timestep_features_type", "learned", "expo", "the published DiTs' Fourier features");
  require_string(c, "timestep_cond_type", "global", "global", "the timestep joins the global condition");
  require_string(c, "transformer_type", "continuous_transformer", "continuous_transformer", "the published DiTs");
  require_string(c, "norm_type", "layer_norm", "rms_norm", "the published DiTs' block norms");
  require_bool(c, "timestep_features_logsnr", false, false, "the published DiTs feed t itself");
  require_bool(c, "project_cond_tokens", true, true, "the published DiTs project the cross tokens");
  require_bool(c, "project_global_cond", true, true, "the published DiTs project the global condition");
  for (const char* key : {"input_concat_dim", "prepend_cond_dim"})
    APUS_CHECK(c.get_int(key, 0) == 0, c.path, ": '", key, "' is not supported");
  const Config ff = c.json.contains("ff_kwargs") ? object(c, "ff_kwargs") : Config{c.path, Json::object()};
  known_keys(ff, {"mult"});
  const double mult = ff.get_double("mult", 4.0);
  APUS_CHECK(mult > 0 && mult <= 64, ff.path, ": 'mult' ", mult, " out of range");
  d.ff_inner = int64_t(double(d.dim) * mult);
  const Config attn = object(c, "attn_kwargs");
  known_keys(attn, {"qk_norm", "differential", "qk_norm_eps"});
  require_string(attn, "qk_norm", "none", "rms", "the published DiTs' QK norm");
  d.differential = attn.get_bool("differential", false);
  d.qk_norm_eps = float(attn.get_positive("qk_norm_eps", 1e-6));
  const Config norm = c.json.contains("norm_kwargs") ? object(c, "norm_kwargs") : Config{c.path, Json::object()};
  known_keys(norm, {"force_fp32", "eps"});
  d.norm_eps = float(norm.get_positive("eps", 1e-5));
  known_keys(c, {"io_channels",
                 "patch_size",
                 "embed_dim",
                 "depth",
                 "num_heads",
                 "cond_token_dim",
                 "global_cond_dim",
                 "local_add_cond_dim",
                 "timestep_features_dim",
                 "num_memory_tokens",
                 "global_cond_type",
                 "timestep_features_type",
                 "timestep_cond_type",
                 "transformer_type",
                 "norm_type",
                 "timestep_features_logsnr",
                 "project_cond_tokens",
                 "project_global_cond",
                 "input_concat_dim",
                 "prepend_cond_dim",
                 "ff_kwargs",
                 "attn_kwargs",
                 "norm_kwargs",
                 "diffusion_objective"});
  return d;
}

}  // namespace

namespace {

// One side of SAME (model.pretransform.config.encoder or .decoder's config): its resampling
// level into s (s.audio_channels, patch_size and sample_rate already set); its mask_noise out.
void read_same_side(const Config& side, bool encoder, SameConfig& s, float& mask_noise) {
  s.latent_dim = side.get_size("latent_dim", 1);
  s.dim = side.get_size("channels", 128, 1) * one_level(side, "c_mults");
  s.stride = one_level(side, "strides");
  s.depth = one_level(side, "transformer_depths");
  s.sin_blocks = side.json.contains("sinusoidal_blocks") ? side.get_ints("sinusoidal_blocks").at(0) : 0;
  s.head_dim = std::min(side.get_size("dim_heads", 128, 1), s.dim);
  APUS_CHECK(s.dim % s.head_dim == 0 && s.head_dim % 4 == 0, side.path, ": width ", s.dim,
             " is not a whole number of heads of ", s.head_dim);
  s.ff_inner = s.dim * side.get_size("ff_mult", 3, 1);
  s.differential = side.get_bool("differential", true);
  const char* audio_key = encoder ? "in_channels" : "out_channels";
  APUS_CHECK(side.get_size(audio_key, 2, 1) == s.patch_width(), side.path, ": '", audio_key,
             "' must be channels x patch_size of the patched pretransform");
  if (side.json.contains("sliding_window") && !side.json["sliding_window"].is_null()) {
    // SAME-L: a band of w latents on either side.
    const std::vector<int64_t> window = side.get_ints("sliding_window");
    APUS_CHECK(window.size() == 2 && window[0] == window[1] && window[0] >= 1, side.path,
               ": 'sliding_window' must be [w, w] with w >= 1");
    s.window = window[0] * (s.stride + 1);
    s.chunk_tokens = 0;
    require_bool(side, "chunk_midpoint_shift", false, false, "a band needs no shifted chunks");
  } else {
    // SAME-S: attention within chunks of chunk_size latents' worth of tokens.
    const int64_t chunk = side.get_size("chunk_size", 128, 1);
    APUS_CHECK(chunk % s.stride == 0, side.path, ": 'chunk_size' ", chunk, " is not a multiple of the stride ",
               s.stride);
    s.window = 0;
    s.chunk_tokens = chunk + chunk / s.stride;
    s.midpoint_shift = side.get_bool("chunk_midpoint_shift", false);
    APUS_CHECK(!s.midpoint_shift || s.chunk_tokens % 2 == 0, side.path, ": chunks of ", s.chunk_tokens,
               " tokens have no midpoint");
  }
  s.mapping_kernel = side.get_bool("conv_mapping", false) ? 3 : 1;
  require_bool(side, "dyt", true, true, "the published autoencoders normalise with DynamicTanh");
  require_bool(side, "variable_stride", false, true, "the published autoencoders learn one new token");
  for (const char* key : {"layer_scale", "conformer", "causal", "cross_attn", "feat_scale"})
    require_bool(side, key, false, false, "not in the published autoencoders");
  APUS_CHECK(side.get_bool("mapping_bias", true), side.path, ": 'mapping_bias' false is not supported");
  // The noise on the decoder's placeholder tokens, before their DynamicTanh norms: the published
  // decoders add 0.01 (small) and 0.1 (medium); at 1 it already drowns the learned token.
  const double noise = side.get_double("mask_noise", 0.0);
  APUS_CHECK(noise >= 0 && noise <= 1, side.path, ": 'mask_noise' ", noise,
             " outside [0, 1] (the published decoders use 0.01 and 0.1)");
  mask_noise = float(noise);
  known_keys(side, {audio_key,
                    "channels",
                    "c_mults",
                    "strides",
                    "latent_dim",
                    "transformer_depths",
                    "sinusoidal_blocks",
                    "sliding_window",
                    "dim_heads",
                    "differential",
                    "dyt",
                    "variable_stride",
                    "conv_mapping",
                    "mask_noise",
                    "checkpointing",
                    "layer_scale",
                    "conformer",
                    "chunk_size",
                    "chunk_midpoint_shift",
                    "ff_mult",
                    "causal",
                    "cross_attn",
                    "feat_scale",
                    "mapping_bias",
                    "freeze_backbone"});
}

}  // namespace

// A {type, config} block of the autoencoder (its pretransform, bottleneck, encoder, decoder): the
// type apus implements there, and the block's own keys.
Config typed_block(const Config& ae, const std::string& key, const std::string& type, const std::string& why,
                   const std::set<std::string>& keys = {"type", "config"}) {
  const Config block = object(ae, key);
  require_string(block, "type", "", type, why);
  known_keys(block, keys);
  return object(block, "config");
}

void read_official_autoencoder(const Config& ae, int64_t rate, OfficialConfig& o) {
  const Config patched = typed_block(ae, "pretransform", "patched", "the published autoencoders patch the audio");
  known_keys(patched, {"channels", "patch_size"});
  const Config bottleneck = typed_block(ae, "bottleneck", "soft_norm", "the published bottleneck: running_std");
  SameConfig& s = o.same;
  s.sample_rate = rate;
  s.audio_channels = patched.get_size("channels", 2, 1);
  s.patch_size = patched.get_size("patch_size", 1);
  o.encoder = s;
  const Config dec = typed_block(ae, "decoder", "same", "Stable Audio 3's SAME", {"type", "config", "soft_clip"});
  read_same_side(dec, false, s, o.mask_noise);
  const Config enc = typed_block(ae, "encoder", "same", "Stable Audio 3's SAME");
  read_same_side(enc, true, o.encoder, o.encoder_mask_noise);
  APUS_CHECK(o.encoder.latent_dim == s.latent_dim && o.encoder.stride == s.stride, enc.path,
             ": 'latent_dim' and 'strides' must match the decoder's");
  // The official canvas aligns to the encoder's chunk_size (a band encoder's default 32 included).
  o.encoder_chunk = enc.get_size("chunk_size", 32, 1);
  APUS_CHECK(!object(ae, "decoder").get_bool("soft_clip", false), dec.path,
             ": the decoder's 'soft_clip' (a final tanh) is not supported");
  require_bool(bottleneck, "auto_scale", false, true, "the published bottlenecks carry running_std");
  APUS_CHECK(bottleneck.get_int("noise_augment_dim", 0) == 0, bottleneck.path,
             ": 'noise_augment_dim' is not supported");
  APUS_CHECK(bottleneck.get_size("dim", 1) == s.latent_dim, bottleneck.path,
             ": 'dim' differs from the decoder's latent_dim");
  o.bottleneck_noise = bottleneck.get_bool("noise_regularize", false);
  known_keys(bottleneck, {"dim", "noise_augment_dim", "noise_regularize", "auto_scale", "freeze"});
  APUS_CHECK(ae.get_size("downsampling_ratio", 1) == s.patch_size * s.stride, ae.path,
             ": 'downsampling_ratio' is not patch_size x stride");
  APUS_CHECK(ae.get_size("latent_dim", s.latent_dim, 1) == s.latent_dim, ae.path,
             ": 'latent_dim' differs from the decoder's");
  APUS_CHECK(ae.get_size("io_channels", s.audio_channels, 1) == s.audio_channels, ae.path,
             ": 'io_channels' differs from the patched pretransform's channels");
  known_keys(ae,
             {"encoder", "decoder", "bottleneck", "pretransform", "latent_dim", "downsampling_ratio", "io_channels"});
}

OfficialConfig read_official_config(const std::string& path) {
  const Config top = read_config(path);
  OfficialConfig o;
  require_string(top, "model_type", "", "diffusion_cond", "a text-to-audio model");
  known_keys(top, {"model_type", "sample_size", "sample_rate", "audio_channels", "model"});
  const int64_t rate = top.get_size("sample_rate", 1);
  o.sample_size = top.get_size("sample_size", 1);
  const Config model = object(top, "model");
  known_keys(model, {"io_channels", "pretransform", "conditioning", "diffusion"});
  o.dit = read_dit(object(model, "diffusion"), o.euler);

  // SAME: the autoencoder under model.pretransform.config.
  const Config pretransform = object(model, "pretransform");
  require_string(pretransform, "type", "", "autoencoder", "Stable Audio 3's SAME");
  o.chunked_decode = pretransform.get_bool("chunked", false);
  // iterate_batch encodes and decodes a batch's samples one at a time: the same values.
  known_keys(pretransform, {"type", "chunked", "iterate_batch", "config"});
  read_official_autoencoder(object(pretransform, "config"), rate, o);
  APUS_CHECK(top.get_size("audio_channels", o.same.audio_channels, 1) == o.same.audio_channels, top.path,
             ": 'audio_channels' ", top.get_int("audio_channels", 0), " differs from the autoencoder's ",
             o.same.audio_channels);
  // Conditioning: T5Gemma's prompt and the duration.
  const Config cond = object(model, "conditioning");
  known_keys(cond, {"cond_dim", "configs"});
  const int64_t cond_dim = cond.get_size("cond_dim", 1);
  APUS_CHECK(cond.json.contains("configs") && cond.json["configs"].is_array(), cond.path, ": missing list 'configs'");
  bool prompt = false, seconds = false;
  for (size_t i = 0; i < cond.json["configs"].size(); ++i) {
    const Config entry{below(below(cond.path, "configs"), detail::concat("[", i, "]")), cond.json["configs"][i]};
    APUS_CHECK(entry.json.is_object(), entry.path, ": not an object");
    known_keys(entry, {"id", "type", "config"});
    const std::string id = entry.get_string("id", ""), type = entry.get_string("type", "");
    const Config cfg = object(entry, "config");
    if (id == "prompt" && type == "t5gemma") {
      require_string(cfg, "model_name", "google/t5gemma-b-b-ul2", "google/t5gemma-b-b-ul2", "the encoder apus runs");
      require_string(cfg, "padding_mode", "zero", "learned", "the published models' learned padding");
      require_bool(cfg, "project_out", false, false, "the published models use the encoder's output as is");
      o.max_tokens = int(cfg.get_size("max_length", 128, 1));
      o.max_tokens_key = cfg.path + ": 'max_length'";
      o.text_encoder_folder = cfg.get_string("subfolder", "t5gemma-b-b-ul2");
      APUS_CHECK(o.text_encoder_folder.find('/') == std::string::npos && o.text_encoder_folder != "..", cfg.path,
                 ": 'subfolder' must name a folder beside model_config.json");
      APUS_CHECK(!cfg.json.contains("model_path") || cfg.json["model_path"].is_null(), cfg.path,
                 ": 'model_path' is not supported (the encoder is read from the 'subfolder')");
      known_keys(cfg, {"model_name", "max_length", "enable_grad", "project_out", "padding_mode", "model_path",
                       "repo_id", "subfolder"});
      prompt = true;
    } else if (id == "seconds_total" && type == "number") {
      require_string(cfg, "fourier_features_type", "learned", "expo", "the published duration features");
      o.duration.output_dim = cond_dim;
      o.duration.fourier_dim = 256;  // NumberEmbedder's fixed width
      o.duration.min_val = cfg.get_double("min_val", 0.0);
      o.duration.max_val = cfg.get_double("max_val", 1.0);
      o.duration.check_range(cfg.path);
      known_keys(cfg, {"min_val", "max_val", "fourier_features_type"});
      seconds = true;
    } else {
      fail(entry.path, ": conditioner '", id, "' of type '", type, "' is not supported (prompt: t5gemma, ",
           "seconds_total: number)");
    }
  }
  APUS_CHECK(prompt && seconds, cond.path, ": needs the 'prompt' (t5gemma) and 'seconds_total' (number) conditioners");
  APUS_CHECK(o.dit.cond_dim == cond_dim && o.dit.global_dim == cond_dim, cond.path, ": cond_dim ", cond_dim,
             " differs from the DiT's cond_token_dim ", o.dit.cond_dim, " / global_cond_dim ", o.dit.global_dim);
  APUS_CHECK(model.get_size("io_channels", o.dit.io_channels, 1) == o.dit.io_channels &&
                 o.dit.io_channels == o.same.latent_dim && o.dit.local_dim == o.same.latent_dim + 1,
             model.path, ": the DiT's io_channels ", o.dit.io_channels, " / local_add_cond_dim ", o.dit.local_dim,
             " do not fit the decoder's latent_dim ", o.same.latent_dim);
  return o;
}

}  // namespace apus::sa3
