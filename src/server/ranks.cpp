#include "server/ranks.h"

#include <cstring>
#include <exception>
#include <new>
#include <random>
#include <utility>

#include "core/error.h"
#include "dist/requests.h"
#include "dist/strategy.h"
#include "pipeline/split.h"

namespace apus::server {

namespace {

// What rank 0 announces before a request's bytes: its kind ('i', 'a'; 's' releases the others),
// the model's index, the split and whether the request has a stop flag.
struct Header {
  char kind = 's';
  uint64_t index = 0;
  uint8_t strategy = 0, stops = 0;
};
constexpr size_t kHeaderBytes = 1 + sizeof(uint64_t) + 2;

std::string with_header(const Header& h, const std::string& body) {
  std::string out(kHeaderBytes, '\0');
  out[0] = h.kind;
  std::memcpy(&out[1], &h.index, sizeof h.index);
  out[1 + sizeof h.index] = char(h.strategy);
  out[2 + sizeof h.index] = char(h.stops);
  return out + body;
}

Header header_of(const std::string& message) {
  APUS_CHECK(message.size() >= kHeaderBytes, "serving: a message of ", message.size(), " bytes from rank 0");
  Header h;
  h.kind = message[0];
  std::memcpy(&h.index, &message[1], sizeof h.index);
  h.strategy = uint8_t(message[1 + sizeof h.index]);
  h.stops = uint8_t(message[2 + sizeof h.index]);
  APUS_CHECK(h.strategy <= uint8_t(Parallel::batch), "serving: split ", int(h.strategy), " from rank 0");
  return h;
}

// Runs `work` (one request over the ranks); a failure after its first exchange, other than an
// agreed cancel or a loss already known, leaves the ranks out of step: the world is marked lost,
// which ends the job once the failure is answered (rank 0) or at once (the others).
template <typename Work> auto in_step(const dist::World& world, Work&& work) {
  const int64_t exchanges = world.traffic().calls;
  auto out_of_step = [&](const char* what) {
    if (world.traffic().calls == exchanges) return;  // refused before any exchange: by every rank
    if (world.rank() != 0) world.abort(std::string("serving a request: ") + what);
    world.interrupt();
  };
  try {
    return work();
  } catch (const Cancelled&) {
    throw;
  } catch (const dist::RanksLost&) {
    throw;
  } catch (const std::bad_alloc&) {
    out_of_step("out of memory");
    throw;
  } catch (const std::exception& e) {
    out_of_step(e.what());
    throw;
  }
}

// A request split by its outputs (Parallel::batch; at least one a rank): this rank renders its
// share (share_of: rank 0 the first), the ranks agreeing the stop and finish flags before every
// step, and every rank's results, or how its share failed before any exchange or by the agreed
// cancel, are gathered. Rank 0 returns every result in order, or throws its own share's failure as
// it was (a refusal, a cancel), else the first other rank's.
template <typename Result, typename Model, typename Request>
std::vector<Result> render_share(const dist::World& world, const Model& model, const std::vector<Request>& batch,
                                 const Progress& progress, const std::atomic<bool>* stop) {
  const Share mine = share_of(int64_t(batch.size()), world.rank(), world.size());
  std::string outcome;
  std::exception_ptr failed;
  try {
    std::vector<Request> part(batch.begin() + mine.first, batch.begin() + mine.first + mine.count);
    for (Request& r : part) r.parallel = {Parallel::batch, &world};
    // A failure after the steps' first agreement leaves the ranks out of step (in_step ends the
    // job); a refusal before it, or the agreed cancel, reaches the gather on every rank.
    outcome = "k" + dist::encode(in_step(world, [&] { return model.generate_batch(part, progress, stop); }));
  } catch (const dist::RanksLost&) {
    throw;
  } catch (const std::bad_alloc&) {
    failed = std::current_exception();
    outcome = "eout of memory";
  } catch (const std::exception& e) {
    failed = std::current_exception();
    outcome = std::string("e") + e.what();
  }
  const std::vector<std::string> all = world.all_gather_text(outcome, "the batch's outputs");
  if (failed) std::rethrow_exception(failed);
  std::vector<Result> results;
  for (int r = 0; r < world.size(); ++r) {
    const std::string& o = all[size_t(r)];
    APUS_CHECK(!o.empty() && o[0] != 'e', "rank ", r, " of ", world.size(), ": ", o.empty() ? "" : o.substr(1));
    dist::decode(o.substr(1), results);
  }
  return results;
}

}  // namespace

Ranks::Ranks(const dist::World& world, std::string parallel, Chip here, std::vector<bool> opened_split)
    : world_(world), parallel_(std::move(parallel)), here_(std::move(here)), opened_split_(std::move(opened_split)) {
  APUS_CHECK(parallel_ == "auto" || parallel_ == "batch" || parallel_ == "cfg" || parallel_ == "ulysses" ||
                 parallel_ == "tensor" || parallel_ == "none",
             "serve --parallel ", parallel_, ": expected auto, batch, cfg, ulysses, tensor or none over the ranks");
}

template <typename Model, typename Request>
Parallel Ranks::choose(size_t index, const Model& model, const Request& r, int batch) const {
  // A model opened with its weights split over the ranks: every request runs so.
  if (index < opened_split_.size() && opened_split_[index]) return Parallel::tensor;
  if (parallel_ == "none") return Parallel::none;
  // A named split the request cannot take (batch for fewer outputs than ranks, cfg for one
  // unguided output) gives way to auto's choice.
  const int n = world_.size();
  const bool dealt = batch >= n;  // every rank an output, so every rank runs the steps to agree on
  if (parallel_ == "batch" && dealt) return Parallel::batch;
  for (const Parallel p : {Parallel::cfg, Parallel::ulysses})
    if (parallel_ == parallel_name(p) && dist::takes_split(model, r, p, world_)) return p;
  // Enough outputs weigh the batch split (each rank its share of them) against the others; fewer
  // run on rank 0 alone unless a split is faster.
  const char* alone = dealt ? "batch" : "none";
  const std::string best =
      dist::cheapest_split(model, r, batch, here_, world_, alone, dealt ? (batch + n - 1) / n : batch).best;
  return best == "batch"     ? Parallel::batch
         : best == "cfg"     ? Parallel::cfg
         : best == "ulysses" ? Parallel::ulysses
                             : Parallel::none;
}

template <typename Result, typename Model, typename Request>
std::vector<Result> Ranks::run(char kind, size_t index, const Model& model, std::vector<Request> batch,
                               const Progress& progress, const std::atomic<bool>* stop, std::string& used) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The ranks of a split sample the same noise: rank 0 draws the seeds the others are sent.
  for (Request& r : batch)
    if (!r.seed) r.seed = std::random_device{}();
  const Parallel strategy = choose(index, model, batch.front(), int(batch.size()));
  if (strategy == Parallel::none) {
    used = "rank 0 alone";
    return model.generate_batch(batch, progress, stop);
  }
  used = std::string(parallel_name(strategy)) + " over " + std::to_string(world_.size()) + " ranks";
  world_.broadcast(with_header({kind, index, uint8_t(strategy), uint8_t(stop != nullptr)}, dist::encode(batch)),
                   "the request");
  if (strategy == Parallel::batch) return render_share<Result>(world_, model, batch, progress, stop);
  for (Request& r : batch) r.parallel = {strategy, &world_};
  return in_step(world_, [&] { return model.generate_batch(batch, progress, stop); });
}

std::vector<ImageResult> Ranks::image(size_t index, const ImageModel& model, std::vector<ImageRequest> batch,
                                      const Progress& progress, const std::atomic<bool>* stop, std::string& used) {
  return run<ImageResult>('i', index, model, std::move(batch), progress, stop, used);
}

std::vector<AudioResult> Ranks::audio(size_t index, const AudioModel& model, std::vector<AudioRequest> batch,
                                      const Progress& progress, const std::atomic<bool>* stop, std::string& used) {
  return run<AudioResult>('a', index, model, std::move(batch), progress, stop, used);
}

void Ranks::follow(const std::vector<AnyModel>& models) const {
  // Never set here: rank 0's flags reach this rank through the steps' agreement.
  const std::atomic<bool> never{false};
  for (;;) {
    const std::string message = world_.broadcast("", "rank 0's next request", true);
    const Header h = header_of(message);
    if (h.kind == 's') return;
    APUS_CHECK(h.index < models.size(), "serving: model ", h.index, " of ", models.size(), " from rank 0");
    const AnyModel& m = models[h.index];
    const std::string body = message.substr(kHeaderBytes);
    const Parallelism split{Parallel(h.strategy), &world_};
    const std::atomic<bool>* stop = h.stops ? &never : nullptr;
    if (split.strategy == Parallel::batch) {
      // Its share's outcome reaches rank 0 through the gather (a failure after the steps' first
      // agreement has ended the job: render_share's in_step).
      try {
        if (h.kind == 'i') {
          APUS_CHECK(m.image(), "serving: an image request for ", m.label(), ", an audio model");
          render_share<ImageResult>(world_, *m.image(), dist::decode_images(body, &never), {}, stop);
        } else {
          APUS_CHECK(m.audio(), "serving: an audio request for ", m.label(), ", an image model");
          render_share<AudioResult>(world_, *m.audio(), dist::decode_audio(body, &never), {}, stop);
        }
      } catch (const dist::RanksLost&) {
        throw;
      } catch (const std::exception&) {
      }
      continue;
    }
    try {
      in_step(world_, [&] {
        if (h.kind == 'i') {
          APUS_CHECK(m.image(), "serving: an image request for ", m.label(), ", an audio model");
          std::vector<ImageRequest> batch = dist::decode_images(body, &never);
          for (ImageRequest& r : batch) r.parallel = split;
          m.image()->generate_batch(batch, {}, stop);
        } else {
          APUS_CHECK(m.audio(), "serving: an audio request for ", m.label(), ", an image model");
          std::vector<AudioRequest> batch = dist::decode_audio(body, &never);
          for (AudioRequest& r : batch) r.parallel = split;
          m.audio()->generate_batch(batch, {}, stop);
        }
      });
    } catch (const std::exception&) {
      // Rank 0 met the same refusal or the agreed cancel (in_step ended the job otherwise).
    }
  }
}

void Ranks::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (world_.size() > 1 && !world_.lost()) world_.broadcast(with_header({}, ""), "releasing the ranks");
}

}  // namespace apus::server
