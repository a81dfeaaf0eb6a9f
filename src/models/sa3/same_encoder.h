#pragma once
// Stable Audio 3's SAME encoder (44.1 kHz audio -> latents), as the official SAMEEncoder and its
// soft-norm bottleneck compute it, for audio-to-audio and inpainting: the patches (channel-major
// within each, as the patched pretransform lays them out), a weight-normed mapping to the
// transformer's width (1x1 for SAME-L, kernel 3 for SAME-S), every 16 patches followed by one
// learned summary token, the same DynamicTanh transformer as the decoder's (band or chunked
// attention), the summary tokens kept, a projection to the latent width and the bottleneck's
// (x * scale + bias) / running_std. Weights in diffusers' AutoencoderSAME names.
#include <vector>

#include "apus/apus.h"
#include "models/sa3/same_transformer.h"

namespace apus::sa3 {

// An input clip as the official prepare_audio makes it for the encoder: resampled to `rate`
// (torchaudio's Resample), zero-padded or cut to `length` frames, then brought to `channels`
// (mono to every channel, a mono model the mean, extra channels dropped); planar
// [channels, length] into out. `what` names the clip in errors.
void prepare_clip(const AudioClip& clip, const std::string& what, int64_t rate, int64_t channels, int64_t length,
                  float* out);

class SameEncoder {
 public:
  // Weights under AutoencoderSAME's names; every parameter is converted to `compute` once.
  static SameEncoder load(const SameConfig& config, WeightLoader weights, DType compute);
  const SameConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  size_t make_resident() const { return weights_.make_resident(); }
  // audio [B, audio_channels, frames * samples_per_latent] (planar, any float dtype) -> latents
  // [B*frames, latent_dim] in the activation dtype (heap). chunked: the official encode_audio's
  // chunks of 128 latents overlapping by 32 (shorter clips encode whole).
  Tensor encode(Context& c, const Tensor& audio, bool chunked = false) const;

 private:
  explicit SameEncoder(WeightLoader weights) : weights_(std::move(weights)) {}
  SameConfig cfg_;
  WeightLoader weights_;
  Tensor mapping_, mapping_bias_, new_token_, proj_, proj_bias_;
  Tensor scale_, bias_, inv_std_, zeros_;  // the bottleneck, as [latent_dim] vectors
  SameTransformer transformer_;

  Tensor encode_piece(Context& c, const Tensor& audio) const;
};

}  // namespace apus::sa3
