#pragma once
// UTF-8 as the tokenizers need it: step through a string by the Unicode "maximal subpart" rule,
// and refuse text that is not valid UTF-8 (HF takes Python strings, which cannot hold it, so such
// bytes have no reference behaviour to match).
#include <cstddef>
#include <string_view>

namespace apus {

struct Utf8Step {
  size_t length;  // a whole sequence when valid, else the maximal invalid subpart
  bool valid;
};

// Follows the Unicode "maximal subpart" rule, which is what Rust's String::from_utf8_lossy uses
// when HF's ByteLevel decoder replaces broken sequences. i < s.size().
Utf8Step utf8_step(std::string_view s, size_t i);

// Throws apus::Error naming `what` ("the prompt") and the first invalid byte offset in it.
void require_utf8(std::string_view text, std::string_view what);

}  // namespace apus
