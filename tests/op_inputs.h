#pragma once
// Op test inputs: fresh random values in the test's activation dtype from a seed the test prints
// (APUS_TEST_SEED replays it), and outputs poisoned so that one an op leaves unwritten shows.
#include <cmath>
#include <cstring>
#include <random>

#include "core/tensor.h"
#include "test_util.h"

namespace apus::test {

class OpInputs {
 public:
  explicit OpInputs(DType act) : act(act) {}

  // Normal values of standard deviation `scale`, stored in `dt` (the activation dtype by default).
  Tensor random(Shape s, float scale = 1.0f, DType dt = DType(255)) {
    if (dt == DType(255)) dt = act;
    Tensor t = Tensor::heap(std::move(s), dt);
    std::normal_distribution<float> dist(0.0f, scale);
    for (int64_t i = 0; i < t.numel(); ++i) store(t, i, dist(rng));
    return t;
  }
  // Random bytes in a block format's layout (or fp8 e4m3), each block's f16 scales set to finite
  // values near `scale` / 8 and fp8 codes kept off NaN: every bit of the packing is exercised.
  Tensor random_stored(Shape s, DType dt, float scale = 0.1f) {
    Tensor t = Tensor::heap(std::move(s), dt);
    auto* p = t.ptr<uint8_t>();
    std::uniform_int_distribution<int> byte(0, 255);
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(byte(rng));
    if (dt == DType::fp8_e4m3) {
      for (size_t i = 0; i < t.nbytes(); ++i)
        if ((p[i] & 0x7f) == 0x7f) p[i] &= 0xfe;
      // A checkpoint's per-tensor scale: every decode must apply it (values up to 448 otherwise).
      t.fp8_scale = scale * std::uniform_real_distribution<float>(0.002f, 0.004f)(rng);
      return t;
    }
    std::uniform_real_distribution<float> d(-scale / 8, scale / 8);
    const size_t bytes = dtype_block_bytes(dt);
    // Where each block keeps its f16 scale(s), as ggml-common.h lays the blocks out.
    const size_t at = dt == DType::q6_k ? 208 : 0;
    const int halves = dt == DType::q4_1 || dt == DType::q5_1 || dt == DType::q4_k || dt == DType::q5_k ? 2 : 1;
    for (size_t b = 0; b < t.nbytes() / bytes; ++b)
      for (int h = 0; h < halves; ++h) {
        const _Float16 f = _Float16(h == 0 ? d(rng) : std::fabs(d(rng)) / 4);
        std::memcpy(p + b * bytes + at + 2 * h, &f, 2);
      }
    return t;
  }
  // All bits set: NaN in f32 and bf16.
  Tensor poisoned(Shape s, DType dt = DType(255)) {
    Tensor t = Tensor::heap(std::move(s), dt == DType(255) ? act : dt);
    std::memset(t.data, 0xff, t.nbytes());
    return t;
  }
  static Tensor clone(const Tensor& t) {
    Tensor c = Tensor::heap(t.shape, t.dtype);
    std::memcpy(c.data, t.data, t.nbytes());
    c.fp8_scale = t.fp8_scale;
    return c;
  }
  // Element i of an f32 or bf16 tensor set to v (rounded to bf16 there).
  static void store(Tensor& t, int64_t i, float v) {
    if (t.dtype == DType::bf16) t.ptr<uint16_t>()[i] = f32_to_bf16(v);
    else t.ptr<float>()[i] = v;
  }

  DType act;
  std::mt19937 rng{test_seed()};
};

}  // namespace apus::test
