#include "models/flux2/latent_preview.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/ops.h"

namespace apus::flux2 {

namespace {

// Normal deviates from a fixed splitmix64 stream: the fit is the same on every machine.
class Deviates {
 public:
  float next() {
    auto uniform = [this] {
      uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return (double((z ^ (z >> 31)) >> 11) + 0.5) * 0x1p-53;
    };
    const double r = std::sqrt(-2 * std::log(uniform())), t = 2 * M_PI * uniform();
    return float(r * std::cos(t));
  }

 private:
  uint64_t state_ = 20261203;
};

// Solves the symmetric positive definite system a x = b (n x n, row-major) in place by Cholesky.
void solve_spd(std::vector<double>& a, std::vector<double>& b, int64_t n, int64_t rhs) {
  for (int64_t j = 0; j < n; ++j) {
    double d = a[size_t(j * n + j)];
    for (int64_t k = 0; k < j; ++k) d -= a[size_t(j * n + k)] * a[size_t(j * n + k)];
    APUS_CHECK(d > 0, "latent preview: the fit's normal equations are singular");
    a[size_t(j * n + j)] = std::sqrt(d);
    for (int64_t i = j + 1; i < n; ++i) {
      double v = a[size_t(i * n + j)];
      for (int64_t k = 0; k < j; ++k) v -= a[size_t(i * n + k)] * a[size_t(j * n + k)];
      a[size_t(i * n + j)] = v / a[size_t(j * n + j)];
    }
  }
  for (int64_t r = 0; r < rhs; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      double v = b[size_t(i * rhs + r)];
      for (int64_t k = 0; k < i; ++k) v -= a[size_t(i * n + k)] * b[size_t(k * rhs + r)];
      b[size_t(i * rhs + r)] = v / a[size_t(i * n + i)];
    }
    for (int64_t i = n - 1; i >= 0; --i) {
      double v = b[size_t(i * rhs + r)];
      for (int64_t k = i + 1; k < n; ++k) v -= a[size_t(k * n + i)] * b[size_t(k * rhs + r)];
      b[size_t(i * rhs + r)] = v / a[size_t(i * n + i)];
    }
  }
}

}  // namespace

LatentPreview LatentPreview::fit(const VaeDecoder& vae, Backend* device) {
  const VaeConfig& cfg = vae.config();
  const int64_t ch = cfg.latent_channels * cfg.patch * cfg.patch, s = cfg.pixels_per_token();
  const int64_t side = 16, grids = 2;
  Arena arena(size_t(64) << 20, false, device ? static_cast<Allocator&>(*device) : host_allocator());
  Context c{&arena, DType::f32};
  c.backend = device;
  Tensor tokens = Tensor::heap({grids * side * side, ch}, DType::f32);
  Deviates normal;
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.ptr<float>()[i] = normal.next();
  Tensor image = ops::empty(c, {grids, cfg.out_channels, side * s, side * s}, DType::f32);
  vae.decode(c, ops::to_context(c, tokens), side, side, image);
  return fit_to(tokens, to_f32_vector(ops::to_host(c, image)), side, s);
}

LatentPreview LatentPreview::fit_to(const Tensor& tokens, const std::vector<float>& images, int64_t side,
                                    int64_t pixels_per_token) {
  const int64_t ch = tokens.shape[1], count = tokens.shape[0], grid = side * side, s = pixels_per_token;
  const int64_t px = side * s, planes = int64_t(images.size()) / (px * px), grids = count / grid;
  APUS_CHECK(count % grid == 0 && planes == grids * (planes / grids) && planes / grids >= 3, "latent preview: ", count,
             " tokens and ", images.size(), " pixels are no grids of ", side, "x", side, " tokens");
  const int64_t colours = planes / grids;
  // Least squares of the 12 quarter colours on [token, 1], in double.
  const int64_t n = ch + 1, out = 12, half = s / 2;
  std::vector<double> ata(static_cast<size_t>(n * n), 0.0), atb(static_cast<size_t>(n * out), 0.0);
  std::vector<double> row(static_cast<size_t>(n)), target(static_cast<size_t>(out));
  for (int64_t t = 0; t < count; ++t) {
    const int64_t g = t / grid, ty = (t / side) % side, tx = t % side;
    for (int64_t k = 0; k < ch; ++k) row[size_t(k)] = tokens.ptr<float>()[t * ch + k];
    row[size_t(ch)] = 1;
    for (int q = 0; q < 4; ++q)
      for (int64_t colour = 0; colour < 3; ++colour) {
        double sum = 0;
        const int64_t y0 = ty * s + (q / 2) * half, x0 = tx * s + (q % 2) * half;
        for (int64_t y = y0; y < y0 + half; ++y)
          for (int64_t x = x0; x < x0 + half; ++x) sum += images[size_t(((g * colours + colour) * px + y) * px + x)];
        target[size_t(q * 3 + colour)] = sum / double(half * half);
      }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) ata[size_t(i * n + j)] += row[size_t(i)] * row[size_t(j)];
      for (int64_t o = 0; o < out; ++o) atb[size_t(i * out + o)] += row[size_t(i)] * target[size_t(o)];
    }
  }
  for (int64_t i = 0; i < ch; ++i) ata[size_t(i * n + i)] += 1e-6 * double(count);  // keeps it solvable
  solve_spd(ata, atb, n, out);
  LatentPreview p;
  p.channels_ = ch;
  p.bias_.resize(size_t(out));
  p.gain_.resize(size_t(out * ch));
  for (int64_t o = 0; o < out; ++o) {
    p.bias_[size_t(o)] = float(atb[size_t(ch * out + o)]);
    for (int64_t k = 0; k < ch; ++k) p.gain_[size_t(o * ch + k)] = float(atb[size_t(k * out + o)]);
  }
  return p;
}

Rgb8Image LatentPreview::image(const float* tokens, int64_t h, int64_t w) const {
  Rgb8Image out{int(2 * w), int(2 * h), std::vector<uint8_t>(size_t(12 * h * w))};
  for (int64_t t = 0; t < h * w; ++t) {
    const float* token = tokens + t * channels_;
    for (int q = 0; q < 4; ++q) {
      const int64_t y = 2 * (t / w) + q / 2, x = 2 * (t % w) + q % 2;
      for (int colour = 0; colour < 3; ++colour) {
        const float* g = gain_.data() + (q * 3 + colour) * channels_;
        float v = bias_[size_t(q * 3 + colour)];
        for (int64_t k = 0; k < channels_; ++k) v += g[k] * token[k];
        // [-1, 1] to 0..255 as the pipeline's postprocessing.
        const float level = std::clamp((v + 1.0f) * 127.5f, 0.0f, 255.0f);
        out.rgb[size_t((y * 2 * w + x) * 3 + colour)] = uint8_t(std::lround(level));
      }
    }
  }
  return out;
}

}  // namespace apus::flux2
