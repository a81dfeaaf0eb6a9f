// Attention as the reference's CPU kernels do it: scores and P·V through the GEMM library
// with fp32 accumulation, softmax in fp32, P rounded to the activation dtype before P·V.
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/rows.h"
#include "ops/ops.h"

namespace apus::cpu {
void gemm(const Tensor& a, const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n,
          const Tensor* bias, Tensor& c, int64_t k, int64_t n);
}

namespace apus::ops {

namespace {
// Copies head h of a [S, H*D] view into a contiguous [S, D] tensor.
void gather_head(const Tensor& x, int64_t h, int64_t d, Tensor& out) {
  const size_t es = dtype_size(x.dtype);
  for (int64_t r = 0; r < x.shape[0]; ++r)
    std::memcpy(out.row(r), static_cast<const char*>(x.row(r)) + size_t(h * d) * es, size_t(d) * es);
}
}  // namespace

void attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
               int64_t head_dim, float scale, const AttentionMask& mask) {
  const int64_t sq = q.shape[0], sk = k.shape[0], d = head_dim;
  const int64_t hq = q.shape[1] / d, hk = k.shape[1] / d;
  APUS_CHECK(q.shape[1] % d == 0 && k.shape[1] % d == 0 && v.shape == k.shape &&
                 o.shape == q.shape && hk > 0 && hq % hk == 0 && q.dtype == k.dtype &&
                 k.dtype == v.dtype,
             "attention: q ", shape_str(q.shape), ", k ", shape_str(k.shape), ", v ",
             shape_str(v.shape), ", o ", shape_str(o.shape), ", head_dim ", d);
  ArenaScope scope(*c.arena);
  const DType dt = q.dtype;
  const int64_t block = std::min<int64_t>(sq, 256);
  Tensor qh = Tensor::in(*c.arena, {sq, d}, dt);
  Tensor kh = Tensor::in(*c.arena, {sk, d}, dt);
  Tensor vh = Tensor::in(*c.arena, {sk, d}, dt);
  Tensor scores = Tensor::in(*c.arena, {block, sk}, DType::f32);
  Tensor probs = Tensor::in(*c.arena, {block, sk}, dt);
  Tensor out = Tensor::in(*c.arena, {block, d}, DType::f32);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t g = h / (hq / hk);
    gather_head(q, h, d, qh);
    if (h % (hq / hk) == 0) {
      gather_head(k, g, d, kh);
      gather_head(v, g, d, vh);
    }
    for (int64_t r0 = 0; r0 < sq; r0 += block) {
      const int64_t nb = std::min(block, sq - r0);
      Tensor qb = qh.rows(r0, r0 + nb), sb = scores.rows(0, nb), pb = probs.rows(0, nb),
             ob = out.rows(0, nb);
      cpu::gemm(qb, kh.data, dt, 1, d, nullptr, sb, d, sk);  // Q · K^T
#pragma omp parallel for
      for (int64_t i = 0; i < nb; ++i) {
        float* srow = sb.ptr<float>() + i * sk;
        const int64_t qpos = r0 + i;
        float mx = neg_inf;
        for (int64_t j = 0; j < sk; ++j) {
          const bool masked = (mask.causal && j > qpos) || (mask.key_valid && !mask.key_valid[j]);
          srow[j] = masked ? neg_inf : srow[j] * scale;
          mx = std::max(mx, srow[j]);
        }
        float sum = 0;
        for (int64_t j = 0; j < sk; ++j) {
          srow[j] = mx == neg_inf ? 0.0f : std::exp(srow[j] - mx);
          sum += srow[j];
        }
        const float inv = sum > 0 ? 1.0f / sum : 0.0f;
        for (int64_t j = 0; j < sk; ++j) srow[j] *= inv;
        cpu::store_row(pb, i, srow, sk);
      }
      cpu::gemm(pb, vh.data, dt, d, 1, nullptr, ob, sk, d);  // P · V
      const size_t es = dtype_size(o.dtype);
      for (int64_t i = 0; i < nb; ++i) {
        Tensor orow = o.rows(r0 + i, r0 + i + 1);
        orow.data = static_cast<char*>(orow.data) + size_t(h * d) * es;
        orow.shape = {1, d};
        cpu::store_row(orow, 0, ob.ptr<float>() + i * d, d);
      }
    }
  }
}

}  // namespace apus::ops
