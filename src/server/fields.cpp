#include "server/fields.h"

#include "server/bodies.h"

namespace apus::server {

const FieldNames kOpenAiImageFields = {{"width", "size"}, {"height", "size"}, {"batch", "n"}};
const FieldNames kA1111Fields = {
    {"batch", "batch_size"}, {"cfg", "cfg_scale"}, {"images", "init_images"}, {"strength", "denoising_strength"}};
const FieldNames kAudioFields = {};

[[noreturn]] void refuse(int status, const std::string& message, const std::string& param) {
  throw HttpError{status, message, param};
}

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

void send_error(http::Response& res, int status, const std::string& message, const std::string& param) {
  const char* type = status == 401   ? "authentication_error"
                     : status == 429 ? "rate_limit_error"
                     : status >= 500 ? "server_error"
                                     : "invalid_request_error";
  Json err = {{"message", message}, {"type", type}, {"param", param.empty() ? Json() : Json(param)}};
  res.status = status;
  res.set_content(dump(Json{{"error", err}}), "application/json");
}

std::string base64(const std::vector<uint8_t>& bytes) {
  static const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const uint32_t v = uint32_t(bytes[i]) << 16 | (i + 1 < bytes.size() ? uint32_t(bytes[i + 1]) << 8 : 0) |
                       (i + 2 < bytes.size() ? uint32_t(bytes[i + 2]) : 0);
    out += table[(v >> 18) & 63];
    out += table[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? table[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? table[v & 63] : '=';
  }
  return out;
}

std::optional<std::string> unbase64(const std::string& text) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  size_t n = text.size();
  while (n > 0 && text[n - 1] == '=' && text.size() - n < 2) --n;
  std::string out;
  out.reserve(n * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = value(text[i]);
    if (v < 0) return std::nullopt;
    acc = acc << 6 | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((acc >> bits) & 0xff));
    }
  }
  if (n % 4 == 1) return std::nullopt;
  return out;
}

Json parse_body(const http::Request& req) {
  try {
    return parse_json_object(req.body);
  } catch (const Error& e) {
    refuse(400, e.what());
  }
}

}  // namespace apus::server
