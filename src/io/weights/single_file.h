#pragma once
// A checkpoint that is one file (safetensors or GGUF, told apart by their first bytes) handed
// under the names a model asks for: every tensor under its stored name, or through a table a
// family builds from the stored names (a fused tensor's rows, a reordered one).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/weights/gguf.h"
#include "io/weights/quantized_layout.h"
#include "io/weights/safetensors.h"
#include "io/weights/weight_source.h"

namespace apus {

class SingleFile final : public WeightSource {
 public:
  // Where a name the model asks for is stored: rows [begin, end) of `stored` (end -1: all rows),
  // with its two halves of rows swapped, or in a shape that differs from the stored one only by
  // unit dimensions (a 1x1 convolution's weight read as a linear's, a squeezed [16] as [1, 16, 1]).
  // A quantised weight comes with its scales attached.
  struct Entry {
    std::string stored;
    int64_t begin = 0, end = -1;
    bool swap_halves = false;
    bool unit_dims_free = false;
  };
  static std::shared_ptr<SingleFile> open(const std::string& path);
  const std::string& path() const { return path_; }
  bool is_gguf() const { return gguf_ != nullptr; }
  const GgufFile* gguf() const { return gguf_.get(); }
  // The stored tensors of the model: the tensors that describe a quantised weight (its scales and
  // format tags, io/weights/quantized_layout.h) are no names of their own.
  const std::vector<std::string>& stored_names() const { return stored_names_; }
  // A stored tensor's view (a GGUF type apus does not read is refused naming it).
  const Tensor& stored(const std::string& name) const;
  // The names the model asks for, replacing the stored names.
  void rename(std::map<std::string, Entry> entries) { entries_ = std::move(entries); }

  bool contains(const std::string& name) const override { return entries_.count(name) > 0; }
  // Also refuses a dtype no op reads (integers, booleans).
  Tensor fetch(const std::string& name, const Shape& expected) const override;
  Tensor describe(const std::string& name, const Shape& expected) const override;
  std::string where(const std::string& name) const override;
  size_t make_resident(const std::vector<std::string>& names) const override;
  void release(const std::string& name) const override;

 private:
  // fetch's tensor; without data, a reordered tensor is not copied.
  Tensor view(const std::string& name, const Shape& expected, bool with_data) const;
  std::string path_;
  std::shared_ptr<SafetensorsFile> safetensors_;
  std::shared_ptr<GgufFile> gguf_;
  std::vector<std::string> stored_names_;
  QuantizedLayout quantized_;
  std::map<std::string, Entry> entries_;
};

}  // namespace apus
