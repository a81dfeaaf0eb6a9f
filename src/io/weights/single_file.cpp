#include "io/weights/single_file.h"

#include <cstring>

#include "core/error.h"
#include "core/scaled_codes.h"
#include "io/files.h"

namespace apus {

std::shared_ptr<SingleFile> SingleFile::open(const std::string& path) {
  auto f = std::make_shared<SingleFile>();
  f->path_ = path;
  const std::shared_ptr<MappedFile> bytes = map_file(path);
  if (bytes->size >= 4 && std::memcmp(bytes->data, "GGUF", 4) == 0) {
    f->gguf_ = std::make_shared<GgufFile>(GgufFile::parse(bytes));
    f->stored_names_ = f->gguf_->names();
  } else {
    try {
      f->safetensors_ = std::make_shared<SafetensorsFile>(SafetensorsFile::parse(bytes));
    } catch (const Error& e) {
      fail(path, ": neither a GGUF nor a safetensors file (read as safetensors: ", e.what(), ")");
    }
    f->quantized_ = read_quantized_layout(path, *f->safetensors_);
    for (const std::string& name : f->safetensors_->names())
      if (!f->quantized_.sidecars.count(name)) f->stored_names_.push_back(name);
  }
  return f;
}

const Tensor& SingleFile::stored(const std::string& name) const {
  if (gguf_) return gguf_->get(name);
  APUS_CHECK(safetensors_->contains(name), path_, ": no tensor '", name, "'");
  return safetensors_->get(name);
}

Shape SingleFile::stored_shape(const std::string& name) const {
  if (gguf_) return gguf_->shape(name);
  return with_scales(name).shape;
}

Tensor SingleFile::with_scales(const std::string& name) const {
  const auto quantized = quantized_.weights.find(name);
  return quantized == quantized_.weights.end() ? stored(name)
                                               : quantized_weight(path_, *safetensors_, name, quantized->second);
}

bool SingleFile::contains(const std::string& name) const {
  return gguf_ ? gguf_->contains(name) : safetensors_->contains(name) && !quantized_.sidecars.count(name);
}

std::string SingleFile::where(const std::string& name) const { return path_ + ": tensor '" + name + "'"; }

Tensor SingleFile::fetch(const std::string& name, const Shape& expected) const { return view(name, expected); }

Tensor SingleFile::describe(const std::string& name, const Shape& expected) const {
  const Tensor t = view(name, expected);
  return Tensor::shape_only(t.shape, t.dtype);
}

Tensor SingleFile::view(const std::string& name, const Shape& expected) const {
  APUS_CHECK(contains(name), path_, ": no tensor for '", name, "'");
  const Tensor t = with_scales(name);
  const DType dt = t.dtype;
  APUS_CHECK(dt == DType::bf16 || dt == DType::f16 || dt == DType::f32 || is_stored_quantized(dt), where(name),
             " has dtype ", dtype_name(dt), ", expected a float, fp8, quantised or GGML block format");
  // Integer codes are values only through their scale (ComfyUI's int8 layers carry one in
  // `.weight_scale` and a `.comfy_quant` tag); untagged, they would be read as the codes times 1.
  APUS_CHECK(dt != DType::i8 || quantized_.weights.count(name), where(name),
             " holds int8 codes without a scale (no '.weight_scale' and '.comfy_quant' tag beside it): integer ",
             "weights need their scale");
  APUS_CHECK(t.shape == expected, where(name), " has shape ", shape_str(t.shape), ", expected ", shape_str(expected));
  return t;
}

size_t SingleFile::make_resident(const std::vector<std::string>& names) const {
  std::vector<const Tensor*> tensors;
  for (const std::string& name : names)
    if (contains(name)) tensors.push_back(&stored(name));
  return read_pages(tensors);
}

void SingleFile::release(const std::string& name) const {
  if (!contains(name)) return;
  const Tensor& t = stored(name);
  if (gguf_ || safetensors_->maps(t)) drop_pages(t);
}

}  // namespace apus
