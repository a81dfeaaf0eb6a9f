#pragma once
// The blocks the FLUX.2 VAE's encoder and decoder share (diffusers' ResnetBlock2D without a time
// embedding, and the mid block's single-head attention), with their weights read by key prefix.
#include <string>

#include "io/model_dir.h"
#include "models/common/feature_split.h"
#include "ops/ops.h"

namespace apus::flux2::vae {

// diffusers' Encoder and Decoder fix every GroupNorm eps (resnets, mid-block attention,
// conv_norm_out) at 1e-6 in code; the config has no key for it.
constexpr float kNormEps = 1e-6f;

struct Norm {
  Tensor weight, bias;
};
struct Resnet {
  Norm norm1, norm2;
  Tensor conv1_w, conv1_b, conv2_w, conv2_b;
  Tensor shortcut_w, shortcut_b;  // a 1x1 conv, only where the block changes the channel count
};
struct Attention {
  Norm norm;
  Tensor q_w, q_b, k_w, k_b, v_w, v_b, out_w, out_b;
};

Norm load_norm(const WeightLoader& w, const std::string& prefix, int64_t channels);
// A square conv's weight [out, in, k, k] and bias [out].
void load_conv(const WeightLoader& w, const std::string& prefix, int64_t out, int64_t in, int64_t k, Tensor& weight,
               Tensor& bias);
Resnet load_resnet(const WeightLoader& w, const std::string& prefix, int64_t in, int64_t out);
Attention load_attention(const WeightLoader& w, const std::string& prefix, int64_t channels);

// The latents' batch-norm statistics as the pipeline applies them in the activation dtype `dt`:
// the running mean cast to it and sqrt(running_var + eps) evaluated in it (f32 tensors holding
// those values); shapes only when the weights are (counting mode).
struct BatchNormStats {
  Tensor mean, std;
};
// In host memory (the encoder derives its normalisation from them); the decoder places them.
BatchNormStats batch_norm_stats(const WeightLoader& w, int64_t channels, double eps, DType dt);

// ops::conv2d, its output channels over `split`'s ranks when given (models/common/feature_split.h:
// under cfg and Ulysses the decoder's convolutions are dealt out, the rest runs whole on each rank).
void conv(Context& c, FeatureSplit* split, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
          int64_t stride, int64_t pad, int64_t pad_end);

// y = x + conv2(silu(norm2(conv1(silu(norm1(x)))))), the sum through the 1x1 shortcut where the
// channel count changes; NCHW, each eager op rounded to the activation dtype.
void resnet(Context& c, const Resnet& r, int64_t groups, const Tensor& x, Tensor& y, FeatureSplit* split = nullptr);
// y = x + attention over all H*W positions, one head of head_dim = channels (AttnProcessor2_0
// with group_norm and a residual connection; rescale_output_factor 1).
void attention(Context& c, const Attention& a, int64_t groups, const Tensor& x, Tensor& y);

}  // namespace apus::flux2::vae
