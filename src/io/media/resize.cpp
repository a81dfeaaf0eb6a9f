#include "io/media/resize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace apus {

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // Pillow's PRECISION_BITS for 8-bit images

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= M_PI;
  return std::sin(x) / x;
}

double lanczos(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3.0) : 0.0; }

// One axis's taps as Pillow's precompute_coeffs and normalize_coeffs_8bpc make them: for output
// position i, the first source index, the count, and fixed-point weights (ksize per position).
struct Taps {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> weights;
};

Taps taps(int in_size, int out_size) {
  const double scale = double(in_size) / out_size;
  const double filter_scale = std::max(scale, 1.0), support = 3.0 * filter_scale;
  Taps t;
  t.ksize = int(std::ceil(support)) * 2 + 1;
  t.first.resize(size_t(out_size));
  t.count.resize(size_t(out_size));
  t.weights.assign(size_t(out_size) * size_t(t.ksize), 0);
  std::vector<double> k(size_t(t.ksize));
  for (int i = 0; i < out_size; ++i) {
    const double center = (i + 0.5) * scale, ss = 1.0 / filter_scale;
    int lo = int(center - support + 0.5);
    if (lo < 0) lo = 0;
    int hi = int(center + support + 0.5);
    if (hi > in_size) hi = in_size;
    const int n = hi - lo;
    double sum = 0.0;
    for (int x = 0; x < n; ++x) {
      k[size_t(x)] = lanczos((x + lo - center + 0.5) * ss);
      sum += k[size_t(x)];
    }
    for (int x = 0; x < n; ++x) {
      const double w = sum != 0.0 ? k[size_t(x)] / sum : k[size_t(x)];
      t.weights[size_t(i) * size_t(t.ksize) + size_t(x)] =
          int32_t(w < 0 ? -0.5 + w * (1 << kPrecisionBits) : 0.5 + w * (1 << kPrecisionBits));
    }
    t.first[size_t(i)] = lo;
    t.count[size_t(i)] = n;
  }
  return t;
}

void check_resize(const Rgb8Image& image, int width, int height) {
  APUS_CHECK(width > 0 && height > 0 && image.width > 0 && image.height > 0 &&
                 image.rgb.size() == size_t(image.width) * size_t(image.height) * 3,
             "resize: ", image.width, "x", image.height, " to ", width, "x", height);
}

uint8_t clip8(int64_t v) {
  if (v >= (int64_t(1) << kPrecisionBits << 8)) return 255;
  if (v <= 0) return 0;
  return uint8_t(v >> kPrecisionBits);
}

}  // namespace

Rgb8Image resize_lanczos(const Rgb8Image& image, int width, int height) {
  check_resize(image, width, height);
  const Taps h = taps(image.width, width), v = taps(image.height, height);
  // The horizontal pass covers only the rows the vertical one reads.
  const int row_first = v.first[0], row_last = v.first[size_t(height - 1)] + v.count[size_t(height - 1)];
  const bool horizontal = width != image.width, vertical = height != image.height;
  Rgb8Image mid;
  const Rgb8Image* src = &image;
  int offset = 0;  // source row of mid's row 0
  if (horizontal) {
    mid = {width, row_last - row_first, std::vector<uint8_t>(size_t(width) * size_t(row_last - row_first) * 3)};
    for (int y = 0; y < mid.height; ++y)
      for (int x = 0; x < width; ++x) {
        const int32_t* k = &h.weights[size_t(x) * size_t(h.ksize)];
        for (int c = 0; c < 3; ++c) {
          int64_t sum = int64_t(1) << (kPrecisionBits - 1);
          for (int i = 0; i < h.count[size_t(x)]; ++i)
            sum +=
                int64_t(image.rgb[(size_t(y + row_first) * size_t(image.width) + size_t(h.first[size_t(x)] + i)) * 3 +
                                  size_t(c)]) *
                k[i];
          mid.rgb[(size_t(y) * size_t(width) + size_t(x)) * 3 + size_t(c)] = clip8(sum);
        }
      }
    src = &mid;
    offset = row_first;
  }
  if (!vertical) return horizontal ? mid : image;
  Rgb8Image out{width, height, std::vector<uint8_t>(size_t(width) * size_t(height) * 3)};
  for (int y = 0; y < height; ++y) {
    const int32_t* k = &v.weights[size_t(y) * size_t(v.ksize)];
    for (int x = 0; x < width; ++x)
      for (int c = 0; c < 3; ++c) {
        int64_t sum = int64_t(1) << (kPrecisionBits - 1);
        for (int i = 0; i < v.count[size_t(y)]; ++i)
          sum += int64_t(src->rgb[(size_t(v.first[size_t(y)] + i - offset) * size_t(src->width) + size_t(x)) * 3 +
                                  size_t(c)]) *
                 k[i];
        out.rgb[(size_t(y) * size_t(width) + size_t(x)) * 3 + size_t(c)] = clip8(sum);
      }
  }
  return out;
}

namespace {

// The source index of each of `out` positions over `in`, as Pillow's ImagingScaleAffine steps it.
std::vector<int> nearest_taps(int in, int out) {
  const double step = double(in) / double(out);
  std::vector<int> at(static_cast<size_t>(out));
  double position = step * 0.5;
  for (int i = 0; i < out; ++i, position += step) at[size_t(i)] = std::min(in - 1, int(position));
  return at;
}

}  // namespace

Rgb8Image resize_nearest(const Rgb8Image& image, int width, int height) {
  check_resize(image, width, height);
  const std::vector<int> xs = nearest_taps(image.width, width), ys = nearest_taps(image.height, height);
  Rgb8Image out{width, height, std::vector<uint8_t>(size_t(width) * size_t(height) * 3)};
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x)
      std::copy_n(&image.rgb[(size_t(ys[size_t(y)]) * size_t(image.width) + size_t(xs[size_t(x)])) * 3], 3,
                  &out.rgb[(size_t(y) * size_t(width) + size_t(x)) * 3]);
  return out;
}

Rgb8Image pasted(const Rgb8Image& image, int width, int height, int x, int y) {
  Rgb8Image out{width, height, std::vector<uint8_t>(size_t(width) * size_t(height) * 3, 0)};
  for (int row = std::max(0, y); row < std::min(height, y + image.height); ++row)
    for (int col = std::max(0, x); col < std::min(width, x + image.width); ++col)
      std::copy_n(&image.rgb[(size_t(row - y) * size_t(image.width) + size_t(col - x)) * 3], 3,
                  &out.rgb[(size_t(row) * size_t(width) + size_t(col)) * 3]);
  return out;
}

}  // namespace apus
