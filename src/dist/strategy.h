#pragma once
// `--parallel auto` (issue 43): the split the cost model predicts fastest for a request over a
// group's ranks, priced at this machine's calibrated rates and the link rate measured between the
// ranks. The candidates: the request without a split (`alone`: the CLI's batch parallelism, each
// rank ceil(B / N) outputs; a server's none, rank 0 all of them), cfg (each rank ceil(S / N) of
// the steps' S samples) and ulysses (each rank 1/N of every sample's tokens), of those the model
// takes for this request.
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "apus/apus.h"
#include "core/cost.h"
#include "core/error.h"
#include "cost/roofline.h"

namespace apus::dist {

// Whether `model` takes requests like `r` split as `strategy` (its plan refuses those it does not).
template <typename Model, typename Request>
bool takes_split(const Model& model, Request r, Parallel strategy, const ProcessGroup& group) {
  r.parallel = {strategy, &group};
  try {
    model.count(r, 1);
    return true;
  } catch (const Error&) {
    return false;
  }
}

struct SplitChoice {
  std::vector<std::pair<std::string, double>> floors;  // each candidate's floor, seconds
  std::string best;
  // "cfg (the floors over 2 ranks: batch 1.2 s, cfg 0.7 s; 3.81 GB/s between ranks)"
  std::string describe(int ranks, double link_bps) const {
    std::string line;
    for (const auto& [name, s] : floors) line += (line.empty() ? "" : ", ") + name + " " + std::to_string(s) + " s";
    char link[32];
    std::snprintf(link, sizeof link, "%.2f", link_bps / 1e9);
    return best + " (the floors over " + std::to_string(ranks) + " ranks: " + line + "; " + link +
           " GB/s between ranks)";
  }
};

// `here`: this machine's calibrated chip with link_bps the measured rate between the ranks;
// `alone_batch`: the outputs the busiest rank renders without a split.
template <typename Model, typename Request> SplitChoice cheapest_split(const Model& model, const Request& r, int batch,
                                                                       const Chip& here, const ProcessGroup& group,
                                                                       const char* alone, int alone_batch) {
  SplitChoice c;
  c.floors.emplace_back(alone, double(roofline_json(model.count(r, alone_batch), {here, 1})["total"]["floor_s"]));
  const nlohmann::json split = roofline_json(model.count(r, batch), {here, group.size()})["collectives"];
  for (const auto& [name, strategy] : {std::pair{"cfg", Parallel::cfg}, {"ulysses", Parallel::ulysses}})
    if (takes_split(model, r, strategy, group)) c.floors.emplace_back(name, double(split[name]["floor_s"]));
  c.best = std::min_element(c.floors.begin(), c.floors.end(), [](const auto& x, const auto& y) {
             return x.second < y.second;
           })->first;
  return c;
}

}  // namespace apus::dist
