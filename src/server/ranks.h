#pragma once
// `apus serve` under mpirun or srun (issue 43): every rank loads the models; rank 0 answers HTTP
// and runs each request together with the others, split as --parallel says (auto: the split the
// cost model prices fastest for that request, dist/strategy.h). Rank 0 announces the request
// (dist/requests.h), every rank runs it on its share, rank 0 keeps the result. One request runs
// over the ranks at a time, whichever model it is for. A request for at least as many outputs as
// ranks can split by them (batch): each rank renders its share, the ranks agreeing a cancel before
// every step, and rank 0 gathers the results.
//
// A failure the ranks cannot share ends the job: a rank lost (dead, hung past --rank-timeout, or
// mpirun ending the job) fails the request in flight with 503 on rank 0, and a rank that fails
// after the request's first exchange (other than an agreed cancel) ends the job, since the others
// are out of step. A refusal before any exchange is every rank's (the same checks on the same
// request), and they go on.
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "cost/chips.h"
#include "dist/world.h"
#include "pipeline/registry.h"

namespace apus::server {

class Ranks {
 public:
  // parallel: auto, batch, cfg, ulysses, tensor (the models opened split over the ranks) or none. `here`: this
  // machine's calibrated chip with link_bps the rate measured between the ranks (auto prices the splits at it).
  // `opened_split`: which models (in ServeOptions::models' order) were opened with their weights
  // split over the ranks: their requests all run as tensor.
  Ranks(const dist::World& world, std::string parallel, Chip here, std::vector<bool> opened_split);
  int size() const { return world_.size(); }

  // Rank 0: `batch` of the model at `index` (in ServeOptions::models' order) over the ranks, or on
  // rank 0 alone where the choice is none; `used` says which ("cfg over 2 ranks").
  std::vector<ImageResult> image(size_t index, const ImageModel& model, std::vector<ImageRequest> batch,
                                 const Progress& progress, const std::atomic<bool>* stop, std::string& used);
  std::vector<AudioResult> audio(size_t index, const AudioModel& model, std::vector<AudioRequest> batch,
                                 const Progress& progress, const std::atomic<bool>* stop, std::string& used);
  // Every other rank: runs what rank 0 announces on `models` until rank 0 releases them.
  void follow(const std::vector<AnyModel>& models) const;
  // Rank 0, stopping while no request is in flight: the others return from follow().
  void release();

 private:
  const dist::World& world_;
  std::string parallel_;
  Chip here_;
  std::vector<bool> opened_split_;
  std::mutex mutex_;  // one request over the ranks at a time

  template <typename Model, typename Request>
  Parallel choose(size_t index, const Model& model, const Request& r, int batch) const;
  template <typename Result, typename Model, typename Request>
  std::vector<Result> run(char kind, size_t index, const Model& model, std::vector<Request> batch,
                          const Progress& progress, const std::atomic<bool>* stop, std::string& used);
};

}  // namespace apus::server
