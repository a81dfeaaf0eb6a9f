#pragma once
// Shared helpers for the fixture-driven tests.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "core/error.h"
#include "core/tensor.h"
#include "io/model_dir.h"
#include "io/weights/safetensors.h"

namespace apus::test {

// f32 -> f16 bits, rounded to nearest even (normal and subnormal range; a carry out of the
// mantissa lands in the exponent, as it should). Not _Float16: clang 14 has it on no x86 target.
inline uint16_t f16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const float a = std::fabs(v);
  if (a == 0) return uint16_t(sign);
  if (a < 0x1p-14f) return uint16_t(sign | uint32_t(std::nearbyint(a * 0x1p24f)));  // subnormal
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const uint32_t mant = uint32_t(std::nearbyint((m * 2 - 1) * 1024));
  return uint16_t(sign | ((uint32_t(e - 1 + 15) << 10) + mant));
}

// This test process's scratch folder, below the one the run was given (gtest's TempDir():
// $TEST_TMPDIR, else $TMPDIR, else /tmp): made before any test runs and handed to every later
// ::testing::TempDir() through TEST_TMPDIR, and to the programs the tests start (the CLI, Chromium)
// through TMPDIR, so whatever they write lands inside it; removed with its contents when the process
// exits, so a run leaves nothing behind.
class ScratchDir {
 public:
  ScratchDir() : path_(::testing::TempDir() + "apus_tests_" + std::to_string(::getpid()) + "/") {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
    ::setenv("TEST_TMPDIR", path_.c_str(), 1);
    ::setenv("TMPDIR", path_.c_str(), 1);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};
inline const ScratchDir scratch_dir;

// The committed fixtures: the source tree's this binary was built from, or $APUS_FIXTURES_DIR for a
// binary run from another checkout (tools/device-check.sh runs a prebuilt bundle on a GPU machine).
inline std::string fixture(const std::string& rel) {
  static const std::string root = [] {
    const char* moved = std::getenv("APUS_FIXTURES_DIR");
    return std::string(moved && *moved ? moved : APUS_FIXTURES);
  }();
  return root + "/" + rel;
}

// A component folder's weights on the CPU.
inline WeightLoader weights_in(const std::string& dir) { return WeightLoader(open_weights(dir)); }

// A klein stage as the pipeline loads it: its component's config and weights in `dir`.
template <typename Model, typename... Rest>
Model load_stage(const ModelDir& dir, const std::string& component, Rest&&... rest) {
  return Model::load(dir.config(component), dir.weights(component), std::forward<Rest>(rest)...);
}

// ||a - b|| / ||b||
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The official code disagreeing with itself (bf16 run against fp32 run) sets the bf16 bound:
// our bf16 result may sit at most this many times as far from the fp32 reference.
constexpr double kBf16Factor = 2.0;

// How far two images' bytes are apart, in levels: the mean and the largest |a - b|.
struct LevelGap {
  double mean = 0;
  int worst = 0;
};
inline LevelGap level_gap(const uint8_t* a, const uint8_t* b, size_t n) {
  LevelGap g;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const int d = std::abs(int(a[i]) - int(b[i]));
    sum += d;
    g.worst = std::max(g.worst, d);
  }
  g.mean = n ? sum / double(n) : 0.0;
  return g;
}
inline LevelGap level_gap(const std::vector<uint8_t>& a, const Tensor& b) {
  EXPECT_EQ(a.size(), size_t(b.numel())) << "images of different sizes";
  return level_gap(a.data(), b.ptr<uint8_t>(), std::min(a.size(), size_t(b.numel())));
}
inline LevelGap level_gap(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel()) << "images of different sizes";
  return level_gap(a.ptr<uint8_t>(), b.ptr<uint8_t>(), size_t(std::min(a.numel(), b.numel())));
}
// fp32 parity: relative L2 against the fp32 reference.
constexpr double kFp32Tolerance = 1e-4;

struct Reference {
  SafetensorsFile file;
  Json meta;
  explicit Reference(const std::string& variant)
      : file(SafetensorsFile::open(fixture(variant + "_ref.safetensors"))),
        meta(read_json(fixture(variant + "_ref.json"))) {}
  std::vector<float> f32(const std::string& key) const { return to_f32_vector(file.get(key)); }
  std::vector<int64_t> i64(const std::string& key) const {
    const Tensor& t = file.get(key);
    return std::vector<int64_t>(t.ptr<int64_t>(), t.ptr<int64_t>() + t.numel());
  }
  // A fixture tensor as a heap tensor of `dt` with a 2-D shape.
  Tensor as(const std::string& key, DType dt, Shape shape) const {
    return to_dtype(file.get(key), dt).reshape(std::move(shape));
  }
};

// The oracle's fp32 request of klein `variant` from its own fp32 noise (staged as a file, removed
// with the object), and a render's mean level distance from the official fp32 image beside the
// official bf16 image's: how a tier is held to the official code's own disagreement.
class Fp32ImageRequest {
 public:
  explicit Fp32ImageRequest(const std::string& variant)
      : ref_(variant), noise_(::testing::TempDir() + variant + "_fp32_noise.safetensors") {
    write_safetensors(noise_, {{"noise", ref_.file.get("fp32.noise")}});
    request_.prompt = ref_.meta["prompt"].get<std::string>();
    request_.width = ref_.meta["width"].get<int>();
    request_.height = ref_.meta["height"].get<int>();
    request_.steps = ref_.meta["steps"].get<int>();
    request_.noise_file = noise_;
    request_.fp32 = true;
  }
  ~Fp32ImageRequest() { std::filesystem::remove(noise_); }
  const ImageRequest& request() const { return request_; }
  double gap(const std::vector<uint8_t>& rgb) const { return level_gap(rgb, ref_.file.get("fp32.image_u8")).mean; }
  double official_gap() const { return level_gap(ref_.file.get("bf16.image_u8"), ref_.file.get("fp32.image_u8")).mean; }

 private:
  Reference ref_;
  std::string noise_;
  ImageRequest request_;
};

// Expects apus::Error on one line whose message contains every fragment.
template <typename F, typename Fragments = std::initializer_list<std::string>>
void expect_error(F&& f, const Fragments& fragments) {
  try {
    f();
    ADD_FAILURE() << "no error raised";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "error spans lines: " << msg;
    for (const auto& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << msg;
  }
}

// What `f` was refused with: the message and the field it names ("(no field)" for a plain Error).
struct Refusal {
  std::string message, field;
};
template <typename F> Refusal refusal(F&& f) {
  try {
    f();
  } catch (const FieldError& e) {
    return {e.what(), e.field};
  } catch (const Error& e) {
    return {e.what(), "(no field)"};
  }
  return {"(nothing refused)", ""};
}

// A fresh random seed per test, printed so a failure can be replayed with APUS_TEST_SEED=N.
inline uint32_t test_seed() {
  const char* forced = std::getenv("APUS_TEST_SEED");
  const uint32_t seed = forced ? uint32_t(std::strtoul(forced, nullptr, 10)) : std::random_device{}();
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::printf("[ seed    ] %s.%s: APUS_TEST_SEED=%u\n", info ? info->test_suite_name() : "?", info ? info->name() : "?",
              seed);
  return seed;
}

// An n x k bf16 or f32 matrix of normal values (standard deviation 0.05, a linear's weights).
inline Tensor random_weight(int64_t n, int64_t k, DType dt, std::mt19937& rng) {
  Tensor w = Tensor::heap({n, k}, dt);
  std::normal_distribution<float> d(0.0f, 0.05f);
  for (int64_t i = 0; i < n * k; ++i) {
    const float v = d(rng);
    if (dt == DType::bf16) w.ptr<uint16_t>()[i] = f32_to_bf16(v);
    else w.ptr<float>()[i] = v;
  }
  return w;
}

// A klein request the tiny fixtures render in a blink: 64x48, 2 steps, `prompt` from `seed`.
inline ImageRequest small_image_request(const std::string& prompt, uint64_t seed) {
  ImageRequest r;
  r.prompt = prompt;
  r.seed = seed;
  r.steps = 2;
  r.width = 64;
  r.height = 48;
  return r;
}

// The apus CLI run through the shell (`prefix` runs first in the same shell, e.g. a ulimit).
struct CliRun {
  int status;          // exit status, or 128 + signal number when a signal ended it
  std::string output;  // stdout and stderr
};

inline CliRun run_cli(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = prefix + std::string(APUS_CLI) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  CliRun r{-1, ""};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  return r;
}

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Whether a sanitizer instruments this build (its shadow memory and quarantine change what memory
// measurements mean).
constexpr bool kSanitized =
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

// The longest clip a test reads back (read_audio's bound): longer than any the tests write.
constexpr double kTestClipSeconds = 60;

inline DType precision_dtype(const std::string& p) { return p == "fp32" ? DType::f32 : DType::bf16; }

// torch's (B, C, T) latents as the engine lays them out: [B*T, C] fp32, frames sample-major.
inline Tensor frames_major(const Tensor& z) {
  const int64_t batch = z.shape[0], ch = z.shape[1], frames = z.shape[2];
  Tensor out = Tensor::heap({batch * frames, ch}, DType::f32);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < ch; ++c)
      for (int64_t t = 0; t < frames; ++t)
        out.ptr<float>()[(b * frames + t) * ch + c] = load_f32(z, (b * ch + c) * frames + t);
  return out;
}

// Asserts the bound for one stage output; returns the measured error for the log.
inline void expect_matches(const std::string& what, const std::string& p, const std::vector<float>& ours,
                           const std::vector<float>& ref_fp32, const std::vector<float>& ref_bf16) {
  const double err = rel_l2(ours, ref_fp32);
  if (p == "fp32") {
    EXPECT_LT(err, kFp32Tolerance) << what << " fp32 rel L2 " << err;
    std::printf("[ measure ] %s fp32: rel L2 to fp32 ref %.3e\n", what.c_str(), err);
  } else {
    const double ref_disagreement = rel_l2(ref_bf16, ref_fp32);
    const double to_bf16_ref = rel_l2(ours, ref_bf16);
    EXPECT_LT(err, kBf16Factor * ref_disagreement)
        << what << " bf16 rel L2 to fp32 ref " << err << ", reference bf16-vs-fp32 " << ref_disagreement;
    EXPECT_LT(to_bf16_ref, kBf16Factor * ref_disagreement)
        << what << " bf16 rel L2 to bf16 ref " << to_bf16_ref << ", reference bf16-vs-fp32 " << ref_disagreement;
    std::printf("[ measure ] %s bf16: rel L2 to fp32 ref %.3e, to bf16 ref %.3e, ref bf16-vs-fp32 %.3e\n", what.c_str(),
                err, to_bf16_ref, ref_disagreement);
  }
}

}  // namespace apus::test
