// Attention on the GPU with the contract's numerics: scores in fp32 over the keys a row may see
// (causal, band, padding), shaped as the reference shapes them (softcap, step-by-step rounding),
// softmax in fp32, probabilities rounded to the activation dtype, P·V summed in fp32; the
// differential form rounds each term before the difference. NaN propagates as torch's softmax
// propagates it: a NaN score, or an infinite maximum, makes the row's probabilities NaN (a row
// that sees no key stays zero). Four kernels (knob cuda.attention):
//   flash the default: the scores never written (flash_attention.cu: two passes, the contract's
//         roundings), bf16 heads of 64 and 128 without softcap or step rounding, bands included;
//         the rest goes to the products (or, with a band, the rows kernel)
//   gemm  the scores of a chunk of heads materialised by one cuBLASLt product (tensor cores), a
//         softmax kernel per row, P·V by a second product; every attention without a band
//   rows  one thread block per (query row, head), the correct-first kernel: bands, and operands
//         the products cannot take (head widths off 8 elements, unaligned views)
//   cudnn cuDNN's fused SDPA (cudnn_attention.cpp): bf16 heads up to 128 wide without a key mask,
//         band, softcap or step rounding (klein's joint attention, SA3's differential one as two
//         calls and a difference), its softmax online, rounding each probability before the
//         division by the sum (the bound it is held to: cudnn_attention.h); the rest, or a shape
//         cuDNN declines, goes to flash
#include <algorithm>

#include "core/variants.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/cuda/device.cuh"
#include "ops/cuda/flash_attention.h"

namespace apus::cuda {

Knob attention_knob("cuda.attention",
                    "attention kernel: flash (two passes, the scores never written), scores by cuBLASLt products, "
                    "one block per query row, or cuDNN's fused SDPA",
                    {"flash", "gemm", "rows", "cudnn"});

enum AttentionChoice { kFlash, kProducts, kRows, kCudnn };

namespace {

struct Rows {
  const void* data;
  int64_t stride;  // elements between rows
};

struct Params {
  Rows q[2], k[2], v;
  void* o;
  int64_t o_stride;
  DType dt;
  int terms;
  int64_t batch, sq, sk, hq, hk, d, window;
  float scale, softcap;
  bool causal, round_steps;
  const int64_t* key_valid;
};

// A raw score q·k as the reference shapes it: times the scale, and with a softcap or step-by-step
// rounding each sub-step as eager PyTorch evaluates it.
__device__ float shaped_score(float s, float scale, float softcap, bool round_steps) {
  if (softcap <= 0 && !round_steps) return s * scale;
  if (round_steps) s = round_to(DType::bf16, s);
  s *= scale;
  if (round_steps) s = round_to(DType::bf16, s);
  if (softcap > 0) {
    s /= softcap;
    if (round_steps) s = round_to(DType::bf16, s);
    s = tanhf(s);
    if (round_steps) s = round_to(DType::bf16, s);
    s *= softcap;
    if (round_steps) s = round_to(DType::bf16, s);
  }
  return s;
}

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
      s = shaped_score(s, p.scale, p.softcap, p.round_steps);
      if (p.key_valid && !p.key_valid[key]) s = -INFINITY;
      probs[j] = s;
    }
    __syncthreads();
    float mx = -INFINITY, nan = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      mx = fmaxf(mx, probs[j]);
      nan = fmaxf(nan, isnan(probs[j]) ? 1.0f : 0.0f);
    }
    mx = block_reduce(mx, true);
    const bool poisoned = block_reduce(nan, true) > 0.0f || mx == INFINITY;
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float e = poisoned ? NAN : mx == -INFINITY ? 0.0f : expf(probs[j] - mx);
      probs[j] = e;
      sum += e;
    }
    sum = block_reduce(sum, false);
    const float inv = poisoned ? NAN : sum > 0.0f ? 1.0f / sum : 0.0f;
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

// The gemm kernel's softmax: one block per row of a chunk's scores S [rows, sk] (f32, the scale
// already applied unless `shape` is set), written as probabilities P in the activation dtype.
// Row r is query r % sq of the chunk's head r / sq.
struct SoftmaxParams {
  const float* s;
  void* p;
  DType dt;
  int64_t sq, sk, ld;  // ld: elements between rows of s and p (sk rounded up to 8, aligned rows)
  float scale, softcap;
  bool shape, round_steps, causal;
  const int64_t* key_valid;  // this sample's keys, or null
};

__global__ void softmax_kernel(SoftmaxParams a) {
  const int64_t row = blockIdx.x, qi = row % a.sq;
  const float* s = a.s + row * a.ld;
  const int64_t n = a.causal ? min(qi + 1, a.sk) : a.sk;
  auto score = [&](int64_t j) {
    float v = a.shape ? shaped_score(s[j], a.scale, a.softcap, a.round_steps) : s[j];
    return a.key_valid && !a.key_valid[j] ? -INFINITY : v;
  };
  float mx = -INFINITY, nan = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    mx = fmaxf(mx, score(j));
    nan = fmaxf(nan, isnan(score(j)) ? 1.0f : 0.0f);
  }
  mx = block_reduce(mx, true);
  const bool poisoned = block_reduce(nan, true) > 0.0f || mx == INFINITY;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += mx == -INFINITY ? 0.0f : expf(score(j) - mx);
  sum = block_reduce(sum, false);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const int64_t out = row * a.ld;
  for (int64_t j = threadIdx.x; j < a.sk; j += blockDim.x)
    store(a.dt, a.p, out + j,
          poisoned                   ? NAN
          : j < n && mx != -INFINITY ? round_to(a.dt, expf(score(j) - mx) * inv)
                                     : 0.0f);
}

// o = t1 - t2 over a chunk of heads: [sq, count * d] rows of the two terms (each already rounded
// to the activation dtype), into o's rows from `o_at` with o's row stride.
__global__ void difference_kernel(const void* t1, const void* t2, void* o, DType dt, int64_t sq, int64_t width,
                                  int64_t o_stride) {
  const int64_t n = sq * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(dt, o, (i / width) * o_stride + i % width, load(dt, t1, i) - load(dt, t2, i));
}

const char* element(const Tensor& t, int64_t row, int64_t col) {
  return static_cast<const char*>(t.data) + dtype_bytes(t.dtype, row * t.row_stride() + col);
}

bool gemm_ready(const Tensor& t, int64_t d) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && dtype_bytes(t.dtype, t.row_stride()) % 16 == 0 &&
         dtype_bytes(t.dtype, d) % 16 == 0;
}

// Scores as cuBLASLt products: per sample, chunks of heads whose scores fit a scratch budget; heads
// sharing a key/value head (grouped queries) one product each.
void attend_by_products(Context& c, const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks,
                        const Tensor& v, Tensor& o, const Params& p) {
  const int64_t sq = p.sq, sk = p.sk, d = p.d, rep = p.hq / p.hk, act = dtype_bytes(p.dt, 1);
  const int64_t ld = (sk + 7) / 8 * 8, per_head = sq * ld * (4 + act), budget = int64_t(1) << 30;
  const int64_t chunk = rep == 1 ? std::max<int64_t>(1, std::min<int64_t>(p.hq, budget / per_head)) : 1;
  const bool shape = p.softcap > 0 || p.round_steps;
  ArenaScope scope(*c.arena);
  const Tensor scores = Tensor::in(*c.arena, {chunk * sq, ld}, DType::f32);
  const Tensor probs = Tensor::in(*c.arena, {chunk * sq, ld}, p.dt);
  Tensor terms[2];
  if (p.terms > 1)
    for (Tensor& t : terms) t = Tensor::in(*c.arena, {sq, chunk * d}, p.dt);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h0 = 0; h0 < p.hq; h0 += chunk) {
      const int64_t count = std::min(chunk, p.hq - h0), g = h0 / rep;
      for (int t = 0; t < p.terms; ++t) {
        const Tensor &q = *qs[size_t(t)], &k = *ks[size_t(t)];
        gemm({element(q, b * sq, h0 * d), q.dtype, q.row_stride(), d},
             {element(k, b * sk, g * d), k.dtype, k.row_stride(), d}, true, {scores.data, DType::f32, ld, sq * ld}, sq,
             sk, d, count, shape ? 1.0f : p.scale);
        SoftmaxParams a{};
        a.s = scores.ptr<float>();
        a.p = probs.data;
        a.dt = p.dt;
        a.sq = sq;
        a.sk = sk;
        a.ld = ld;
        a.scale = p.scale;
        a.softcap = p.softcap;
        a.shape = shape;
        a.round_steps = p.round_steps;
        a.causal = p.causal;
        a.key_valid = p.key_valid ? p.key_valid + b * sk : nullptr;
        softmax_kernel<<<unsigned(count * sq), kThreads, 0, stream()>>>(a);
        check(cudaGetLastError(), "attention softmax launch");
        const Operand out = p.terms > 1 ? Operand{terms[t].data, p.dt, chunk * d, d}
                                        : Operand{element(o, b * sq, h0 * d), p.dt, o.row_stride(), d};
        gemm({probs.data, p.dt, ld, sq * ld}, {element(v, b * sk, g * d), v.dtype, v.row_stride(), d}, false, out, sq,
             d, sk, count, 1.0f);
      }
      if (p.terms > 1) {
        difference_kernel<<<blocks_for(sq * count * d), kThreads, 0, stream()>>>(
            terms[0].data, terms[1].data, const_cast<char*>(element(o, b * sq, h0 * d)), p.dt, sq, count * d,
            o.row_stride());
        check(cudaGetLastError(), "differential attention launch");
      }
    }
}

// Both terms in one launch of the flash kernel.
void attend_by_flash(const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks, const Tensor& v,
                     Tensor& o, const Params& p) {
  FlashParams f{};
  for (int t = 0; t < p.terms; ++t) {
    f.q[t] = qs[size_t(t)]->data;
    f.k[t] = ks[size_t(t)]->data;
    f.q_stride[t] = qs[size_t(t)]->row_stride();
    f.k_stride[t] = ks[size_t(t)]->row_stride();
  }
  f.v = v.data;
  f.v_stride = v.row_stride();
  f.o = o.data;
  f.o_stride = o.row_stride();
  f.terms = p.terms;
  f.batch = p.batch;
  f.sq = p.sq;
  f.sk = p.sk;
  f.hq = p.hq;
  f.hk = p.hk;
  f.d = p.d;
  f.window = p.window;
  f.scale = p.scale;
  f.causal = p.causal;
  f.key_valid = p.key_valid;
  flash_attention(f);
}

// Attention without a mask, band, softcap or step rounding through cuDNN, one call a term (the
// differential form's terms each rounded into scratch rows, then their difference); false where
// the arm does not take it (the caller goes on to flash).
bool attend_by_cudnn(Context& c, const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks,
                     const Tensor& v, Tensor& o, const Params& p) {
  if (p.dt != DType::bf16 || p.key_valid || p.window != 0 || p.softcap > 0 || p.round_steps) return false;
  for (int t = 0; t < p.terms; ++t)
    if (!cudnn_attention_takes(p.d, qs[size_t(t)]->row_stride(), ks[size_t(t)]->row_stride(), v.row_stride(),
                               o.row_stride()))
      return false;
  ArenaScope scope(*c.arena);
  Tensor terms[2];
  for (int t = 0; t < p.terms; ++t) {
    const Tensor &q = *qs[size_t(t)], &k = *ks[size_t(t)];
    if (p.terms > 1) terms[t] = Tensor::in(*c.arena, o.shape, p.dt);
    Tensor& out = p.terms > 1 ? terms[t] : o;
    const SdpaOperands a{q.data,           k.data,  v.data, out.data, q.row_stride(), k.row_stride(), v.row_stride(),
                         out.row_stride(), p.batch, p.sq,   p.sk,     p.hq,           p.hk,           p.d,
                         p.scale,          p.causal};
    if (!attention_by_cudnn(c, a)) return false;
  }
  if (p.terms > 1) {
    difference_kernel<<<blocks_for(o.shape[0] * o.shape[1]), kThreads, 0, stream()>>>(
        terms[0].data, terms[1].data, o.data, p.dt, o.shape[0], o.shape[1], o.row_stride());
    check(cudaGetLastError(), "differential attention launch");
  }
  return true;
}

void attend(Context& c, const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks, const Tensor& v,
            Tensor& o, int64_t head_dim, float scale, const ops::AttentionOptions& mask) {
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
  bool aligned = gemm_ready(v, d) && gemm_ready(o, d);
  for (const std::vector<const Tensor*>* side : {&qs, &ks})
    for (const Tensor* t : *side) aligned = aligned && gemm_ready(*t, d);
  if (attention_knob.value() == kCudnn && aligned && attend_by_cudnn(c, qs, ks, v, o, p)) {
    attention_knob.took(kCudnn);
    return;
  }
  const bool flash = attention_knob.value() == kFlash || attention_knob.value() == kCudnn;
  if (flash && aligned && flash_takes(d, p.dt, p.softcap <= 0 && !p.round_steps)) {
    attention_knob.took(kFlash);
    return attend_by_flash(qs, ks, v, o, p);
  }
  const bool products = attention_knob.value() != kRows && p.window == 0 && aligned;
  attention_knob.took(products ? kProducts : kRows);
  if (products) return attend_by_products(c, qs, ks, v, o, p);
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
  attend(c, {&q}, {&k}, v, o, head_dim, scale, mask);
}

void differential_attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& q2, const Tensor& k2,
                            const Tensor& v, Tensor& o, int64_t head_dim, float scale,
                            const ops::AttentionOptions& mask) {
  attend(c, {&q, &q2}, {&k, &k2}, v, o, head_dim, scale, mask);
}

}  // namespace apus::cuda
