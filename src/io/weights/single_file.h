#pragma once
// A checkpoint that is one file (safetensors or GGUF, told apart by their first bytes), its tensors
// under their stored names; a format that names them otherwise renames them through
// io/weights/renamed_source.h.
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
  static std::shared_ptr<SingleFile> open(const std::string& path);
  const std::string& path() const { return path_; }
  bool is_gguf() const { return gguf_ != nullptr; }
  const GgufFile* gguf() const { return gguf_.get(); }
  // The stored tensors of the model: the tensors that describe a quantised weight (its scales and
  // format tags, io/weights/quantized_layout.h) are no names of their own.
  const std::vector<std::string>& stored_names() const { return stored_names_; }
  // A stored tensor's view (a GGUF type apus does not read is refused naming it).
  const Tensor& stored(const std::string& name) const;
  // The shape fetch hands it in, the data untouched (a GGUF's block scales are checked when the
  // tensor is fetched).
  Shape stored_shape(const std::string& name) const;

  bool contains(const std::string& name) const override;
  // A quantised weight comes with its scales attached. Also refuses a dtype no op reads (integers,
  // booleans).
  Tensor fetch(const std::string& name, const Shape& expected) const override;
  Tensor describe(const std::string& name, const Shape& expected) const override;
  std::string where(const std::string& name) const override;
  size_t make_resident(const std::vector<std::string>& names) const override;
  void release(const std::string& name) const override;

 private:
  Tensor view(const std::string& name, const Shape& expected) const;
  // The stored tensor, a quantised weight with its scales attached.
  Tensor with_scales(const std::string& name) const;
  std::string path_;
  std::shared_ptr<SafetensorsFile> safetensors_;
  std::shared_ptr<GgufFile> gguf_;
  std::vector<std::string> stored_names_;
  QuantizedLayout quantized_;
};

}  // namespace apus
