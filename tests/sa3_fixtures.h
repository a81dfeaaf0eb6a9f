#pragma once
// The tiny Stable Audio 3 checkpoints the tests run, assembled from the fixtures by links, once
// per test process: diffusers' folders and the official single-checkpoint layout.
#include <unistd.h>

#include <filesystem>
#include <string>

#include "test_util.h"

namespace apus::test {

// The diffusers layout of the tiny pipeline: its own folder plus the stage fixtures linked in,
// made once per test process.
inline const std::string& pipeline_dir() {
  static const std::string dir = [] {
    const std::string d = ::testing::TempDir() + "apus_sa3_pipeline_" + std::to_string(::getpid());
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    const std::pair<const char*, const char*> parts[] = {
        {"model_index.json", "sa3_tiny/pipeline/model_index.json"},
        {"scheduler", "sa3_tiny/pipeline/scheduler"},
        {"duration_embedder", "sa3_tiny/pipeline/duration_embedder"},
        {"transformer", "sa3_tiny/dit_diff"},
        {"vae", "sa3_tiny/same_l"},
        {"text_encoder", "t5gemma_tiny"},
        {"tokenizer", "t5gemma_tok"}};
    for (const auto& [name, part] : parts)
      std::filesystem::create_symlink(std::filesystem::absolute(fixture(part)), d + "/" + name);
    return d;
  }();
  return dir;
}

// The same tiny model in the official single-checkpoint layout: model_config.json and
// model.safetensors, the T5Gemma folder beside them.
inline const std::string& official_dir() {
  static const std::string dir = [] {
    const std::string d = ::testing::TempDir() + "apus_sa3_official_" + std::to_string(::getpid());
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d + "/t5gemma-b-b-ul2");
    const std::pair<const char*, const char*> parts[] = {
        {"model_config.json", "sa3_tiny/original/model_config.json"},
        {"model.safetensors", "sa3_tiny/original/model.safetensors"},
        {"t5gemma-b-b-ul2/config.json", "t5gemma_tiny/config.json"},
        {"t5gemma-b-b-ul2/model.safetensors", "t5gemma_tiny/model.safetensors"},
        {"t5gemma-b-b-ul2/tokenizer.model", "t5gemma_tok/tokenizer.model"},
        {"t5gemma-b-b-ul2/tokenizer_config.json", "t5gemma_tok/tokenizer_config.json"}};
    for (const auto& [name, part] : parts)
      std::filesystem::create_symlink(std::filesystem::absolute(fixture(part)), d + "/" + name);
    return d;
  }();
  return dir;
}

// A small model (plain-attention DiT, SAME-S) in the official layout.
inline const std::string& official_small_dir() {
  static const std::string dir = [] {
    const std::string d = ::testing::TempDir() + "apus_sa3_small_" + std::to_string(::getpid());
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    std::filesystem::create_symlink(std::filesystem::absolute(fixture("sa3_tiny/original_small/model_config.json")), d + "/model_config.json");
    std::filesystem::create_symlink(std::filesystem::absolute(fixture("sa3_tiny/original_small/model.safetensors")), d + "/model.safetensors");
    std::filesystem::create_symlink(std::filesystem::absolute(official_dir() + "/t5gemma-b-b-ul2"), d + "/t5gemma-b-b-ul2");
    return d;
  }();
  return dir;
}

// A copy of the pipeline folder (links) with one part replaced by a real folder the test spoils.
}  // namespace apus::test
