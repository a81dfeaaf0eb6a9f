// apus::TorchGenerator against real torch.randn output (tools/oracle/make_rng_fixtures.py).
// Every case must match bit for bit: the initial noise decides the whole image.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/weights/safetensors.h"
#include "sampling/draws_ahead.h"
#include "sampling/torch_rng.h"
#include "test_util.h"

namespace {

using apus::TorchFloatKernel;
using apus::TorchGenerator;

const std::string kFixtures = APUS_FIXTURES;

struct Case {
  std::string key, dtype, sequence, kernel;
  uint64_t seed = 0;
  int64_t numel = 0;
  int draw = 0;
  bool successive = false;
};

std::vector<Case> load_index() {
  std::ifstream f(kFixtures + "/torch_randn.json");
  EXPECT_TRUE(f.good()) << "missing torch_randn.json; run tools/oracle/make_rng_fixtures.py";
  std::vector<Case> cases;
  if (!f.good()) return cases;
  const auto j = nlohmann::json::parse(f);
  for (const auto& c : j.at("cases")) {
    Case k;
    k.key = c.at("key");
    k.seed = c.at("seed").get<uint64_t>();
    k.numel = c.at("numel");
    k.dtype = c.at("dtype");
    k.successive = c.at("successive");
    k.sequence = c.at("sequence");
    k.draw = c.at("draw");
    k.kernel = c.at("kernel");
    cases.push_back(k);
  }
  return cases;
}

// Draws `c` from `g` and compares its bit patterns with the recorded tensor; reports the
// first differing index, the values there, and how many differ in all.
void check_draw(TorchGenerator& g, const Case& c, const apus::SafetensorsFile& st) {
  SCOPED_TRACE("case " + c.key);
  const apus::Tensor& ref = st.get(c.key);
  ASSERT_EQ(ref.numel(), c.numel);
  std::vector<uint32_t> want(c.numel), got(c.numel);
  std::vector<float> want_f(c.numel), got_f(c.numel);
  if (c.dtype == "f32") {
    ASSERT_EQ(ref.dtype, apus::DType::f32);
    g.randn(got_f.data(), c.numel);
    std::memcpy(want_f.data(), ref.data, c.numel * 4);
    for (int64_t i = 0; i < c.numel; ++i) {
      std::memcpy(&want[i], &want_f[i], 4);
      std::memcpy(&got[i], &got_f[i], 4);
    }
  } else {
    ASSERT_EQ(c.dtype, "bf16");
    ASSERT_EQ(ref.dtype, apus::DType::bf16);
    std::vector<uint16_t> out(c.numel);
    g.randn_bf16(out.data(), c.numel);
    const auto* r = static_cast<const uint16_t*>(ref.data);
    for (int64_t i = 0; i < c.numel; ++i) {
      want[i] = r[i];
      got[i] = out[i];
      want_f[i] = apus::bf16_to_f32(r[i]);
      got_f[i] = apus::bf16_to_f32(out[i]);
    }
  }
  int64_t first = -1, count = 0;
  for (int64_t i = 0; i < c.numel; ++i) {
    if (want[i] != got[i]) {
      if (first < 0) first = i;
      ++count;
    }
  }
  EXPECT_EQ(count, 0) << "first mismatch at index " << first << ": got " << got_f[first] << " (0x" << std::hex
                      << got[first] << "), torch " << std::dec << want_f[first] << " (0x" << std::hex << want[first]
                      << ")" << std::dec << "; " << count << " of " << c.numel << " differ";
}

TEST(TorchRng, MatchesTorchRandnBitExact) {
  const auto cases = load_index();
  ASSERT_FALSE(cases.empty());
  const auto st = apus::SafetensorsFile::open(kFixtures + "/torch_randn.safetensors");

  // Draws of one sequence share a generator and are replayed in order.
  std::map<std::string, std::vector<Case>> sequences;
  for (const auto& c : cases) sequences[c.sequence].push_back(c);
  int checked = 0, successive = 0;
  for (auto& [name, draws] : sequences) {
    SCOPED_TRACE("sequence " + name);
    std::sort(draws.begin(), draws.end(), [](const Case& a, const Case& b) { return a.draw < b.draw; });
    const auto kernel = draws.front().kernel == "scalar" ? TorchFloatKernel::scalar : TorchFloatKernel::avx2;
    TorchGenerator g(draws.front().seed, kernel);
    for (const auto& c : draws) {
      ASSERT_EQ(c.seed, draws.front().seed);
      check_draw(g, c, st);
      ++checked;
      successive += c.successive;
    }
  }
  EXPECT_EQ(checked, int(cases.size()));
  EXPECT_GT(successive, 0);
}

// apus's Mt19937 is std::mt19937's stream (torch's generator): single draws and bulk fills of
// random lengths, interleaved, across many twists, from a fresh seed (printed) and the standard's
// default one (its 10000th value is fixed by the standard).
TEST(TorchRng, Mt19937IsTheStandardsStream) {
  for (const uint32_t seed : {uint32_t(apus::test::test_seed()), 5489u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    apus::Mt19937 mine(seed);
    std::mt19937 standard(seed), lengths(seed ^ 0x5eedu);
    std::vector<uint32_t> got;
    int64_t drawn = 0;
    while (drawn < 200000) {
      const int64_t n = std::uniform_int_distribution<int64_t>(0, 2500)(lengths);
      if (n % 3 == 0) {
        got.push_back(mine());
        ++drawn;
        ASSERT_EQ(got.back(), standard()) << "single draw " << drawn;
        continue;
      }
      got.resize(size_t(n));
      mine.fill(got.data(), n);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(i)], standard()) << "fill of " << n << " at " << drawn + i;
      drawn += n;
      got.clear();
    }
  }
  apus::Mt19937 fixed(5489u);
  std::vector<uint32_t> first(10000);
  fixed.fill(first.data(), 10000);
  EXPECT_EQ(first.back(), 4123659995u);
}

// torch keeps only the low 32 bits of the seed for its mt19937.
TEST(TorchRng, SeedUsesLow32Bits) {
  TorchGenerator a(7), b((uint64_t(1) << 32) + 7);
  std::vector<float> x(40), y(40);
  a.randn(x.data(), 40);
  b.randn(y.data(), 40);
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), 40 * sizeof(float)));
}

TEST(TorchRng, EmptyDrawLeavesStateAlone) {
  TorchGenerator a(3), b(3);
  std::vector<float> x(20), y(20);
  a.randn(x.data(), 0);
  a.randn(x.data(), 20);
  b.randn(y.data(), 20);
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), 20 * sizeof(float)));
}

// Draws made ahead on their own thread are the generator's own, in order, after the skipped ones,
// with a budget smaller than one draw (each waits for the previous to be taken) and larger.
TEST(DrawsAhead, AreTheGeneratorsDrawsAfterTheSkippedOnes) {
  const uint32_t seed = apus::test::test_seed();
  const std::vector<int64_t> skip = {5, 70000}, sizes = {17, 100003, 3, 65536};
  for (const int64_t budget : {int64_t(10), int64_t(1) << 20}) {
    TorchGenerator direct(seed), source(seed);
    std::vector<float> scratch(70000);
    source.randn(scratch.data(), 9);  // the caller's own draws before; the copy starts after them
    direct.randn(scratch.data(), 9);
    apus::DrawsAhead ahead(source, skip, sizes, budget);
    for (const int64_t n : skip) direct.randn(scratch.data(), n);
    for (const int64_t n : sizes) {
      std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n), -1.0f);
      direct.randn(want.data(), n);
      ahead.take(got.data(), n);
      ASSERT_EQ(0, std::memcmp(want.data(), got.data(), size_t(n) * sizeof(float)))
          << n << " values, budget " << budget;
    }
  }
}

TEST(DrawsAhead, AnUnplannedDrawIsRefusedAndAnUntakenOneStops) {
  apus::DrawsAhead ahead(TorchGenerator(1), {}, {100, 200}, 1);
  std::vector<float> out(300);
  apus::test::expect_error([&] { ahead.take(out.data(), 99); }, {"draw 1 asked for 99 values, planned 100"});
  ahead.take(out.data(), 100);
  // The second draw is never taken: destruction stops the thread without waiting for a taker.
}

}  // namespace
