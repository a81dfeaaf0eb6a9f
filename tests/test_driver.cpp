// The family contract (pipeline/driver.h): a type with every member the driver calls is a
// PipelineFamily; one without a member (here describe(), as a misspelling would leave it) is not,
// so the static_assert under a family's class (klein_model.h, sa3_model.h) names the gap there.
#include <gtest/gtest.h>

#include "pipeline/driver.h"

namespace apus {
namespace {

template <bool WithDescribe> struct ToyFamily {
  struct Request {
    std::optional<uint64_t> seed;
    bool trace = false;
    PreviewSink preview;
    const std::atomic<bool>* finish_steps = nullptr;
    Parallelism parallel;
  };
  struct Result {
    uint64_t seed = 0;
    std::vector<StageTime> stages;
    std::string trace;
  };
  struct Work {
    Parallelism parallel;
  };
  Weights weights() const;
  const std::string& root() const;
  Backend* device() const;
  Request resolved(const Request&) const;
  Work plan(const Request&, int64_t batch) const;
  void check_batch_agrees(const std::vector<Request>&) const;
  PipelineCost cost_header(const Request&, const Work&, int batch) const;
  void count_inputs(Work&, int batch) const;
  std::string describe(const Request&) const requires WithDescribe;
  DType compute(const Request&) const;
  void tokenize(Work&, const std::vector<Request>&, std::vector<Result>&, const Progress&) const;
  void initial_noise(Context&, Work&, const std::vector<Request>&, std::vector<Result>&) const;
  const std::vector<std::unique_ptr<Part<Work>>>& parts() const;
  void finish(Context&, Work&, const std::vector<Request>&, std::vector<Result>&) const;
};

TEST(FamilyContract, NamesAFamilyMissingAMember) {
  EXPECT_TRUE(PipelineFamily<ToyFamily<true>>);
  EXPECT_FALSE(PipelineFamily<ToyFamily<false>>);
}

}  // namespace
}  // namespace apus
