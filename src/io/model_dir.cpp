#include "io/model_dir.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "io/files.h"
#include "io/synth.h"
#include "ops/backend.h"

namespace apus {

bool path_exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

Json parse_json(const std::string& text, const std::string& path) {
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    fail(path, ": malformed JSON at byte ", e.byte);
  } catch (const Json::exception& e) {
    // e.g. a number beyond double's range (1e999)
    fail(path, ": unreadable JSON: ", e.what());
  }
}

Json read_json(const std::string& path) { return parse_json(read_file(path), path); }

Config read_config(const std::string& path) {
  Config c{path, read_json(path)};
  APUS_CHECK(c.json.is_object(), path, ": expected a JSON object of settings, found ",
             c.json.type_name());
  return c;
}

bool Config::has(const std::string& key) const {
  consulted->add(prefix + key);
  return json.contains(key) && !json[key].is_null();
}

const Json& Config::at(const std::string& key) const {
  consulted->add(prefix + key);
  APUS_CHECK(json.contains(key), path, ": missing key '", key, "'");
  return json[key];
}

Config Config::object(const std::string& key) const {
  const Json& o = at(key);
  APUS_CHECK(o.is_object(), path, ": '", key, "' is ", o.dump(), ", expected an object of settings");
  return Config{path + " (" + key + ")", o, consulted, prefix + key + "."};
}

void Config::no_effect(std::initializer_list<const char*> keys) const {
  for (const char* key : keys) consulted->add(prefix + key);
}

int64_t Config::get_int(const std::string& key) const {
  consulted->add(prefix + key);
  APUS_CHECK(json.contains(key), path, ": missing key '", key, "'");
  APUS_CHECK(json[key].is_number_integer(), path, ": '", key, "' is ", json[key].dump(),
             ", expected an integer");
  return json[key].get<int64_t>();
}

int64_t Config::get_int(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

namespace {
constexpr int64_t kMaxSize = int64_t(1) << 24;
}

int64_t Config::get_size(const std::string& key, int64_t lo) const {
  const int64_t v = get_int(key);
  APUS_CHECK(v >= lo && v <= kMaxSize, path, ": '", key, "' is ", v, ", expected ", lo, "..",
             kMaxSize);
  return v;
}

int64_t Config::get_size(const std::string& key, int64_t fallback, int64_t lo) const {
  return has(key) ? get_size(key, lo) : fallback;
}

std::vector<int64_t> Config::get_sizes(const std::string& key) const {
  std::vector<int64_t> v = get_ints(key);
  for (int64_t x : v)
    APUS_CHECK(x >= 1 && x <= kMaxSize, path, ": '", key, "' holds ", x, ", expected 1..", kMaxSize);
  return v;
}

double Config::get_double(const std::string& key) const {
  consulted->add(prefix + key);
  APUS_CHECK(json.contains(key), path, ": missing key '", key, "'");
  APUS_CHECK(json[key].is_number(), path, ": '", key, "' is ", json[key].dump(),
             ", expected a number");
  return json[key].get<double>();
}

double Config::get_double(const std::string& key, double fallback) const {
  return has(key) ? get_double(key) : fallback;
}

double Config::get_positive(const std::string& key) const {
  const double v = get_double(key);
  APUS_CHECK(std::isfinite(v) && v > 0, path, ": '", key, "' is ", json[key].dump(),
             ", expected a positive number");
  return v;
}

double Config::get_positive(const std::string& key, double fallback) const {
  return has(key) ? get_positive(key) : fallback;
}

std::string Config::get_string(const std::string& key, const std::string& fallback) const {
  consulted->add(prefix + key);
  if (!json.contains(key) || json[key].is_null()) return fallback;
  APUS_CHECK(json[key].is_string(), path, ": '", key, "' is ", json[key].dump(),
             ", expected a string");
  return json[key].get<std::string>();
}

bool Config::get_bool(const std::string& key, bool fallback) const {
  consulted->add(prefix + key);
  if (!json.contains(key) || json[key].is_null()) return fallback;
  APUS_CHECK(json[key].is_boolean(), path, ": '", key, "' is ", json[key].dump(),
             ", expected true or false");
  return json[key].get<bool>();
}

std::vector<int64_t> Config::get_ints(const std::string& key) const {
  consulted->add(prefix + key);
  APUS_CHECK(json.contains(key), path, ": missing key '", key, "'");
  const Json& a = json[key];
  APUS_CHECK(a.is_array(), path, ": '", key, "' is ", a.dump(), ", expected a list of integers");
  std::vector<int64_t> v;
  for (const Json& x : a) {
    APUS_CHECK(x.is_number_integer(), path, ": '", key, "' holds ", x.dump(),
               ", expected integers");
    v.push_back(x.get<int64_t>());
  }
  return v;
}

WeightSet WeightSet::open_dir(const std::string& dir, Backend* device) {
  WeightSet w;
  w.device_ = device;
  std::vector<std::string> files;
  // diffusers names its files diffusion_pytorch_model*, transformers model*; either may be sharded.
  for (const char* stem : {"diffusion_pytorch_model", "model"}) {
    const std::string index = dir + "/" + stem + ".safetensors.index.json";
    const std::string single = dir + "/" + stem + ".safetensors";
    if (path_exists(index)) {
      const Json j = read_json(index);
      APUS_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), index,
                 ": missing object 'weight_map'");
      std::map<std::string, std::string> shard_of;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        APUS_CHECK(it.value().is_string(), index, ": weight_map['", it.key(),
                   "'] is not a file name");
        const std::string shard = it.value().get<std::string>();
        APUS_CHECK(shard.find('/') == std::string::npos, index, ": shard name '", shard,
                   "' must be a plain file name");
        shard_of[it.key()] = shard;
      }
      std::map<std::string, const SafetensorsFile*> opened;
      for (const auto& [name, shard] : shard_of) {
        if (!opened.count(shard)) {
          w.shards_.push_back(std::make_shared<SafetensorsFile>(
              SafetensorsFile::open(dir + "/" + shard)));
          opened[shard] = w.shards_.back().get();
        }
        const SafetensorsFile* f = opened[shard];
        APUS_CHECK(f->contains(name), f->path(), ": index ", index, " lists tensor '", name,
                   "' but the shard does not hold it");
        w.where_[name] = f;
      }
      w.attach_synthetic_values(dir);
      return w;
    }
    if (path_exists(single)) files.push_back(single);
  }
  APUS_CHECK(!files.empty(), dir,
             ": no weights found (expected diffusion_pytorch_model.safetensors, model.safetensors "
             "or a *.safetensors.index.json)");
  w.shards_.push_back(std::make_shared<SafetensorsFile>(SafetensorsFile::open(files[0])));
  for (const auto& n : w.shards_[0]->names()) w.where_[n] = w.shards_[0].get();
  w.attach_synthetic_values(dir);
  return w;
}

void WeightSet::attach_synthetic_values(const std::string& dir) {
  const std::filesystem::path component = std::filesystem::absolute(dir).lexically_normal();
  for (const std::filesystem::path& root : {component, component.parent_path()}) {
    const std::string marker = (root / kSyntheticValuesFile).string();
    if (!path_exists(marker)) continue;
    const Json j = read_json(marker);
    APUS_CHECK(j.is_object() && j.contains("seed") && j["seed"].is_number_unsigned(), marker,
               ": expected {\"seed\": N} with N a whole number");
    synthetic_seed_ = j["seed"].get<uint64_t>();
    for (const auto& shard : shards_)
      synthetic_rel_[shard.get()] =
          std::filesystem::absolute(shard->path()).lexically_normal().lexically_relative(root).generic_string();
    return;
  }
}

const std::string& WeightSet::file_of(const std::string& name) const {
  get(name);  // refuses a missing tensor naming the files
  return where_.at(name)->path();
}

const Tensor& WeightSet::get(const std::string& name) const {
  auto it = where_.find(name);
  APUS_CHECK(it != where_.end(), "missing tensor '", name, "' in ",
             shards_.empty() ? std::string("(no files)") : shards_[0]->path());
  if (!synthetic_seed_) return it->second->get(name);
  auto made = generated_.find(name);
  if (made == generated_.end()) {
    const Tensor& layout = it->second->get(name);
    Tensor values = Tensor::heap(layout.shape, layout.dtype);
    synth_values(*synthetic_seed_, synthetic_rel_.at(it->second), name, values);
    made = generated_.emplace(name, std::move(values)).first;
  }
  return made->second;
}

WeightSet WeightSet::shapes_only() {
  WeightSet w;
  w.shapes_only_ = true;
  return w;
}

const Tensor& WeightSet::get(const std::string& name, const Shape& expected) const {
  const Tensor& t = host(name, expected);
  if (!device_ || shapes_only_) return t;
  auto it = uploaded_.find(name);
  if (it == uploaded_.end()) {
    it = uploaded_.emplace(name, device_->upload(t)).first;
    generated_.erase(name);  // the device copy is what stays
  }
  return it->second;
}

Tensor WeightSet::place(const Tensor& host_tensor) const {
  return device_ && host_tensor.data ? device_->upload(host_tensor) : host_tensor;
}

const Tensor& WeightSet::host(const std::string& name, const Shape& expected) const {
  fetched_[name] = shape_numel(expected);
  if (shapes_only_) {
    Tensor& t = placeholders_[name];
    t.dtype = DType::bf16;
    t.shape = expected;
    return t;
  }
  const Tensor& t = get(name);
  APUS_CHECK(t.shape == expected, where_.at(name)->path(), ": tensor '", name, "' has shape ",
             shape_str(t.shape), ", expected ", shape_str(expected));
  APUS_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f32 || t.dtype == DType::f16,
             where_.at(name)->path(), ": tensor '", name, "' has dtype ", dtype_name(t.dtype),
             ", expected bf16, f16 or f32");
  return t;
}

bool WeightSet::contains(const std::string& name) const {
  return shapes_only_ || where_.count(name) > 0;
}
size_t WeightSet::count() const { return where_.size(); }

size_t WeightSet::make_resident() const {
  // On a device the copies made at each fetch are what stays, and generated values are in memory
  // from their fetch; the mapping is not read again.
  if (shapes_only_ || device_ || synthetic_seed_) return 0;
  std::vector<const Tensor*> tensors;
  size_t total = 0;
  for (const auto& [name, elements] : fetched_) {
    if (released_.count(name)) continue;
    tensors.push_back(&get(name));
    total += tensors.back()->nbytes();
  }
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  // Read-ahead hint first, then one load per page from both cores.
  for (const Tensor* t : tensors) {
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

void WeightSet::release(const std::string& name) const {
  if (shapes_only_) return;
  if (synthetic_seed_) {
    generated_.erase(name);
    released_.insert(name);
    return;
  }
  const Tensor& t = get(name);
  released_.insert(name);
  // Whole pages inside the tensor only: a neighbour that shares an edge page keeps it.
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data) + t.nbytes()) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

int64_t WeightSet::fetched_elements() const {
  int64_t n = 0;
  for (const auto& [name, elements] : fetched_) n += elements;
  return n;
}

ModelDir ModelDir::open(const std::string& root, bool load_weights, Backend* device) {
  APUS_CHECK(is_directory(root), root, ": model directory does not exist");
  ModelDir m;
  m.root_ = root;
  m.load_weights_ = load_weights;
  m.device_ = device;
  const std::string index = root + "/model_index.json";
  m.index_ = read_json(index);
  APUS_CHECK(m.index_.is_object(), index, ": expected an object naming the pipeline class and its ",
             "components, found ", m.index_.type_name());
  APUS_CHECK(m.index_.contains("_class_name") && m.index_["_class_name"].is_string(), index,
             ": missing the pipeline class '_class_name'");
  return m;
}

std::string ModelDir::pipeline_class() const { return index_["_class_name"].get<std::string>(); }

std::string ModelDir::component_class(const std::string& name) const {
  const Json* entry = index_.contains(name) ? &index_[name] : nullptr;
  APUS_CHECK(entry && entry->is_array() && entry->size() == 2 && (*entry)[1].is_string(), root_,
             "/model_index.json: '", name, "' must be [library, class]");
  return (*entry)[1].get<std::string>();
}

std::string ModelDir::component(const std::string& name) const {
  const std::string p = root_ + "/" + name;
  APUS_CHECK(is_directory(p), p, ": component folder missing (model_index.json lists '", name,
             "')");
  return p;
}

Config ModelDir::config(const std::string& name, const std::string& file) const {
  return read_config(component(name) + "/" + file);
}

}  // namespace apus
