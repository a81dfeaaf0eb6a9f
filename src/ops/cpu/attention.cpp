// Attention as the reference's CPU kernels compute it: Q·K^T and P·V through the GEMM library
// with fp32 accumulation, softmax in fp32, P rounded to the activation dtype before P·V.
// Heads and query blocks are spread over threads; each thread runs its GEMMs single-threaded.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/rows.h"
#include "ops/cpu/vec.h"

namespace apus::cpu {

Knob attention_block_knob("cpu.attention_block", "query rows per attention task", {"128", "32", "64", "256", "512"});

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Copies every head of a [S, H*D] view into head-major [H, S, D].
void split_heads(const Tensor& x, int64_t d, Tensor& out) {
  const int64_t s = x.shape[0], h = x.shape[1] / d;
  const size_t es = dtype_size(x.dtype), row = size_t(d) * es;
  parallel_for(s, [&](int64_t r) {
    for (int64_t i = 0; i < h; ++i)
      std::memcpy(static_cast<char*>(out.data) + size_t(i * s + r) * row,
                  static_cast<const char*>(x.row(r)) + size_t(i) * row, row);
  });
}

// Sets the scores of keys a query may not see to -inf: those outside [first, end) (causal, band)
// and those whose key_valid entry is 0 (padding). s covers n keys; key_valid is indexed alike.
void mask_row(float* s, int64_t n, int64_t first, int64_t end, const int64_t* key_valid) {
  for (int64_t j = 0; j < std::min(first, n); ++j) s[j] = kNegInf;
  for (int64_t j = std::max<int64_t>(end, 0); j < n; ++j) s[j] = kNegInf;
  if (key_valid)
    for (int64_t j = std::max<int64_t>(first, 0); j < std::min(end, n); ++j)
      if (!key_valid[j]) s[j] = kNegInf;
}

void round_row_bf16(float* s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) s[j] = round_bf16(s[j]);
}

// s <- softcap * tanh(scale * s / softcap) (or scale * s without a cap), rounded to bf16 after
// each step when round_steps: eager PyTorch's Q·K^T, * scale, / softcap, tanh, * softcap.
void shape_scores(float* s, int64_t n, float scale, float softcap, bool round_steps) {
  if (round_steps) round_row_bf16(s, n);
  for (int64_t j = 0; j < n; ++j) s[j] *= scale;
  if (round_steps) round_row_bf16(s, n);
  if (softcap <= 0) return;
  for (int64_t j = 0; j < n; ++j) s[j] /= softcap;
  if (round_steps) round_row_bf16(s, n);
  tanh_row(s, n);
  if (round_steps) round_row_bf16(s, n);
  for (int64_t j = 0; j < n; ++j) s[j] *= softcap;
  if (round_steps) round_row_bf16(s, n);
}

// softmax(q k^T * scale) v for each (q, k) term; two terms give the differential attention's
// o = round(o1) - round(o2): both softmaxes of a query block land in one probability buffer, one
// stacked P·V GEMM forms both outputs, and V is split into heads once.
void attend(Context& c, const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks, const Tensor& v,
            Tensor& o, int64_t head_dim, float scale, const ops::AttentionOptions& mask) {
  const Tensor& q = *qs[0];
  const Tensor& k = *ks[0];
  const int64_t terms = int64_t(qs.size());
  const int64_t batch = mask.batch, rows_q = q.shape[0], rows_k = k.shape[0], d = head_dim;
  const int64_t sq = rows_q / batch, sk = rows_k / batch;
  const int64_t hq = q.shape[1] / d, hk = k.shape[1] / d;
  APUS_CHECK(batch >= 1 && rows_q % batch == 0 && rows_k % batch == 0 && q.shape[1] % d == 0 && k.shape[1] % d == 0 &&
                 v.shape == k.shape && o.shape == q.shape && hk > 0 && hq % hk == 0 && q.dtype == k.dtype &&
                 k.dtype == v.dtype && o.dtype == q.dtype,
             "attention: q ", shape_str(q.shape), ", k ", shape_str(k.shape), ", v ", shape_str(v.shape), ", o ",
             shape_str(o.shape), ", head_dim ", d, ", batch ", batch);
  for (int64_t i = 1; i < terms; ++i)
    APUS_CHECK(qs[size_t(i)]->shape == q.shape && ks[size_t(i)]->shape == k.shape && qs[size_t(i)]->dtype == q.dtype &&
                   ks[size_t(i)]->dtype == k.dtype,
               "differential attention: q2 ", shape_str(qs[size_t(i)]->shape), ", k2 ", shape_str(ks[size_t(i)]->shape),
               " differ from q ", shape_str(q.shape), ", k ", shape_str(k.shape));
  APUS_CHECK(mask.window >= 0 && (mask.window == 0 || sq == sk), "attention: a band (window ", mask.window,
             ") needs as many queries as keys, got ", sq, " and ", sk);
  APUS_CHECK(!mask.key_valid || (mask.key_valid->dtype == DType::i64 && mask.key_valid->numel() == rows_k &&
                                 mask.key_valid->contiguous()),
             "attention: the key mask must be i64 [", rows_k, "] (one entry per key row)");
  const int64_t* key_valid = mask.key_valid ? mask.key_valid->ptr<int64_t>() : nullptr;
  ArenaScope scope(*c.arena);
  const DType dt = q.dtype;
  const int choice = attention_block_knob.value();
  attention_block_knob.took(choice);
  const int64_t block = std::min<int64_t>(sq, std::stoll(attention_block_knob.choices()[size_t(choice)]));
  const int64_t blocks = (sq + block - 1) / block;
  std::vector<Tensor> qh, kh;
  for (int64_t i = 0; i < terms; ++i) {
    qh.push_back(Tensor::in(*c.arena, {hq, rows_q, d}, dt));
    kh.push_back(Tensor::in(*c.arena, {hk, rows_k, d}, dt));
    split_heads(*qs[size_t(i)], d, qh.back());
    split_heads(*ks[size_t(i)], d, kh.back());
  }
  Tensor vh = Tensor::in(*c.arena, {hk, rows_k, d}, dt);
  split_heads(v, d, vh);
  const bool round_steps = mask.rounding == ops::Rounding::each_step && dt == DType::bf16;
  const bool transformed = mask.softcap > 0 || round_steps;
  const int threads = omp_get_max_threads();
  // A band needs scores for its block's rows and the window on either side only.
  const int64_t max_keys = mask.window > 0 ? std::min(sk, block + 2 * mask.window) : sk;
  const int64_t stacked = terms * block;  // each thread's probability rows: the terms' blocks
  Tensor scores = Tensor::in(*c.arena, {threads * block, max_keys}, DType::f32);
  Tensor probs = Tensor::in(*c.arena, {threads * stacked, max_keys}, dt);
  // Two terms: both outputs in fp32 before each is rounded and the difference taken.
  Tensor outs = Tensor::in(*c.arena, {terms > 1 ? threads * stacked : 0, d}, DType::f32);
  const size_t es = dtype_size(dt);

  // Sample b's rows of head h sit at h * rows + b * s + r in the head-major copies.
  parallel_for(
      batch * hq * blocks,
      [&](int64_t task) {
        const int64_t b = task / (hq * blocks), h = (task / blocks) % hq;
        const int64_t r0 = (task % blocks) * block, nb = std::min(block, sq - r0);
        const int64_t g = h / (hq / hk);
        const int64_t t = omp_get_thread_num();
        const int64_t q0 = h * rows_q + b * sq + r0;
        Tensor sb = scores.rows(t * block, t * block + nb);
        // Keys the block can see: up to its last row (causal), within the band (window), else all.
        const int64_t w = mask.window;
        const int64_t key_lo = w > 0 ? std::max<int64_t>(0, r0 - w) : 0;
        int64_t key_hi = w > 0 ? std::min(sk, r0 + nb + w) : sk;
        if (mask.causal) key_hi = std::min(key_hi, r0 + nb);
        const int64_t nk = key_hi - key_lo;
        const size_t kv_offset = size_t((g * rows_k + b * sk + key_lo) * d) * es;
        const char* vbase = static_cast<const char*>(vh.data) + kv_offset;
        Tensor ob = o.rows(b * sq + r0, b * sq + r0 + nb).cols(h * d, (h + 1) * d);
        const int64_t* valid = key_valid ? key_valid + b * sk + key_lo : nullptr;
        Tensor sbn = sb.cols(0, nk);
        Tensor pall = probs.rows(t * stacked, t * stacked + terms * nb).cols(0, nk);
        for (int64_t term = 0; term < terms; ++term) {
          Tensor qb = qh[size_t(term)].reshape({hq * rows_q, d}).rows(q0, q0 + nb);
          const char* kbase = static_cast<const char*>(kh[size_t(term)].data) + kv_offset;
          Tensor pbn = pall.rows(term * nb, (term + 1) * nb);
          gemm(qb, kbase, dt, 1, d, nullptr, sbn, d, nk);  // Q · K^T
          for (int64_t i = 0; i < nb; ++i) {
            float* srow = static_cast<float*>(sbn.row(i));
            // Scores formed outside the softmax when they are capped or rounded step by step; the
            // plain case leaves the scale to the softmax's fused exp.
            const float softmax_scale = transformed ? 1.0f : scale;
            if (transformed) shape_scores(srow, nk, scale, mask.softcap, round_steps);
            const int64_t qi = r0 + i;  // this row's position; the visible keys, relative to key_lo
            int64_t first = 0, end = nk;
            if (w > 0) {
              first = qi - w - key_lo;
              end = qi + w + 1 - key_lo;
            }
            if (mask.causal) end = std::min(end, qi + 1 - key_lo);
            // The softmax runs over the keys this row can see; the others get probability 0.
            const int64_t lo = std::clamp<int64_t>(first, 0, nk), hi = std::clamp<int64_t>(end, lo, nk);
            mask_row(srow + lo, hi - lo, 0, hi - lo, valid ? valid + lo : nullptr);
            char* prow = static_cast<char*>(pbn.row(i));
            std::memset(prow, 0, size_t(lo) * es);
            std::memset(prow + size_t(hi) * es, 0, size_t(nk - hi) * es);
            if (dt == DType::bf16)
              softmax_row_bf16(srow + lo, hi - lo, softmax_scale, reinterpret_cast<uint16_t*>(prow) + lo);
            else softmax_row_f32(srow + lo, hi - lo, softmax_scale, reinterpret_cast<float*>(prow) + lo);
          }
        }
        if (terms == 1) {
          gemm(pall, vbase, dt, d, 1, nullptr, ob, nk, d);  // P · V
          return;
        }
        Tensor both = outs.rows(t * stacked, t * stacked + 2 * nb);
        // Each term's P · V its own GEMM of the shape attention's is: a GEMM's rows are not the
        // same bits at every row count on every CPU (oneDNN's AVX2 sgemm), and the difference
        // of two attentions must be exactly that.
        for (int64_t term = 0; term < terms; ++term) {
          Tensor out_term = both.rows(term * nb, (term + 1) * nb);
          gemm(pall.rows(term * nb, (term + 1) * nb), vbase, dt, d, 1, nullptr, out_term, nk, d);
        }
        for (int64_t i = 0; i < nb; ++i) {
          float* first = static_cast<float*>(both.row(i));
          const float* second = static_cast<const float*>(both.row(nb + i));
          round_to(dt, first, d);
          float* diff = thread_scratch(0, d);
          std::copy(second, second + d, diff);
          round_to(dt, diff, d);
          for (int64_t j = 0; j < d; ++j) first[j] -= diff[j];
          store_row(ob, i, first, d);
        }
      },
      Schedule::dynamic);
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

}  // namespace apus::cpu
