// The element-wise, norm and layout ops on the GPU, with the op list's roundings: values in f32,
// each eager sub-step rounded to the output dtype where the contract says so, one store rounding.
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"
#include "ops/permute_plan.h"

namespace apus::cuda {

namespace {

// A rank-2 view as kernels see it: rows of `cols` elements `stride` apart (any tensor of another
// rank is its contiguous [numel / last, last]).
struct View {
  void* data;
  DType dt;
  int64_t rows, cols, stride;
};

View view(const Tensor& t) {
  APUS_CHECK(!is_stored_quantized(t.dtype), "cuda: a weight stored as ", dtype_name(t.dtype), " ", shape_str(t.shape),
             " reached an op that reads plain values (only linear and embedding decode it)");
  if (t.rank() == 2) return {t.data, t.dtype, t.shape[0], t.shape[1], t.row_stride()};
  APUS_CHECK(t.contiguous(), "cuda: a ", shape_str(t.shape), " view of rank ", t.rank(), " is not supported");
  const int64_t last = t.rank() ? t.shape.back() : 1;
  return {t.data, t.dtype, last ? t.numel() / last : 0, last, last};
}

__device__ float ld(const View& v, int64_t r, int64_t c) { return load(v.dt, v.data, r * v.stride + c); }
__device__ void st(const View& v, int64_t r, int64_t c, float x) { store(v.dt, v.data, r * v.stride + c, x); }

// A per-feature vector [D] or per-sample [B, D] (sample b covers rows b * rows / B ...), at row r.
__device__ float per_row(const View& v, int64_t rows, int64_t r, int64_t c) {
  if (v.rows == 1) return ld(v, 0, c);
  if (rows <= INT32_MAX) return ld(v, uint32_t(r) / (uint32_t(rows) / uint32_t(v.rows)), c);  // see launch()
  return ld(v, r / (rows / v.rows), c);
}

// Runs f(r, c) over every element of a rows x cols grid. The row and column come from the flat
// index by a 32-bit division where the grid allows (a 64-bit one is a long software sequence per
// element, which held SA3's element-wise ops to ~4 % of the memory rate on the H200).
template <typename F> void launch(int64_t rows, int64_t cols, F f) {
  if (rows * cols == 0) return;
  if (rows * cols <= INT32_MAX) {
    const uint32_t n = uint32_t(rows * cols), width = uint32_t(cols);
    for_each_index<<<blocks_for(n), kThreads, 0, stream()>>>(
        n, [=] __device__(uint32_t i) { f(int64_t(i / width), int64_t(i % width)); });
  } else {
    for_each_index<<<blocks_for(rows * cols), kThreads, 0, stream()>>>(
        rows * cols, [=] __device__(int64_t i) { f(i / cols, i % cols); });
  }
  check(cudaGetLastError(), "element-wise kernel launch");
}

// The activations in double, as the reference evaluates them: CUDA's float tanhf and sinf differ
// from a correctly rounded result by an ulp or two, which moved 1% of GELU's bf16 outputs by
// 2 ulp (42 with each step rounded) on the H200.
__device__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ float gelu_tanh_f(float x) {
  const double v = x, u = 0.79788456080286535588 * (v + 0.044715 * v * v * v);
  return float(2.0 * u < -18.0 ? 0.0 * v : 0.5 * v * (1.0 + tanh(u)));
}

// y = x / rms over each group of `group` features, then * weight: one warp per (row, group), the
// sum of squares over the lanes and then across them (SA3's per-head norms are groups of 64: a
// block each left most of its threads idle).
__global__ void rms_norm_kernel(View x, View w, View y, float eps, int64_t group, int64_t groups, int64_t count,
                                bool each_step) {
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= count) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  const int64_t r = item / groups, g0 = item % groups * group;
  float ss = 0;
  for (int64_t c = lane; c < group; c += 32) {
    const float v = ld(x, r, g0 + c);
    ss += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float rs = 1.0f / sqrtf(ss / float(group) + eps);
  for (int64_t c = lane; c < group; c += 32) {
    float v = ld(x, r, g0 + c) * rs;
    if (each_step) v = round_to(y.dt, v);
    st(y, r, g0 + c, v * ld(w, 0, c));
  }
}

// (x - mean) / std over a row, then * (1 + scale) + shift: one block per row.
__global__ void layer_norm_modulate_kernel(View x, View shift, View scale, View y, float eps, bool each_step) {
  const int64_t r = blockIdx.x, d = x.cols;
  float s = 0;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) s += ld(x, r, c);
  const float mu = block_sum(s) / float(d);
  float q = 0;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    const float v = ld(x, r, c) - mu;
    q += v * v;
  }
  const float rstd = 1.0f / sqrtf(block_sum(q) / float(d) + eps);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    const float n = (ld(x, r, c) - mu) * rstd;
    const float sc = 1.0f + per_row(scale, x.rows, r, c), sh = per_row(shift, x.rows, r, c);
    st(y, r, c, each_step ? round_to(y.dt, round_to(y.dt, round_to(y.dt, n) * round_to(y.dt, sc)) + sh) : n * sc + sh);
  }
}

}  // namespace

void copy(Context& c, const Tensor& x, Tensor& y) {
  APUS_CHECK(x.numel() == y.numel(), "copy: x ", shape_str(x.shape), ", y ", shape_str(y.shape));
  const bool same_view = x.rank() == 2 && y.rank() == 2 && x.shape == y.shape;
  const View a = same_view ? view(x) : view(x.reshape({x.numel()})),
             b = same_view ? view(y) : view(y.reshape({y.numel()}));
  launch(a.rows, a.cols, [=] __device__(int64_t r, int64_t col) { st(b, r, col, ld(a, r, col)); });
}

void silu(Context& c, const Tensor& x, Tensor& y) {
  const View a = view(x), b = view(y);
  launch(a.rows, a.cols, [=] __device__(int64_t r, int64_t col) { st(b, r, col, silu_f(ld(a, r, col))); });
}

void glu(Context& c, const Tensor& a, const Tensor& b, Tensor& y, ops::Activation act, ops::Rounding rounding) {
  APUS_CHECK(a.shape == b.shape && y.shape == a.shape, "glu: a ", shape_str(a.shape), ", b ", shape_str(b.shape));
  const View va = view(a), vb = view(b), vy = view(y);
  const bool each = rounding == ops::Rounding::each_step;
  launch(va.rows, va.cols, [=] __device__(int64_t r, int64_t col) {
    const float x = ld(va, r, col);
    float s;
    if (act == ops::Activation::silu) s = silu_f(x);
    else if (act == ops::Activation::gelu_tanh) s = gelu_tanh_f(x);
    else s = float(sin(double(each ? round_to(vy.dt, 3.14159265358979323846f * x) : 3.14159265358979323846f * x)));
    if (each) s = round_to(vy.dt, s);
    st(vy, r, col, s * ld(vb, r, col));
  });
}

void add_gated(Context& c, Tensor& x, const Tensor& y, const Tensor* gate, ops::Rounding rounding) {
  APUS_CHECK(y.shape == x.shape, "add_gated: x ", shape_str(x.shape), ", y ", shape_str(y.shape));
  const View vx = view(x), vy = view(y);
  const bool gated = gate != nullptr, each = rounding == ops::Rounding::each_step;
  const View vg = gated ? view(*gate) : vy;
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    float t = ld(vy, r, col);
    if (gated) {
      t *= per_row(vg, vx.rows, r, col);
      if (each) t = round_to(vx.dt, t);
    }
    st(vx, r, col, ld(vx, r, col) + t);
  });
}

void modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y,
              ops::Rounding rounding) {
  APUS_CHECK(y.shape == x.shape && shift.shape == scale.shape, "modulate: x ", shape_str(x.shape), ", shift ",
             shape_str(shift.shape), ", scale ", shape_str(scale.shape));
  const View vx = view(x), vsh = view(shift), vsc = view(scale), vy = view(y);
  const bool each = rounding == ops::Rounding::each_step && y.dtype != DType::f32;
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    const float sc = 1.0f + per_row(vsc, vx.rows, r, col), sh = per_row(vsh, vx.rows, r, col), v = ld(vx, r, col);
    st(vy, r, col, each ? round_to(vy.dt, round_to(vy.dt, v * round_to(vy.dt, sc)) + sh) : v * sc + sh);
  });
}

void layer_norm_modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y, float eps,
                         ops::Rounding rounding) {
  APUS_CHECK(y.shape == x.shape && shift.shape == scale.shape, "layer_norm_modulate: x ", shape_str(x.shape));
  if (x.shape[0] == 0) return;
  layer_norm_modulate_kernel<<<unsigned(x.shape[0]), kThreads, 0, stream()>>>(
      view(x), view(shift), view(scale), view(y), eps, rounding == ops::Rounding::each_step && y.dtype != DType::f32);
  check(cudaGetLastError(), "layer_norm_modulate");
}

void rms_norm(Context& c, const Tensor& x, const Tensor& weight, Tensor& y, float eps, int64_t group,
              ops::Rounding rounding) {
  APUS_CHECK(y.shape == x.shape && x.shape[1] % group == 0 && weight.numel() == group, "rms_norm: x ",
             shape_str(x.shape), ", weight ", shape_str(weight.shape), ", group ", group);
  if (x.shape[0] == 0) return;
  const int64_t groups = x.shape[1] / group, count = x.shape[0] * groups, per_block = kThreads / 32;
  rms_norm_kernel<<<unsigned((count + per_block - 1) / per_block), kThreads, 0, stream()>>>(
      view(x), view(weight.reshape({1, group})), view(y), eps, group, groups, count,
      rounding == ops::Rounding::each_step);
  check(cudaGetLastError(), "rms_norm");
}

void gate_sigmoid(Context& c, const Tensor& x, Tensor& y, ops::Rounding rounding) {
  const View vx = view(x), vy = view(y);
  const bool each = rounding == ops::Rounding::each_step;
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    float t = 1.0f - ld(vx, r, col);
    if (each) t = round_to(vy.dt, t);
    st(vy, r, col, 1.0f / (1.0f + expf(-t)));
  });
}

void affine(Context& c, const Tensor& x, const Tensor& scale, const Tensor& shift, Tensor& y, ops::Rounding rounding) {
  const int64_t d = x.shape[1];
  APUS_CHECK(x.rank() == 2 && y.shape == x.shape && scale.numel() == d && shift.numel() == d, "affine: x ",
             shape_str(x.shape), ", scale ", shape_str(scale.shape), ", shift ", shape_str(shift.shape));
  const View vx = view(x), vs = view(scale.reshape({1, d})), vb = view(shift.reshape({1, d})), vy = view(y);
  const bool each = rounding == ops::Rounding::each_step;
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    float p = ld(vx, r, col) * ld(vs, 0, col);
    if (each) p = round_to(vy.dt, p);
    st(vy, r, col, p + ld(vb, 0, col));
  });
}

void dyt(Context& c, const Tensor& x, const Tensor& alpha, const Tensor& gamma, const Tensor& beta, Tensor& y,
         ops::Rounding rounding) {
  const int64_t group = gamma.numel();
  APUS_CHECK(y.shape == x.shape && alpha.numel() == 1 && group > 0 && x.shape[1] % group == 0 && beta.numel() == group,
             "dyt: x ", shape_str(x.shape), ", gamma ", shape_str(gamma.shape));
  const View vx = view(x), va = view(alpha.reshape({1, 1})), vg = view(gamma.reshape({1, group})),
             vb = view(beta.reshape({1, group})), vy = view(y);
  const bool each = rounding == ops::Rounding::each_step && y.dtype == DType::bf16;
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    const int64_t i = col % group;
    float v = ld(va, 0, 0) * ld(vx, r, col);
    if (each) v = round_to(vy.dt, v);
    v = tanhf(v);
    if (each) v = round_to(vy.dt, v);
    v *= ld(vg, 0, i);
    if (each) v = round_to(vy.dt, v);
    st(vy, r, col, v + ld(vb, 0, i));
  });
}

void euler_update(Context& c, Tensor& x, const Tensor& velocity, float step) {
  APUS_CHECK(x.shape == velocity.shape && x.rank() == 2, "euler_step: x ", shape_str(x.shape), ", velocity ",
             shape_str(velocity.shape));
  const View vx = view(x), vv = view(velocity);
  const bool bf16 = velocity.dtype == DType::bf16;
  const float dt = bf16 ? __bfloat162float(__float2bfloat16_rn(step)) : step;
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    const float d = dt * ld(vv, r, col);
    st(vx, r, col, ld(vx, r, col) + (bf16 ? round_to(DType::bf16, d) : d));
  });
}

void blend(Context& c, const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y) {
  APUS_CHECK(y.rank() == 2 && a.shape == y.shape && b.shape == y.shape && w.dtype == DType::f32 &&
                 (w.numel() == 1 || w.numel() == y.shape[0]),
             "blend: a ", shape_str(a.shape), ", b ", shape_str(b.shape), ", w ", shape_str(w.shape), ", y ",
             shape_str(y.shape));
  const View va = view(a), vb = view(b), vy = view(y);
  const float* wp = w.ptr<float>();
  const bool one = w.numel() == 1;
  launch(vy.rows, vy.cols, [=] __device__(int64_t r, int64_t col) {
    const float wr = round_to(vy.dt, wp[one ? 0 : r]), keep = round_to(vy.dt, 1.0f - wr);
    st(vy, r, col, round_to(vy.dt, keep * ld(va, r, col)) + round_to(vy.dt, wr * ld(vb, r, col)));
  });
}

void transpose(Context& c, const Tensor& x, Tensor& y) {
  APUS_CHECK(
      x.rank() == 2 && y.rank() == 2 && y.shape[0] == x.shape[1] && y.shape[1] == x.shape[0] && x.dtype == y.dtype,
      "transpose: x ", shape_str(x.shape), ", y ", shape_str(y.shape));
  const View vx = view(x), vy = view(y);
  launch(vy.rows, vy.cols, [=] __device__(int64_t r, int64_t col) { st(vy, r, col, ld(vx, col, r)); });
}

void upsample_nearest2x(Context& c, const Tensor& x, Tensor& y) {
  APUS_CHECK(x.rank() == 4 && y.rank() == 4 && y.shape[2] == 2 * x.shape[2] && y.shape[3] == 2 * x.shape[3],
             "upsample_nearest2x: x ", shape_str(x.shape), ", y ", shape_str(y.shape));
  const int64_t h = x.shape[2], w = x.shape[3];
  const View vx = view(x.reshape({x.numel() / w, w})), vy = view(y.reshape({y.numel() / (2 * w), 2 * w}));
  launch(vy.rows, vy.cols, [=] __device__(int64_t r, int64_t col) {
    const int64_t plane = r / (2 * h), row = r % (2 * h);
    st(vy, r, col, ld(vx, plane * h + row / 2, col / 2));
  });
}

void rope(Context& c, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim, ops::RopeStyle style,
          ops::Rounding rounding) {
  const int64_t s = x.shape[0], d = x.shape[1], half = cos.shape[1], table = cos.shape[0];
  APUS_CHECK(d % head_dim == 0 && cos.rank() == 2 && half > 0 && 2 * half <= head_dim && table > 0 && s % table == 0 &&
                 sin.shape == cos.shape && cos.dtype == DType::f32,
             "rope: x ", shape_str(x.shape), ", cos ", shape_str(cos.shape), ", head_dim ", head_dim);
  const View vx = view(x);
  const float *cp = cos.ptr<float>(), *sp = sin.ptr<float>();
  const bool rounded = rounding == ops::Rounding::each_step && x.dtype == DType::bf16;
  const bool interleaved = style == ops::RopeStyle::interleaved;
  // One thread per rotated pair: (row, head * half + j).
  launch(s, (d / head_dim) * half, [=] __device__(int64_t r, int64_t k) {
    const int64_t h = (k / half) * head_dim, j = k % half;
    const int64_t i0 = h + (interleaved ? 2 * j : j), i1 = h + (interleaved ? 2 * j + 1 : j + half);
    const float c0 = cp[(r % table) * half + j], s0 = sp[(r % table) * half + j];
    const float x0 = ld(vx, r, i0), x1 = ld(vx, r, i1);
    if (rounded) {
      const float cb = round_to(DType::bf16, c0), sb = round_to(DType::bf16, s0);
      st(vx, r, i0, round_to(DType::bf16, x0 * cb) + round_to(DType::bf16, -x1 * sb));
      st(vx, r, i1, round_to(DType::bf16, x1 * cb) + round_to(DType::bf16, x0 * sb));
    } else {
      st(vx, r, i0, x0 * c0 - x1 * s0);
      st(vx, r, i1, x1 * c0 + x0 * s0);
    }
  });
}

void pingpong_update(Context& c, Tensor& x, const Tensor& velocity, const Tensor& noise, float t, float t_next) {
  APUS_CHECK(velocity.shape == x.shape && noise.shape == x.shape && x.rank() == 2, "pingpong_update: x ",
             shape_str(x.shape), ", velocity ", shape_str(velocity.shape), ", noise ", shape_str(noise.shape));
  const View vx = view(x), vv = view(velocity), vn = view(noise);
  const DType dt = x.dtype;
  const float keep = dt == DType::bf16 ? __bfloat162float(__float2bfloat16_rn(1.0f - t_next)) : 1.0f - t_next;
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    const float v = round_to(dt, t * ld(vv, r, col));
    const float denoised = round_to(dt, round_to(dt, ld(vx, r, col) - v) * keep);
    st(vx, r, col, denoised + round_to(dt, t_next * ld(vn, r, col)));
  });
}

namespace {

// Per sample of guided_velocity: over the valid frames, diff's part orthogonal to d_c (fp32
// values, double sums as the CPU's), replacing diff in proportion apg.
__global__ void project_kernel(float* dc, float* diff, int64_t per_sample, int64_t valid, float apg, DType dt) {
  __shared__ double partial[32];
  const int64_t b = blockIdx.x;
  float* pc = dc + b * per_sample;
  float* pd = diff + b * per_sample;
  auto sum = [&](double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0;
    if (threadIdx.x == 0)
      for (unsigned w = 0; w < (blockDim.x >> 5); ++w) s += partial[w];
    __syncthreads();
    if (threadIdx.x == 0) partial[0] = s;
    __syncthreads();
    s = partial[0];
    __syncthreads();
    return s;
  };
  double sq = 0;
  for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) sq += double(pc[i]) * pc[i];
  const float norm = fmaxf(float(sqrt(sum(sq))), 1e-8f);
  double dot = 0;
  for (int64_t i = threadIdx.x; i < valid; i += blockDim.x) dot += double(pd[i]) * (pc[i] / norm);
  const float along = float(sum(dot));
  for (int64_t i = threadIdx.x; i < per_sample; i += blockDim.x) {
    const float orth = i < valid ? pd[i] - along * (pc[i] / norm) : 0.0f;
    pd[i] = apg == 1 ? round_to(dt, orth) : round_to(dt, round_to(dt, apg * orth) + round_to(dt, (1 - apg) * pd[i]));
  }
}

}  // namespace

void guided_velocity(Context& c, const Tensor& x, const Tensor& cond, const Tensor& uncond, Tensor& y, float sigma,
                     float scale, float apg, int64_t batch, int64_t valid) {
  const int64_t rows = x.shape[0], ch = x.shape[1], t = batch > 0 ? rows / batch : 0;
  APUS_CHECK(batch >= 1 && rows % batch == 0 && cond.shape == x.shape && uncond.shape == x.shape &&
                 y.shape == x.shape && valid >= 1 && valid <= t && sigma > 0,
             "guided_velocity: x ", shape_str(x.shape), ", cond ", shape_str(cond.shape), ", y ", shape_str(y.shape),
             ", batch ", batch, ", valid ", valid, ", sigma ", sigma);
  ArenaScope scope(*c.arena);
  Tensor dc = Tensor::in(*c.arena, {rows, ch}, DType::f32), diff = Tensor::in(*c.arena, {rows, ch}, DType::f32);
  const View vx = view(x), vc = view(cond), vu = view(uncond), vy = view(y), vdc = view(dc), vdiff = view(diff);
  const DType dt = y.dtype;
  launch(rows, ch, [=] __device__(int64_t r, int64_t k) {
    const float xv = ld(vx, r, k);
    const float d_c = round_to(dt, xv - round_to(dt, ld(vc, r, k) * sigma));
    st(vdc, r, k, d_c);
    st(vdiff, r, k, round_to(dt, d_c - round_to(dt, xv - round_to(dt, ld(vu, r, k) * sigma))));
  });
  if (apg != 0) {
    project_kernel<<<unsigned(batch), 256, 0, stream()>>>(dc.ptr<float>(), diff.ptr<float>(), t * ch, valid * ch, apg,
                                                          dt);
    check(cudaGetLastError(), "guided_velocity projection");
  }
  launch(rows, ch, [=] __device__(int64_t r, int64_t k) {
    const float guided = round_to(dt, ld(vdc, r, k) + round_to(dt, (scale - 1) * ld(vdiff, r, k)));
    st(vy, r, k, round_to(dt, ld(vx, r, k) - guided) / sigma);
  });
}

void timestep_embedding(Context& c, float t, Tensor& y) {
  APUS_CHECK(y.rank() == 2 && y.shape[0] == 1 && y.shape[1] % 2 == 0, "timestep_embedding: y ", shape_str(y.shape),
             ", expected [1, 2H]");
  const int64_t half = y.shape[1] / 2;
  const View vy = view(y);
  launch(1, half, [=] __device__(int64_t, int64_t i) {
    // The angle in float32 as diffusers computes it, its frequency correctly rounded (CUDA's expf
    // is off by up to 2 ulp, and t = 738.5 turns an ulp of the frequency into 738 of the angle).
    const float arg = t * float(exp(double(-float(log(10000.0)) * float(i) / float(half))));
    st(vy, 0, i, float(cos(double(arg))));
    st(vy, 0, half + i, float(sin(double(arg))));
  });
}

void fourier_features(Context& c, float t, const Tensor& freqs, Tensor& y) {
  const int64_t half = freqs.numel();
  APUS_CHECK(y.shape == Shape({1, 2 * half}), "fourier_features: freqs ", shape_str(freqs.shape), ", y ",
             shape_str(y.shape), "; expected y [1, ", 2 * half, "]");
  const View vf = view(freqs.reshape({1, half})), vy = view(y);
  launch(1, half, [=] __device__(int64_t, int64_t i) {
    const float a = t * ld(vf, 0, i) * 2.0f * 3.14159265358979323846f;
    st(vy, 0, i, float(cos(double(a))));
    st(vy, 0, half + i, float(sin(double(a))));
  });
}

void permute(Context& c, const Tensor& x, Tensor& y, const std::vector<int>& perm) {
  const PermutePlan axes = permute_plan(x, y, perm);
  const int rank = axes.rank;
  const View vx = view(x.reshape({x.numel()})), vy = view(y.reshape({y.numel()}));
  launch(1, y.numel(), [=] __device__(int64_t, int64_t i) {
    int64_t src = 0, rem = i;
    for (int a = rank - 1; a >= 0; --a) {
      src += (rem % axes.dims[a]) * axes.from[a];
      rem /= axes.dims[a];
    }
    st(vy, 0, i, ld(vx, 0, src));
  });
}

bool all_finite(Context& c, const Tensor& x) {
  refuse_wait_in_graph("all_finite (an answer to the host)");
  const View vx = view(x);
  int* flag = nullptr;
  check(cudaMallocAsync(&flag, sizeof(int), stream()), "all_finite flag");
  check(cudaMemsetAsync(flag, 0, sizeof(int), stream()), "all_finite flag");
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    if (!isfinite(ld(vx, r, col))) *flag = 1;
  });
  int bad = 0;
  check(cudaMemcpyAsync(&bad, flag, sizeof(int), cudaMemcpyDeviceToHost, stream()), "all_finite result");
  check(cudaFreeAsync(flag, stream()), "all_finite flag");
  check(cudaStreamSynchronize(stream()), "all_finite");
  return bad == 0;
}

void nonfinite_flag(Context& c, const Tensor& x, Tensor& flags, int64_t slot) {
  check_flag_slot(flags, slot);
  const View vx = view(x);
  int32_t* flag = flags.ptr<int32_t>() + slot;
  check(cudaMemsetAsync(flag, 0, sizeof(int32_t), stream()), "clear a non-finite flag");
  launch(vx.rows, vx.cols, [=] __device__(int64_t r, int64_t col) {
    if (!isfinite(ld(vx, r, col))) *flag = 1;
  });
}

}  // namespace apus::cuda
