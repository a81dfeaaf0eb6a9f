#pragma once
// What the JSON routes share: a client mistake and its answer, base64 for the files a JSON body
// carries, typed field access refusing with the field's name, and a route's names for the engine's
// request fields.
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "server/http.h"

namespace apus::server {

using Json = nlohmann::json;

// The service's own bounds, on what a request sends rather than what it asks the engine to do
// (whose bounds are the engine's, ImageLimits and AudioLimits, refused with its messages).
constexpr size_t kMaxPrompt = 4000;   // characters
constexpr size_t kMaxReferences = 4;  // reference images per edit
constexpr size_t kMaxLoras = 8;       // adapters per request
constexpr size_t kKeptJobs = 256;     // finished jobs kept for GET /v1/jobs/{id}, oldest dropped first

// A client mistake: the status, the message and the request field it concerns.
struct HttpError {
  int status;
  std::string message, param;
};

[[noreturn]] void refuse(int status, const std::string& message, const std::string& param = "");

// JSON text of an answer; bytes of a client's that are not UTF-8 (echoed in a message) become U+FFFD.
std::string dump(const Json& j);

// An error's answer, as OpenAI's API shapes it.
void send_error(http::Response& res, int status, const std::string& message, const std::string& param);

std::string base64(const std::vector<uint8_t>& bytes);

// Strict base64 (padding optional, no whitespace); nullopt when the text is not base64.
std::optional<std::string> unbase64(const std::string& text);

// Typed field access with errors naming the field.
struct Fields {
  const Json& j;
  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  std::string string(const char* k, const std::string& fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_string()) refuse(400, std::string("'") + k + "' must be a string", k);
    return j[k].get<std::string>();
  }
  int64_t integer(const char* k, int64_t fallback, int64_t lo, int64_t hi) const {
    if (!has(k)) return fallback;
    if (!j[k].is_number_integer()) refuse(400, std::string("'") + k + "' must be an integer", k);
    const int64_t v = j[k].get<int64_t>();
    if (v < lo || v > hi)
      refuse(400,
             std::string("'") + k + "' is " + std::to_string(v) + ", expected " + std::to_string(lo) + ".." +
                 std::to_string(hi),
             k);
    return v;
  }
  double number(const char* k, double fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_number()) refuse(400, std::string("'") + k + "' must be a number", k);
    return j[k].get<double>();
  }
  bool boolean(const char* k, bool fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_boolean()) refuse(400, std::string("'") + k + "' must be true or false", k);
    return j[k].get<bool>();
  }
  // An integer the engine bounds (absent: the model's default); only what an int cannot hold is
  // refused here.
  std::optional<int> setting(const char* k) const {
    if (!has(k)) return std::nullopt;
    return int(integer(k, 0, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  }
  std::optional<uint64_t> seed() const {
    if (!has("seed")) return std::nullopt;
    return uint64_t(integer("seed", 0, 0, (int64_t(1) << 53)));
  }
  std::string prompt() const {
    const std::string p = string("prompt", "");
    if (p.empty()) refuse(400, "'prompt' is required and must not be empty", "prompt");
    if (p.size() > kMaxPrompt)
      refuse(400, "'prompt' is longer than " + std::to_string(kMaxPrompt) + " characters", "prompt");
    return p;
  }
  // OpenAI answers an argument it does not know with 400; so does apus, naming it.
  void only(const std::set<std::string>& known) const {
    for (auto it = j.begin(); it != j.end(); ++it)
      if (!known.count(it.key())) refuse(400, "unrecognized request argument: '" + it.key() + "'", it.key());
  }
};

// A route's names for the engine's request fields where its body calls them otherwise (the
// engine's "batch" is OpenAI's n).
using FieldNames = std::map<std::string, std::string>;
extern const FieldNames kOpenAiImageFields;
extern const FieldNames kA1111Fields;
extern const FieldNames kAudioFields;  // the audio route calls every field as the engine does

// Runs engine code, its refusal of a field renamed to the route's name for that field.
template <typename F> auto as_route(const FieldNames& names, F&& f) {
  try {
    return f();
  } catch (const FieldError& e) {
    const auto it = names.find(e.field);
    if (it == names.end()) throw;
    throw FieldError(e.what(), it->second);
  }
}

// A JSON object body, refused with 400 where it is not one.
Json parse_body(const http::Request& req);

}  // namespace apus::server
