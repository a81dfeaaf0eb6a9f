#include "text/utf8.h"

#include "core/error.h"

namespace apus {

Utf8Step utf8_step(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, true};
  size_t trailing;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    trailing = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    trailing = 2;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    trailing = 3;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // beyond U+10FFFF
  } else {
    return {1, false};
  }
  for (size_t k = 1; k <= trailing; ++k) {
    if (i + k >= s.size()) return {k, false};
    const auto b = static_cast<unsigned char>(s[i + k]);
    if (b < lo || b > hi) return {k, false};
    lo = 0x80;
    hi = 0xBF;
  }
  return {trailing + 1, true};
}

void require_utf8(std::string_view text, std::string_view what) {
  for (size_t i = 0; i < text.size();) {
    const Utf8Step step = utf8_step(text, i);
    APUS_CHECK(step.valid, what, " is not valid UTF-8 (byte offset ", i, ")");
    i += step.length;
  }
}

}  // namespace apus
