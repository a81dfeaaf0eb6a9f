#include "io/model_dir.h"

#include <sys/stat.h>

#include <cmath>

#include "core/error.h"
#include "io/files.h"

namespace apus {

bool path_exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_single_file(const std::string& model) { return !model.empty() && path_exists(model) && !is_directory(model); }

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
  APUS_CHECK(c.json.is_object(), path, ": expected a JSON object of settings, found ", c.json.type_name());
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
  APUS_CHECK(json[key].is_number_integer(), path, ": '", key, "' is ", json[key].dump(), ", expected an integer");
  return json[key].get<int64_t>();
}

int64_t Config::get_int(const std::string& key, int64_t fallback) const { return has(key) ? get_int(key) : fallback; }

namespace {
constexpr int64_t kMaxSize = int64_t(1) << 24;
}

int64_t Config::get_size(const std::string& key, int64_t lo) const {
  const int64_t v = get_int(key);
  APUS_CHECK(v >= lo && v <= kMaxSize, path, ": '", key, "' is ", v, ", expected ", lo, "..", kMaxSize);
  return v;
}

int64_t Config::get_size(const std::string& key, int64_t fallback, int64_t lo) const {
  return has(key) ? get_size(key, lo) : fallback;
}

std::vector<int64_t> Config::get_sizes(const std::string& key) const {
  std::vector<int64_t> v = get_ints(key);
  for (int64_t x : v) APUS_CHECK(x >= 1 && x <= kMaxSize, path, ": '", key, "' holds ", x, ", expected 1..", kMaxSize);
  return v;
}

double Config::get_double(const std::string& key) const {
  consulted->add(prefix + key);
  APUS_CHECK(json.contains(key), path, ": missing key '", key, "'");
  APUS_CHECK(json[key].is_number(), path, ": '", key, "' is ", json[key].dump(), ", expected a number");
  return json[key].get<double>();
}

double Config::get_double(const std::string& key, double fallback) const {
  return has(key) ? get_double(key) : fallback;
}

double Config::get_positive(const std::string& key) const {
  const double v = get_double(key);
  APUS_CHECK(std::isfinite(v) && v > 0, path, ": '", key, "' is ", json[key].dump(), ", expected a positive number");
  return v;
}

double Config::get_positive(const std::string& key, double fallback) const {
  return has(key) ? get_positive(key) : fallback;
}

std::string Config::get_string(const std::string& key, const std::string& fallback) const {
  consulted->add(prefix + key);
  if (!json.contains(key) || json[key].is_null()) return fallback;
  APUS_CHECK(json[key].is_string(), path, ": '", key, "' is ", json[key].dump(), ", expected a string");
  return json[key].get<std::string>();
}

bool Config::get_bool(const std::string& key, bool fallback) const {
  consulted->add(prefix + key);
  if (!json.contains(key) || json[key].is_null()) return fallback;
  APUS_CHECK(json[key].is_boolean(), path, ": '", key, "' is ", json[key].dump(), ", expected true or false");
  return json[key].get<bool>();
}

std::vector<int64_t> Config::get_ints(const std::string& key) const {
  consulted->add(prefix + key);
  APUS_CHECK(json.contains(key), path, ": missing key '", key, "'");
  const Json& a = json[key];
  APUS_CHECK(a.is_array(), path, ": '", key, "' is ", a.dump(), ", expected a list of integers");
  std::vector<int64_t> v;
  for (const Json& x : a) {
    APUS_CHECK(x.is_number_integer(), path, ": '", key, "' holds ", x.dump(), ", expected integers");
    v.push_back(x.get<int64_t>());
  }
  return v;
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
  APUS_CHECK(entry && entry->is_array() && entry->size() == 2 && (*entry)[1].is_string(), root_, "/model_index.json: '",
             name, "' must be [library, class]");
  return (*entry)[1].get<std::string>();
}

std::string ModelDir::component(const std::string& name) const {
  const auto given = parts_.find(name);
  const std::string p = given != parts_.end() ? given->second : root_ + "/" + name;
  APUS_CHECK(is_directory(p), p, ": component folder missing (model_index.json lists '", name, "')");
  return p;
}

std::string ModelDir::part(const std::string& name) const {
  const auto given = parts_.find(name);
  return given != parts_.end() ? given->second : component(name);
}

WeightLoader ModelDir::weights(const std::string& name) const {
  const auto given = sources_.find(name);
  std::shared_ptr<const WeightSource> source;
  if (!load_weights_)
    source = given != sources_.end()
                 ? std::shared_ptr<const WeightSource>(std::make_shared<StoredShapes>(given->second))
                 : std::make_shared<ShapesOnly>();
  else source = given != sources_.end() ? given->second : open_weights(component(name));
  const WeightLoader stored(source, device_);
  const auto t = transform(name);
  return t ? stored.with(t) : stored;
}

std::shared_ptr<const WeightTransform> ModelDir::transform(const std::string& component) const {
  const auto it = transforms_.find(component);
  return it != transforms_.end() ? it->second : nullptr;
}

ModelDir& ModelDir::use_transform(const std::string& component, std::shared_ptr<const WeightTransform> transform) {
  transforms_[component] = std::move(transform);
  return *this;
}

ModelDir& ModelDir::use_weights(const std::string& component, std::shared_ptr<const WeightSource> source) {
  sources_[component] = std::move(source);
  return *this;
}

ModelDir& ModelDir::use_part(const std::string& component, const std::string& path) {
  APUS_CHECK(path_exists(path), path, ": no such file or folder (expected the ", component, ")");
  parts_[component] = path;
  return *this;
}

ModelDir& ModelDir::set_label(std::string label) {
  label_ = std::move(label);
  return *this;
}

ModelDir ModelDir::without_weights() const {
  ModelDir m = *this;
  m.load_weights_ = false;
  return m;
}

Config ModelDir::config(const std::string& name, const std::string& file) const {
  return read_config(component(name) + "/" + file);
}

}  // namespace apus
