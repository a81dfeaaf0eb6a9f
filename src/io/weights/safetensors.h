#pragma once
// Safetensors over mmap: tensors are views into the mapping, never copied at load.
// Every header field is validated against the file before a view is handed out.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/files.h"

namespace apus {

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
};

// The header exactly as the Python safetensors writer lays it out: metadata first, then tensors in
// data order with keys dtype, shape, data_offsets; compact JSON padded with spaces to 8 bytes.
// `where` names the file when a tensor is listed twice.
std::string safetensors_header(const std::vector<SafetensorsEntry>& entries,
                               const std::vector<std::pair<std::string, std::string>>& metadata,
                               const std::string& where);

class SafetensorsFile {
 public:
  // Throws apus::Error naming the file and the offending entry for any inconsistency.
  static SafetensorsFile open(const std::string& path);
  // Parses a header already in memory (the fuzz target and `open` share this path).
  static SafetensorsFile parse(std::shared_ptr<MappedFile> file);

  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  const Tensor& get(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::string& path() const { return file_->path; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Whether `t` is a view of this file's mapping (not an aligned copy): only then may its pages
  // be dropped.
  bool maps(const Tensor& t) const {
    const auto* p = static_cast<const uint8_t*>(t.data);
    return file_->mapped && p >= file_->data && p + t.nbytes() <= file_->data + file_->size;
  }

 private:
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, Tensor> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (CPU, contiguous) as one safetensors file; used by `apus synth` and tests.
struct NamedTensor {
  std::string name;
  Tensor tensor;
};
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace apus
