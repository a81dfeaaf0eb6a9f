// Stable Audio 3's two layouts (diffusers' StableAudio3Pipeline folders, the official single
// checkpoint), the model opened on either, and its parts loaded from it.
#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "io/hf_cache.h"
#include "io/weights/gguf.h"
#include "io/weights/quant_weights.h"
#include "io/weights/safetensors.h"
#include "io/weights/single_file.h"
#include "io/weights/synth.h"
#include "pipeline/sa3/official_checkpoint.h"
#include "pipeline/sa3/sa3_model.h"
#include "sampling/logsnr.h"

namespace apus {

namespace {

// The published configs' sample_size, for diffusers folders (which do not carry it): medium (the
// differential DiT) 16777216 samples (380 s), the small models 5324800 (120.7 s).
constexpr int64_t kMediumSampleSize = 16777216, kSmallSampleSize = 5324800;

void check_sa3_index(const ModelDir& dir) {
  const std::string index = dir.root() + "/model_index.json";
  const std::pair<const char*, const char*> components[] = {{"transformer", "StableAudio3DiTModel"},
                                                            {"vae", "AutoencoderSAME"},
                                                            {"text_encoder", "T5GemmaEncoderModel"},
                                                            {"duration_embedder", "StableAudio3DurationEmbedder"},
                                                            {"scheduler", "FlowMatchEulerDiscreteScheduler"}};
  for (const auto& [name, cls] : components)
    APUS_CHECK(dir.component_class(name) == cls, index, ": ", name, " class '", dir.component_class(name),
               "' is not supported (expected ", cls, ")");
  const std::string tok = dir.component_class("tokenizer");
  APUS_CHECK(tok == "GemmaTokenizer" || tok == "GemmaTokenizerFast", index, ": tokenizer class '", tok,
             "' is not supported (expected GemmaTokenizer)");
}

}  // namespace

GemmaTokenizer GemmaTokenizer::load(const std::string& source) {
  GemmaTokenizer t;
  // transformers 5 saves Gemma's tokenizer as tokenizer.json alone.
  const std::string json = std::filesystem::path(source).replace_filename("tokenizer.json").string();
  const bool json_instead = source.ends_with("tokenizer.model") && !path_exists(source) && path_exists(json);
  if ((path_exists(source) && is_gguf_file(source)) || source.ends_with(".json") || json_instead) {
    t.bpe_.emplace(BpeTokenizer::load(json_instead ? json : source));
    t.pad_ = t.bpe_->token_id("<pad>");
    t.bos_ = t.bpe_->token_id("<bos>");
    t.eos_ = t.bpe_->token_id("<eos>");
    t.vocab_ = t.bpe_->max_id() + 1;
    return t;
  }
  if (source.ends_with(".safetensors")) {
    const SafetensorsFile file = SafetensorsFile::open(source);
    APUS_CHECK(file.contains("spiece_model"), source, ": carries no tokenizer (no 'spiece_model' tensor, ",
               "as ComfyUI's T5Gemma file has)");
    const Tensor& b = file.get("spiece_model");
    APUS_CHECK(b.dtype == DType::u8 && b.rank() == 1, source, ": 'spiece_model' is ", dtype_name(b.dtype), " ",
               shape_str(b.shape), ", expected the bytes of a SentencePiece model (u8, one dimension)");
    t.sentencepiece_.emplace(SentencePieceTokenizer::parse(
        std::string(static_cast<const char*>(b.data), size_t(b.nbytes())), source + ": spiece_model"));
  } else {
    APUS_CHECK(path_exists(source), source,
               ": missing, and no tokenizer.json beside it (apus reads Gemma's SentencePiece model, its ",
               "tokenizer.json, or sa3.cpp's vocabulary GGUF)");
    t.sentencepiece_.emplace(SentencePieceTokenizer::load(source));
  }
  t.pad_ = t.sentencepiece_->pad_id();
  t.bos_ = t.sentencepiece_->bos_id();
  t.eos_ = t.sentencepiece_->eos_id();
  t.vocab_ = t.sentencepiece_->vocab_size();
  return t;
}

std::vector<int32_t> GemmaTokenizer::encode(std::string_view text) const {
  return bpe_ ? bpe_->encode(text) : sentencepiece_->encode(text);
}

bool tokenizer_from_parts(const ModelParts& parts, Sa3Layout& l) {
  if (!parts.tokenizer.empty()) {
    l.tokenizer_model = is_directory(parts.tokenizer) ? parts.tokenizer + "/tokenizer.model" : parts.tokenizer;
    return true;
  }
  if (parts.text_encoder.ends_with(".safetensors") &&
      SafetensorsFile::open(parts.text_encoder).contains("spiece_model")) {
    l.tokenizer_model = parts.text_encoder;
    return true;
  }
  return false;
}

Sa3Layout diffusers_layout(const ModelDir& dir) {
  check_sa3_index(dir);
  const Config scheduler = dir.config("scheduler", "scheduler_config.json");
  Sa3Layout l;
  l.euler = sa3_scheduler_is_euler(scheduler);
  l.root = dir.root();
  l.dit = sa3::DitConfig::read(dir.config("transformer"));
  l.same = sa3::SameConfig::read(dir.config("vae"));
  l.encoder = sa3::SameConfig::read(dir.config("vae"), /*encoder=*/true);
  l.duration = sa3::DurationConfig::read(dir.config("duration_embedder"));
  l.text_dir = dir.component("text_encoder");
  l.text_weights = l.text_dir;
  l.tokenizer_dir = dir.component("tokenizer");
  l.tokenizer_model = l.tokenizer_dir + "/tokenizer.model";
  l.sample_size = l.dit.differential ? kMediumSampleSize : kSmallSampleSize;
  l.linears = dir.transform("transformer");
  l.decoder_linears = dir.transform("vae");
  return l;
}

Sa3Layout official_layout(const std::string& root) {
  const sa3::OfficialConfig o = sa3::read_official_config(root + "/model_config.json");
  Sa3Layout l;
  l.official = true;
  l.root = root;
  l.dit = o.dit;
  l.same = o.same;
  l.encoder = o.encoder;
  l.encoder_mask_noise = o.encoder_mask_noise;
  l.duration = o.duration;
  l.checkpoint = root;
  l.text_dir = root + "/" + o.text_encoder_folder;
  l.text_weights = l.text_dir;
  l.tokenizer_dir = l.text_dir;
  l.tokenizer_model = l.tokenizer_dir + "/tokenizer.model";
  APUS_CHECK(is_directory(l.text_dir), l.text_dir, ": missing; the T5Gemma encoder and tokenizer ",
             "folder model_config.json names (its 'subfolder')");
  l.max_tokens = o.max_tokens;
  l.max_tokens_key = o.max_tokens_key;
  l.sample_size = o.sample_size;
  l.encoder_chunk = o.encoder_chunk;
  l.chunked_decode = o.chunked_decode;
  l.euler = o.euler;
  l.mask_noise = o.mask_noise;
  l.bottleneck_noise = o.bottleneck_noise;
  return l;
}

std::shared_ptr<const WeightSource> Sa3Model::checkpoint(const std::string& path, bool load) const {
  if (!load) return std::make_shared<ShapesOnly>();
  if (layout_.gguf && (path.empty() || path == layout_.checkpoint)) return layout_.gguf;
  if (is_directory(path)) return open_weights(path);
  return SingleFile::open(path);
}

WeightLoader Sa3Model::loader(std::shared_ptr<const WeightSource> source,
                              const std::shared_ptr<const WeightTransform>& transform) const {
  const WeightLoader stored(std::move(source), device_);
  return transform ? stored.with(transform) : stored;
}

sa3::T5GemmaEncoder Sa3Model::load_text(bool load) const {
  return sa3::T5GemmaEncoder::load(text_cfg_, loader(checkpoint(layout_.text_weights, load), layout_.linears),
                                   layout_.tensor_ranks);
}

Sa3Model::Transformer Sa3Model::load_transformer(DType dt, bool load, bool split) const {
  const ProcessGroup* ranks = split ? layout_.tensor_ranks : nullptr;
  if (!layout_.official)
    return {sa3::Dit::load(layout_.dit, loader(checkpoint(layout_.root + "/transformer", load), layout_.linears), dt,
                           ranks),
            sa3::DurationEmbedder::load(layout_.duration,
                                        WeightLoader(checkpoint(layout_.root + "/duration_embedder", load), device_))};
  const auto file = checkpoint(layout_.checkpoint, load);
  return {
      sa3::Dit::load(layout_.dit, loader(sa3::OfficialCheckpoint::dit(file, layout_.dit.differential), layout_.linears),
                     dt, ranks),
      sa3::DurationEmbedder::load_official(layout_.duration,
                                           WeightLoader(sa3::OfficialCheckpoint::duration(file), device_))};
}

sa3::SameDecoder Sa3Model::load_same(DType dt, bool load) const {
  if (!layout_.official)
    return sa3::SameDecoder::load(layout_.same,
                                  loader(checkpoint(layout_.root + "/vae", load), layout_.decoder_linears), dt,
                                  layout_.tensor_ranks);
  const auto file = checkpoint(layout_.checkpoint, load);
  const auto same = sa3::OfficialCheckpoint::same(file, "pretransform.model.", layout_.same.differential);
  return sa3::SameDecoder::load(layout_.same, loader(same, layout_.decoder_linears), dt, layout_.tensor_ranks);
}

sa3::SameEncoder Sa3Model::load_encoder(DType dt, bool load) const {
  if (!layout_.official)
    return sa3::SameEncoder::load(layout_.encoder, WeightLoader(checkpoint(layout_.root + "/vae", load), device_), dt);
  const auto file = checkpoint(layout_.checkpoint, load);
  const auto same = sa3::OfficialCheckpoint::same(file, "pretransform.model.", layout_.encoder.differential);
  return sa3::SameEncoder::load(layout_.encoder, WeightLoader(same, device_), dt);
}

Sa3Model::Sa3Model(Sa3Layout layout, Weights weights, Backend* device)
    : layout_(std::move(layout)),
      weights_(weights),
      device_(device),
      label_(layout_.label.empty() ? model_label(layout_.root) : layout_.label),
      sampler_(layout_.euler ? "Euler (rectified_flow)" : "ping-pong (rf_denoiser)") {
  text_cfg_ = sa3::T5GemmaConfig::read(read_config(layout_.text_dir + "/config.json"));
  // Every prompt is padded to max_tokens, and the encoder runs a sliding layer only where the whole
  // sequence fits its window.
  const bool slides = std::find(text_cfg_.sliding.begin(), text_cfg_.sliding.end(), true) != text_cfg_.sliding.end();
  APUS_CHECK(!slides || layout_.max_tokens <= text_cfg_.sliding_window, layout_.max_tokens_key, " is ",
             layout_.max_tokens, ", expected 1..", text_cfg_.sliding_window, " (the sliding window of ",
             layout_.text_dir, "/config.json; longer prompts are not supported)");
  const std::string where = layout_.root + (layout_.official ? "/model_config.json" : "/model_index.json");
  APUS_CHECK(text_cfg_.hidden == dit_cfg_.cond_dim && layout_.duration.output_dim == dit_cfg_.cond_dim &&
                 layout_.duration.output_dim == dit_cfg_.global_dim,
             where, ": the text encoder (", text_cfg_.hidden, "), duration embedder (", layout_.duration.output_dim,
             ") and transformer (cond_token_dim ", dit_cfg_.cond_dim, ", global_cond_dim ", dit_cfg_.global_dim,
             ") widths do not agree");
  APUS_CHECK(same_cfg_.latent_dim == dit_cfg_.io_channels && dit_cfg_.local_dim == dit_cfg_.io_channels + 1, where,
             ": the transformer's io_channels ", dit_cfg_.io_channels, " / local_add_cond_dim ", dit_cfg_.local_dim,
             " do not fit the decoder's latent_dim ", same_cfg_.latent_dim);
  {
    const Transformer counted = load_transformer(DType::bf16, false, /*split=*/false);
    lora_targets_ =
        sa3::lora_targets(counted.dit.weight_shapes(), counted.duration.weight_shapes(), dit_cfg_.differential);
  }
  if (weights_ == Weights::none) return;
  const std::string& tok_dir = layout_.tokenizer_dir;
  tokenizer_.emplace(GemmaTokenizer::load(layout_.tokenizer_model));
  APUS_CHECK(tokenizer_->vocab_size() <= text_cfg_.vocab, layout_.tokenizer_model, ": ", tokenizer_->vocab_size(),
             " pieces, more than the text encoder's ", text_cfg_.vocab, "-entry embedding (config.json vocab_size)");
  const std::string tok_config = tok_dir + "/tokenizer_config.json";
  if (path_exists(tok_config)) {
    padding_side_ = read_padding_side(tok_config);
    const Config tc = read_config(tok_config);
    add_bos_ = tc.get_bool("add_bos_token", true);  // GemmaTokenizer's defaults
    add_eos_ = tc.get_bool("add_eos_token", false);
  }
  if (weights_ == Weights::resident) {
    // A server's model serves one precision: bf16, the fast path.
    text_.emplace(load_text());
    dit_.emplace(load_transformer(resident_dtype_));
    same_.emplace(load_same(resident_dtype_));
    encoder_.emplace(load_encoder(resident_dtype_));
    text_->make_resident();
  }
}

std::unique_ptr<AudioModel> open_sa3(const ModelDir& dir, Weights weights, const ProcessGroup* tensor_ranks) {
  Sa3Layout l = diffusers_layout(dir);
  l.tensor_ranks = tensor_ranks;
  return std::make_unique<Sa3Model>(std::move(l), weights, dir.device());
}

std::shared_ptr<const WeightTransform> same_decoder_tier(Quant quant) {
  // SAME's feed-forward stays in bf16: with it in int8 the tiny model's MR-STFT median in `apus
  // gate` went from 0.50 to 0.66 against a threshold of 0.48, where the attention projections moved
  // it no further than the DiT's share does (docs/SPEED.md). The fp8 tier leaves the decoder whole:
  // its projections in e4m3 moved the tiny model's medians further (MR-STFT 0.650 -> 0.665,
  // log-mel 0.542 -> 0.576 against a threshold of 0.553, session 35). A decoder stored quantised
  // keeps its formats.
  if (quant != Quant::int8) return nullptr;
  return std::make_shared<TierLinears>(Products::int8,
                                       TierScope{{}, {"attn.to_qkv.weight", "attn.to_out.weight"}, true});
}

void use_quant(Sa3Layout& l, Quant quant, Backend* device) {
  l.linears = quant_linears(quant, device);
  l.decoder_linears = same_decoder_tier(quant);
}

std::unique_ptr<AudioModel> open_sa3_official(const std::string& root, Weights weights, Backend* device, Quant quant,
                                              const ProcessGroup* tensor_ranks) {
  Sa3Layout l = official_layout(root);
  use_quant(l, quant, device);
  l.tensor_ranks = tensor_ranks;
  return std::make_unique<Sa3Model>(std::move(l), weights, device);
}

std::unique_ptr<AudioModel> open_sa3_single_file(const ModelParts& parts, Weights weights, Backend* device) {
  const std::string& file = parts.model;
  if (is_gguf_file(file)) return open_sa3_gguf(parts, weights, device);
  APUS_CHECK(parts.vae.empty(), file, ": the checkpoint holds its own SAME autoencoder; --vae ", parts.vae,
             " is for sa3.cpp's GGUF files (a SAME .gguf beside their DiT)");
  std::string root;
  if (!parts.config.empty()) {
    root = resolve_model_dir(parts.config, Weights::none);
  } else {
    // The published layout of its shape: medium's DiT is the differential one (the two small
    // models share one config).
    // The file held while its tensor is read (a reference into a temporary's table dangled: an
    // intermittent crash of Sa3SingleFile.ComfyUiFilesGiveTheOfficialFoldersClip, session 21).
    const SafetensorsFile checkpoint = SafetensorsFile::open(file);
    const Tensor& qkv = checkpoint.get(kSa3SingleFileKey);
    const bool differential = qkv.dim(0) == 5 * qkv.dim(1);
    root = published_layout_dir(differential ? "stable-audio-3-medium" : "stable-audio-3-small-music");
    const sa3::OfficialConfig o = sa3::read_official_config(root + "/model_config.json");
    APUS_CHECK(o.dit.dim == qkv.dim(1), file, ": a Stable Audio 3 DiT of width ", qkv.dim(1),
               ", none of the published layouts' (", o.dit.dim, "); pass --config DIR, an official folder ",
               "(model_config.json beside its T5Gemma folder)");
  }
  Sa3Layout l = official_layout(root);
  use_quant(l, parts.quant, device);
  l.label = std::filesystem::path(file).filename().string();
  l.checkpoint = file;
  l.tensor_ranks = parts.tensor_ranks;
  if (!parts.text_encoder.empty()) l.text_weights = parts.text_encoder;
  const bool own_tokenizer = tokenizer_from_parts(parts, l) || !parts.config.empty();
  // The layouts apus carries hold no weights and a stand-in tokenizer.
  APUS_CHECK(weights == Weights::none || !parts.config.empty() || (!parts.text_encoder.empty() && own_tokenizer), file,
             ": a single Stable Audio 3 checkpoint needs --text-encoder FILE (T5Gemma, as ComfyUI's ",
             "t5gemma_b_b_ul2.safetensors, which carries its tokenizer) and, for a file without one, --tokenizer ",
             "(Gemma's tokenizer.model), or --config DIR, an official folder holding them");
  return std::make_unique<Sa3Model>(std::move(l), weights, device);
}

}  // namespace apus
