// What a server's rank 0 hands the other ranks and they hand back (dist/requests.h), how the ranks
// of a split stop together (pipeline/split.h StepAgreement) and a batch split's ranks, without
// MPI: tests/mpi/serve.sh runs them over real ranks.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "dist/requests.h"
#include "pipeline/registry.h"
#include "pipeline/split.h"
#include "test_util.h"
#include "thread_ranks.h"

namespace apus {
namespace {

struct Draw {
  std::mt19937 rng{test::test_seed()};
  int number(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
  float real() { return std::uniform_real_distribution<float>(-10, 10)(rng); }
  std::string text() {
    std::string s(size_t(number(0, 40)), ' ');
    for (char& c : s) c = char(number(1, 255));  // any byte but NUL, non-ASCII included
    return s;
  }
  Rgb8Image image() {
    Rgb8Image im{number(1, 9), number(1, 9), {}};
    for (int i = 0; i < im.width * im.height * 3; ++i) im.rgb.push_back(uint8_t(number(0, 255)));
    return im;
  }
  AudioClip clip() {
    AudioClip c{number(8000, 48000), number(1, 2), {}};
    for (int i = 0; i < number(1, 50); ++i) c.samples.push_back(real());
    return c;
  }
  std::vector<Lora> loras() {
    std::vector<Lora> l;
    for (int i = 0; i < number(0, 3); ++i) l.push_back({text(), real()});
    return l;
  }
};

void expect_same(const Rgb8Image& a, const Rgb8Image& b) {
  EXPECT_EQ(a.width, b.width);
  EXPECT_EQ(a.height, b.height);
  EXPECT_EQ(a.rgb, b.rgb);
}
void expect_same(const AudioClip& a, const AudioClip& b) {
  EXPECT_EQ(a.sample_rate, b.sample_rate);
  EXPECT_EQ(a.channels, b.channels);
  EXPECT_EQ(a.samples, b.samples);
}
void expect_same(const std::vector<Lora>& a, const std::vector<Lora>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].file, b[i].file);
    EXPECT_EQ(a[i].scale, b[i].scale);
  }
}

TEST(RankRequests, ImageRequestsCrossWithEverySetting) {
  Draw d;
  std::vector<ImageRequest> sent(size_t(d.number(1, 3)));
  const std::atomic<bool> asked{false};
  for (size_t i = 0; i < sent.size(); ++i) {
    ImageRequest& r = sent[i];
    r.prompt = d.text();
    if (d.number(0, 1)) r.width = d.number(16, 4096);
    if (d.number(0, 1)) r.height = d.number(16, 4096);
    for (int k = d.number(0, 2); k > 0; --k) r.references.push_back(d.image());
    if (d.number(0, 1)) r.inpaint = Inpainting{d.image(), d.image(), double(d.real())};
    if (d.number(0, 1)) r.steps = d.number(1, 200);
    if (d.number(0, 1)) r.cfg = d.real();
    if (d.number(0, 1)) r.negative_prompt = d.text();
    if (d.number(0, 1)) r.seed = (uint64_t(d.rng()) << 32) | d.rng();
    r.noise_index = d.number(0, 63);
    r.noise_file = d.text();
    r.fp32 = d.number(0, 1);
    r.trace = d.number(0, 1);
    r.loras = d.loras();
    if (i == 0 || d.number(0, 1)) r.preview = [](const Preview&) {};
    if (i == 0 || d.number(0, 1)) r.finish_steps = &asked;
  }
  const std::atomic<bool> here{false};
  const std::vector<ImageRequest> got = dist::decode_images(dist::encode(sent), &here);
  ASSERT_EQ(got.size(), sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    const ImageRequest &a = sent[i], &b = got[i];
    EXPECT_EQ(a.prompt, b.prompt);
    EXPECT_EQ(a.width, b.width);
    EXPECT_EQ(a.height, b.height);
    ASSERT_EQ(a.references.size(), b.references.size());
    for (size_t k = 0; k < a.references.size(); ++k) expect_same(a.references[k], b.references[k]);
    ASSERT_EQ(a.inpaint.has_value(), b.inpaint.has_value());
    if (a.inpaint) {
      expect_same(a.inpaint->image, b.inpaint->image);
      expect_same(a.inpaint->mask, b.inpaint->mask);
      EXPECT_EQ(a.inpaint->strength, b.inpaint->strength);
    }
    EXPECT_EQ(a.steps, b.steps);
    EXPECT_EQ(a.cfg, b.cfg);
    EXPECT_EQ(a.negative_prompt, b.negative_prompt);
    EXPECT_EQ(a.seed, b.seed);
    EXPECT_EQ(a.noise_index, b.noise_index);
    EXPECT_EQ(a.noise_file, b.noise_file);
    EXPECT_EQ(a.fp32, b.fp32);
    EXPECT_EQ(a.trace, b.trace);
    expect_same(a.loras, b.loras);
    EXPECT_EQ(bool(a.preview), bool(b.preview));
    EXPECT_EQ(b.finish_steps, a.finish_steps ? &here : nullptr);
    EXPECT_EQ(b.parallel.strategy, Parallel::none);
  }
}

TEST(RankRequests, AudioRequestsCrossWithEverySetting) {
  Draw d;
  std::vector<AudioRequest> sent(size_t(d.number(1, 3)));
  for (size_t i = 0; i < sent.size(); ++i) {
    AudioRequest& r = sent[i];
    r.prompt = d.text();
    if (d.number(0, 1)) r.seconds = d.real();
    if (d.number(0, 1)) r.steps = d.number(1, 200);
    if (d.number(0, 1)) r.seed = d.rng();
    r.fp32 = d.number(0, 1);
    if (d.number(0, 1)) r.chunked_decode = d.number(0, 1);
    if (d.number(0, 1)) r.cfg = d.real();
    r.apg = d.real();
    if (d.number(0, 1)) r.negative_prompt = d.text();
    if (i == 0 || d.number(0, 1)) r.init_audio = d.clip();
    if (d.number(0, 1)) r.init_noise_level = d.real();
    if (i == 0 || d.number(0, 1)) r.inpaint_audio = d.clip();
    for (int k = d.number(0, 3); k > 0; --k) r.inpaint_regions.emplace_back(d.real(), d.real());
    r.trace = d.number(0, 1);
    r.loras = d.loras();
    if (d.number(0, 1)) r.preview = [](const Preview&) {};
  }
  const std::vector<AudioRequest> got = dist::decode_audio(dist::encode(sent), nullptr);
  ASSERT_EQ(got.size(), sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    const AudioRequest &a = sent[i], &b = got[i];
    EXPECT_EQ(a.prompt, b.prompt);
    EXPECT_EQ(a.seconds, b.seconds);
    EXPECT_EQ(a.steps, b.steps);
    EXPECT_EQ(a.seed, b.seed);
    EXPECT_EQ(a.fp32, b.fp32);
    EXPECT_EQ(a.chunked_decode, b.chunked_decode);
    EXPECT_EQ(a.cfg, b.cfg);
    EXPECT_EQ(a.apg, b.apg);
    EXPECT_EQ(a.negative_prompt, b.negative_prompt);
    for (const auto& [x, y] : {std::pair{&a.init_audio, &b.init_audio}, {&a.inpaint_audio, &b.inpaint_audio}}) {
      ASSERT_EQ(x->has_value(), y->has_value());
      if (*x) expect_same(**x, **y);
    }
    EXPECT_EQ(a.init_noise_level, b.init_noise_level);
    EXPECT_EQ(a.inpaint_regions, b.inpaint_regions);
    EXPECT_EQ(a.trace, b.trace);
    expect_same(a.loras, b.loras);
    EXPECT_EQ(bool(a.preview), bool(b.preview));
  }
}

TEST(RankRequests, ACutOrPaddedMessageIsRefused) {
  Draw d;
  const std::string bytes = dist::encode(std::vector<ImageRequest>{{.prompt = d.text(), .loras = d.loras()}});
  const size_t cut = size_t(d.number(0, int(bytes.size()) - 1));
  std::printf("cut at %zu of %zu bytes\n", cut, bytes.size());
  EXPECT_THROW(dist::decode_images(bytes.substr(0, cut), nullptr), Error);
  EXPECT_THROW(dist::decode_images(bytes + "x", nullptr), Error);
}

std::vector<StageTime> stages(Draw& d) {
  std::vector<StageTime> s;
  for (int i = 0; i < d.number(0, 4); ++i) s.push_back({d.text(), d.text(), double(d.real())});
  return s;
}
void expect_same(const std::vector<StageTime>& a, const std::vector<StageTime>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].stage, b[i].stage);
    EXPECT_EQ(a[i].seconds, b[i].seconds);
  }
}

// What a rank hands rank 0 under a server's batch split: every member of every result, appended
// after the results already there (rank 0 gathers rank after rank).
TEST(RankResults, ImageAndAudioResultsCrossWithEveryMember) {
  Draw d;
  std::vector<ImageResult> images(size_t(d.number(0, 3)));
  for (ImageResult& r : images) {
    const Rgb8Image im = d.image();
    r = {im.width,         im.height,        uint64_t(d.number(0, 1 << 30)) << 20,
         d.number(1, 200), d.number(1, 200), d.real(),
         im.rgb,           stages(d),        d.text()};
  }
  std::vector<ImageResult> got(1);
  dist::decode(dist::encode(images), got);
  ASSERT_EQ(got.size(), images.size() + 1);
  for (size_t i = 0; i < images.size(); ++i) {
    const ImageResult &a = images[i], &b = got[i + 1];
    EXPECT_EQ(a.width, b.width);
    EXPECT_EQ(a.height, b.height);
    EXPECT_EQ(a.seed, b.seed);
    EXPECT_EQ(a.steps, b.steps);
    EXPECT_EQ(a.steps_run, b.steps_run);
    EXPECT_EQ(a.cfg, b.cfg);
    EXPECT_EQ(a.rgb, b.rgb);
    EXPECT_EQ(a.trace, b.trace);
    expect_same(a.stages, b.stages);
  }
  std::vector<AudioResult> clips(size_t(d.number(0, 3)));
  for (AudioResult& r : clips) {
    const AudioClip c = d.clip();
    r = {c.sample_rate,    c.channels, c.samples, uint64_t(d.number(0, 1 << 30)) << 20,
         d.number(0, 300), stages(d),  d.text()};
  }
  std::vector<AudioResult> heard;
  dist::decode(dist::encode(clips), heard);
  ASSERT_EQ(heard.size(), clips.size());
  for (size_t i = 0; i < clips.size(); ++i) {
    const AudioResult &a = clips[i], &b = heard[i];
    EXPECT_EQ(a.sample_rate, b.sample_rate);
    EXPECT_EQ(a.channels, b.channels);
    EXPECT_EQ(a.samples, b.samples);
    EXPECT_EQ(a.seed, b.seed);
    EXPECT_EQ(a.prompt_tokens, b.prompt_tokens);
    EXPECT_EQ(a.trace, b.trace);
    expect_same(a.stages, b.stages);
  }
  const std::string bytes = dist::encode(std::vector<AudioResult>{clips.empty() ? AudioResult{} : clips[0]});
  const size_t cut = size_t(d.number(0, int(bytes.size()) - 1));
  std::printf("cut at %zu of %zu bytes\n", cut, bytes.size());
  EXPECT_THROW(dist::decode(bytes.substr(0, cut), heard), Error);
  EXPECT_THROW(dist::decode(bytes + "x", heard), Error);
}

// Two ranks in one process: rank 0 here, the other rank's flags as given.
class TwoRanks final : public ProcessGroup {
 public:
  uint8_t other_stop = 0, other_finish = 0;
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void all_gather(void* data, const std::vector<size_t>& bytes, const char*) const override {
    EXPECT_EQ(bytes, std::vector<size_t>({2, 2}));
    uint8_t* d = static_cast<uint8_t*>(data);
    d[2] = other_stop, d[3] = other_finish;
  }
  void all_to_all(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&,
                  const char*) const override {
    ADD_FAILURE() << "agreeing flags exchanges no all-to-all";
  }
};

TEST(StepAgreement, AFlagSetOnAnyRankIsSetOnAll) {
  TwoRanks group;
  std::atomic<bool> stop{false}, finish{false};
  StepAgreement a(group, &stop, &finish);
  a.before_step();
  EXPECT_FALSE(*a.stop());
  EXPECT_FALSE(*a.finish());
  stop = true;  // set here between steps: not agreed until the next step starts
  EXPECT_FALSE(*a.stop());
  a.before_step();
  EXPECT_TRUE(*a.stop());
  EXPECT_FALSE(*a.finish());

  StepAgreement b(group, nullptr, nullptr);  // this rank has no flags; the other finishes
  group.other_finish = 1;
  b.before_step();
  EXPECT_FALSE(*b.stop());
  EXPECT_TRUE(*b.finish());
}

// A server's batch split (Parallel::batch): two ranks as threads each render their own request,
// one process's image each (the text encoder and the VAE not dealt out: the ranks' prompts
// differ), and a cancel set on rank 0 after its first step stops rank 1's share too, at the same
// step, through the flags agreed before each.
TEST(BatchSplit, EachRankRendersItsOwnRequestAndACancelStopsEveryRank) {
  const std::string model = test::fixture("klein_tiny_a");
  const auto one = ImageModel::open(model, Weights::per_stage);
  const uint32_t seed = test::test_seed();
  std::vector<ImageRequest> requests = {test::small_image_request("a red fox in the snow", seed),
                                        test::small_image_request("a lighthouse at dusk", seed + 1)};
  for (ImageRequest& r : requests) r.steps = 3;
  test::ThreadRanks all(2);
  const test::ThreadRanks::Rank ranks[2] = {{all, 0}, {all, 1}};
  for (const bool cancel : {false, true}) {
    SCOPED_TRACE(cancel ? "rank 0 cancels after its first step" : "every step");
    std::atomic<bool> stop[2] = {false, false};
    std::string outcome[2];
    std::vector<uint8_t> rgb[2];
    auto render = [&](int r) {
      ImageRequest mine = requests[size_t(r)];
      mine.parallel = {Parallel::batch, &ranks[r]};
      auto say = [&](const std::string& line) {
        if (cancel && r == 0 && line.rfind("step 1/", 0) == 0) stop[0] = true;
      };
      try {
        rgb[r] = ImageModel::open(model, Weights::per_stage)->generate(mine, say, &stop[r]).rgb;
        outcome[r] = "done";
      } catch (const Cancelled&) {
        outcome[r] = "cancelled";
      }
    };
    std::thread other(render, 1);
    render(0);
    other.join();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(outcome[r], cancel ? "cancelled" : "done") << "rank " << r;
      if (!cancel) EXPECT_TRUE(rgb[r] == one->generate(requests[size_t(r)]).rgb) << "rank " << r;
      EXPECT_GT(ranks[r].sent, 0) << "rank " << r << " agreed no flags";
    }
  }
}

}  // namespace
}  // namespace apus
