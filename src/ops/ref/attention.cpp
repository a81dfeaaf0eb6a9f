// Attention head by head in f64: scores, mask, softmax, probabilities rounded to the activation
// dtype, then P·V.
#include <cmath>
#include <vector>

#include "ops/ref/ref_ops.h"

namespace apus::ref {

void attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, int64_t head_dim, float scale,
               const ops::AttentionOptions& mask) {
  const int64_t batch = mask.batch, sq = q.shape[0] / batch, sk = k.shape[0] / batch, d = head_dim;
  const int64_t hq = q.shape[1] / d, hk = k.shape[1] / d;
  APUS_CHECK(hk > 0 && hq % hk == 0 && v.shape == k.shape && o.shape == q.shape && q.shape[0] % batch == 0 &&
                 k.shape[0] % batch == 0,
             "attention: shapes do not agree");
  APUS_CHECK(!mask.key_valid || (mask.key_valid->dtype == DType::i64 && mask.key_valid->numel() == k.shape[0]),
             "attention: the key mask must be i64 [", k.shape[0], "]");
  const int64_t* key_valid = mask.key_valid ? mask.key_valid->ptr<int64_t>() : nullptr;
  std::vector<double> p(static_cast<size_t>(sk));
  std::vector<char> seen_by_row(static_cast<size_t>(sk));
  for (int64_t task = 0; task < batch * hq; ++task) {
    const int64_t b = task / hq, h = task % hq, g = h / (hq / hk);
    for (int64_t i = 0; i < sq; ++i) {
      // NaN propagates as torch's softmax propagates it: a NaN score (or an infinite maximum,
      // whose exp(inf - inf) is NaN) makes the whole row NaN; a row that sees no key is zero.
      double mx = -INFINITY;
      int64_t seen = 0;
      for (int64_t j = 0; j < sk; ++j) {
        const bool visible = (!mask.causal || j <= i) && (mask.window == 0 || std::abs(i - j) <= mask.window) &&
                             (!key_valid || key_valid[b * sk + j]);
        double s = -INFINITY;
        if (visible) {
          s = 0;
          for (int64_t e = 0; e < d; ++e) s += get(q, b * sq + i, h * d + e) * get(k, b * sk + j, g * d + e);
          const bool each = mask.rounding == ops::Rounding::each_step;
          const DType dt = q.dtype;
          if (each) s = as(dt, s);
          s = s * double(scale);
          if (each) s = as(dt, s);
          if (mask.softcap > 0) {
            const double cap = double(mask.softcap);
            s = each ? as(dt, as(dt, std::tanh(as(dt, s / cap))) * cap) : cap * std::tanh(s / cap);
          }
        }
        p[size_t(j)] = s;
        seen_by_row[size_t(j)] = visible;
        seen += visible;
        mx = std::isnan(s) || std::isnan(mx) ? NAN : std::max(mx, s);
      }
      double sum = 0;
      for (int64_t j = 0; j < sk; ++j) {
        p[size_t(j)] = seen == 0 ? 0.0 : std::exp(p[size_t(j)] - mx);
        sum += p[size_t(j)];
      }
      for (int64_t j = 0; j < sk; ++j) p[size_t(j)] = seen == 0 ? 0.0 : as(q.dtype, p[size_t(j)] / sum);
      for (int64_t e = 0; e < d; ++e) {
        double acc = 0;
        // Over the keys the row sees: a NaN value outside its band, causal range or padding
        // does not reach it (as the kernels, which never read those keys).
        for (int64_t j = 0; j < sk; ++j)
          if (seen_by_row[size_t(j)]) acc += p[size_t(j)] * get(v, b * sk + j, g * d + e);
        put(o, b * sq + i, h * d + e, acc);
      }
    }
  }
}

void differential_attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& q2, const Tensor& k2,
                            const Tensor& v, Tensor& o, int64_t head_dim, float scale,
                            const ops::AttentionOptions& mask) {
  ref::attention(c, q, k, v, o, head_dim, scale, mask);
  Tensor second = Tensor::heap(o.shape, o.dtype);
  ref::attention(c, q2, k2, v, second, head_dim, scale, mask);
  for (int64_t r = 0; r < o.shape[0]; ++r)
    for (int64_t i = 0; i < o.shape[1]; ++i) put(o, r, i, get(o, r, i) - get(second, r, i));
}

}  // namespace apus::ref
