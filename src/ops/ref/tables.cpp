// Tables, gathers and re-layouts, element by element.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/ref/ref_ops.h"

namespace apus::ref {

void rope_tables(Context& c, const Tensor& positions, const std::vector<int64_t>& axes, double theta,
                 ops::RopeMath math, Tensor& cos, Tensor& sin) {
  for (int64_t r = 0; r < positions.shape[0]; ++r) {
    int64_t j = 0;
    for (size_t a = 0; a < axes.size(); ++a) {
      const int64_t d = axes[a];
      const float p = float(positions.ptr<int64_t>()[r * int64_t(axes.size()) + int64_t(a)]);
      for (int64_t i = 0; i < d / 2; ++i, ++j) {
        // The f32 convention is float arithmetic by definition (transformers' inv_freq).
        const double angle = math == ops::RopeMath::f32
                                 ? double(p * (1.0f / std::pow(float(theta), float(2 * i) / float(d))))
                                 : double(p) * (1.0 / std::pow(theta, double(2 * i) / double(d)));
        put(cos, r, j, math == ops::RopeMath::f32 ? double(std::cos(float(angle))) : std::cos(angle));
        put(sin, r, j, math == ops::RopeMath::f32 ? double(std::sin(float(angle))) : std::sin(angle));
      }
    }
  }
}

void timestep_embedding(Context& c, float t, Tensor& y) {
  const int64_t half = y.shape[1] / 2;
  for (int64_t i = 0; i < half; ++i) {
    // The angle is float32 arithmetic by definition (diffusers' get_timestep_embedding): an ulp
    // of the frequency moves it by t ulps, so the reference computes it the same way.
    const float arg = t * std::exp(-std::log(10000.0f) * float(i) / float(half));
    put(y, 0, i, std::cos(double(arg)));
    put(y, 0, half + i, std::sin(double(arg)));
  }
}

void fourier_features(Context& c, float t, const Tensor& freqs, Tensor& y) {
  const Tensor f = rows2d(freqs);
  const int64_t half = f.shape[1];
  for (int64_t i = 0; i < half; ++i) {
    // The angle is float32 arithmetic by definition (`t * freqs * 2.0 * math.pi` on fp32 tensors).
    const float a = t * float(get(f, 0, i)) * 2.0f * 3.14159265358979323846f;
    put(y, 0, i, std::cos(double(a)));
    put(y, 0, half + i, std::sin(double(a)));
  }
}

void embedding(Context& c, const Tensor& table, const Tensor& ids, Tensor& y) {
  for (int64_t r = 0; r < ids.numel(); ++r) {
    const int32_t id = ids.ptr<int32_t>()[r];
    APUS_CHECK(id >= 0 && id < table.shape[0], "embedding: token id ", id, " outside the table");
    for (int64_t i = 0; i < table.shape[1]; ++i) put(y, r, i, get(table, id, i));
  }
}

void affine(Context& c, const Tensor& x, const Tensor& scale, const Tensor& shift, Tensor& y, ops::Rounding rounding) {
  const Tensor sc = rows2d(scale), sh = rows2d(shift);
  for (int64_t r = 0; r < x.shape[0]; ++r)
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      const double p = get(x, r, i) * get(sc, 0, i);
      put(y, r, i, (rounding == ops::Rounding::each_step ? as(y.dtype, p) : p) + get(sh, 0, i));
    }
}

void permute(Context& c, const Tensor& x, Tensor& y, const std::vector<int>& perm) {
  const int rank = x.rank();
  const size_t es = dtype_size(x.dtype);
  std::vector<int64_t> index(size_t(rank), 0);
  for (int64_t out = 0; out < y.numel(); ++out) {
    // index holds y's multi-index; x's is the same values in x's axis order.
    int64_t src = 0;
    for (int a = 0; a < rank; ++a) {
      int64_t stride = 1;
      for (int b = a + 1; b < rank; ++b) stride *= x.shape[size_t(b)];
      int64_t coord = 0;
      for (int i = 0; i < rank; ++i)
        if (perm[size_t(i)] == a) coord = index[size_t(i)];
      src += coord * stride;
    }
    std::memcpy(static_cast<char*>(y.data) + size_t(out) * es, static_cast<const char*>(x.data) + size_t(src) * es, es);
    for (int i = rank - 1; i >= 0; --i) {
      if (++index[size_t(i)] < y.shape[size_t(i)]) break;
      index[size_t(i)] = 0;
    }
  }
}

void image_to_rgb8(Context& c, const Tensor& image, Tensor& rgb) {
  const int64_t h = image.shape[2], w = image.shape[3];
  const Tensor planes = image.reshape({3 * h, w});
  for (int64_t ch = 0; ch < 3; ++ch)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x) {
        const double v = get(planes, ch * h + y, x);
        APUS_CHECK(std::isfinite(v), "image_to_rgb8: a pixel is not finite");
        const double unit = std::clamp(as(image.dtype, as(image.dtype, v * 0.5) + 0.5), 0.0, 1.0);
        rgb.ptr<uint8_t>()[(y * w + x) * 3 + ch] = uint8_t(std::nearbyint(float(unit) * 255.0f));
      }
}

}  // namespace apus::ref
