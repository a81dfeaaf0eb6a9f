#pragma once
// The one way weights reach a model. A WeightSource hands tensors by the names a model asks for;
// a WeightTransform changes each tensor as it is fetched; a WeightLoader is what a model's load
// function takes: a source with its transforms, the device the tensors go to, and the record of
// what the model fetched.
//
// The dtype convention: a source hands tensors as stored (bf16, f16 or f32); a transform may change
// the dtype; a model converts what it receives to its compute dtype where the op needs it. Klein's
// models and SA3's text encoder and duration embedder hold what they receive and their ops convert
// per call; SA3's DiT and SAME chain ConvertTo(compute) on the tensors they compute with (the
// official model.to(dtype)), so a resident one serves one precision.
//
// A new checkpoint format is one WeightSource class; a LoRA merge or a dequantisation is one
// WeightTransform class.
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/share.h"
#include "core/tensor.h"
#include "io/weights/safetensors.h"

namespace apus {

class Backend;

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool contains(const std::string& name) const = 0;
  // Tensor `name` in host memory, checked to have shape `expected` (errors name the file and the
  // stored name); in counting mode, a tensor of that shape without data.
  virtual Tensor fetch(const std::string& name, const Shape& expected) const = 0;
  // The tensor fetch would hand, its shape and stored dtype without data: what counting prices.
  virtual Tensor describe(const std::string& name, const Shape& expected) const {
    const Tensor t = fetch(name, expected);
    return Tensor::shape_only(t.shape, t.dtype);
  }
  // Rows `rows` of the tensor fetch would hand (`expected` its whole shape), one range after
  // another, in a copy of their own: a rank's share of a weight under tensor parallelism. The
  // whole tensor's pages are released, so only the copy stays resident.
  virtual Tensor fetch_rows(const std::string& name, const Shape& expected, const std::vector<Share>& rows) const;
  // "FILE: tensor 'STORED NAME'", for errors about a fetched tensor's values.
  virtual std::string where(const std::string& name) const = 0;
  // Reads the named tensors' pages into memory now, so that loading (disk or page cache) is timed
  // as loading and not inside the first forward. Returns the bytes made resident.
  virtual size_t make_resident(const std::vector<std::string>& names) const = 0;
  // A fetched tensor the model holds a copy of instead: its stored pages leave this process's
  // resident set (they stay in the page cache) and make_resident skips it.
  virtual void release(const std::string& name) const = 0;
};

// Name and the tensor as the source below hands it -> the tensor the model receives. In counting
// mode `stored` has no data and the result is the data-less tensor the model would receive.
class WeightTransform {
 public:
  virtual ~WeightTransform() = default;
  virtual Tensor apply(const std::string& name, const Tensor& stored) const = 0;
};

// A diffusers or transformers component folder: diffusion_pytorch_model.safetensors or
// model.safetensors, either possibly sharded through its *.index.json. Tensors are mmap views.
class SafetensorsFolder final : public WeightSource {
 public:
  static std::shared_ptr<const SafetensorsFolder> open(const std::string& dir);
  bool contains(const std::string& name) const override { return where_.count(name) > 0; }
  // Also refuses a dtype other than bf16, f16 or f32.
  Tensor fetch(const std::string& name, const Shape& expected) const override;
  std::string where(const std::string& name) const override;
  size_t make_resident(const std::vector<std::string>& names) const override;
  void release(const std::string& name) const override;
  // The tensor as stored, unchecked; refuses a missing name naming the files.
  const Tensor& stored(const std::string& name) const;
  const std::string& file_of(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::vector<std::shared_ptr<SafetensorsFile>> shards_;
  std::map<std::string, const SafetensorsFile*> where_;
  mutable std::set<std::string> released_;
};

// A checkpoint made by synth_on_demand: the files give names, dtypes and shapes (their data is a
// hole), and each tensor's values are generated as it is fetched, byte for byte what
// synth_checkpoint writes.
class SyntheticValues final : public WeightSource {
 public:
  // root: the checkpoint's root, which the generated values' file paths are relative to.
  SyntheticValues(std::shared_ptr<const SafetensorsFolder> layout, uint64_t seed, std::string root);
  bool contains(const std::string& name) const override { return layout_->contains(name); }
  Tensor fetch(const std::string& name, const Shape& expected) const override;
  std::string where(const std::string& name) const override { return layout_->where(name); }
  // Generated values are in memory from their fetch and own no file pages.
  size_t make_resident(const std::vector<std::string>&) const override { return 0; }
  void release(const std::string&) const override {}

 private:
  std::shared_ptr<const SafetensorsFolder> layout_;
  uint64_t seed_;
  std::string root_;
};

// No files: every name is there, as a bf16 tensor of the expected shape without data. The cost
// model runs the model code over these.
class ShapesOnly final : public WeightSource {
 public:
  bool contains(const std::string&) const override { return true; }
  Tensor fetch(const std::string&, const Shape& expected) const override {
    return Tensor::shape_only(expected, DType::bf16);
  }
  std::string where(const std::string& name) const override { return "(no files): tensor '" + name + "'"; }
  size_t make_resident(const std::vector<std::string>&) const override { return 0; }
  void release(const std::string&) const override {}
};

// Counting a model whose weights were given as a source (a single file): each tensor's shape and
// the dtype it is stored in (a GGUF's blocks priced at their bytes), never its data.
class StoredShapes final : public WeightSource {
 public:
  explicit StoredShapes(std::shared_ptr<const WeightSource> source) : source_(std::move(source)) {}
  bool contains(const std::string& name) const override { return source_->contains(name); }
  Tensor fetch(const std::string& name, const Shape& expected) const override {
    return source_->describe(name, expected);
  }
  std::string where(const std::string& name) const override { return source_->where(name); }
  size_t make_resident(const std::vector<std::string>&) const override { return 0; }
  void release(const std::string&) const override {}

 private:
  std::shared_ptr<const WeightSource> source_;
};

// The pages of mapped tensors read in now, from both cores (each tensor once); returns the bytes.
size_t read_pages(std::vector<const Tensor*> tensors);
// A mapped tensor's whole pages out of this process's resident set (a neighbour sharing an edge
// page keeps it); they stay in the page cache.
void drop_pages(const Tensor& t);

// A component folder's weights: SyntheticValues where the folder or the one above holds
// kSyntheticValuesFile (a checkpoint synth_on_demand made), else the SafetensorsFolder.
std::shared_ptr<const WeightSource> open_weights(const std::string& dir);

// Every tensor in `dtype`, but a quantised weight (GGUF blocks, fp8 and the like), which stays as
// stored: the linear decodes it a panel at a time (ops/cpu/linear.cpp), never the whole model.
class ConvertTo final : public WeightTransform {
 public:
  explicit ConvertTo(DType dtype) : dtype_(dtype) {}
  Tensor apply(const std::string& name, const Tensor& stored) const override;

 private:
  DType dtype_;
};

class WeightLoader {
 public:
  // device: where get() puts what it hands out; null: the CPU.
  explicit WeightLoader(std::shared_ptr<const WeightSource> source, Backend* device = nullptr);
  // This loader with `transform` applied to every tensor fetched through the result, after the
  // transforms already chained; the record of fetched tensors is shared.
  WeightLoader with(std::shared_ptr<const WeightTransform> transform) const;
  // The tensor the model holds: fetched, transformed, and on a device its device copy.
  Tensor get(const std::string& name, const Shape& expected) const;
  // Rows `rows` of it (`expected` its whole shape) as one tensor, fetched and transformed on their
  // own: a rank's share under tensor parallelism. Recorded with the shape it has.
  Tensor get_rows(const std::string& name, const Shape& expected, const std::vector<Share>& rows) const;
  // The same in host memory, for what a model computes from its weights at load; place() puts such
  // a result where get() would: the device copy of a host tensor, or itself.
  Tensor host(const std::string& name, const Shape& expected) const;
  Tensor place(const Tensor& host_tensor) const;
  bool contains(const std::string& name) const { return source_->contains(name); }
  std::string where(const std::string& name) const { return source_->where(name); }
  // Elements of the distinct tensors fetched: the parameters a model uses, in both modes.
  int64_t fetched_elements() const;
  // Bytes of the distinct tensors get() and get_rows() handed out (as transformed: an int8 tier's
  // codes and scales, a bf16 copy), in both modes: what a model holding them keeps in memory.
  size_t held_bytes() const;
  // Every tensor fetched, by name, with the shape the model asked for.
  const std::map<std::string, Shape>& fetched() const { return *fetched_; }
  // The fetched tensors' pages read in (nothing on a device: the copies are what stays).
  size_t make_resident() const;

 private:
  std::shared_ptr<const WeightSource> source_;
  Backend* device_;
  std::shared_ptr<std::map<std::string, Shape>> fetched_;
  std::shared_ptr<std::map<std::string, size_t>> held_;
};

}  // namespace apus
