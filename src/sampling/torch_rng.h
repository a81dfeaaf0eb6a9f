#pragma once
// Bit-exact replica of torch's CPU normal sampler, so that `--seed S` reproduces the initial
// noise of `torch.randn(shape, generator=torch.Generator("cpu").manual_seed(S), dtype=D)`,
// which is how diffusers' randn_tensor draws FLUX.2 latents (D = the pipeline's dtype,
// bf16 for the usual bf16 checkpoints).  Verified against torch 2.9.1 with
// tests/fixtures/torch_randn.* (tools/oracle/make_rng_fixtures.py).
#include <cstdint>

namespace apus {

// torch picks the float32 Box-Muller kernel at build time of its CPU-capability variant:
// x86 builds for AVX2 and AVX-512 both use the 8-lane Cephes-style kernel (avx_mathfun),
// everything else (ATEN_CPU_CAPABILITY=default, non-x86 wheels) uses libm logf/cosf/sinf.
// The two disagree in the low bits of about 39% of float32 values (at most ~2e-6 absolute,
// measured over 1e5 samples); bf16 and the under-16-element path are the same on all of them.
enum class TorchFloatKernel { avx2, scalar };

// std::mt19937's stream (torch's CPU generator), with a bulk fill whose twist and tempering run
// over whole vectors: std::mt19937 makes one value at a time (5.7 ns a value on a 2-core Xeon,
// the sequential part of SAME's decoder noise).
class Mt19937 {
 public:
  explicit Mt19937(uint32_t seed);
  uint32_t operator()() {
    if (next_ == kWords) twist();
    return temper(state_[next_++]);
  }
  // The next n values, as n calls would give them.
  void fill(uint32_t* out, int64_t n);
  // A state word as the generator hands it out.
  static uint32_t temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
  }

 private:
  static constexpr int kWords = 624;
  void twist();

  uint32_t state_[kWords];
  int next_ = kWords;
};

class TorchGenerator {
 public:
  explicit TorchGenerator(uint64_t seed, TorchFloatKernel kernel = TorchFloatKernel::avx2);

  // torch.randn(n, dtype=torch.float32); consumes generator state exactly as torch does.
  void randn(float* out, int64_t n);
  // torch.randn(n, dtype=torch.bfloat16); `out` receives bf16 bit patterns.
  void randn_bf16(uint16_t* out, int64_t n);
  // torch.rand(n, dtype=torch.float32): one 24-bit uniform per element, in order.
  void rand(float* out, int64_t n);

  uint64_t initial_seed() const { return seed_; }

 private:
  uint32_t random32();
  // n float32 uniforms on [0, 1), one draw each, in order (torch.rand).
  void uniforms(float* out, int64_t n);
  uint64_t random64();
  // One N(0,1) sample of torch's double Box-Muller, which yields pairs and parks the
  // second value in the generator for the next call (across randn calls and dtypes).
  double normal_double();

  uint64_t seed_;
  TorchFloatKernel kernel_;
  // torch seeds its mt19937 with the low 32 bits of the seed using the standard
  // initialisation, so std::mt19937's stream is torch's.
  Mt19937 engine_;
  bool has_cached_normal_ = false;
  double cached_normal_ = 0.0;
};

}  // namespace apus
