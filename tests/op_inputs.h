#pragma once
// Op test inputs: fresh random values in the test's activation dtype from a seed the test prints
// (APUS_TEST_SEED replays it), and outputs poisoned so that one an op leaves unwritten shows.
#include <cmath>
#include <cstring>
#include <random>

#include "core/scaled_codes.h"
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
    if (is_code_format(dt)) {
      for (size_t i = 0; i < t.nbytes(); ++i) {
        if (dt == DType::fp8_e4m3 && (p[i] & 0x7f) == 0x7f) p[i] &= 0xfe;
        if (dt == DType::fp8_e5m2 && (p[i] & 0x7c) == 0x7c) p[i] &= 0xfb;  // off infinities and NaNs
      }
      // A checkpoint's per-tensor scale: every decode must apply it (codes up to 448 otherwise).
      const float largest = dt == DType::fp8_e5m2 ? 57344 : dt == DType::i8 ? 127 : dt == DType::fp4_e2m1 ? 6 : 448;
      t.encoding.code_scale = scale / largest * std::uniform_real_distribution<float>(1.0f, 2.0f)(rng);
      return t;
    }
    std::uniform_real_distribution<float> d(-scale / 8, scale / 8);
    const size_t bytes = dtype_block_bytes(dt);
    // Where each block keeps its f16 scale(s), as ggml-common.h lays the blocks out.
    const size_t at = dt == DType::q6_k ? 208 : 0;
    const int halves = dt == DType::q4_1 || dt == DType::q5_1 || dt == DType::q4_k || dt == DType::q5_k ? 2 : 1;
    for (size_t b = 0; b < t.nbytes() / bytes; ++b)
      for (int h = 0; h < halves; ++h) {
        const uint16_t f = test::f16_bits(h == 0 ? d(rng) : std::fabs(d(rng)) / 4);
        std::memcpy(p + b * bytes + at + 2 * h, &f, 2);
      }
    return t;
  }
  // Codes with a factor a block of `block` elements along each row, as ComfyUI stores them: one f32
  // a row (int8, block = the row), e8m0 (mxfp8, 32) or fp8 e4m3 (nvfp4, 16) in cuBLAS's tiles.
  // The factors spread over a factor of 4 or more, so a factor read from the wrong block shows.
  Tensor random_block_scaled(Shape s, DType codes, DType factors, int64_t block) {
    Tensor t = random_stored(s, codes);
    const int64_t rows = s[0], per_row = s[1] / block;
    const bool tiled = factors != DType::f32;
    Tensor f = Tensor::heap(tiled ? Shape{(rows + 127) / 128 * 128, (per_row + 3) / 4 * 4} : Shape{rows}, factors);
    std::uniform_int_distribution<int> exponent(125, 128);  // e8m0: 2^-2 .. 2^1
    std::uniform_real_distribution<float> spread(0.25f, 2.0f);
    for (int64_t i = 0; i < f.numel(); ++i) {
      if (factors == DType::e8m0) f.ptr<uint8_t>()[i] = uint8_t(exponent(rng));
      else if (factors == DType::fp8_e4m3) f.ptr<uint8_t>()[i] = uint8_t(0x30 + exponent(rng) % 16);  // 0.25 .. 0.94
      else f.ptr<float>()[i] = t.encoding.code_scale * spread(rng);
    }
    if (factors != DType::fp8_e4m3) t.encoding.code_scale = 1;  // only nvfp4 has a per-tensor factor beside its blocks
    auto b = std::make_shared<BlockScales>();
    b->factors = f;
    b->block = block;
    b->per_row = per_row;
    b->tiled = tiled;
    t.encoding.block_scales = std::move(b);
    return t;
  }
  // All bits set: NaN in f32 and bf16.
  // An output for inputs that hold NaN or infinities: every element a finite sentinel (1e30), so
  // that one an op leaves unwritten still shows.
  Tensor sentinel(Shape s) {
    Tensor t = Tensor::heap(std::move(s), act);
    for (int64_t i = 0; i < t.numel(); ++i) store(t, i, 1e30f);
    return t;
  }
  Tensor poisoned(Shape s, DType dt = DType(255)) {
    Tensor t = Tensor::heap(std::move(s), dt == DType(255) ? act : dt);
    std::memset(t.data, 0xff, t.nbytes());
    return t;
  }
  static Tensor clone(const Tensor& t) {
    Tensor c = Tensor::heap(t.shape, t.dtype);
    std::memcpy(c.data, t.data, t.nbytes());
    c.encoding = t.encoding;
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
