// libFuzzer target for the request bodies the server parses before any route logic: JSON objects
// (any bytes: an object, or apus::Error saying what is wrong; the answer that echoes it always
// serialises) and multipart/form-data (the input's first line is the boundary, the rest the body:
// parts whose content lies inside the body, each named, or apus::Error) and a target's query.
#include <cstring>
#include <string>

#include "fuzz_file.h"
#include "server/bodies.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  apus::fuzz::expect_only_apus_errors([&] {
    const nlohmann::json j = apus::server::parse_json_object(input);
    if (!j.is_object()) __builtin_trap();
    (void)j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  });
  try {
    (void)apus::server::parse_json_object(input);
  } catch (const apus::Error& e) {
    // The refusal itself goes out as JSON text.
    (void)nlohmann::json{{"message", e.what()}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  // A query: any value found came out of the target's text (never longer than it).
  for (const char* name : {"limit", "", "a b"})
    if (const std::optional<std::string> v = apus::server::query_value(input, name); v && v->size() > input.size())
      __builtin_trap();
  const size_t eol = input.find('\n');
  if (eol == std::string::npos) return 0;
  const std::string type = "multipart/form-data; boundary=" + input.substr(0, eol), body = input.substr(eol + 1);
  apus::fuzz::expect_only_apus_errors([&] {
    for (const apus::server::FormPart& part : apus::server::parse_multipart(type, body))
      if (part.name.empty() || part.content.size() > body.size() ||
          (!part.content.empty() && body.find(part.content) == std::string::npos))
        __builtin_trap();
  });
  return 0;
}
