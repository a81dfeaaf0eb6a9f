#include <algorithm>
#include <atomic>
#include <cmath>

#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/rows.h"

namespace apus::cpu {

void glu(Context& c, const Tensor& a, const Tensor& b, Tensor& y, ops::Activation act, ops::Rounding rounding) {
  const int64_t m = a.shape[0], f = a.shape[1];
  APUS_CHECK(b.shape == a.shape && y.shape == a.shape, "glu: a ", shape_str(a.shape), ", b ", shape_str(b.shape),
             ", y ", shape_str(y.shape));
  parallel_for(m, [&](int64_t r) {
    float* va = thread_scratch(0, f);
    float* vb = thread_scratch(1, f);
    load_row(a, r, va, f);
    load_row(b, r, vb, f);
    const bool rounded = rounding == ops::Rounding::each_step;
    if (act == ops::Activation::silu) {
      silu_row(va, f);
    } else if (act == ops::Activation::gelu_tanh) {
      gelu_tanh_row(va, f);
    } else {  // sin(pi x): the product is an eager op of its own
      for (int64_t i = 0; i < f; ++i) va[i] *= 3.14159265358979323846f;
      if (rounded) round_to(y.dtype, va, f);
      sin_row(va, f);
    }
    if (rounded) round_to(y.dtype, va, f);
    for (int64_t i = 0; i < f; ++i) va[i] *= vb[i];
    store_row(y, r, va, f);
  });
}

namespace {
// y = fn(x) row by row in fp32, for the unary ops over any two tensors of one element count.
template <typename RowFn> void unary_rows(const Tensor& x, Tensor& y, RowFn&& fn) {
  const Tensor xv = as_rows(x);
  Tensor yv = same_rows(y, xv);
  const int64_t f = xv.shape[1];
  parallel_for(xv.shape[0], [&](int64_t r) {
    float* v = thread_scratch(0, f);
    load_row(xv, r, v, f);
    fn(v, f);
    store_row(yv, r, v, f);
  });
}
}  // namespace

void silu(Context& c, const Tensor& x, Tensor& y) { unary_rows(x, y, silu_row); }

void dyt(Context& c, const Tensor& x, const Tensor& alpha, const Tensor& gamma, const Tensor& beta, Tensor& y,
         ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  const int64_t group = gamma.numel();
  APUS_CHECK(y.shape == x.shape && alpha.numel() == 1 && group > 0 && d % group == 0 && beta.numel() == group,
             "dyt: x ", shape_str(x.shape), ", alpha ", shape_str(alpha.shape), ", gamma ", shape_str(gamma.shape),
             ", beta ", shape_str(beta.shape), ", y ", shape_str(y.shape));
  ArenaScope scope(*c.arena);
  const Tensor g = as_dtype(*c.arena, vector_row(gamma), DType::f32);
  const Tensor b = as_dtype(*c.arena, vector_row(beta), DType::f32);
  const float a = load_f32(alpha, 0);
  const bool rounded = rounding == ops::Rounding::each_step;
  const float* gp = g.ptr<float>();
  const float* bp = b.ptr<float>();
  parallel_for(m, [&](int64_t r) {
    float* v = thread_scratch(0, d);
    load_row(x, r, v, d);
    dyt_row(v, d, a, gp, bp, group, rounded && y.dtype == DType::bf16);
    store_row(y, r, v, d);
  });
}

void gate_sigmoid(Context& c, const Tensor& x, Tensor& y, ops::Rounding rounding) {
  const bool rounded = rounding == ops::Rounding::each_step;
  unary_rows(x, y, [&](float* v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) v[i] = 1.0f - v[i];
    if (rounded) round_to(y.dtype, v, n);
    for (int64_t i = 0; i < n; ++i) v[i] = 1.0f / (1.0f + std::exp(-v[i]));
  });
}

void add_gated(Context& c, Tensor& x, const Tensor& y, const Tensor* gate, ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(y.shape == x.shape, "add_gated: x ", shape_str(x.shape), ", y ", shape_str(y.shape));
  ArenaScope scope(*c.arena);
  const Tensor g = gate ? sample_vectors(*c.arena, *gate, d, m) : Tensor{};
  const int64_t per_sample = gate ? m / g.shape[0] : m;
  parallel_for(m, [&](int64_t r) {
    float* vx = thread_scratch(0, d);
    float* vy = thread_scratch(1, d);
    load_row(x, r, vx, d);
    load_row(y, r, vy, d);
    if (gate) {
      const float* gr = g.ptr<float>() + (r / per_sample) * d;
      for (int64_t i = 0; i < d; ++i) vy[i] *= gr[i];
      if (rounding == ops::Rounding::each_step) round_to(x.dtype, vy, d);
    }
    for (int64_t i = 0; i < d; ++i) vx[i] += vy[i];
    store_row(x, r, vx, d);
  });
}

void affine(Context& c, const Tensor& x, const Tensor& scale, const Tensor& shift, Tensor& y, ops::Rounding rounding) {
  const int64_t d = x.shape[1];
  APUS_CHECK(x.rank() == 2 && y.shape == x.shape && scale.numel() == d && shift.numel() == d, "affine: x ",
             shape_str(x.shape), ", scale ", shape_str(scale.shape), ", shift ", shape_str(shift.shape), ", y ",
             shape_str(y.shape));
  ArenaScope scope(*c.arena);
  const Tensor sc = as_dtype(*c.arena, vector_row(scale), DType::f32);
  const Tensor sh = as_dtype(*c.arena, vector_row(shift), DType::f32);
  const bool each = rounding == ops::Rounding::each_step;
  parallel_for(x.shape[0], [&](int64_t r) {
    float* v = thread_scratch(0, d);
    load_row(x, r, v, d);
    for (int64_t i = 0; i < d; ++i) {
      const float p = v[i] * sc.ptr<float>()[i];
      v[i] = (each ? round_as(y.dtype, p) : p) + sh.ptr<float>()[i];
    }
    store_row(y, r, v, d);
  });
}

void copy(Context& c, const Tensor& x, Tensor& y) {
  unary_rows(x, y, [](float*, int64_t) {});  // the conversion is the load and the store
}

bool all_finite(Context& c, const Tensor& x) {
  const Tensor xv = as_rows(x);
  const int64_t f = xv.shape[1];
  std::atomic<bool> finite{true};
  parallel_for(xv.shape[0], [&](int64_t r) {
    float* v = thread_scratch(0, f);
    load_row(xv, r, v, f);
    if (!finite_row(v, f)) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

void nonfinite_flag(Context& c, const Tensor& x, Tensor& flags, int64_t slot) {
  check_flag_slot(flags, slot);
  flags.ptr<int32_t>()[slot] = all_finite(c, x) ? 0 : 1;
}

namespace {
template <typename T> void transpose_tiles(const T* x, T* y, int64_t m, int64_t n) {
  constexpr int64_t tile = 32;  // both sides stay in cache lines while a tile is moved
  const int64_t tiles_n = (n + tile - 1) / tile;
  parallel_for(((m + tile - 1) / tile) * tiles_n, [&](int64_t t) {
    const int64_t i0 = (t / tiles_n) * tile, j0 = (t % tiles_n) * tile;
    for (int64_t i = i0; i < std::min(i0 + tile, m); ++i)
      for (int64_t j = j0; j < std::min(j0 + tile, n); ++j) y[j * m + i] = x[i * n + j];
  });
}

// y[2j] = y[2j + 1] = x[j]: a loop the compiler turns into unpacks.
template <typename T> void widen_twice(const T* x, T* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    y[2 * j] = x[j];
    y[2 * j + 1] = x[j];
  }
}
}  // namespace

void transpose(Context& c, const Tensor& x, Tensor& y) {
  APUS_CHECK(x.rank() == 2 && y.shape == Shape({x.shape[1], x.shape[0]}) && x.dtype == y.dtype && x.contiguous() &&
                 y.contiguous(),
             "transpose: x ", shape_str(x.shape), " ", dtype_name(x.dtype), ", y ", shape_str(y.shape), " ",
             dtype_name(y.dtype));
  switch (dtype_size(x.dtype)) {
    case 2:
      transpose_tiles(x.ptr<uint16_t>(), y.ptr<uint16_t>(), x.shape[0], x.shape[1]);
      return;
    case 4:
      transpose_tiles(x.ptr<uint32_t>(), y.ptr<uint32_t>(), x.shape[0], x.shape[1]);
      return;
    default:
      fail("transpose: unsupported dtype ", dtype_name(x.dtype));
  }
}

void rope(Context& c, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim, ops::RopeStyle style,
          ops::Rounding rounding) {
  const int64_t s = x.shape[0], d = x.shape[1], half = cos.shape[1], table = cos.shape[0];
  APUS_CHECK(d % head_dim == 0 && cos.rank() == 2 && half > 0 && 2 * half <= head_dim && table > 0 && s % table == 0 &&
                 sin.shape == cos.shape && cos.dtype == DType::f32,
             "rope: x ", shape_str(x.shape), ", cos ", shape_str(cos.shape), ", head_dim ", head_dim);
  const bool rounded = rounding == ops::Rounding::each_step && x.dtype == DType::bf16;
  parallel_for(s, [&](int64_t r) {
    float* v = thread_scratch(0, d);
    load_row(x, r, v, d);
    // A table of one sample's positions serves every sample of a batch.
    rope_row(v, d, head_dim, cos.ptr<float>() + (r % table) * half, sin.ptr<float>() + (r % table) * half, half,
             style == ops::RopeStyle::interleaved, rounded);
    store_row(x, r, v, d);
  });
}

void upsample_nearest2x(Context& c, const Tensor& x, Tensor& y) {
  const int64_t ch = x.shape[0] * x.shape[1], h = x.shape[2], w = x.shape[3];
  APUS_CHECK(y.shape == Shape({x.shape[0], x.shape[1], 2 * h, 2 * w}) && x.dtype == y.dtype, "upsample_nearest2x: x ",
             shape_str(x.shape), ", y ", shape_str(y.shape));
  const size_t es = dtype_size(x.dtype);
  APUS_CHECK(es == 2 || es == 4, "upsample_nearest2x: ", dtype_name(x.dtype), " is not an activation dtype");
  // Each input row is widened once (every element twice) and the wide row stored twice.
  parallel_for(ch * h, [&](int64_t r) {
    const char* src = static_cast<const char*>(x.data) + size_t(r * w) * es;
    char* dst = static_cast<char*>(y.data) + size_t(r * 4 * w) * es;
    if (es == 2) widen_twice(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint16_t*>(dst), w);
    else widen_twice(reinterpret_cast<const uint32_t*>(src), reinterpret_cast<uint32_t*>(dst), w);
    std::memcpy(dst + size_t(2 * w) * es, dst, size_t(2 * w) * es);
  });
}

void pingpong_update(Context& c, Tensor& x, const Tensor& velocity, const Tensor& noise, float t, float t_next) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(velocity.shape == x.shape && noise.shape == x.shape, "pingpong_update: x ", shape_str(x.shape),
             ", velocity ", shape_str(velocity.shape), ", noise ", shape_str(noise.shape));
  const float keep = round_as(x.dtype, 1.0f - t_next);
  parallel_for(m, [&](int64_t r) {
    float* vx = thread_scratch(0, d);
    float* vv = thread_scratch(1, d);
    float* vn = thread_scratch(2, d);
    load_row(x, r, vx, d);
    load_row(velocity, r, vv, d);
    load_row(noise, r, vn, d);
    // Step by step as the reference's eager ops round (no fused multiply-add).
    for (int64_t i = 0; i < d; ++i) vv[i] = round_as(x.dtype, t * vv[i]);
    for (int64_t i = 0; i < d; ++i) vx[i] = round_as(x.dtype, vx[i] - vv[i]);
    for (int64_t i = 0; i < d; ++i) vx[i] = round_as(x.dtype, keep * vx[i]);
    for (int64_t i = 0; i < d; ++i) vn[i] = round_as(x.dtype, t_next * vn[i]);
    for (int64_t i = 0; i < d; ++i) vx[i] += vn[i];
    store_row(x, r, vx, d);
  });
}

void blend(Context& c, const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y) {
  const int64_t m = y.shape[0], d = y.rank() == 2 ? y.shape[1] : 0;
  APUS_CHECK(y.rank() == 2 && a.shape == y.shape && b.shape == y.shape && w.dtype == DType::f32 &&
                 (w.numel() == 1 || w.numel() == m),
             "blend: a ", shape_str(a.shape), ", b ", shape_str(b.shape), ", w ", shape_str(w.shape), " ",
             dtype_name(w.dtype), ", y ", shape_str(y.shape), "; expected [M, D] each and w f32 [M] or [1]");
  parallel_for(m, [&](int64_t r) {
    float* va = thread_scratch(0, d);
    float* vb = thread_scratch(1, d);
    load_row(a, r, va, d);
    load_row(b, r, vb, d);
    const float wr = round_as(y.dtype, w.ptr<float>()[w.numel() == 1 ? 0 : r]);
    const float keep = round_as(y.dtype, 1.0f - wr);
    for (int64_t i = 0; i < d; ++i) va[i] = round_as(y.dtype, keep * va[i]) + round_as(y.dtype, wr * vb[i]);
    store_row(y, r, va, d);
  });
}

void guided_velocity(Context& c, const Tensor& x, const Tensor& cond, const Tensor& uncond, Tensor& y, float sigma,
                     float scale, float apg, int64_t batch, int64_t valid) {
  const int64_t rows = x.shape[0], ch = x.shape[1], t = batch > 0 ? rows / batch : 0;
  APUS_CHECK(batch >= 1 && rows % batch == 0 && cond.shape == x.shape && uncond.shape == x.shape &&
                 y.shape == x.shape && valid >= 1 && valid <= t && sigma > 0,
             "guided_velocity: x ", shape_str(x.shape), ", cond ", shape_str(cond.shape), ", uncond ",
             shape_str(uncond.shape), ", y ", shape_str(y.shape), ", batch ", batch, ", valid ", valid, ", sigma ",
             sigma);
  ArenaScope scope(*c.arena);
  const DType dt = y.dtype;
  auto r = [dt](float v) { return round_as(dt, v); };
  Tensor dc = Tensor::in(*c.arena, {rows, ch}, DType::f32), diff = Tensor::in(*c.arena, {rows, ch}, DType::f32);
  parallel_for(rows, [&](int64_t i) {
    float* vx = thread_scratch(0, ch);
    float* vc = thread_scratch(1, ch);
    float* vu = thread_scratch(2, ch);
    load_row(x, i, vx, ch);
    load_row(cond, i, vc, ch);
    load_row(uncond, i, vu, ch);
    float* pc = dc.ptr<float>() + i * ch;
    float* pd = diff.ptr<float>() + i * ch;
    for (int64_t k = 0; k < ch; ++k) {
      pc[k] = r(vx[k] - r(vc[k] * sigma));
      pd[k] = r(pc[k] - r(vx[k] - r(vu[k] * sigma)));
    }
  });
  for (int64_t b = 0; b < batch; ++b) {
    float* pc = dc.ptr<float>() + b * t * ch;
    float* pd = diff.ptr<float>() + b * t * ch;
    if (apg != 0) {
      // The projection in fp32 over the valid frames: u = d_c / ||d_c||, orth = (diff - <diff, u> u).
      double sq = 0;
      for (int64_t i = 0; i < valid * ch; ++i) sq += double(pc[i]) * pc[i];
      const float norm = std::max(float(std::sqrt(sq)), 1e-8f);
      double dot = 0;
      for (int64_t i = 0; i < valid * ch; ++i) dot += double(pd[i]) * (pc[i] / norm);
      const float along = float(dot);
      for (int64_t i = 0; i < t * ch; ++i) {
        const float orth = i < valid * ch ? pd[i] - along * (pc[i] / norm) : 0.0f;
        pd[i] = apg == 1 ? r(orth) : r(r(apg * orth) + r((1 - apg) * pd[i]));
      }
    }
    for (int64_t i = 0; i < t * ch; ++i) {
      const float guided = r(pc[i] + r((scale - 1) * pd[i]));
      pd[i] = guided;
    }
  }
  parallel_for(rows, [&](int64_t i) {
    float* vx = thread_scratch(0, ch);
    load_row(x, i, vx, ch);
    const float* g = diff.ptr<float>() + i * ch;
    for (int64_t k = 0; k < ch; ++k) vx[k] = r(vx[k] - g[k]) / sigma;
    store_row(y, i, vx, ch);
  });
}

void euler_update(Context& c, Tensor& x, const Tensor& velocity, float step) {
  APUS_CHECK(x.shape == velocity.shape && x.rank() == 2, "euler_step: x ", shape_str(x.shape), ", velocity ",
             shape_str(velocity.shape));
  // The reference multiplies the 0-d fp32 step size into the velocity in the velocity's dtype
  // (0-d tensors do not promote), then adds in fp32: bf16(x + bf16(bf16(dt) * v)).
  const bool bf16 = velocity.dtype == DType::bf16;
  const float dt = bf16 ? round_bf16(step) : step;
  const int64_t n = x.shape[1];
  parallel_for(x.shape[0], [&](int64_t r) {
    float* vx = thread_scratch(0, n);
    float* vv = thread_scratch(1, n);
    load_row(x, r, vx, n);
    load_row(velocity, r, vv, n);
    for (int64_t i = 0; i < n; ++i) vx[i] += bf16 ? round_bf16(dt * vv[i]) : dt * vv[i];
    store_row(x, r, vx, n);
  });
}

}  // namespace apus::cpu
