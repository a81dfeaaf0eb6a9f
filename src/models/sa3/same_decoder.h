#pragma once
// Stable Audio 3's SAME-L audio decoder (latents -> 44.1 kHz stereo), as the official SAMEDecoder
// computes it: the bottleneck's scale, a projection, each latent followed by 16 learned
// placeholder tokens, transformer blocks with DynamicTanh norms and differential attention over a
// band |i - j| <= 17 tokens, the placeholders kept, a weight-normed 1x1 convolution to patches and
// the unpatch. Weights in diffusers' AutoencoderSAME layout.
//
// The official decode's inference noise (the bottleneck's noise_regularize, the placeholders'
// mask_noise; diffusers' class has neither) and its chunked decode (128 latents, overlap 32, each
// chunk on its own with fresh noise) are options. SAME-S (the small models') attends within
// 34-token chunks, shifted by half a chunk for its second half of blocks, and maps with a
// kernel-3 convolution; diffusers' class cannot hold it, so it comes from official checkpoints.
#include <vector>

#include <functional>

#include "apus/apus.h"
#include "core/share.h"
#include "models/sa3/same_transformer.h"
#include "sampling/torch_rng.h"

namespace apus::sa3 {

// The official decode's noise, drawn per decoded piece from each sample's generator (torch's
// global one in the official code), in its order: the bottleneck's N(0, 1) x running_std x 1e-3
// over C x T, then the placeholders' N(0, 1) x mask over T x 16 x D.
struct DecodeNoise {
  bool bottleneck = false;
  float mask = 0;
  // Sample s's next n normals into out: its generator's next torch.randn(n), or the same values
  // drawn ahead (DrawsAhead). Null: no noise.
  std::function<void(int64_t s, float* out, int64_t n)> draw;
  int64_t samples = 0;  // how many samples `draw` has
  bool any() const { return draw && (bottleneck || mask > 0); }
  // Noise from one generator per sample.
  static DecodeNoise from(bool bottleneck, float mask, std::vector<TorchGenerator>& generators);
};

// The sizes of each sample's decoder draws, in order, for a decode of `frames` latents: what
// DrawsAhead makes ahead.
std::vector<int64_t> same_noise_draws(const SameConfig& config, int64_t frames, bool chunked, const DecodeNoise& noise);

class SameDecoder {
 public:
  // Weights under diffusers' names; every parameter is converted to `compute` once (the official
  // model.to(dtype)). With `tensor_ranks` (more than one) the transformer's linears hold this
  // rank's share of their features (SameTransformer::load): every rank then decodes every piece.
  static SameDecoder load(const SameConfig& config, WeightLoader weights, DType compute,
                          const ProcessGroup* tensor_ranks = nullptr);
  const SameConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  size_t make_resident() const { return weights_.make_resident(); }
  // latents [B*T, latent_dim] (frames sample-major) -> audio [B, audio_channels, T * 4096] in
  // the activation dtype (heap), planar channels. chunked: the official decode_audio's chunks of
  // 128 latents overlapping by 32 (sequences shorter than a chunk decode whole). With `ranks`
  // (issue 43: every rank holding the same latents and generators) the chunks split over the ranks,
  // each rank drawing past the earlier chunks' noise, and their audio is gathered into every rank's
  // copy; a decoder loaded split over ranks takes none (its ranks decode every chunk together).
  Tensor decode(Context& c, const Tensor& latents, int64_t batch, bool chunked = false, const DecodeNoise& noise = {},
                const ProcessGroup* ranks = nullptr) const;

 private:
  explicit SameDecoder(WeightLoader weights) : weights_(std::move(weights)) {}
  // The chunks' audio every other rank decoded, into `out` [B * channels, samples].
  void gather_chunks(Context& c, const ProcessGroup& ranks, const std::vector<SameChunk>& chunks, Tensor& out) const;
  SameConfig cfg_;
  WeightLoader weights_;
  Tensor scale_, zeros_;   // running_std as a [latent_dim] vector; the shift 0
  float noise_scale_ = 1;  // running_std in the compute dtype, for the bottleneck noise
  Tensor proj_, proj_bias_, new_token_, mapping_, mapping_bias_;
  SameTransformer transformer_;

  Tensor decode_piece(Context& c, const Tensor& latents, int64_t batch, const DecodeNoise& noise) const;
};

}  // namespace apus::sa3
