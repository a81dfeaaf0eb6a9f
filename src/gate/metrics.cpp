#include "gate/metrics.h"

#include <algorithm>
#include <cmath>
#include <complex>

#include "core/error.h"

namespace apus {

namespace {

// BT.601 luma of every pixel, in [0, 255].
std::vector<double> luma(const Rgb8Image& im) {
  std::vector<double> y(size_t(im.width) * size_t(im.height));
  for (size_t i = 0; i < y.size(); ++i)
    y[i] = 0.299 * im.rgb[3 * i] + 0.587 * im.rgb[3 * i + 1] + 0.114 * im.rgb[3 * i + 2];
  return y;
}

// Mean SSIM over the positions where the whole 11x11 window fits (the image itself where smaller).
double ssim(const std::vector<double>& a, const std::vector<double>& b, int w, int h) {
  const int radius = std::min({5, (w - 1) / 2, (h - 1) / 2});
  std::vector<double> g(size_t(2 * radius + 1));
  double sum = 0;
  for (int i = -radius; i <= radius; ++i) sum += g[size_t(i + radius)] = std::exp(-(i * i) / (2 * 1.5 * 1.5));
  for (double& v : g) v /= sum;
  const double c1 = (0.01 * 255) * (0.01 * 255), c2 = (0.03 * 255) * (0.03 * 255);
  double total = 0;
  int64_t count = 0;
  for (int y = radius; y < h - radius; ++y)
    for (int x = radius; x < w - radius; ++x) {
      double ma = 0, mb = 0, saa = 0, sbb = 0, sab = 0;
      for (int dy = -radius; dy <= radius; ++dy)
        for (int dx = -radius; dx <= radius; ++dx) {
          const double k = g[size_t(dy + radius)] * g[size_t(dx + radius)];
          const size_t i = size_t(y + dy) * size_t(w) + size_t(x + dx);
          ma += k * a[i];
          mb += k * b[i];
          saa += k * a[i] * a[i];
          sbb += k * b[i] * b[i];
          sab += k * a[i] * b[i];
        }
      const double va = saa - ma * ma, vb = sbb - mb * mb, cov = sab - ma * mb;
      total += ((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma * ma + mb * mb + c1) * (va + vb + c2));
      ++count;
    }
  return count ? total / double(count) : 1.0;
}

double gmsd(const std::vector<double>& a, const std::vector<double>& b, int w, int h) {
  // Zeros pad an odd side (both sides grow by one, as piq pads), then a 2x2 average halves them.
  const int pad = (w % 2) | (h % 2), ww = (w + pad) / 2, hh = (h + pad) / 2;
  auto down = [&](const std::vector<double>& v) {
    auto at = [&](int x, int y) { return x < w && y < h ? v[size_t(y) * size_t(w) + size_t(x)] : 0.0; };
    std::vector<double> out(size_t(ww) * size_t(hh));
    for (int y = 0; y < hh; ++y)
      for (int x = 0; x < ww; ++x)
        out[size_t(y) * size_t(ww) + size_t(x)] =
            (at(2 * x, 2 * y) + at(2 * x + 1, 2 * y) + at(2 * x, 2 * y + 1) + at(2 * x + 1, 2 * y + 1)) / 4;
    return out;
  };
  const std::vector<double> da = down(a), db = down(b);
  // Prewitt filters (divided by 3) over zero padding.
  auto magnitude = [&](const std::vector<double>& v, int x, int y) {
    auto at = [&](int xx, int yy) {
      return xx < 0 || yy < 0 || xx >= ww || yy >= hh ? 0.0 : v[size_t(yy) * size_t(ww) + size_t(xx)];
    };
    double gx = 0, gy = 0;
    for (int d = -1; d <= 1; ++d) {
      gx += (at(x + 1, y + d) - at(x - 1, y + d)) / 3;
      gy += (at(x + d, y + 1) - at(x + d, y - 1)) / 3;
    }
    return std::sqrt(gx * gx + gy * gy);
  };
  const double c = 170;  // the paper's, for values in [0, 255]
  std::vector<double> gms;
  gms.reserve(size_t(ww) * size_t(hh));
  for (int y = 0; y < hh; ++y)
    for (int x = 0; x < ww; ++x) {
      const double ma = magnitude(da, x, y), mb = magnitude(db, x, y);
      gms.push_back((2 * ma * mb + c) / (ma * ma + mb * mb + c));
    }
  double mean = 0;
  for (double v : gms) mean += v;
  mean /= double(gms.size());
  double var = 0;
  for (double v : gms) var += (v - mean) * (v - mean);
  return std::sqrt(var / double(gms.size()));
}

// In-place iterative radix-2 FFT; the size a power of two.
void fft(std::vector<std::complex<double>>& a) {
  const size_t n = a.size();
  for (size_t i = 1, j = 0; i < n; ++i) {
    size_t bit = n >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) std::swap(a[i], a[j]);
  }
  for (size_t len = 2; len <= n; len <<= 1) {
    const double ang = -2 * M_PI / double(len);
    const std::complex<double> w(std::cos(ang), std::sin(ang));
    for (size_t i = 0; i < n; i += len) {
      std::complex<double> wk(1);
      for (size_t k = 0; k < len / 2; ++k, wk *= w) {
        const auto u = a[i + k], v = a[i + k + len / 2] * wk;
        a[i + k] = u + v;
        a[i + k + len / 2] = u - v;
      }
    }
  }
}

// |STFT| frames x (n/2 + 1) of one channel of interleaved audio, Hann window, hop n / 4.
std::vector<std::vector<double>> magnitudes(const std::vector<float>& x, int channels, int ch, size_t n) {
  const size_t frames_in = x.size() / size_t(channels), hop = n / 4;
  std::vector<std::vector<double>> out;
  for (size_t start = 0; start + n <= frames_in; start += hop) {
    std::vector<std::complex<double>> buf(n);
    for (size_t i = 0; i < n; ++i)
      buf[i] = double(x[(start + i) * size_t(channels) + size_t(ch)]) *
               (0.5 - 0.5 * std::cos(2 * M_PI * double(i) / double(n)));
    fft(buf);
    std::vector<double> mag(n / 2 + 1);
    for (size_t k = 0; k <= n / 2; ++k) mag[k] = std::abs(buf[k]);
    out.push_back(std::move(mag));
  }
  return out;
}

}  // namespace

ImageScores image_scores(const Rgb8Image& a, const Rgb8Image& ref) {
  APUS_CHECK(a.width == ref.width && a.height == ref.height && a.width > 0 && a.height > 0 &&
                 a.rgb.size() == size_t(a.width) * size_t(a.height) * 3 && ref.rgb.size() == a.rgb.size(),
             "image scores: ", a.width, "x", a.height, " against ", ref.width, "x", ref.height);
  ImageScores s;
  double se = 0;
  for (size_t i = 0; i < a.rgb.size(); ++i) se += (double(a.rgb[i]) - ref.rgb[i]) * (double(a.rgb[i]) - ref.rgb[i]);
  const double mse = se / double(a.rgb.size());
  s.psnr = mse == 0 ? 100.0 : std::min(100.0, 10 * std::log10(255.0 * 255.0 / mse));
  const std::vector<double> ya = luma(a), yb = luma(ref);
  s.ssim = ssim(ya, yb, a.width, a.height);
  s.gmsd = gmsd(ya, yb, a.width, a.height);
  return s;
}

AudioScores audio_scores(const std::vector<float>& a, const std::vector<float>& ref, int channels, int rate) {
  APUS_CHECK(channels > 0 && rate > 0 && a.size() == ref.size() && a.size() % size_t(channels) == 0,
             "audio scores: ", a.size(), " samples against ", ref.size(), " in ", channels, " channels");
  AudioScores d;
  const size_t sizes[] = {512, 256, 128};
  const double eps = 1e-7;
  for (size_t n : sizes) {
    double sc = 0, lm = 0;
    for (int ch = 0; ch < channels; ++ch) {
      const auto ma = magnitudes(a, channels, ch, n), mb = magnitudes(ref, channels, ch, n);
      double num = 0, den = 0, l1 = 0;
      size_t count = 0;
      for (size_t f = 0; f < ma.size(); ++f)
        for (size_t k = 0; k < ma[f].size(); ++k) {
          num += (ma[f][k] - mb[f][k]) * (ma[f][k] - mb[f][k]);
          den += mb[f][k] * mb[f][k];
          l1 += std::fabs(std::log(ma[f][k] + eps) - std::log(mb[f][k] + eps));
          ++count;
        }
      sc += std::sqrt(num / std::max(den, 1e-30));
      lm += l1 / double(std::max<size_t>(count, 1));
    }
    d.stft += (sc + lm) / double(channels) / double(std::size(sizes));
  }
  // Log-mel: 40 triangular bands up to Nyquist over the 512-point STFT.
  const size_t n = 512, bins = n / 2 + 1, bands = 40;
  auto mel = [](double hz) { return 2595.0 * std::log10(1.0 + hz / 700.0); };
  auto hz = [](double m) { return 700.0 * (std::pow(10.0, m / 2595.0) - 1.0); };
  std::vector<double> edges(bands + 2);
  for (size_t i = 0; i < edges.size(); ++i)
    edges[i] = hz(mel(0) + (mel(rate / 2.0) - mel(0)) * double(i) / double(bands + 1)) * double(n) / rate;
  double total = 0;
  size_t count = 0;
  for (int ch = 0; ch < channels; ++ch) {
    const auto ma = magnitudes(a, channels, ch, n), mb = magnitudes(ref, channels, ch, n);
    for (size_t f = 0; f < ma.size(); ++f)
      for (size_t m = 0; m < bands; ++m) {
        double ea = 0, eb = 0;
        for (size_t k = 0; k < bins; ++k) {
          const double x = double(k);
          const double w = x < edges[m] || x > edges[m + 2] ? 0
                           : x <= edges[m + 1]              ? (x - edges[m]) / std::max(edges[m + 1] - edges[m], 1e-9)
                                               : (edges[m + 2] - x) / std::max(edges[m + 2] - edges[m + 1], 1e-9);
          ea += w * ma[f][k] * ma[f][k];
          eb += w * mb[f][k] * mb[f][k];
        }
        total += std::fabs(std::log(ea + eps) - std::log(eb + eps));
        ++count;
      }
  }
  d.log_mel = total / double(std::max<size_t>(count, 1));
  return d;
}

}  // namespace apus
