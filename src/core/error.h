#pragma once
// Errors carry the context a user needs to act: the file, tensor or value and what was expected.
#include <sstream>
#include <stdexcept>
#include <string>

namespace apus {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}
}  // namespace detail

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw Error(detail::concat(parts...));
}

}  // namespace apus

#define APUS_CHECK(cond, ...)                 \
  do {                                        \
    if (!(cond)) ::apus::fail(__VA_ARGS__);   \
  } while (0)
