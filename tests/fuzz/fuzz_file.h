#pragma once
// Fuzz inputs reach the loaders as real files, through the same open/read path a user's file
// takes. Any exception other than apus::Error breaks the error contract and is a finding.
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>

#include "core/error.h"
#include "io/files.h"

namespace apus::fuzz {

inline std::string scratch_dir() {
  static const std::string dir = [] {
    std::string d = "/tmp/apus_fuzz_" + std::to_string(::getpid());
    std::string cmd = "mkdir -p " + d;
    if (std::system(cmd.c_str()) != 0) __builtin_trap();
    return d;
  }();
  return dir;
}

// The input as a file already in memory, for parsers that take their bytes (MappedFile).
inline std::shared_ptr<MappedFile> in_memory(const uint8_t* data, size_t size) {
  auto file = std::make_shared<MappedFile>();
  file->path = "fuzz-input";
  file->data = data;
  file->size = size;
  file->mapped = false;
  return file;
}

inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

// Runs f; apus::Error is the documented outcome for bad input, anything else traps.
template <typename F> void expect_only_apus_errors(F&& f) {
  try {
    f();
  } catch (const apus::Error&) {
  } catch (...) {
    __builtin_trap();
  }
}

}  // namespace apus::fuzz
