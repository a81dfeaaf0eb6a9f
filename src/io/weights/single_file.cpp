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
  for (const std::string& name : f->stored_names_) f->entries_[name] = Entry{name};
  return f;
}

const Tensor& SingleFile::stored(const std::string& name) const {
  if (gguf_) return gguf_->get(name);
  APUS_CHECK(safetensors_->contains(name), path_, ": no tensor '", name, "'");
  return safetensors_->get(name);
}

std::string SingleFile::where(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) return path_ + ": tensor '" + name + "'";
  const Entry& e = it->second;
  std::string w = path_ + ": tensor '" + e.stored + "'";
  if (e.end >= 0) w += " rows " + std::to_string(e.begin) + ".." + std::to_string(e.end);
  return w;
}

Tensor SingleFile::fetch(const std::string& name, const Shape& expected) const { return view(name, expected, true); }

Tensor SingleFile::describe(const std::string& name, const Shape& expected) const {
  const Tensor t = view(name, expected, false);
  return Tensor::shape_only(t.shape, t.dtype);
}

Tensor SingleFile::view(const std::string& name, const Shape& expected, bool with_data) const {
  const auto it = entries_.find(name);
  APUS_CHECK(it != entries_.end(), path_, ": no tensor for '", name, "'");
  const Entry& e = it->second;
  const auto quantized = quantized_.weights.find(e.stored);
  const Tensor t = quantized == quantized_.weights.end()
                       ? stored(e.stored)
                       : quantized_weight(path_, *safetensors_, e.stored, quantized->second);
  const DType dt = t.dtype;
  APUS_CHECK(dt == DType::bf16 || dt == DType::f16 || dt == DType::f32 || is_stored_quantized(dt), where(name),
             " has dtype ", dtype_name(dt), ", expected a float, fp8, quantised or GGML block format");
  // Integer codes are values only through their scale (ComfyUI's int8 layers carry one in
  // `.weight_scale` and a `.comfy_quant` tag); untagged, they would be read as the codes times 1.
  APUS_CHECK(dt != DType::i8 || quantized != quantized_.weights.end(), where(name),
             " holds int8 codes without a scale (no '.weight_scale' and '.comfy_quant' tag beside it): integer ",
             "weights need their scale");
  Tensor out = e.end >= 0 ? t.rows(e.begin, e.end) : t;
  if (e.swap_halves && with_data) {
    APUS_CHECK(out.rank() >= 1 && out.shape[0] % 2 == 0, where(name), ": ", shape_str(out.shape),
               " has no two halves of rows to swap");
    const int64_t half = out.shape[0] / 2;
    if (out.encoding.block_scales) {
      // Block factors follow their rows: the swapped weight is decoded, as fp32.
      const Tensor values = to_dtype(out, DType::f32);
      Tensor swapped = Tensor::heap(out.shape, DType::f32);
      std::memcpy(swapped.data, values.rows(half, 2 * half).data, values.nbytes() / 2);
      std::memcpy(swapped.rows(half, 2 * half).data, values.data, values.nbytes() / 2);
      out = swapped;
    } else {
      Tensor swapped = Tensor::heap(out.shape, dt);
      swapped.encoding.code_scale = out.encoding.code_scale;
      const size_t bytes = out.nbytes() / 2;
      std::memcpy(swapped.data, static_cast<const char*>(out.data) + bytes, bytes);
      std::memcpy(static_cast<char*>(swapped.data) + bytes, out.data, bytes);
      out = swapped;
    }
  }
  if (e.unit_dims_free) {
    auto squeezed = [](Shape s) {
      std::erase(s, int64_t{1});
      return s;
    };
    if (squeezed(out.shape) == squeezed(expected)) out = out.reshape(expected);
  }
  APUS_CHECK(out.shape == expected, where(name), " has shape ", shape_str(out.shape), ", expected ",
             shape_str(expected), " (for '", name, "')");
  return out;
}

size_t SingleFile::make_resident(const std::vector<std::string>& names) const {
  std::vector<const Tensor*> tensors;
  for (const std::string& name : names) {
    const auto it = entries_.find(name);
    if (it != entries_.end() && !it->second.swap_halves) tensors.push_back(&stored(it->second.stored));
  }
  return read_pages(tensors);
}

void SingleFile::release(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end() || it->second.swap_halves) return;
  const Tensor& t = stored(it->second.stored);
  if (gguf_ || safetensors_->maps(t)) drop_pages(t);
}

}  // namespace apus
