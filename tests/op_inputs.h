#pragma once
// Op test inputs: fresh random values in the test's activation dtype from a seed the test prints
// (APUS_TEST_SEED replays it), and outputs poisoned so that one an op leaves unwritten shows.
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
  // All bits set: NaN in f32 and bf16.
  Tensor poisoned(Shape s, DType dt = DType(255)) {
    Tensor t = Tensor::heap(std::move(s), dt == DType(255) ? act : dt);
    std::memset(t.data, 0xff, t.nbytes());
    return t;
  }
  static Tensor clone(const Tensor& t) {
    Tensor c = Tensor::heap(t.shape, t.dtype);
    std::memcpy(c.data, t.data, t.nbytes());
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
