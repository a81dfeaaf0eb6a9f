#include "io/weights/weight_source.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/scaled_codes.h"
#include "io/model_dir.h"
#include "io/weights/synth.h"
#include "ops/backend.h"

namespace apus {

Tensor WeightSource::fetch_rows(const std::string& name, const Shape& expected, const std::vector<Share>& rows) const {
  const Tensor whole = fetch(name, expected);
  APUS_CHECK(whole.rank() >= 1 && !whole.encoding.block_scales, where(name),
             ": a weight with block scales is not split over ranks yet (parallel tensor)");
  const Tensor part = rows_copy(whole, rows);
  if (whole.data) release(name);
  return part;
}

std::shared_ptr<const SafetensorsFolder> SafetensorsFolder::open(const std::string& dir) {
  auto w = std::make_shared<SafetensorsFolder>();
  std::vector<std::string> files;
  // diffusers names its files diffusion_pytorch_model*, transformers model*; either may be sharded.
  for (const char* stem : {"diffusion_pytorch_model", "model"}) {
    const std::string index = dir + "/" + stem + ".safetensors.index.json";
    const std::string single = dir + "/" + stem + ".safetensors";
    if (path_exists(index)) {
      const Json j = read_json(index);
      APUS_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), index, ": missing object 'weight_map'");
      std::map<std::string, std::string> shard_of;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        APUS_CHECK(it.value().is_string(), index, ": weight_map['", it.key(), "'] is not a file name");
        const std::string shard = it.value().get<std::string>();
        APUS_CHECK(shard.find('/') == std::string::npos, index, ": shard name '", shard, "' must be a plain file name");
        shard_of[it.key()] = shard;
      }
      std::map<std::string, const SafetensorsFile*> opened;
      for (const auto& [name, shard] : shard_of) {
        if (!opened.count(shard)) {
          w->shards_.push_back(std::make_shared<SafetensorsFile>(SafetensorsFile::open(dir + "/" + shard)));
          opened[shard] = w->shards_.back().get();
        }
        const SafetensorsFile* f = opened[shard];
        APUS_CHECK(f->contains(name), f->path(), ": index ", index, " lists tensor '", name,
                   "' but the shard does not hold it");
        w->where_[name] = f;
      }
      return w;
    }
    if (path_exists(single)) files.push_back(single);
  }
  APUS_CHECK(!files.empty(), dir,
             ": no weights found (expected diffusion_pytorch_model.safetensors, model.safetensors "
             "or a *.safetensors.index.json)");
  w->shards_.push_back(std::make_shared<SafetensorsFile>(SafetensorsFile::open(files[0])));
  for (const auto& n : w->shards_[0]->names()) w->where_[n] = w->shards_[0].get();
  return w;
}

const Tensor& SafetensorsFolder::stored(const std::string& name) const {
  auto it = where_.find(name);
  APUS_CHECK(it != where_.end(), "missing tensor '", name, "' in ",
             shards_.empty() ? std::string("(no files)") : shards_[0]->path());
  return it->second->get(name);
}

const std::string& SafetensorsFolder::file_of(const std::string& name) const {
  stored(name);  // refuses a missing tensor naming the files
  return where_.at(name)->path();
}

std::string SafetensorsFolder::where(const std::string& name) const {
  return file_of(name) + ": tensor '" + name + "'";
}

std::vector<std::string> SafetensorsFolder::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

Tensor SafetensorsFolder::fetch(const std::string& name, const Shape& expected) const {
  const Tensor& t = stored(name);
  APUS_CHECK(t.shape == expected, file_of(name), ": tensor '", name, "' has shape ", shape_str(t.shape), ", expected ",
             shape_str(expected));
  APUS_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f32 || t.dtype == DType::f16, file_of(name), ": tensor '",
             name, "' has dtype ", dtype_name(t.dtype), ", expected bf16, f16 or f32");
  return t;
}

size_t SafetensorsFolder::make_resident(const std::vector<std::string>& names) const {
  std::vector<const Tensor*> tensors;
  for (const std::string& name : names)
    if (!released_.count(name)) tensors.push_back(&stored(name));
  return read_pages(std::move(tensors));
}

void SafetensorsFolder::release(const std::string& name) const {
  const Tensor& t = stored(name);
  released_.insert(name);
  if (where_.at(name)->maps(t)) drop_pages(t);
}

size_t read_pages(std::vector<const Tensor*> tensors) {
  std::sort(tensors.begin(), tensors.end());
  tensors.erase(std::unique(tensors.begin(), tensors.end()), tensors.end());
  size_t total = 0;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  // Read-ahead hint first, then one load per page from both cores.
  for (const Tensor* t : tensors) {
    total += t->nbytes();
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t->data) & ~(page - 1);
    const uintptr_t end = reinterpret_cast<uintptr_t>(t->data) + t->nbytes();
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_WILLNEED);
  }
  uint64_t checksum = 0;
#pragma omp parallel for schedule(dynamic) reduction(+ : checksum)
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto* p = static_cast<const volatile uint8_t*>(tensors[i]->data);
    for (size_t off = 0; off < tensors[i]->nbytes(); off += page) checksum += p[off];
  }
  (void)checksum;
  return total;
}

void drop_pages(const Tensor& t) {
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data) + t.nbytes()) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

SyntheticValues::SyntheticValues(std::shared_ptr<const SafetensorsFolder> layout, uint64_t seed, std::string root)
    : layout_(std::move(layout)), seed_(seed), root_(std::move(root)) {}

Tensor SyntheticValues::fetch(const std::string& name, const Shape& expected) const {
  const Tensor& layout = layout_->fetch(name, expected);
  Tensor values = Tensor::heap(layout.shape, layout.dtype);
  const std::string rel =
      std::filesystem::absolute(layout_->file_of(name)).lexically_normal().lexically_relative(root_).generic_string();
  synth_values(seed_, rel, name, values);
  return values;
}

std::shared_ptr<const WeightSource> open_weights(const std::string& dir) {
  std::shared_ptr<const SafetensorsFolder> folder = SafetensorsFolder::open(dir);
  const std::filesystem::path component = std::filesystem::absolute(dir).lexically_normal();
  for (const std::filesystem::path& root : {component, component.parent_path()}) {
    const std::string marker = (root / kSyntheticValuesFile).string();
    if (!path_exists(marker)) continue;
    const Json j = read_json(marker);
    APUS_CHECK(j.is_object() && j.contains("seed") && j["seed"].is_number_unsigned(), marker,
               ": expected {\"seed\": N} with N a whole number");
    return std::make_shared<SyntheticValues>(std::move(folder), j["seed"].get<uint64_t>(), root.string());
  }
  return folder;
}

Tensor ConvertTo::apply(const std::string& name, const Tensor& stored) const {
  if (stored.dtype == dtype_ || (is_stored_quantized(stored.dtype) && name.ends_with(".weight"))) return stored;
  return stored.data ? to_dtype(stored, dtype_) : Tensor::shape_only(stored.shape, dtype_);
}

namespace {

// `inner` with `transform` applied to what it hands out.
class TransformedSource final : public WeightSource {
 public:
  TransformedSource(std::shared_ptr<const WeightSource> inner, std::shared_ptr<const WeightTransform> transform)
      : inner_(std::move(inner)), transform_(std::move(transform)) {}
  bool contains(const std::string& name) const override { return inner_->contains(name); }
  Tensor fetch_rows(const std::string& name, const Shape& expected, const std::vector<Share>& rows) const override {
    return transform_->apply(name, inner_->fetch_rows(name, expected, rows));
  }
  Tensor fetch(const std::string& name, const Shape& expected) const override {
    const Tensor stored = inner_->fetch(name, expected);
    Tensor out = transform_->apply(name, stored);
    // The model reads the transform's copy only.
    if (stored.data && out.data != stored.data) inner_->release(name);
    return out;
  }
  std::string where(const std::string& name) const override { return inner_->where(name); }
  size_t make_resident(const std::vector<std::string>& names) const override { return inner_->make_resident(names); }
  void release(const std::string& name) const override { inner_->release(name); }

 private:
  std::shared_ptr<const WeightSource> inner_;
  std::shared_ptr<const WeightTransform> transform_;
};

// What holding t takes: its values and, for a code format, its blocks' factors.
size_t held_size(const Tensor& t) {
  return t.nbytes() + (t.encoding.block_scales ? t.encoding.block_scales->factors.nbytes() : 0);
}

}  // namespace

WeightLoader::WeightLoader(std::shared_ptr<const WeightSource> source, Backend* device)
    : source_(std::move(source)),
      device_(device),
      fetched_(std::make_shared<std::map<std::string, Shape>>()),
      held_(std::make_shared<std::map<std::string, size_t>>()) {}

WeightLoader WeightLoader::with(std::shared_ptr<const WeightTransform> transform) const {
  WeightLoader w = *this;
  w.source_ = std::make_shared<TransformedSource>(source_, std::move(transform));
  return w;
}

Tensor WeightLoader::host(const std::string& name, const Shape& expected) const {
  const auto entry = fetched_->insert_or_assign(name, expected).first;
  Tensor t = source_->fetch(name, expected);
  t.weight_name = &entry->first;
  return t;
}

Tensor WeightLoader::get(const std::string& name, const Shape& expected) const {
  const Tensor host_tensor = host(name, expected);
  Tensor t = place(host_tensor);
  t.weight_name = host_tensor.weight_name;
  (*held_)[name] = held_size(host_tensor);
  return t;
}

Tensor WeightLoader::get_rows(const std::string& name, const Shape& expected, const std::vector<Share>& rows) const {
  const Tensor host_tensor = source_->fetch_rows(name, expected, rows);
  Tensor t = place(host_tensor);
  t.weight_name = &fetched_->insert_or_assign(name, t.shape).first->first;
  (*held_)[name] = held_size(host_tensor);
  return t;
}

size_t WeightLoader::held_bytes() const {
  size_t n = 0;
  for (const auto& [name, bytes] : *held_) n += bytes;
  return n;
}

Tensor WeightLoader::place(const Tensor& host_tensor) const {
  return device_ && host_tensor.data ? device_->upload(host_tensor) : host_tensor;
}

int64_t WeightLoader::fetched_elements() const {
  int64_t n = 0;
  for (const auto& [name, shape] : *fetched_) n += shape_numel(shape);
  return n;
}

size_t WeightLoader::make_resident() const {
  if (device_) return 0;
  std::vector<std::string> names;
  for (const auto& [name, shape] : *fetched_) names.push_back(name);
  return source_->make_resident(names);
}

}  // namespace apus
