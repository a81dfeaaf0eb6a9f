#include "io/weights/renamed_source.h"

#include <algorithm>

#include "core/error.h"

namespace apus {

namespace {

// The rows' equal blocks in `order`. A weight whose block factors run along its rows is decoded to
// fp32 first (its factors would not follow their rows); a per-tensor code scale stays with it.
Tensor reordered(const Tensor& t, const std::vector<int>& order) {
  if (t.encoding.block_scales) return row_blocks_permuted(to_dtype(t, DType::f32), order);
  Tensor out = row_blocks_permuted(t, order);
  out.encoding.code_scale = t.encoding.code_scale;
  return out;
}

Shape without_unit_dims(Shape s) {
  std::erase(s, int64_t{1});
  return s;
}

}  // namespace

RenamedSource::Rule RenamedSource::table(std::map<std::string, StoredAs> entries) {
  return [entries = std::move(entries)](const std::string& asked) -> std::optional<StoredAs> {
    const auto it = entries.find(asked);
    if (it == entries.end()) return std::nullopt;
    return it->second;
  };
}

StoredAs RenamedSource::stored_as(const std::string& name) const {
  std::optional<StoredAs> s = rule_(name);
  if (!s) fail(origin_, ": no tensor for '", name, "' (no stored tensor maps to it)");
  return *std::move(s);
}

bool RenamedSource::contains(const std::string& name) const {
  const std::optional<StoredAs> s = rule_(name);
  return s && file(*s).contains(s->taps > 0 ? s->name + ".w0" : s->name);
}

std::string RenamedSource::where(const std::string& name) const {
  const std::optional<StoredAs> s = rule_(name);
  if (!s) return files_.front()->where(name);
  std::string w = file(*s).where(s->taps > 0 ? s->name + ".w*" : s->name);
  if (s->end >= 0) w += " rows " + std::to_string(s->begin) + ".." + std::to_string(s->end);
  return w;
}

Shape RenamedSource::asked_shape(const std::string& name, const StoredAs& s, Shape shape, const Shape& expected) const {
  if (s.end >= 0) {
    APUS_CHECK(!shape.empty() && 0 <= s.begin && s.begin < s.end && s.end <= shape[0], where(name), ": ",
               shape_str(shape), " has no rows ", s.begin, "..", s.end);
    shape[0] = s.end - s.begin;
  }
  if (!s.shape.empty() && without_unit_dims(shape) == without_unit_dims(expected)) shape = expected;
  APUS_CHECK(shape == expected, where(name), " has shape ", shape_str(shape), ", expected ", shape_str(expected),
             " (for '", name, "')");
  return shape;
}

Tensor RenamedSource::fetch(const std::string& name, const Shape& expected) const {
  const StoredAs s = stored_as(name);
  if (s.taps > 0) return gather_taps(name, s, expected);
  const Tensor stored = file(s).fetch(s.name, s.shape.empty() ? expected : s.shape);
  const Shape shape = asked_shape(name, s, stored.shape, expected);
  if (!stored.data) return Tensor::shape_only(shape, stored.dtype);
  Tensor t = s.end >= 0 ? stored.rows(s.begin, s.end) : stored;
  if (!s.row_blocks.empty()) {
    const int64_t blocks = int64_t(s.row_blocks.size());
    APUS_CHECK(t.rank() >= 1 && t.dim(0) % blocks == 0, where(name), ": ", shape_str(t.shape), " does not split into ",
               blocks, " blocks of rows");
    t = reordered(t, s.row_blocks);
  }
  if (s.offset != 0) {
    t = to_dtype(t, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] += s.offset;
  }
  if (t.shape != shape) t = t.reshape(shape);
  if (s.copies()) file(s).release(s.name);
  return t;
}

Tensor RenamedSource::gather_taps(const std::string& name, const StoredAs& s, const Shape& expected) const {
  APUS_CHECK(expected.size() == 3 && expected[2] == s.taps, where(name), ": a convolution of ", s.taps,
             " taps, expected ", shape_str(expected), " (for '", name, "')");
  const int64_t out = expected[0], in = expected[1];
  Tensor w = Tensor::heap(expected, DType::f32);
  for (int t = 0; t < s.taps; ++t) {
    const std::string stored = s.name + ".w" + std::to_string(t);
    const Tensor tap = to_dtype(file(s).fetch(stored, {out, in}), DType::f32);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) w.ptr<float>()[(o * in + i) * s.taps + t] = tap.ptr<float>()[o * in + i];
    file(s).release(stored);
  }
  return w;
}

Tensor RenamedSource::describe(const std::string& name, const Shape& expected) const {
  const StoredAs s = stored_as(name);
  if (s.taps > 0) return Tensor::shape_only(expected, DType::f32);
  const Tensor stored = file(s).describe(s.name, s.shape.empty() ? expected : s.shape);
  return Tensor::shape_only(asked_shape(name, s, stored.shape, expected), s.offset != 0 ? DType::f32 : stored.dtype);
}

size_t RenamedSource::make_resident(const std::vector<std::string>& names) const {
  std::vector<std::vector<std::string>> stored(files_.size());
  for (const std::string& name : names)
    if (const std::optional<StoredAs> s = rule_(name); s && !s->copies()) stored.at(s->file).push_back(s->name);
  size_t bytes = 0;
  for (size_t f = 0; f < files_.size(); ++f)
    if (!stored[f].empty()) bytes += files_[f]->make_resident(stored[f]);
  return bytes;
}

void RenamedSource::release(const std::string& name) const {
  const std::optional<StoredAs> s = rule_(name);
  if (s && !s->copies()) file(*s).release(s->name);
}

}  // namespace apus
