#pragma once
// The one way a format hands its stored tensors under the names a model asks for: a rule says,
// for each asked name, which stored tensor holds it and how it is read from there. Every format
// that renames (FLUX.2's BFL and ldm single files, llama.cpp's Qwen3 GGUF, sa3.cpp's GGUF files,
// Stable Audio 3's official checkpoint) is a table or a function of this one kind, and a renaming
// may sit on another (the official checkpoint's names over sa3.cpp's).
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/weights/weight_source.h"

namespace apus {

// Where an asked tensor is stored and how it is read.
struct StoredAs {
  std::string name;  // the stored name; with taps, the stem of name.w0, name.w1, ...
  size_t file = 0;   // which of the renaming's sources holds it
  // The stored shape where it is not the asked one: a row range is taken from it, and unit
  // dimensions it has more or fewer than the asked shape are dropped or added (a 1x1
  // convolution's weight read as a linear's, a squeezed [16] read as [1, 16, 1]).
  Shape shape;
  int64_t begin = 0, end = -1;  // rows [begin, end) (end -1: all rows)
  // The rows' equal blocks taken in this order (empty: as stored): {1, 0} swaps two halves.
  std::vector<int> row_blocks;
  // > 0: a convolution's weight [out, in, taps] gathered from `taps` stored [out, in] matrices,
  // one a tap (sa3.cpp's fold of a weight-normed convolution).
  int taps = 0;
  float offset = 0;  // added to every value (Gemma's RMSNorm weight w stored as 1 + w: -1)

  // Read into a copy of its own (not a view of the stored pages).
  bool copies() const { return !row_blocks.empty() || taps > 0 || offset != 0; }
};

class RenamedSource final : public WeightSource {
 public:
  // The stored tensor of an asked name; nullopt for a name the format does not have.
  using Rule = std::function<std::optional<StoredAs>(const std::string& asked)>;
  // A rule that is a table of every asked name.
  static Rule table(std::map<std::string, StoredAs> entries);

  // origin: the files as a refusal of a name the rule does not have names them.
  RenamedSource(std::vector<std::shared_ptr<const WeightSource>> files, Rule rule, std::string origin)
      : files_(std::move(files)), rule_(std::move(rule)), origin_(std::move(origin)) {}
  bool contains(const std::string& name) const override;
  // A copy's stored pages leave the resident set once it is made: the model reads the copy only.
  Tensor fetch(const std::string& name, const Shape& expected) const override;
  Tensor describe(const std::string& name, const Shape& expected) const override;
  std::string where(const std::string& name) const override;
  size_t make_resident(const std::vector<std::string>& names) const override;
  void release(const std::string& name) const override;

 private:
  StoredAs stored_as(const std::string& name) const;
  const WeightSource& file(const StoredAs& s) const { return *files_.at(s.file); }
  // The asked shape from a stored tensor's shape: its row range, then its unit dimensions.
  Shape asked_shape(const std::string& name, const StoredAs& s, Shape stored, const Shape& expected) const;
  Tensor gather_taps(const std::string& name, const StoredAs& s, const Shape& expected) const;
  std::vector<std::shared_ptr<const WeightSource>> files_;
  Rule rule_;
  std::string origin_;
};

}  // namespace apus
