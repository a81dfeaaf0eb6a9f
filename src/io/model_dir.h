#pragma once
// A diffusers-layout model directory: model_index.json plus one folder per component.
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "io/weights/weight_source.h"

namespace apus {

using Json = nlohmann::json;

// Every JSON the engine reads goes through these: any library exception (syntax, a number
// beyond double's range) becomes apus::Error naming the file.
Json parse_json(const std::string& text, const std::string& path);
Json read_json(const std::string& path);

// Typed config access whose errors name the file and key.
// The keys a Config's readers consulted (models read their configs from several request threads).
class ConsultedKeys {
 public:
  void add(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    keys_.insert(key);
  }
  bool contains(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return keys_.count(key) > 0;
  }

 private:
  mutable std::mutex mutex_;
  std::set<std::string> keys_;
};

struct Config {
  std::string path;
  Json json;
  // The keys consulted through the methods below, shared by copies: a test holds them against the
  // keys the official classes read, so that none is silently ignored.
  std::shared_ptr<ConsultedKeys> consulted = std::make_shared<ConsultedKeys>();
  // A nested object's keys are recorded under its path: "encoder.hidden_size".
  std::string prefix;
  bool has(const std::string& key) const;        // present and not null
  const Json& at(const std::string& key) const;  // present (null allowed); refused when missing
  // A nested object of settings (refused if not one), recording its keys in this Config's set.
  Config object(const std::string& key) const;
  // Official keys that leave inference unchanged (training, generation or export settings):
  // consulted, so the walk over the official keys finds them accounted for.
  void no_effect(std::initializer_list<const char*> keys) const;
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  // A size or count: an integer in [lo, 2^24], so a hostile config cannot reach a zero divisor,
  // a negative shape or an allocation overflow.
  int64_t get_size(const std::string& key, int64_t lo = 1) const;
  int64_t get_size(const std::string& key, int64_t fallback, int64_t lo) const;
  double get_double(const std::string& key) const;
  double get_double(const std::string& key, double fallback) const;
  // Finite and > 0 (an eps, a RoPE base): zero or negative values make the arithmetic meaningless.
  double get_positive(const std::string& key) const;
  double get_positive(const std::string& key, double fallback) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::vector<int64_t> get_ints(const std::string& key) const;
  std::vector<int64_t> get_sizes(const std::string& key) const;  // each in [1, 2^24]
};
Config read_config(const std::string& path);

class ModelDir {
 public:
  // With load_weights false, weights() never opens a file (configs only, for cost counting). With
  // a device backend, weights() hands out the device copies of what the models fetch.
  static ModelDir open(const std::string& root, bool load_weights = true, Backend* device = nullptr);
  const std::string& root() const { return root_; }
  // path of the folder, checked to exist (a folder given by use_part first)
  std::string component(const std::string& name) const;
  // What use_part gave for the component (a folder or a file), else its folder.
  std::string part(const std::string& name) const;
  Config config(const std::string& name, const std::string& file = "config.json") const;
  WeightLoader weights(const std::string& name) const;
  const Json& index() const { return index_; }
  Backend* device() const { return device_; }  // null: the CPU
  // model_index.json's `_class_name` ("Flux2KleinPipeline"), checked to be present at open().
  std::string pipeline_class() const;
  // The class model_index.json gives a component ("Flux2Transformer2DModel").
  std::string component_class(const std::string& name) const;

  // A model assembled from parts: `component`'s weights from `source` (a single file) instead of
  // its folder; the component itself (configs, a tokenizer) at `path`, a folder or, where the
  // component is one file (a tokenizer inside a GGUF), that file.
  ModelDir& use_weights(const std::string& component, std::shared_ptr<const WeightSource> source);
  ModelDir& use_part(const std::string& component, const std::string& path);
  // `component`'s weights through `transform` (the int8 tier's quantisation), in counting too.
  ModelDir& use_transform(const std::string& component, std::shared_ptr<const WeightTransform> transform);
  std::shared_ptr<const WeightTransform> transform(const std::string& component) const;  // null: none
  // What the model is called (a PNG's metadata): model_label(root) unless set.
  const std::string& label() const { return label_; }
  ModelDir& set_label(std::string label);
  // The same parts without weights: what counting loads (a source given by use_weights priced at
  // its stored dtypes).
  ModelDir without_weights() const;

 private:
  std::string root_, label_;
  Json index_;
  bool load_weights_ = true;
  Backend* device_ = nullptr;
  std::map<std::string, std::shared_ptr<const WeightSource>> sources_;
  std::map<std::string, std::string> parts_;
  std::map<std::string, std::shared_ptr<const WeightTransform>> transforms_;
};

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// Whether --model names one file (a transformer checkpoint) rather than a folder or a name.
bool is_single_file(const std::string& model);

}  // namespace apus
