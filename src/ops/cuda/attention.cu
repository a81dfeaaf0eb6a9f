// Attention on the GPU with the contract's numerics, one thread block per (query row, head):
// scores in fp32 over the keys the row may see (causal, band, padding), shaped as the reference
// shapes them (softcap, step-by-step rounding), softmax in fp32, probabilities rounded to the
// activation dtype, P·V summed in fp32; the differential form rounds each term before the
// difference. Correct first: a fused flash-style kernel (issue 11) replaces it once this one has
// proven the numerics on a device.
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"

namespace apus::cuda {

namespace {

struct Operand {
  const void* data;
  int64_t stride;  // elements between rows
};

struct Params {
  Operand q[2], k[2], v;
  void* o;
  int64_t o_stride;
  DType dt;
  int terms;
  int64_t batch, sq, sk, hq, hk, d, window;
  float scale, softcap;
  bool causal, round_steps;
  const int64_t* key_valid;
};

__global__ void attention_kernel(Params p) {
  extern __shared__ float probs[];  // the visible keys' scores, then probabilities
  const int64_t row = blockIdx.x, h = blockIdx.y, b = row / p.sq, qi = row % p.sq, g = h / (p.hq / p.hk);
  int64_t lo = 0, hi = p.sk;
  if (p.window > 0) {
    lo = max(qi - p.window, int64_t(0));
    hi = min(qi + p.window + 1, p.sk);
  }
  if (p.causal) hi = min(hi, qi + 1);
  const int64_t n = hi - lo;
  float out[2] = {0.0f, 0.0f};  // this thread's channel, per term
  const int64_t c = threadIdx.x;
  for (int t = 0; t < p.terms; ++t) {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const int64_t key = b * p.sk + lo + j;
      float s = 0.0f;
      for (int64_t e = 0; e < p.d; ++e)
        s += load(p.dt, p.q[t].data, row * p.q[t].stride + h * p.d + e) *
             load(p.dt, p.k[t].data, key * p.k[t].stride + g * p.d + e);
      float scale = p.scale;
      if (p.softcap > 0 || p.round_steps) {
        if (p.round_steps) s = round_to(DType::bf16, s);
        s *= p.scale;
        if (p.round_steps) s = round_to(DType::bf16, s);
        if (p.softcap > 0) {
          s /= p.softcap;
          if (p.round_steps) s = round_to(DType::bf16, s);
          s = tanhf(s);
          if (p.round_steps) s = round_to(DType::bf16, s);
          s *= p.softcap;
          if (p.round_steps) s = round_to(DType::bf16, s);
        }
        scale = 1.0f;
      }
      if (p.key_valid && !p.key_valid[key]) s = -INFINITY;
      probs[j] = s * scale;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, probs[j]);
    mx = block_reduce(mx, true);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float e = mx == -INFINITY ? 0.0f : expf(probs[j] - mx);
      probs[j] = e;
      sum += e;
    }
    sum = block_reduce(sum, false);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) probs[j] = round_to(p.dt, probs[j] * inv);
    __syncthreads();
    if (c < p.d) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; ++j)
        acc += probs[j] * load(p.dt, p.v.data, (b * p.sk + lo + j) * p.v.stride + g * p.d + c);
      out[t] = acc;
    }
    __syncthreads();
  }
  if (c >= p.d) return;
  float result = out[0];
  if (p.terms > 1) result = round_to(p.dt, out[0]) - round_to(p.dt, out[1]);
  const int64_t at = row * p.o_stride + h * p.d + c;
  if (p.dt == DType::bf16) static_cast<__nv_bfloat16*>(p.o)[at] = __float2bfloat16_rn(result);
  else static_cast<float*>(p.o)[at] = result;
}

void attend(const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks, const Tensor& v, Tensor& o,
            int64_t head_dim, float scale, const ops::AttentionOptions& mask) {
  const Tensor &q = *qs[0], &k = *ks[0];
  const int64_t batch = mask.batch, d = head_dim;
  APUS_CHECK(batch >= 1 && q.shape[0] % batch == 0 && k.shape[0] % batch == 0 && q.shape[1] % d == 0 &&
                 k.shape[1] % d == 0 && v.shape == k.shape && o.shape == q.shape && q.dtype == k.dtype &&
                 v.dtype == q.dtype && o.dtype == q.dtype && (q.dtype == DType::bf16 || q.dtype == DType::f32) &&
                 d <= 1024 && (q.shape[1] / d) % (k.shape[1] / d) == 0,
             "attention: q ", shape_str(q.shape), ", k ", shape_str(k.shape), ", v ", shape_str(v.shape), ", o ",
             shape_str(o.shape), ", head_dim ", d, ", batch ", batch);
  Params p{};
  p.terms = int(qs.size());
  for (int t = 0; t < p.terms; ++t) {
    APUS_CHECK(qs[size_t(t)]->shape == q.shape && ks[size_t(t)]->shape == k.shape,
               "differential attention: q2, k2 shapes");
    p.q[t] = {qs[size_t(t)]->data, qs[size_t(t)]->row_stride()};
    p.k[t] = {ks[size_t(t)]->data, ks[size_t(t)]->row_stride()};
  }
  p.v = {v.data, v.row_stride()};
  p.o = o.data;
  p.o_stride = o.row_stride();
  p.dt = q.dtype;
  p.batch = batch;
  p.sq = q.shape[0] / batch;
  p.sk = k.shape[0] / batch;
  p.hq = q.shape[1] / d;
  p.hk = k.shape[1] / d;
  p.d = d;
  p.window = mask.window;
  APUS_CHECK(p.window == 0 || p.sq == p.sk, "attention: a band needs as many queries as keys");
  p.scale = scale;
  p.softcap = mask.softcap;
  p.causal = mask.causal;
  p.round_steps = mask.rounding == ops::Rounding::each_step && q.dtype == DType::bf16;
  if (q.shape[0] == 0) return;
  APUS_CHECK(!mask.key_valid || (mask.key_valid->dtype == DType::i64 && mask.key_valid->numel() == k.shape[0] &&
                                 mask.key_valid->contiguous()),
             "attention: the key mask must be i64 [", k.shape[0], "]");
  p.key_valid = mask.key_valid ? mask.key_valid->ptr<int64_t>() : nullptr;  // staged by the caller
  const int threads = int(std::max<int64_t>(32, std::min<int64_t>(1024, (d + 31) / 32 * 32)));
  const size_t shared = size_t(p.window > 0 ? std::min(p.sk, 2 * p.window + 1) : p.sk) * sizeof(float);
  check(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)),
        "attention shared memory");
  attention_kernel<<<dim3(unsigned(q.shape[0]), unsigned(p.hq)), unsigned(threads), shared, stream()>>>(p);
  check(cudaGetLastError(), "attention kernel launch");
}

}  // namespace

void attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, int64_t head_dim, float scale,
               const ops::AttentionOptions& mask) {
  attend({&q}, {&k}, v, o, head_dim, scale, mask);
}

void differential_attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& q2, const Tensor& k2,
                            const Tensor& v, Tensor& o, int64_t head_dim, float scale,
                            const ops::AttentionOptions& mask) {
  attend({&q, &q2}, {&k, &k2}, v, o, head_dim, scale, mask);
}

}  // namespace apus::cuda
