#include <cmath>

#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/rows.h"

namespace apus::cpu {

namespace {

// The per-sample shift and (1 + scale) of a modulation as f32 [B, D], (1 + scale) rounded to the
// output dtype when the reference rounds step by step.
struct Modulation {
  Tensor shift, scale;
  int64_t per_sample;
  bool rounded;
  Modulation(Arena& arena, const Tensor& sh, const Tensor& sc, const Tensor& y, ops::Rounding rounding) {
    const int64_t m = y.shape[0], d = y.shape[1];
    shift = sample_vectors(arena, sh, d, m);
    scale = sample_vectors(arena, sc, d, m);
    per_sample = m / shift.shape[0];
    rounded = rounding == ops::Rounding::each_step && y.dtype != DType::f32;
    for (int64_t i = 0; i < scale.numel(); ++i) scale.ptr<float>()[i] += 1.0f;
    if (rounded) round_to(y.dtype, scale.ptr<float>(), scale.numel());
  }
  // row <- row * (1 + scale) + shift for output row r, rounded as the reference rounds.
  void apply(float* row, int64_t r, int64_t d) const {
    const float* shp = shift.ptr<float>() + (r / per_sample) * d;
    const float* scp = scale.ptr<float>() + (r / per_sample) * d;
    if (rounded)
      for (int64_t i = 0; i < d; ++i) row[i] = round_bf16(round_bf16(round_bf16(row[i]) * scp[i]) + shp[i]);
    else
      for (int64_t i = 0; i < d; ++i) row[i] = row[i] * scp[i] + shp[i];
  }
};

}  // namespace

void layer_norm_modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y, float eps,
                         ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(y.shape == x.shape && shift.shape == scale.shape, "layer_norm_modulate: x ", shape_str(x.shape),
             ", shift ", shape_str(shift.shape), ", scale ", shape_str(scale.shape), ", y ", shape_str(y.shape));
  ArenaScope scope(*c.arena);
  const Modulation mod(*c.arena, shift, scale, y, rounding);
  parallel_for(m, [&](int64_t r) {
    float* row = thread_scratch(0, d);
    load_row(x, r, row, d);
    const float mu = sum_row(row, d) / float(d);
    const float var = squared_deviation_row(row, d, mu) / float(d);
    const float rstd = 1.0f / std::sqrt(var + eps);
    for (int64_t i = 0; i < d; ++i) row[i] = (row[i] - mu) * rstd;
    mod.apply(row, r, d);
    store_row(y, r, row, d);
  });
}

void modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y,
              ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(y.shape == x.shape && shift.shape == scale.shape, "modulate: x ", shape_str(x.shape), ", shift ",
             shape_str(shift.shape), ", scale ", shape_str(scale.shape), ", y ", shape_str(y.shape));
  ArenaScope scope(*c.arena);
  const Modulation mod(*c.arena, shift, scale, y, rounding);
  parallel_for(m, [&](int64_t r) {
    float* row = thread_scratch(0, d);
    load_row(x, r, row, d);
    mod.apply(row, r, d);
    store_row(y, r, row, d);
  });
}

void rms_norm(Context& c, const Tensor& x, const Tensor& weight, Tensor& y, float eps, int64_t group,
              ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(y.shape == x.shape && d % group == 0 && weight.numel() == group, "rms_norm: x ", shape_str(x.shape),
             ", weight ", shape_str(weight.shape), ", group ", group);
  ArenaScope scope(*c.arena);
  const Tensor wf = as_dtype(*c.arena, vector_row(weight), DType::f32);
  const float* w = wf.ptr<float>();
  parallel_for(m, [&](int64_t r) {
    float* row = thread_scratch(0, d);
    load_row(x, r, row, d);
    for (int64_t g = 0; g < d; g += group) {
      float* v = row + g;
      // A vector reduction: the serial sum is one chain of dependent adds (0.4 ms a call on
      // Stable Audio's 452 x 1536 rows).
      const float ss = squared_deviation_row(v, group, 0.0f);
      const float rs = 1.0f / std::sqrt(ss / float(group) + eps);
      for (int64_t i = 0; i < group; ++i) v[i] *= rs;
      if (rounding == ops::Rounding::each_step) round_to(y.dtype, v, group);
      for (int64_t i = 0; i < group; ++i) v[i] *= w[i];
    }
    store_row(y, r, row, d);
  });
}

void group_norm(Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, int64_t groups,
                float eps, bool fuse_silu, ops::Rounding rounding) {
  const int64_t n = x.shape[0], ch = x.shape[1], hw = x.shape[2] * x.shape[3];
  APUS_CHECK(x.rank() == 4 && ch % groups == 0 && y.shape == x.shape, "group_norm: x ", shape_str(x.shape), " with ",
             groups, " groups");
  ArenaScope scope(*c.arena);
  const Tensor wf = as_dtype(*c.arena, vector_row(weight), DType::f32);
  const Tensor bf = as_dtype(*c.arena, vector_row(bias), DType::f32);
  const float *w = wf.ptr<float>(), *b = bf.ptr<float>();
  const int64_t per = ch / groups;
  const Tensor xr = x.reshape({n * ch, hw});
  Tensor yr = y.reshape({n * ch, hw});
  // Each sample's groups are normalised on their own: task = sample * groups + group.
  parallel_for(n * groups, [&](int64_t task) {
    const int64_t g = task % groups, plane0 = (task / groups) * ch;
    float* buf = thread_scratch(0, per * hw);
    for (int64_t j = 0; j < per; ++j) load_row(xr, plane0 + g * per + j, buf + j * hw, hw);
    // Per-channel partial sums in float (vectorised), combined in double.
    const double count = double(per * hw);
    double total = 0;
    for (int64_t j = 0; j < per; ++j) total += sum_row(buf + j * hw, hw);
    const float mean = float(total / count);
    double dev = 0;
    for (int64_t j = 0; j < per; ++j) dev += squared_deviation_row(buf + j * hw, hw, mean);
    const float rstd = float(1.0 / std::sqrt(dev / count + eps));
    for (int64_t j = 0; j < per; ++j) {
      float* v = buf + j * hw;
      const int64_t cidx = g * per + j;
      const float a = rstd * w[cidx], b0 = b[cidx] - mean * a;
      for (int64_t i = 0; i < hw; ++i) v[i] = v[i] * a + b0;
      if (fuse_silu) {
        if (rounding == ops::Rounding::each_step) round_to(y.dtype, v, hw);
        silu_row(v, hw);
      }
      store_row(yr, plane0 + cidx, v, hw);
    }
  });
}

}  // namespace apus::cpu
