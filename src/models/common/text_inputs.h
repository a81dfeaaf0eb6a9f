#pragma once
// What every transformers-style text encoder does first: B prompts' ids staged as a tensor and
// embedded, and the default RoPE tables (transformers' f32 inverse frequencies) for positions
// 0..T-1, one sample's, shared by the batch.
#include <vector>

#include "ops/ops.h"

namespace apus {

struct TextInputs {
  Tensor x;         // [B*T, hidden] embedding rows in the activation dtype (arena)
  Tensor cos, sin;  // [T, head_dim / 2] f32 (arena)
};

TextInputs embed_text(Context& c, const Tensor& embedding, const std::vector<int32_t>& ids, int64_t batch,
                      int64_t head_dim, double rope_theta);

// A padding mask (1: a real token) as the attention ops take it: i64 in the context's memory
// (arena), staged once for every layer.
Tensor key_mask(Context& c, const std::vector<int64_t>& mask);

// The activations one pre-norm attention + gated-MLP layer works in, [rows, width] each, in the
// activation dtype (arena), reused by every layer.
struct LayerBuffers {
  Tensor normed, q, k, v, attn, proj, gate, up;
};
LayerBuffers layer_buffers(Context& c, int64_t rows, int64_t hidden, int64_t q_width, int64_t kv_width,
                           int64_t intermediate);

}  // namespace apus
