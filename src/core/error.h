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

// A refusal of one field of a request, so a front end can point at it: `field` as the engine's
// request structs name it ("width", "steps", "seconds"; "batch" for a batch's size), or as a
// server route's body does.
class FieldError : public Error {
 public:
  FieldError(const std::string& what, std::string field) : Error(what), field(std::move(field)) {}
  std::string field;
};

// A request ended by its owner's stop flag (Context::stop) between two ops.
class Cancelled : public Error {
 public:
  Cancelled() : Error("cancelled") {}
};

namespace detail {
template <typename... Parts> std::string concat(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}
}  // namespace detail

template <typename... Parts> [[noreturn]] void fail(const Parts&... parts) { throw Error(detail::concat(parts...)); }

}  // namespace apus

#define APUS_CHECK(cond, ...)               \
  do {                                      \
    if (!(cond)) ::apus::fail(__VA_ARGS__); \
  } while (0)

#define APUS_CHECK_FIELD(cond, field, ...)                                             \
  do {                                                                                 \
    if (!(cond)) throw ::apus::FieldError(::apus::detail::concat(__VA_ARGS__), field); \
  } while (0)
