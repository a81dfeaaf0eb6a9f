#pragma once
// A library the CUDA backend opens at run time (cuBLASLt, cuDNN, NCCL) rather than links: a
// binary built with the backend starts where they are absent, and only what needs one refuses.
#include <dlfcn.h>

#include <initializer_list>
#include <string>
#include <type_traits>

#include "core/error.h"

namespace apus::cuda {

class LoadedLibrary {
 public:
  // The first of `files` that opens (the versioned name first); `what` names the library in
  // missing() ("NCCL").
  LoadedLibrary(const char* what, std::initializer_list<const char*> files) : what_(what) {
    for (const char* file : files)
      if ((handle_ = dlopen(file, RTLD_NOW | RTLD_LOCAL))) return;
    missing_ = detail::concat("cannot open ", what, " (", *files.begin(), "): ", dlerror());
  }
  // f = the library's function `name`; where the library is absent or lacks it, f stays null and
  // missing() says so (the first thing missing).
  template <typename F> void function(F& f, const char* name) {
    f = handle_ ? reinterpret_cast<std::remove_reference_t<F>>(dlsym(handle_, name)) : nullptr;
    if (!f && missing_.empty()) missing_ = detail::concat(what_, " has no ", name);
  }
  // Why the library or one of its functions is missing; empty when everything asked for is there.
  const std::string& missing() const { return missing_; }

 private:
  const char* what_;
  void* handle_ = nullptr;
  std::string missing_;
};

}  // namespace apus::cuda
