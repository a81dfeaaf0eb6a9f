// Convolution, group norm, gathers and tables on the GPU, with the contract's numerics. conv2d
// has two kernels (knob cuda.conv): `gemm` lays each output pixel's receptive field out as a row
// (im2col) and multiplies by the weights through cuBLASLt (fp32 sums on tensor cores, the bias
// added in fp32 as the result is laid back to NCHW); `direct` is the correct-first kernel, one
// thread per output; `cudnn` cuDNN's implicit GEMM (cudnn_conv.cu). GroupNorm+SiLU fused into
// cuDNN's NHWC kernels is the step after (issue 38).
#include <algorithm>

#include "core/variants.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"

namespace apus::cuda {

Knob conv_knob("cuda.conv",
               "convolution kernel: im2col and a cuBLASLt product, one thread per output, or cuDNN's implicit GEMM",
               {"gemm", "direct", "cudnn"});

namespace {

// Rows [p0, p0 + rows) of sample b's im2col matrix: row p holds output pixel p's receptive field
// (channel, ky, kx), zeros where it falls in the padding and past K up to the row stride kp.
__global__ void im2col_kernel(const void* x, DType dt, void* col, int64_t ci, int64_t h, int64_t wd, int64_t k,
                              int64_t ow, int64_t stride, int64_t pad, int64_t p0, int64_t rows, int64_t kp) {
  const int64_t total = rows * kp, kk = k * k;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / kp, e = i % kp, p = p0 + r;
    float v = 0.0f;
    if (e < ci * kk) {
      const int64_t c = e / kk, ky = e % kk / k, kx = e % k;
      const int64_t iy = p / ow * stride - pad + ky, ix = p % ow * stride - pad + kx;
      if (iy >= 0 && iy < h && ix >= 0 && ix < wd) v = load(dt, x, (c * h + iy) * wd + ix);
    }
    store(dt, col, i, v);
  }
}

// The weights [co, K] in the activation dtype, rows padded with zeros to kp.
__global__ void pack_weights_kernel(const void* w, DType wt, void* out, DType dt, int64_t co, int64_t kdim,
                                    int64_t kp) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < co * kp; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = i / kp, e = i % kp;
    store(dt, out, i, e < kdim ? load(wt, w, o * kdim + e) : 0.0f);
  }
}

// y[o][p0 + r] = product[r][o] + bias[o], rounded once to y's dtype (the direct kernel's sum).
__global__ void to_nchw_kernel(const float* product, int64_t ldp, const void* bias, DType bt, void* y, DType dt,
                               int64_t co, int64_t pixels, int64_t p0, int64_t rows) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * co;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = i / rows, r = i % rows;
    store(dt, y, o * pixels + p0 + r, product[r * ldp + o] + (bias ? load(bt, bias, o) : 0.0f));
  }
}

// Pair j of a RoPE table turns as the index[j]-th pair of axis[j], whose width is width[j].
struct RopePairs {
  int32_t axis[128], index[128], width[128];
};

__global__ void conv2d_kernel(const void* x, DType xt, const void* w, DType wt, const void* bias, DType bt, void* y,
                              int64_t n, int64_t ci, int64_t h, int64_t wd, int64_t co, int64_t k, int64_t oh,
                              int64_t ow, int64_t stride, int64_t pad) {
  const int64_t total = n * co * oh * ow;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t ox = i % ow, oy = (i / ow) % oh, o = (i / (ow * oh)) % co, b = i / (ow * oh * co);
    float acc = 0.0f;
    for (int64_t c = 0; c < ci; ++c)
      for (int64_t ky = 0; ky < k; ++ky) {
        const int64_t iy = oy * stride - pad + ky;
        if (iy < 0 || iy >= h) continue;
        for (int64_t kx = 0; kx < k; ++kx) {
          const int64_t ix = ox * stride - pad + kx;
          if (ix < 0 || ix >= wd) continue;
          // The weight in x's dtype, as the contract converts it.
          const float wv = round_to(xt, load(wt, w, ((o * ci + c) * k + ky) * k + kx));
          acc += load(xt, x, ((b * ci + c) * h + iy) * wd + ix) * wv;
        }
      }
    if (bias) acc += load(bt, bias, o);
    store(xt, y, i, acc);
  }
}

// Group norm in three passes over many blocks (a block per (sample, group) and slice of it, so a
// 1024x1024 VAE activation with 32 groups fills the GPU): the slices' sums, then their squared
// distances from the group's mean, then the affine per channel (SiLU after it when fused). The
// mean and variance are the two-pass ones the reference computes.
struct GroupSlices {
  int64_t ch, hw, groups, splits;
  __device__ int64_t per() const { return ch / groups; }
  __device__ int64_t count() const { return per() * hw; }
  __device__ int64_t base(int64_t ng) const { return (ng / groups * ch + ng % groups * per()) * hw; }
  __device__ int64_t lo(int64_t split) const { return (count() + splits - 1) / splits * split; }
  __device__ int64_t hi(int64_t split) const { return min(count(), lo(split + 1)); }
  // The group's value from its slices' partial sums, over its element count.
  __device__ float total(const float* partial, int64_t ng) const {
    float t = 0.0f;
    for (int64_t j = 0; j < splits; ++j) t += partial[ng * splits + j];
    return t / float(count());
  }
};

__global__ void group_sums_kernel(const void* x, DType dt, GroupSlices g, const float* sums, float* out) {
  const int64_t ng = blockIdx.x, split = blockIdx.y, base = g.base(ng);
  const float mean = sums ? g.total(sums, ng) : 0.0f;
  float s = 0.0f;
  for (int64_t i = g.lo(split) + threadIdx.x; i < g.hi(split); i += blockDim.x) {
    const float v = load(dt, x, base + i);
    s += sums ? (v - mean) * (v - mean) : v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) out[ng * g.splits + split] = s;
}

__global__ void group_apply_kernel(const void* x, const void* w, DType wt, const void* b, DType bt, void* y, DType dt,
                                   GroupSlices g, const float* sums, const float* squares, float eps, bool silu,
                                   bool each_step) {
  const int64_t ng = blockIdx.x, split = blockIdx.y, base = g.base(ng);
  const float mean = g.total(sums, ng), rstd = 1.0f / sqrtf(g.total(squares, ng) + eps);
  for (int64_t i = g.lo(split) + threadIdx.x; i < g.hi(split); i += blockDim.x) {
    const int64_t c = ng % g.groups * g.per() + i / g.hw;
    const float a = rstd * load(wt, w, c), b0 = load(bt, b, c) - mean * a;
    float v = load(dt, x, base + i) * a + b0;
    if (silu) {
      if (each_step) v = round_to(dt, v);
      v = v / (1.0f + expf(-v));
    }
    store(dt, y, base + i, v);
  }
}

}  // namespace

namespace {

// conv2d as im2col and a product, per sample, in chunks of output pixels whose im2col rows fit a
// scratch budget.
void conv2d_by_products(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t stride,
                        int64_t pad, int64_t oh, int64_t ow) {
  const int64_t n = x.shape[0], ci = x.shape[1], h = x.shape[2], wd = x.shape[3], co = w.shape[0], k = w.shape[2];
  const DType dt = x.dtype;
  const int64_t kdim = ci * k * k, kp = round_up(kdim, 8), cop = round_up(co, 4), pixels = oh * ow;
  const int64_t budget = int64_t(1) << 30;
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(pixels, budget / int64_t(dtype_bytes(dt, kp) + 4 * cop)));
  ArenaScope scope(*c.arena);
  const Tensor packed = Tensor::in(*c.arena, {co, kp}, dt);
  pack_weights_kernel<<<blocks_for(co * kp), kThreads, 0, stream()>>>(w.data, w.dtype, packed.data, dt, co, kdim, kp);
  const Tensor col = Tensor::in(*c.arena, {rows, kp}, dt);
  const Tensor product = Tensor::in(*c.arena, {rows, cop}, DType::f32);
  for (int64_t b = 0; b < n; ++b) {
    const char* xb = static_cast<const char*>(x.data) + dtype_bytes(dt, b * ci * h * wd);
    char* yb = static_cast<char*>(y.data) + dtype_bytes(dt, b * co * pixels);
    for (int64_t p0 = 0; p0 < pixels; p0 += rows) {
      const int64_t r = std::min(rows, pixels - p0);
      im2col_kernel<<<blocks_for(r * kp), kThreads, 0, stream()>>>(xb, dt, col.data, ci, h, wd, k, ow, stride, pad, p0,
                                                                   r, kp);
      gemm({col.data, dt, kp}, {packed.data, dt, kp}, true, {product.data, DType::f32, cop}, r, co, kdim, 1, 1.0f);
      to_nchw_kernel<<<blocks_for(r * co), kThreads, 0, stream()>>>(
          product.ptr<float>(), cop, bias ? bias->data : nullptr, bias ? bias->dtype : DType::f32, yb, dt, co, pixels,
          p0, r);
    }
  }
  check(cudaGetLastError(), "conv2d kernels launch");
}

}  // namespace

void conv2d(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t stride, int64_t pad,
            int64_t pad_end) {
  const int64_t n = x.shape[0], ci = x.shape[1], h = x.shape[2], wd = x.shape[3], co = w.shape[0], k = w.shape[2];
  const int64_t oh = (h + pad + pad_end - k) / stride + 1, ow = (wd + pad + pad_end - k) / stride + 1;
  APUS_CHECK(x.rank() == 4 && w.rank() == 4 && w.shape[1] == ci && w.shape[3] == k && stride >= 1 &&
                 y.shape == Shape({n, co, oh, ow}) && x.dtype == y.dtype && x.contiguous() && w.contiguous() &&
                 (!bias || bias->numel() == co),
             "conv2d: x ", shape_str(x.shape), ", w ", shape_str(w.shape), ", y ", shape_str(y.shape), ", stride ",
             stride, ", pad ", pad, "+", pad_end);
  APUS_CHECK(!is_stored_quantized(w.dtype), "conv2d on the GPU: a ", dtype_name(w.dtype),
             " weight (no checkpoint apus reads stores a convolution so)");
  const int64_t total = n * co * oh * ow;
  if (total == 0) return;
  // cuDNN where asked and it takes the conv (symmetric padding, the bias in x's dtype), else the
  // products; the direct kernel where asked or neither takes the dtype.
  const bool wide = x.dtype == DType::bf16 || x.dtype == DType::f32;
  const int asked = conv_knob.value();
  if (asked == 2 && cudnn_conv_takes(x, bias, pad, pad_end)) {
    conv_knob.took(2);
    return conv2d_by_cudnn(c, x, w, bias, y, stride, pad);
  }
  const bool products = asked != 1 && wide;
  conv_knob.took(products ? 0 : 1);
  if (products) return conv2d_by_products(c, x, w, bias, y, stride, pad, oh, ow);
  conv2d_kernel<<<blocks_for(total), kThreads, 0, stream()>>>(
      x.data, x.dtype, w.data, w.dtype, bias ? bias->data : nullptr, bias ? bias->dtype : DType::f32, y.data, n, ci, h,
      wd, co, k, oh, ow, stride, pad);
  check(cudaGetLastError(), "conv2d kernel launch");
}

void group_norm(Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, int64_t groups,
                float eps, bool fuse_silu, ops::Rounding rounding) {
  APUS_CHECK(x.rank() == 4 && x.shape[1] % groups == 0 && y.shape == x.shape && x.contiguous() &&
                 weight.numel() == x.shape[1] && bias.numel() == x.shape[1],
             "group_norm: x ", shape_str(x.shape), " with ", groups, " groups");
  if (x.numel() == 0) return;
  const int64_t ng = x.shape[0] * groups, count = x.shape[1] / groups * x.shape[2] * x.shape[3];
  const GroupSlices g{x.shape[1], x.shape[2] * x.shape[3], groups, std::min<int64_t>(64, (count + 16383) / 16384)};
  ArenaScope scope(*c.arena);
  Tensor sums = Tensor::in(*c.arena, {ng, g.splits}, DType::f32),
         squares = Tensor::in(*c.arena, {ng, g.splits}, DType::f32);
  const dim3 grid(unsigned(ng), unsigned(g.splits));
  group_sums_kernel<<<grid, kThreads, 0, stream()>>>(x.data, x.dtype, g, nullptr, sums.ptr<float>());
  group_sums_kernel<<<grid, kThreads, 0, stream()>>>(x.data, x.dtype, g, sums.ptr<float>(), squares.ptr<float>());
  group_apply_kernel<<<grid, kThreads, 0, stream()>>>(x.data, weight.data, weight.dtype, bias.data, bias.dtype, y.data,
                                                      x.dtype, g, sums.ptr<float>(), squares.ptr<float>(), eps,
                                                      fuse_silu, rounding == ops::Rounding::each_step);
  check(cudaGetLastError(), "group_norm kernel launch");
}

void embedding(Context& c, const Tensor& table, const Tensor& ids, Tensor& y) {
  const int64_t s = ids.numel(), d = table.shape[1], rows = table.shape[0];
  APUS_CHECK(table.rank() == 2 && table.contiguous() && ids.dtype == DType::i32 && y.shape == Shape({s, d}),
             "embedding: table ", shape_str(table.shape), ", ids ", shape_str(ids.shape), " ", dtype_name(ids.dtype),
             ", y ", shape_str(y.shape));
  // The ids are checked on the host first (a small copy), so a bad one is refused, not read.
  std::vector<int32_t> host(static_cast<size_t>(s));
  check(cudaMemcpyAsync(host.data(), ids.data, size_t(s) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream()),
        "embedding ids");
  check(cudaStreamSynchronize(stream()), "embedding ids");
  for (const int32_t id : host)
    APUS_CHECK(id >= 0 && id < rows, "embedding: token id ", id, " outside the table's ", rows, " rows");
  if (is_stored_quantized(table.dtype)) return decode_stored(table, &ids, y);  // a GGUF's token table
  const DType tt = table.dtype, yt = y.dtype;
  const void* t = table.data;
  const int32_t* id = ids.ptr<int32_t>();
  void* out = y.data;
  const int64_t total = s * d;
  if (total == 0) return;
  for_each_index<<<blocks_for(total), kThreads, 0, stream()>>>(
      total, [=] __device__(int64_t i) { store(yt, out, i, load(tt, t, int64_t(id[i / d]) * d + i % d)); });
  check(cudaGetLastError(), "embedding kernel launch");
}

void rope_tables(Context& c, const Tensor& positions, const std::vector<int64_t>& axes, double theta,
                 ops::RopeMath math, Tensor& cos, Tensor& sin) {
  const int64_t s = positions.shape[0];
  int64_t dim = 0;
  for (int64_t a : axes) dim += a;
  APUS_CHECK(positions.rank() == 2 && positions.dtype == DType::i64 && positions.shape[1] == int64_t(axes.size()) &&
                 axes.size() <= 8 && cos.shape == Shape({s, dim / 2}) && sin.shape == cos.shape &&
                 cos.dtype == DType::f32 && sin.dtype == DType::f32,
             "rope_tables: positions ", shape_str(positions.shape), ", cos ", shape_str(cos.shape), " for ",
             axes.size(), " axes of ", dim);
  RopePairs pairs{};
  APUS_CHECK(dim / 2 <= 128, "rope_tables: ", dim / 2, " pairs, at most 128 on cuda");
  int64_t j = 0;
  for (size_t a = 0; a < axes.size(); ++a)
    for (int64_t i = 0; i < axes[a] / 2; ++i, ++j) {
      pairs.axis[j] = int32_t(a);
      pairs.index[j] = int32_t(i);
      pairs.width[j] = int32_t(axes[a]);
    }
  const int64_t half = dim / 2, n_axes = int64_t(axes.size());
  const int64_t* pos = positions.ptr<int64_t>();
  float *cp = cos.ptr<float>(), *sp = sin.ptr<float>();
  const bool f32 = math == ops::RopeMath::f32;
  if (s * half == 0) return;
  for_each_index<<<blocks_for(s * half), kThreads, 0, stream()>>>(s * half, [=] __device__(int64_t k) {
    const int64_t r = k / half, q = k % half, d = pairs.width[q], i = pairs.index[q];
    const float p = float(pos[r * n_axes + pairs.axis[q]]);
    if (f32) {
      const float angle = p * (1.0f / powf(float(theta), float(2 * i) / float(d)));
      cp[k] = cosf(angle);
      sp[k] = sinf(angle);
    } else {
      const double angle = double(p) * (1.0 / pow(theta, double(2 * i) / double(d)));
      cp[k] = float(::cos(angle));
      sp[k] = float(::sin(angle));
    }
  });
  check(cudaGetLastError(), "rope_tables kernel launch");
}

void image_to_rgb8(Context& c, const Tensor& image, Tensor& rgb) {
  const int64_t h = image.shape[2], w = image.shape[3];
  APUS_CHECK(image.rank() == 4 && image.shape[0] == 1 && image.shape[1] == 3 && rgb.shape == Shape({h, w, 3}) &&
                 rgb.dtype == DType::u8 && image.contiguous(),
             "image_to_rgb8: image ", shape_str(image.shape), ", rgb ", shape_str(rgb.shape), " ",
             dtype_name(rgb.dtype), "; expected [1, 3, H, W] and u8 [H, W, 3]");
  APUS_CHECK(all_finite(c, image), "image_to_rgb8: the image holds a non-finite pixel");
  const DType dt = image.dtype;
  const void* in = image.data;
  uint8_t* out = rgb.ptr<uint8_t>();
  const int64_t plane = h * w;
  if (plane == 0) return;
  for_each_index<<<blocks_for(3 * plane), kThreads, 0, stream()>>>(3 * plane, [=] __device__(int64_t k) {
    const int64_t ch = k / plane, at = k % plane;
    // denormalize in the image's dtype (x * 0.5 + 0.5, two rounded ops), clamp, then
    // (v * 255) rounded half to even in fp32.
    const float v = load(dt, in, k);
    const float unit = fminf(fmaxf(round_to(dt, round_to(dt, v * 0.5f) + 0.5f), 0.0f), 1.0f);
    out[at * 3 + ch] = uint8_t(rintf(unit * 255.0f));
  });
  check(cudaGetLastError(), "image_to_rgb8 kernel launch");
}

}  // namespace apus::cuda
