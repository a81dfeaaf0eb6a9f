#include "server/bodies.h"

#include <algorithm>
#include <cctype>

#include "core/error.h"

namespace apus::server {

namespace {

constexpr size_t kMaxParts = 64;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// The parameters after a header's first `;`: name=value or name="quoted \" value", names lowered.
std::vector<std::pair<std::string, std::string>> parameters(const std::string& value, const std::string& what) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t i = value.find(';');
  while (i != std::string::npos && i < value.size()) {
    ++i;
    while (i < value.size() && (value[i] == ' ' || value[i] == '\t')) ++i;
    const size_t eq = value.find('=', i);
    if (eq == std::string::npos) break;
    const std::string name = lower(trim(value.substr(i, eq - i)));
    std::string v;
    i = eq + 1;
    if (i < value.size() && value[i] == '"') {
      for (++i; i < value.size() && value[i] != '"'; ++i)
        v += value[i] == '\\' && i + 1 < value.size() ? value[++i] : value[i];
      APUS_CHECK(i < value.size(), what, ": parameter ", name, " opens a quote it never closes");
      i = value.find(';', i);
    } else {
      const size_t end = value.find(';', i);
      v = trim(value.substr(i, end == std::string::npos ? std::string::npos : end - i));
      i = end;
    }
    out.emplace_back(name, v);
  }
  return out;
}

std::string parameter(const std::vector<std::pair<std::string, std::string>>& params, const std::string& name) {
  for (const auto& [k, v] : params)
    if (k == name) return v;
  return "";
}

// Where the delimiter line that ends a part's content starts (its CRLF), from `from`: CRLF, the
// delimiter, then "--" or optional blanks and CRLF. The delimiter followed by anything else is
// content (a boundary the client chose badly, not a part's end).
size_t delimiter_at(const std::string& body, const std::string& delimiter, size_t from) {
  const std::string opening = "\r\n" + delimiter;
  for (size_t at = body.find(opening, from); at != std::string::npos; at = body.find(opening, at + 1)) {
    size_t after = at + opening.size();
    if (body.compare(after, 2, "--") == 0) return at;
    while (after < body.size() && (body[after] == ' ' || body[after] == '\t')) ++after;
    if (after >= body.size() || body.compare(after, 2, "\r\n") == 0) return at;
  }
  return std::string::npos;
}

}  // namespace

nlohmann::json parse_json_object(const std::string& body) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    // nlohmann's text, without its "[json.exception.x.y] " tag and the "; last read: ..." echo
    // of the client's bytes.
    std::string why = e.what();
    if (const size_t tag = why.find("] "); why.rfind("[json.exception", 0) == 0 && tag != std::string::npos)
      why = why.substr(tag + 2);
    if (const size_t echo = why.find("; last read:"); echo != std::string::npos) why = why.substr(0, echo);
    if (e.id == 406) why += " (beyond the range of a double)";
    fail("the body is not valid JSON: ", why);
  }
  APUS_CHECK(j.is_object(), "the body is JSON ", j.type_name(), ", expected an object");
  return j;
}

bool is_multipart(const std::string& content_type) {
  return lower(trim(content_type.substr(0, content_type.find(';')))) == "multipart/form-data";
}

std::vector<FormPart> parse_multipart(const std::string& content_type, const std::string& body) {
  APUS_CHECK(is_multipart(content_type), "expected a multipart/form-data body, not Content-Type '", content_type, "'");
  const std::string boundary = parameter(parameters(content_type, "Content-Type"), "boundary");
  APUS_CHECK(!boundary.empty() && boundary.size() <= 70, "multipart body: Content-Type names ",
             boundary.empty() ? "no boundary" : "a boundary longer than 70 characters");
  const std::string delimiter = "--" + boundary;
  // The first delimiter opens the body or follows a preamble's line break.
  size_t pos = body.compare(0, delimiter.size(), delimiter) == 0 ? 0 : body.find("\r\n" + delimiter);
  APUS_CHECK(pos != std::string::npos, "multipart body: no boundary line '", delimiter, "' (", body.size(), " bytes)");
  if (pos != 0) pos += 2;
  std::vector<FormPart> parts;
  for (;;) {
    pos += delimiter.size();
    if (body.compare(pos, 2, "--") == 0) return parts;
    while (pos < body.size() && (body[pos] == ' ' || body[pos] == '\t')) ++pos;
    const std::string where = "multipart body: part " + std::to_string(parts.size() + 1);
    APUS_CHECK(pos < body.size(), where, ": the body ends after its boundary without the closing '", delimiter,
               "--' (truncated at ", body.size(), " bytes)");
    APUS_CHECK(body.compare(pos, 2, "\r\n") == 0, where, ": its boundary line at byte ", pos, " does not end in CRLF");
    APUS_CHECK(parts.size() < kMaxParts, "multipart body: more than ", kMaxParts, " parts");
    pos += 2;
    const size_t headers_end = body.find("\r\n\r\n", pos);
    APUS_CHECK(headers_end != std::string::npos, where,
               ": its headers never end (no blank line; the body is truncated at ", body.size(), " bytes?)");
    FormPart part;
    bool disposition = false;
    for (size_t line = pos; line < headers_end + 2;) {
      const size_t eol = body.find("\r\n", line);
      const std::string text = body.substr(line, eol - line);
      line = eol + 2;
      const size_t colon = text.find(':');
      APUS_CHECK(colon != std::string::npos, where, ": header line '", text.substr(0, 60), "' has no ':'");
      const std::string name = lower(trim(text.substr(0, colon)));
      const std::string value = trim(text.substr(colon + 1));
      if (name == "content-disposition") {
        APUS_CHECK(lower(trim(value.substr(0, value.find(';')))) == "form-data", where, ": Content-Disposition is '",
                   value.substr(0, 60), "', expected form-data");
        const auto params = parameters(value, where + " Content-Disposition");
        part.name = parameter(params, "name");
        part.filename = parameter(params, "filename");
        disposition = true;
      } else if (name == "content-type") {
        part.content_type = value;
      }
    }
    APUS_CHECK(disposition && !part.name.empty(), where, ": no Content-Disposition: form-data with a name");
    const size_t content = headers_end + 4;
    const size_t end = delimiter_at(body, delimiter, content);
    APUS_CHECK(end != std::string::npos, where, " ('", part.name, "'): no boundary closes it: the body is truncated (",
               body.size(), " bytes, the part's content starting at byte ", content, ")");
    part.content = body.substr(content, end - content);
    parts.push_back(std::move(part));
    pos = end + 2;
  }
}

namespace {

// '%' and two hex digits as that byte, '+' as a space; a '%' without two hex digits stays itself.
std::string percent_decoded(std::string_view text) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '+') {
      out += ' ';
    } else if (text[i] != '%') {
      out += text[i];
    } else {
      const int hi = i + 2 < text.size() ? hex(text[i + 1]) : -1, lo = i + 2 < text.size() ? hex(text[i + 2]) : -1;
      if (hi < 0 || lo < 0) {
        out += '%';
        continue;
      }
      out += char(hi * 16 + lo);
      i += 2;
    }
  }
  return out;
}

}  // namespace

std::optional<std::string> query_value(std::string_view target, std::string_view name) {
  const size_t mark = target.find('?');
  if (mark == std::string_view::npos) return std::nullopt;
  std::string_view query = target.substr(mark + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (percent_decoded(pair.substr(0, eq)) == name)
      return eq == std::string_view::npos ? std::string() : percent_decoded(pair.substr(eq + 1));
  }
  return std::nullopt;
}

}  // namespace apus::server
