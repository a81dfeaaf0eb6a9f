#pragma once
// GGUF (llama.cpp's single-file format, versions 2 and 3) over mmap: a metadata table and tensors
// whose data are views into the mapping. Every count, length and offset is checked against the
// file before a view is handed out. Shapes are torch's order (GGUF's ne[] reversed).
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "io/files.h"

namespace apus {

// Whether a regular file begins with GGUF's magic.
bool is_gguf_file(const std::string& path);

class GgufFile {
 public:
  // Throws apus::Error naming the file and what in it is wrong.
  static GgufFile open(const std::string& path);
  // The same over bytes already in memory (the fuzz target).
  static GgufFile parse(std::shared_ptr<MappedFile> file);

  const std::string& path() const { return file_->path; }
  uint32_t version() const { return version_; }
  // Metadata: numbers, booleans, strings and arrays of them as JSON values.
  const nlohmann::json& metadata() const { return metadata_; }
  // A metadata string, or `fallback` when absent; refused when present and not a string.
  std::string metadata_string(const std::string& key, const std::string& fallback = "") const;

  bool contains(const std::string& name) const { return tensors_.count(name) > 0; }
  // The tensor's view; refused naming the tensor and its GGML type when apus does not read it.
  const Tensor& get(const std::string& name) const;
  // A tensor's shape, read or not (its data untouched).
  const Shape& shape(const std::string& name) const;
  // GGML's type name of a tensor ("Q4_K"), known to apus or not.
  const char* type_name(const std::string& name) const;
  // In file order.
  const std::vector<std::string>& names() const { return order_; }

 private:
  struct Entry {
    Tensor tensor;  // dtype valid only when `readable`
    uint32_t ggml_type;
    bool readable;
    // A block format's scales are checked once, when the tensor is first fetched.
    std::shared_ptr<std::once_flag> scales_checked = std::make_shared<std::once_flag>();
  };
  std::shared_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  nlohmann::json metadata_;
  std::map<std::string, Entry> tensors_;
  std::vector<std::string> order_;
};

}  // namespace apus
