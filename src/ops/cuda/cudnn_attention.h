#pragma once
// Attention through cuDNN's fused SDPA (cudnn_attention.cpp, knob cuda.attention=cudnn): the
// FlashAttention-style kernels torch's SDPA runs on a GPU, so the official pipelines' own bf16
// numerics there. Their softmax is online: exp(s - running max) is rounded to bf16 before P·V and
// the division by the row's sum comes last, another rounding than the contract's
// round(exp(s - max) / sum); both round each probability once, and the op table holds this arm to
// the bound that arithmetic gives (tests/op_bounds.h, FusedAgreement).
#include <array>
#include <cstdint>
#include <string>

namespace apus {

struct Context;

namespace cuda {

// One attention as the arm takes it: bf16 rows, q [batch * sq, hq * d], k and v [batch * sk,
// hk * d], o like q (row strides in elements), no key mask, band, softcap or step rounding;
// causal: query i sees keys j <= i.
struct SdpaOperands {
  const void *q, *k, *v;
  void* o;
  int64_t q_stride, k_stride, v_stride, o_stride;
  int64_t batch, sq, sk, hq, hk, d;
  float scale;
  bool causal;
};

// An operand as cuDNN sees it: dims [batch, heads, rows, head_dim] and the strides (elements) that
// find apus's layout, sample b at row b * rows, head h at columns h * head_dim.
struct SdpaTensor {
  std::array<int64_t, 4> dim, stride;
};
inline SdpaTensor sdpa_tensor(int64_t batch, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride) {
  return {{batch, heads, rows, head_dim}, {rows * row_stride, head_dim, row_stride, 1}};
}

// Whether the arm can be asked for these heads: widths cuDNN's fused kernels take on Ampere to
// Hopper (multiples of 8 up to 128), rows 16-byte aligned. cuDNN may still decline a shape on the
// GPU at hand (attention_by_cudnn answers false).
bool cudnn_attention_takes(int64_t head_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t o_stride);

// Runs it on the backend's stream (its graph built once per shape and kept); false when cuDNN has
// no engine for the shape on this GPU (kept too, and said once on stderr with cuDNN's reason: the
// caller takes another kernel). A build without cudnn-frontend's headers refuses the knob by name.
bool attention_by_cudnn(Context& c, const SdpaOperands& a);

// The frontend's own check of the graph built for `a` (its dims, strides, data types and
// attributes) as it checks it for a GPU of compute capability `sm` (90: Hopper), made without a
// device (cuDNN is asked its version): empty when it holds, else the frontend's message.
std::string sdpa_graph_problem(const SdpaOperands& a, int sm);

}  // namespace cuda
}  // namespace apus
