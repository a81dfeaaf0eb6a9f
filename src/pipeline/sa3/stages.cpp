// Stable Audio 3's stages (encode_text, encode_clips, condition, step, decode) and the table of
// them that count() walks in counting mode and generate() runs on weights (pipeline/driver.h).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "pipeline/sa3/sa3_model.h"
#include "text/utf8.h"

namespace apus {

namespace {

constexpr const char* kEncodeStage = "same_encode";
constexpr const char* kDecodeStage = "same_decode";

}  // namespace

void Sa3Model::encode_text(Context& c, const sa3::T5GemmaEncoder& encoder, Work& w) const {
  // An empty prompt is all padding: every text position takes the learned padding embedding, so
  // the encoder (which would attend to no key) need not run.
  if (std::none_of(w.mask.begin(), w.mask.end(), [](int64_t m) { return m != 0; })) {
    w.text = ops::zeros(c, {int64_t(w.mask.size()), text_cfg_.hidden}, c.act);
    return;
  }
  // Split, every rank holds the same prompts: the linears' features split over the ranks.
  w.text = encoder.encode(c, w.ids, w.mask, w.negative ? 2 * w.batch : w.batch, ranks_sharing_inputs(w.parallel));
}

Tensor Sa3Model::prepare_clips(Context& c, const std::vector<AudioRequest>& requests, const Work& w) const {
  const int64_t ch = same_cfg_.audio_channels, length = w.canvas.frames * same_cfg_.samples_per_latent();
  Tensor clips = Tensor::heap({w.batch, ch, length}, DType::f32);
  for (int64_t b = 0; b < w.batch; ++b) {
    const AudioRequest& r = requests[size_t(b)];
    const AudioClip& clip = w.init ? *r.init_audio : *r.inpaint_audio;
    sa3::prepare_clip(clip, w.init ? "init audio" : "inpaint audio", same_cfg_.sample_rate, ch, length,
                      clips.ptr<float>() + b * ch * length);
  }
  return ops::to_context(c, clips);
}

void Sa3Model::encode_clips(Context& c, const sa3::SameEncoder& encoder, Work& w) const {
  w.clip_latents = encoder.encode(c, w.clips, layout_.chunked_decode);
}

void Sa3Model::start_from_clip(Context& c, Work& w) const {
  // The official start: init x (1 - level) + noise x level, each product and the sum in fp32.
  // On the host: the scalars are Python floats (1 - level in double), which no op's rounding rule
  // matches; once per request, so counting leaves it out.
  if (c.count_only) return;
  const Tensor clip = ops::to_host(c, w.clip_latents);
  const Tensor z = clip.dtype == DType::f32 ? clip : to_dtype(clip, DType::f32);
  Tensor start = ops::to_host(c, w.latents);
  const float keep = float(1.0 - w.init_level), level = float(w.init_level);
  float* x = start.ptr<float>();
  const float* init = z.ptr<float>();
  for (int64_t i = 0; i < start.numel(); ++i) x[i] = init[i] * keep + x[i] * level;
  w.latents = ops::to_context(c, start);
}

void Sa3Model::condition(Context& c, const Transformer& parts, Work& w) const {
  const sa3::DurationEmbedder& duration = parts.duration;
  const sa3::Dit& dit = parts.dit;
  CostScope scope(c, "conditioning");
  ArenaScope arena(*c.arena);
  const AdapterScope adapted(c, w.adapters.get());
  const int64_t b = w.batch, text = w.tokens, tokens = text + 1, d = dit_cfg_.cond_dim, t = w.canvas.frames;
  const int64_t samples = w.guided ? 2 * b : b;
  w.duration = duration.embed(c, w.seconds);
  // Cross tokens per sample: the text (padding replaced in the DiT's prologue), then the duration.
  // Guided, the unconditional half follows: all zeros (the duration token too), or the negative
  // prompt's tokens with its padding zeroed and the duration token kept, as the official DiT
  // builds it; nothing there is replaced by the padding embedding.
  Tensor cross = ops::zeros(c, {samples * tokens, d}, c.act);
  std::vector<int64_t> valid(size_t(samples * tokens), 1);
  for (int64_t s = 0; s < b; ++s) {
    Tensor text_rows = cross.rows(s * tokens, s * tokens + text);
    ops::copy(c, w.text.rows(s * text, (s + 1) * text), text_rows);
    Tensor last = cross.rows(s * tokens + text, (s + 1) * tokens);
    ops::copy(c, w.duration.rows(s, s + 1), last);
    std::copy(w.mask.begin() + s * text, w.mask.begin() + (s + 1) * text, valid.begin() + s * tokens);
    if (!w.negative) continue;
    // The negative prompt's valid tokens, zeros for its padding: a gather from its rows with a
    // zero row appended (the same ops whatever the mask).
    const int64_t u = b + s;
    Tensor table = ops::zeros(c, {text + 1, d}, c.act);
    Tensor table_text = table.rows(0, text);
    ops::copy(c, w.text.rows(u * text, (u + 1) * text), table_text);
    const Tensor ids = ops::host_filled(c, {text}, DType::i32, [&](Tensor& t) {
      for (int64_t p = 0; p < text; ++p) t.ptr<int32_t>()[p] = int32_t(w.mask[size_t(u * text + p)] ? p : text);
    });
    Tensor neg_text = cross.rows(u * tokens, u * tokens + text);
    ops::embedding(c, table, ids, neg_text);
    Tensor neg_last = cross.rows(u * tokens + text, (u + 1) * tokens);
    ops::copy(c, w.duration.rows(s, s + 1), neg_last);
  }
  Tensor global = Tensor::in(*c.arena, {samples, d}, c.act);
  for (int64_t half = 0; half < samples / b; ++half) {
    Tensor rows = global.rows(half * b, (half + 1) * b);
    ops::copy(c, w.duration, rows);
  }
  // Inpainting: per latent the mask (1: kept), then the clip's latents where kept, for both
  // halves of a guided batch; text-to-audio passes zeros, as the official code does.
  Tensor local = ops::zeros(c, {samples * t, dit_cfg_.local_dim}, c.act);
  if (w.inpaint) {
    // The clip's latents where kept: blended into the zeros with the mask as weight (0 or 1, exact).
    const Tensor keep = ops::host_filled(c, {t}, DType::f32,
                                         [&](Tensor& m) { std::copy(w.keep.begin(), w.keep.end(), m.ptr<float>()); });
    for (int64_t s = 0; s < samples; ++s) {
      Tensor rows = local.rows(s * t, (s + 1) * t);
      Tensor mask_col = rows.cols(0, 1), latents = rows.cols(1, dit_cfg_.local_dim);
      ops::copy(c, keep.reshape({t, 1}), mask_col);
      ops::blend(c, latents, w.clip_latents.rows((s % b) * t, (s % b + 1) * t), keep, latents);
    }
  }
  w.prologue = dit.prologue(c, cross, valid, global, local, w.canvas.valid);
  if (w.parallel.strategy == Parallel::ulysses)
    w.prologue = w.prologue->rank_share(c, SequenceSplit{w.parallel.group, {dit_cfg_.memory_tokens, w.canvas.frames}});
  w.velocity = ops::empty(c, {samples * t, dit_cfg_.io_channels}, c.act);
  if (w.guided) w.guided_velocity = ops::empty(c, {b * t, dit_cfg_.io_channels}, DType::f32);
}

void Sa3Model::draw_noise(Context& c, Work& w, Tensor& out) const {
  const int64_t ch = dit_cfg_.io_channels, t = w.canvas.frames;
  // Counted too: the draw is host work, the transpose into the rows an op.
  for (int64_t s = 0; s < w.batch; ++s) {
    const Tensor planes = ops::host_filled(
        c, {ch, t}, DType::f32, [&](Tensor& p) { w.generators[size_t(s)].randn(p.ptr<float>(), p.numel()); });
    Tensor rows = out.rows(s * t, (s + 1) * t);
    ops::transpose(c, planes, rows);
  }
}

void Sa3Model::step(Context& c, const sa3::Dit& dit, Work& w, int i) const {
  const float t = w.sigmas[size_t(i)], t_next = w.sigmas[size_t(i) + 1];
  ArenaScope arena(*c.arena);
  const int64_t rows = w.latents.shape[0];
  Tensor x = w.latents;
  if (c.act != DType::f32 || w.guided) {
    // Guided, the batch runs twice: conditional rows, then unconditional.
    x = Tensor::in(*c.arena, {(w.guided ? 2 : 1) * rows, w.latents.shape[1]}, c.act);
    for (int64_t half = 0; half < x.shape[0] / rows; ++half) {
      Tensor part = x.rows(half * rows, (half + 1) * rows);
      ops::copy(c, w.latents, part);
    }
  }
  {
    const AdapterScope adapted(c, w.adapters.get());
    split_forward(c, w.parallel, w.prologue->batch, x, w.velocity,
                  [&](int64_t first, int64_t count, const Tensor& mine, Tensor& out) {
                    dit.forward(c, w.prologue->samples(first, count), mine, t, out);
                  });
  }
  if (w.adapters && i == 0) {
    // The conditioning and one step run every linear: an adapter left unapplied was lost on the way.
    const std::vector<std::string> missing = w.adapters->unapplied();
    APUS_CHECK(missing.empty(), label_, ": the LoRA for '", missing.empty() ? "" : missing.front(),
               "' was never applied (its weight does not reach a linear as loaded)");
  }
  CostScope scope(c, "sampler");
  Tensor v = w.velocity;
  if (w.guided) {
    ops::guided_velocity(c, w.latents, w.velocity.rows(0, rows), w.velocity.rows(rows, 2 * rows), w.guided_velocity, t,
                         w.cfg, w.apg, w.batch, w.canvas.valid);
    v = w.guided_velocity;
  }
  if (!w.previews.empty() && !c.count_only) send_previews(c, w, v, i);
  if (layout_.euler) {
    ops::euler_update(c, w.latents, v, t_next - t);
    return;
  }
  // The official loop draws the next noise even on the last step, where t_next = 0 discards it.
  draw_noise(c, w, w.noise);
  ops::pingpong_update(c, w.latents, v, w.noise, t, t_next);
}

void Sa3Model::send_previews(Context& c, const Work& w, const Tensor& velocity, int i) const {
  ArenaScope arena(*c.arena);
  const float t = w.sigmas[size_t(i)];
  const std::vector<float> x = to_f32_vector(ops::to_host(c, w.latents)), v = to_f32_vector(ops::to_host(c, velocity));
  Tensor estimate = Tensor::heap(w.latents.shape, DType::f32);
  for (size_t k = 0; k < x.size(); ++k) estimate.ptr<float>()[k] = x[k] - t * v[k];
  const Tensor f32 = ops::to_context(c, estimate);
  Tensor z = f32;
  if (c.act != DType::f32) {
    z = Tensor::in(*c.arena, estimate.shape, c.act);
    ops::copy(c, f32, z);
  }
  const std::vector<float> audio = to_f32_vector(ops::to_host(c, same_->decode(c, z, w.batch, w.chunked, {})));
  // Each sample's first canvas.samples frames, channels mixed, as (min, max) over 512 buckets.
  const int64_t channels = same_cfg_.audio_channels, n = int64_t(audio.size()) / (w.batch * channels);
  const int64_t frames = std::min(n, w.canvas.samples), buckets = std::min<int64_t>(512, frames);
  for (size_t b = 0; b < w.previews.size(); ++b) {
    if (!w.previews[b]) continue;
    Preview p;
    p.step = i + 1;
    p.steps = int(w.sigmas.size()) - 1;
    for (int64_t k = 0; k < buckets; ++k) {
      float lo = 1, hi = -1;
      for (int64_t f = k * frames / buckets; f < (k + 1) * frames / buckets; ++f) {
        float mixed = 0;
        // Each channel clamped as the clip is, then mixed.
        for (int64_t ch = 0; ch < channels; ++ch)
          mixed += std::clamp(audio[size_t((int64_t(b) * channels + ch) * n + f)], -1.0f, 1.0f);
        mixed /= float(channels);
        lo = std::min(lo, mixed);
        hi = std::max(hi, mixed);
      }
      p.peaks.push_back(lo);
      p.peaks.push_back(hi);
    }
    w.previews[b](p);
  }
}

void Sa3Model::decode(Context& c, const sa3::SameDecoder& same, Work& w) const {
  ArenaScope arena(*c.arena);
  Tensor z = w.latents;
  if (c.act != DType::f32) {
    z = Tensor::in(*c.arena, w.latents.shape, c.act);
    ops::copy(c, w.latents, z);
  }
  // The official decode's noise continues each sample's generator after the sampler's draws
  // (drawn ahead on a device: initial_noise).
  sa3::DecodeNoise noise = sa3::DecodeNoise::from(layout_.bottleneck_noise, layout_.mask_noise, w.generators);
  if (!w.decode_draws.empty())
    noise.draw = [&w](int64_t s, float* out, int64_t n) { w.decode_draws[size_t(s)]->take(out, n); };
  // Split, every rank holds the same latents: the decoder's chunks split over the ranks too, but
  // under tensor, where the decoder's features are (every rank decodes every chunk).
  w.audio = same.decode(c, z, w.batch, w.chunked, noise,
                        w.parallel.strategy == Parallel::tensor ? nullptr : ranks_sharing_inputs(w.parallel));
}

void Sa3Model::count_inputs(Work& w, int batch) const {
  const int prompts = (w.negative ? 2 : 1) * batch;
  w.ids.assign(size_t(prompts * w.tokens), 0);
  w.mask.assign(size_t(prompts * w.tokens), 1);
  w.generators.assign(size_t(batch), TorchGenerator(0));  // counting draws nothing
  const int64_t rows = batch * w.canvas.frames;
  w.latents = Tensor::shape_only({rows, dit_cfg_.io_channels}, DType::f32);
  w.noise = Tensor::shape_only({rows, dit_cfg_.io_channels}, DType::f32);
  w.clips = Tensor::shape_only({batch, same_cfg_.audio_channels, w.canvas.frames * same_cfg_.samples_per_latent()},
                               DType::f32);
}

void Sa3Model::tokenize(Work& w, const std::vector<AudioRequest>& requests, std::vector<AudioResult>& results,
                        const Progress& say) const {
  auto add = [&](const std::string& text, const char* what) {
    require_utf8(text, std::string("the ") + what);
    std::vector<int32_t> ids = tokenizer_->encode(text);
    // The official conditioner calls the tokenizer with its special tokens on: the config decides.
    if (add_bos_) ids.insert(ids.begin(), tokenizer_->bos_id());
    if (add_eos_) ids.push_back(tokenizer_->eos_id());
    const int n = int(ids.size());
    PaddedIds padded = pad_ids(std::move(ids), w.tokens, tokenizer_->pad_id(), padding_side_);
    if (padded.truncated)
      say(std::string(what) + " truncated to " + std::to_string(w.tokens) + " tokens (it has " + std::to_string(n) +
          "), as the official conditioner truncates");
    w.ids.insert(w.ids.end(), padded.ids.begin(), padded.ids.end());
    w.mask.insert(w.mask.end(), padded.mask.begin(), padded.mask.end());
    return n;
  };
  for (size_t i = 0; i < requests.size(); ++i) results[i].prompt_tokens = add(requests[i].prompt, "prompt");
  if (w.negative)
    for (const AudioRequest& o : requests) add(*o.negative_prompt, "negative prompt");
}

void Sa3Model::initial_noise(Context& c, Work& w, const std::vector<AudioRequest>& requests,
                             std::vector<AudioResult>& results) const {
  for (const AudioResult& res : results) w.generators.emplace_back(res.seed);
  w.previews = preview_sinks(requests);
  w.latents = ops::empty(c, {w.batch * w.canvas.frames, dit_cfg_.io_channels}, DType::f32);
  w.noise = ops::empty(c, w.latents.shape, DType::f32);
  draw_noise(c, w, w.latents);
  if (w.init || w.inpaint) w.clips = prepare_clips(c, requests, w);
  // On a device the host would make the decoder's noise while the device waits (millions of
  // normals a chunk): each sample's is drawn ahead, past the sampler's draws, while the text
  // encoder and the DiT run. On the CPU the cores are busy with the model: nothing to gain.
  const sa3::DecodeNoise noise = sa3::DecodeNoise::from(layout_.bottleneck_noise, layout_.mask_noise, w.generators);
  if (!device_ || !noise.any()) return;
  const std::vector<int64_t> sampler(layout_.euler ? 0 : w.sigmas.size() - 1, dit_cfg_.io_channels * w.canvas.frames);
  const std::vector<int64_t> decoder = sa3::same_noise_draws(same_cfg_, w.canvas.frames, w.chunked, noise);
  constexpr int64_t kBudget = int64_t(128) << 20;  // values (512 MiB) waiting at most, per sample
  for (const TorchGenerator& g : w.generators)
    w.decode_draws.push_back(std::make_unique<DrawsAhead>(g, sampler, decoder, kBudget));
}

std::vector<std::unique_ptr<Part<Sa3Model::Work>>> Sa3Model::make_parts() const {
  using Text = sa3::T5GemmaEncoder;
  using Encoder = sa3::SameEncoder;
  using Decoder = sa3::SameDecoder;
  std::vector<std::unique_ptr<Part<Work>>> parts;
  parts.push_back(model_part<Work, Text>(
      {"text encoder load",
       [this](Weights wt, DType) { return load_text(wt != Weights::none); },
       &text_,
       {{kTextStage, "text encoder", [this](Context& c, const Text& m, Work& w, int) { encode_text(c, m, w); },
         &Work::text, "the text encoder"}}}));
  // Audio-to-audio and inpainting encode their clips (the official encoder draws no noise).
  parts.push_back(
      model_part<Work, Encoder>({"encoder load",
                                 [this](Weights wt, DType dt) { return load_encoder(dt, wt != Weights::none); },
                                 &encoder_,
                                 {{kEncodeStage, "encode",
                                   [this](Context& c, const Encoder& m, Work& w, int) {
                                     encode_clips(c, m, w);
                                     if (w.init) start_from_clip(c, w);
                                   },
                                   &Work::clip_latents, "the SAME encoder"}},
                                 [](const Work& w) { return w.init || w.inpaint; }}));
  parts.push_back(model_part<Work, Transformer>(
      {"transformer load",
       [this](Weights wt, DType dt) { return load_transformer(dt, wt != Weights::none); },
       &dit_,
       {{kPrologueStage, "conditioning",
         [this](Context& c, const Transformer& m, Work& w, int) { condition(c, m, w); }},
        {kStepStage, "", [this](Context& c, const Transformer& m, Work& w, int i) { step(c, m.dit, w, i); },
         &Work::latents, "",
         [](const Work& w) {
           return StepRange{0, int(w.sigmas.size()) - 1, &w.sigmas};
         }}}}));
  parts.push_back(model_part<Work, Decoder>(
      {"decoder load",
       [this](Weights wt, DType dt) { return load_same(dt, wt != Weights::none); },
       &same_,
       {{kDecodeStage, "decode", [this](Context& c, const Decoder& m, Work& w, int) { decode(c, m, w); }, &Work::audio,
         "the SAME decoder"}}}));
  return parts;
}

void Sa3Model::finish(Context& c, Work& w, const std::vector<AudioRequest>&, std::vector<AudioResult>& results) const {
  // The official output: fp32, clamped to [-1, 1], the first int(d * rate) samples of each channel
  // (past the padding mask's valid latents it zeroes, which lie beyond that cut).
  const int64_t channels = same_cfg_.audio_channels, length = w.audio.shape[2], n = std::min(w.canvas.samples, length);
  const Tensor decoded = ops::to_host(c, w.audio);
  const Tensor audio = decoded.dtype == DType::f32 ? decoded : to_dtype(decoded, DType::f32);
  for (int64_t s = 0; s < w.batch; ++s) {
    AudioResult& res = results[size_t(s)];
    res.sample_rate = int(same_cfg_.sample_rate);
    res.channels = int(channels);
    res.samples.resize(size_t(n * channels));
    const float* base = audio.ptr<float>() + s * channels * length;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t ch = 0; ch < channels; ++ch)
        res.samples[size_t(i * channels + ch)] = std::clamp(base[ch * length + i], -1.0f, 1.0f);
  }
}

}  // namespace apus
