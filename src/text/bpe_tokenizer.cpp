#include "text/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uniset.h>

#include <algorithm>
#include <array>
#include <climits>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "io/model_dir.h"
#include "io/weights/gguf.h"
#include "text/utf8.h"

namespace apus {
namespace {

using nlohmann::json;

// U+2581, SentencePiece's word-boundary mark, which Gemma's normalizer puts for every space.
constexpr std::string_view kMetaspace = "\xE2\x96\x81";

// --- UTF-8 -----------------------------------------------------------------------------------

// Only called on strings already known to be valid UTF-8 (JSON strings, validated text).
char32_t decode_code_point(std::string_view s, size_t i, size_t length) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (length == 1) return b0;
  char32_t cp = b0 & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// --- GPT-2 byte <-> unicode mapping ------------------------------------------------------------

// Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100.. so that
// every byte has a visible, non-whitespace symbol in the vocabulary.
struct ByteLevelAlphabet {
  std::array<std::string, 256> symbol;    // UTF-8 of the code point standing for each byte
  std::array<int16_t, 256 + 68> byte_of;  // inverse, indexed by code point; -1 where none

  ByteLevelAlphabet() {
    byte_of.fill(-1);
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + shifted++);
      append_utf8(symbol[b], cp);
      byte_of[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet instance;
  return instance;
}

// --- added tokens ------------------------------------------------------------------------------

// Leftmost-longest literal matching, the semantics of HF's Aho-Corasick added-token split.
// Bucketing by first byte keeps the scan near one comparison per byte for ordinary text.
class AddedMatcher {
 public:
  void add(std::string_view content, int32_t id) {
    auto& bucket = by_first_byte_[static_cast<unsigned char>(content[0])];
    bucket.push_back({std::string(content), id});
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const Entry& a, const Entry& b) { return a.content.size() > b.content.size(); });
  }

  // Pushes the id of each match into `ids` and hands the text between matches to `on_text`,
  // in order.
  template <typename OnText> void split(std::string_view text, std::vector<int32_t>& ids, OnText&& on_text) const {
    size_t plain_start = 0;
    size_t pos = 0;
    while (pos < text.size()) {
      const Entry* hit = longest_at(text, pos);
      if (!hit) {
        ++pos;
        continue;
      }
      if (pos > plain_start) on_text(text.substr(plain_start, pos - plain_start));
      ids.push_back(hit->id);
      pos += hit->content.size();
      plain_start = pos;
    }
    if (plain_start < text.size()) on_text(text.substr(plain_start));
  }

 private:
  struct Entry {
    std::string content;
    int32_t id;
  };

  const Entry* longest_at(std::string_view text, size_t pos) const {
    for (const Entry& e : by_first_byte_[static_cast<unsigned char>(text[pos])]) {
      if (text.compare(pos, e.content.size(), e.content) == 0) return &e;
    }
    return nullptr;
  }

  std::array<std::vector<Entry>, 256> by_first_byte_;
};

// --- JSON helpers --------------------------------------------------------------------------------

bool is_true(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it != obj.end() && it->is_boolean() && it->get<bool>();
}

bool is_null_or_empty(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty());
}

bool is_null_or_missing(const json& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null();
}

std::string type_name(const json& node) {
  if (node.is_null()) return "null";
  if (node.is_object() && node.contains("type") && node["type"].is_string()) return node["type"].get<std::string>();
  return "<no type>";
}

const json& member(const json& obj, const char* key) {
  static const json null_node;
  const auto it = obj.find(key);
  return it == obj.end() ? null_node : *it;
}

struct Pcre2CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct Pcre2MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// HF compiles the pattern with Oniguruma; PCRE2 reads the same syntax except for a few escapes.
// Oniguruma's \s is exactly Unicode White_Space, while PCRE2's (UCP mode) also matches U+180E
// MONGOLIAN VOWEL SEPARATOR, which changes how text around that character splits, so \s and \S
// are spelled out as the White_Space set. Escapes whose meanings differ in ways a rewrite cannot
// fix
// (\w and \b follow different "word" sets; \h is a hex digit in Oniguruma) are refused, and so
// are the ^ and $ anchors, whose line semantics differ between the two engines' defaults.
// Returns "" on success, else what is unsupported.
std::string onig_to_pcre2(std::string_view pattern, std::string& out) {
  constexpr std::string_view kWhiteSpace =
      "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}"
      "\\x{3000}";
  constexpr std::string_view kRefused = "wWbBhH";
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char escaped = pattern[++i];
      if (kRefused.find(escaped) != std::string_view::npos) return std::string("\\") + escaped;
      if (escaped == 's') {
        if (!in_class) out += '[';
        out += kWhiteSpace;
        if (!in_class) out += ']';
      } else if (escaped == 'S') {
        if (in_class) return "\\S inside a character class";
        out += "[^";
        out += kWhiteSpace;
        out += ']';
      } else {
        out += c;
        out += escaped;
      }
      continue;
    }
    if (!in_class && (c == '^' || c == '$')) return std::string("the ") + c + " anchor";
    out += c;
    if (!in_class && c == '[') {
      in_class = true;
      // A ']' right after '[' or '[^' is a literal, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
    } else if (in_class && c == ']') {
      in_class = false;
    }
  }
  return "";
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// The pattern {"String": " "}: Gemma's normalizer replaces it, its pre-tokenizer splits at it.
const json& space_pattern() {
  static const json p = {{"String", " "}};
  return p;
}

// Gemma's decoder: U+2581 back to spaces, <0xHH> tokens to their bytes, the pieces joined.
const json& gemma_decoder() {
  static const json d = {{"type", "Sequence"},
                         {"decoders",
                          {{{"type", "Replace"}, {"pattern", {{"String", std::string(kMetaspace)}}}, {"content", " "}},
                           {{"type", "ByteFallback"}},
                           {{"type", "Fuse"}}}}};
  return d;
}

void check_pipeline_ends(const json& root, const std::string& path, bool byte_level) {
  const json& decoder = member(root, "decoder");
  if (byte_level)
    APUS_CHECK(type_name(decoder) == "ByteLevel", path, ": unsupported decoder.type '", type_name(decoder),
               "' (supported: ByteLevel)");
  else
    APUS_CHECK(decoder == gemma_decoder(), path, ": unsupported decoder ", decoder.dump(),
               " (supported with the Replace normalizer: Gemma's ", gemma_decoder().dump(), ")");
  // encode_klein_prompt and the Stable Audio 3 prompts rely on the post-processor adding no
  // tokens: ByteLevel's, or a template of the sequence alone.
  const json& post = member(root, "post_processor");
  const bool adds_nothing = post.is_null() || type_name(post) == "ByteLevel" ||
                            (type_name(post) == "TemplateProcessing" &&
                             member(post, "single") == json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}) &&
                             (is_null_or_missing(post, "special_tokens") || member(post, "special_tokens").empty()));
  APUS_CHECK(adds_nothing, path, ": unsupported post_processor ", post.dump(),
             " (supported: ByteLevel, null, or a TemplateProcessing that adds no tokens)");
  APUS_CHECK(is_null_or_missing(root, "truncation"), path, ": unsupported truncation ",
             member(root, "truncation").dump(), " (only null is supported)");
  APUS_CHECK(is_null_or_missing(root, "padding"), path, ": unsupported padding ", member(root, "padding").dump(),
             " (only null is supported)");
}

// --- a GGUF's vocabulary ---------------------------------------------------------------------

// llama.cpp's token types (gguf-py TokenType) a byte-level BPE has; unknown (2) and byte (6) are
// SentencePiece's.
enum GgufTokenType { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };

// llama.cpp names a byte-level BPE's pre-tokenizer instead of storing its regex; these are the
// regexes of the Hugging Face tokenizers those names stand for.
const char* gguf_pre_tokenizer_regex(const std::string& pre) {
  if (pre == "qwen2")
    return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  return nullptr;
}

// The tokenizer.json a GGUF's tokenizer.ggml.* metadata stands for, as llama.cpp's
// convert_hf_to_gguf writes a Hugging Face byte-level BPE: every id's token with its type (normal
// tokens form the model's vocabulary, control and user-defined tokens are its added tokens, unused
// ones are the padding rows past the tokenizer), the merges as "left right" strings and the
// pre-tokenizer by name.
json tokenizer_json_from_gguf(const GgufFile& gguf) {
  const std::string& path = gguf.path();
  const json& meta = gguf.metadata();
  auto array = [&](const char* key) -> const json& {
    const auto it = meta.find(key);
    APUS_CHECK(it != meta.end(), path, ": no ", key, " (a GGUF carrying its tokenizer has tokenizer.ggml.tokens, ",
               "token_type and merges)");
    APUS_CHECK(it->is_array(), path, ": ", key, " is not an array");
    return *it;
  };
  APUS_CHECK(meta.contains("tokenizer.ggml.model"), path, ": carries no tokenizer (no tokenizer.ggml.model)");
  const std::string model = gguf.metadata_string("tokenizer.ggml.model");
  APUS_CHECK(model == "gpt2", path, ": tokenizer.ggml.model '", model, "', expected 'gpt2' (a byte-level BPE)");
  const std::string pre = gguf.metadata_string("tokenizer.ggml.pre");
  const char* regex = gguf_pre_tokenizer_regex(pre);
  APUS_CHECK(regex, path, ": tokenizer.ggml.pre '", pre, "' is not a pre-tokenizer apus knows (known: qwen2)");
  const json& tokens = array("tokenizer.ggml.tokens");
  const json& types = array("tokenizer.ggml.token_type");
  const json& merges = array("tokenizer.ggml.merges");
  APUS_CHECK(types.size() == tokens.size(), path, ": tokenizer.ggml.token_type has ", types.size(), " entries for ",
             tokens.size(), " tokens");

  json vocab = json::object();
  json added = json::array();
  for (size_t id = 0; id < tokens.size(); ++id) {
    APUS_CHECK(tokens[id].is_string(), path, ": tokenizer.ggml.tokens[", id, "] is not a string");
    APUS_CHECK(types[id].is_number_integer(), path, ": tokenizer.ggml.token_type[", id, "] is not an integer");
    const std::string& token = tokens[id].get_ref<const std::string&>();
    switch (types[id].get<int64_t>()) {
      case kNormal:
        vocab[token] = id;
        break;
      case kControl:
      case kUserDefined:
        // Earlier converters marked the padding rows user-defined; they are still no tokens.
        if (token == "[PAD" + std::to_string(id) + "]") break;
        added.push_back({{"id", id}, {"content", token}, {"special", types[id] == kControl}, {"normalized", false}});
        break;
      case kUnused:
        break;
      default:
        fail(path, ": tokenizer.ggml.token_type[", id, "] is ", types[id].get<int64_t>(), " ('", token,
             "'); a byte-level BPE has normal (1), control (3), user-defined (4) and unused (5) tokens");
    }
  }
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  return {{"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
              byte_level}}}},
          {"model", {{"type", "BPE"}, {"vocab", std::move(vocab)}, {"merges", merges}}},
          {"added_tokens", std::move(added)},
          {"decoder", byte_level},
          {"post_processor", nullptr}};
}

// The tokenizer.json sa3.cpp's vocabulary file (general.architecture sa3-tokenizer) stands for:
// Gemma's, which its converter read the tokens (tok.tokens, by id) and merges (tok.merges, by
// rank) from. The file keeps no token types; the pieces written <name> (other than the <0xHH>
// bytes) are taken as the added tokens they are in Gemma's tokenizer.json, matched whole.
json tokenizer_json_from_sa3cpp(const GgufFile& gguf) {
  const std::string& path = gguf.path();
  const json& meta = gguf.metadata();
  auto array = [&](const char* key) -> const json& {
    const auto it = meta.find(key);
    APUS_CHECK(it != meta.end() && it->is_array(), path, ": no ", key, " array (sa3.cpp's vocabulary has ",
               "tok.tokens and tok.merges)");
    return *it;
  };
  auto number = [&](const char* key) -> int64_t {
    const auto it = meta.find(key);
    APUS_CHECK(it != meta.end() && it->is_number_integer(), path, ": no ", key, " (an integer)");
    return it->get<int64_t>();
  };
  const json& tokens = array("tok.tokens");
  const json& merges = array("tok.merges");
  const int64_t unk = number("tok.unk_id");
  APUS_CHECK(unk >= 0 && size_t(unk) < tokens.size(), path, ": tok.unk_id ", unk, " is not one of the ", tokens.size(),
             " tokens");
  const auto fallback = meta.find("tok.byte_fallback");
  APUS_CHECK(fallback == meta.end() || fallback->is_boolean(), path, ": tok.byte_fallback is not a boolean");
  json vocab = json::object();
  json added = json::array();
  for (size_t id = 0; id < tokens.size(); ++id) {
    APUS_CHECK(tokens[id].is_string(), path, ": tok.tokens[", id, "] is not a string");
    const std::string& token = tokens[id].get_ref<const std::string&>();
    if (token.empty()) continue;  // ids the converter found no piece for
    vocab[token] = id;
    const bool named = token.size() > 2 && token.front() == '<' && token.back() == '>' &&
                       token.find_first_of(" <>", 1) == token.size() - 1 && !token.starts_with("<0x");
    if (named) added.push_back({{"id", id}, {"content", token}, {"special", true}, {"normalized", false}});
  }
  return {{"normalizer", {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", std::string(kMetaspace)}}},
          {"pre_tokenizer", nullptr},
          {"model",
           {{"type", "BPE"},
            {"vocab", std::move(vocab)},
            {"merges", merges},
            {"unk_token", tokens[size_t(unk)]},
            {"fuse_unk", true},
            {"byte_fallback", fallback == meta.end() || fallback->get<bool>()}}},
          {"added_tokens", std::move(added)},
          {"decoder", gemma_decoder()},
          {"post_processor", nullptr}};
}

}  // namespace

struct BpeTokenizer::Impl {
  struct Merge {
    uint32_t rank;
    int32_t merged;
  };
  // Per-encode scratch so the BPE loop does not allocate per word.
  struct Workspace {
    struct Symbol {
      int32_t id;  // -1 once merged into its left neighbour
      int32_t prev;
      int32_t next;
    };
    struct Candidate {
      uint32_t rank;
      int32_t pos;
      int32_t merged;
    };
    std::unique_ptr<pcre2_match_data, Pcre2MatchDataDeleter> match;
    std::vector<Symbol> symbols;
    std::vector<Candidate> heap;
  };

  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<std::string, int32_t> added_ids;
  // By id; a map, not a table sized by the largest id, which an untrusted file chooses.
  std::unordered_map<int32_t, std::string> id_to_token;
  int32_t max_id = -1;
  std::unordered_map<uint64_t, Merge> merges;
  std::array<int32_t, 256> byte_ids{};  // -1: byte absent from the vocabulary, dropped like HF
  bool ignore_merges = false;
  // Gemma's form: words of UTF-8 characters (no byte-level alphabet), spaces normalised to U+2581,
  // a character outside the vocabulary as its bytes' <0xHH> tokens (byte_fallback) or unk_id
  // (a run of them one unk_id where fuse_unk).
  bool byte_level = true;
  bool space_to_metaspace = false;
  bool byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  std::array<int32_t, 256> fallback_ids{};  // <0xHH>'s id, -1 if absent
  // HF's NFC (crate unicode-normalization-alignments) uses Unicode 9.0 tables. Restricting ICU's
  // NFC to characters assigned by 9.0 reproduces that: later characters were unassigned then, hence
  // ccc=0 starters that nothing composes with, which is how the filter treats them.
  std::unique_ptr<icu::UnicodeSet> unicode9;
  std::unique_ptr<icu::FilteredNormalizer2> nfc;  // declared after its set, destroyed before it
  std::unique_ptr<pcre2_code, Pcre2CodeDeleter> split_regex;
  AddedMatcher raw_added;
  AddedMatcher normalized_added;  // matched after normalization, against normalized content

  void configure_normalizer(const json& root, const std::string& path);
  void configure_pre_tokenizer(const json& root, const std::string& path);
  void configure_model(const json& root, const std::string& path);
  void configure_added_tokens(const json& root, const std::string& path);
  void set_token_text(int32_t id, const std::string& text);

  const Merge* find_merge(int32_t left, int32_t right) const {
    const auto it = merges.find(pair_key(left, right));
    return it == merges.end() ? nullptr : &it->second;
  }

  std::string normalize(std::string_view text) const {
    if (space_to_metaspace) {
      std::string out;
      for (const char ch : text) out += ch == ' ' ? std::string(kMetaspace) : std::string(1, ch);
      return out;
    }
    if (!nfc) return std::string(text);
    APUS_CHECK(text.size() <= INT32_MAX, "text to encode is too long for NFC normalization (", text.size(), " bytes)");
    UErrorCode status = U_ZERO_ERROR;
    const icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
    if (nfc->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) return std::string(text);
    std::string out;
    icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(text.size()));
    status = U_ZERO_ERROR;
    nfc->normalizeUTF8(0, piece, sink, nullptr, status);
    APUS_CHECK(U_SUCCESS(status), "NFC normalization failed: ", u_errorName(status));
    return out;
  }

  // HF's Split(behavior=Isolated): both the regex matches and the gaps between them become words.
  void encode_segment(std::string_view text, Workspace& ws, std::vector<int32_t>& ids) const {
    if (!split_regex) {
      if (!text.empty()) encode_word(text, ws, ids);
      return;
    }
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t emitted = 0;
    size_t search = 0;
    while (search < text.size()) {
      const int rc =
          pcre2_match(split_regex.get(), subject, text.size(), search, PCRE2_NO_UTF_CHECK, ws.match.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      APUS_CHECK(rc >= 0, "pre-tokenizer regex failed: ", pcre2_message(rc));
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(ws.match.get());
      const size_t begin = ovector[0], end = ovector[1];
      if (begin > emitted) encode_word(text.substr(emitted, begin - emitted), ws, ids);
      if (end > begin) {
        encode_word(text.substr(begin, end - begin), ws, ids);
        emitted = search = end;
      } else {
        // Empty matches produce no word; step one character on, as Oniguruma's find_iter does.
        if (begin >= text.size()) break;
        emitted = begin;
        search = begin + utf8_step(text, begin).length;
      }
    }
    if (emitted < text.size()) encode_word(text.substr(emitted), ws, ids);
  }

  // HF's BPE start for a word of characters: each character's id; one outside the vocabulary as
  // its bytes' <0xHH> ids when byte_fallback has them all, else unk_id (a run of them fused into
  // one where fuse_unk), else nothing.
  template <typename Append> void append_characters(std::string_view word, Append&& append) const {
    bool in_unk_run = false;
    for (size_t i = 0; i < word.size();) {
      const size_t length = utf8_step(word, i).length;
      const std::string_view ch = word.substr(i, length);
      i += length;
      if (const auto it = vocab.find(std::string(ch)); it != vocab.end()) {
        append(it->second);
        in_unk_run = false;
        continue;
      }
      if (byte_fallback &&
          std::all_of(ch.begin(), ch.end(), [&](char b) { return fallback_ids[static_cast<unsigned char>(b)] >= 0; })) {
        for (const char b : ch) append(fallback_ids[static_cast<unsigned char>(b)]);
        in_unk_run = false;
        continue;
      }
      if (unk_id < 0) continue;
      if (!(fuse_unk && in_unk_run)) append(unk_id);
      in_unk_run = true;
    }
  }

  // Merges the lowest-ranked adjacent pair first, leftmost on ties, with the same stale-entry rule
  // as HF's Word::merge_all, so the result is identical even for vocabularies where two different
  // pairs produce the same token.
  void encode_word(std::string_view word, Workspace& ws, std::vector<int32_t>& ids) const {
    if (ignore_merges) {
      std::string mapped;
      if (byte_level)
        for (const unsigned char b : word) mapped += alphabet().symbol[b];
      else mapped = word;
      if (const auto it = vocab.find(mapped); it != vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    auto& symbols = ws.symbols;
    symbols.clear();
    const auto append = [&](int32_t id) {
      const auto n = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, n - 1, n + 1});
    };
    if (byte_level) {
      for (const unsigned char b : word)
        if (byte_ids[b] >= 0) append(byte_ids[b]);
    } else {
      append_characters(word, append);
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    using Candidate = Workspace::Candidate;
    auto& heap = ws.heap;
    heap.clear();
    // std heap functions build a max-heap; "later" means lower priority.
    const auto later = [](const Candidate& a, const Candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    const auto push = [&](int32_t pos, int32_t left, int32_t right) {
      if (const Merge* m = find_merge(left, right)) {
        heap.push_back({m->rank, pos, m->merged});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i) push(static_cast<int32_t>(i), symbols[i].id, symbols[i + 1].id);

    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      const Candidate top = heap.back();
      heap.pop_back();
      auto& left = symbols[top.pos];
      if (left.id < 0 || left.next < 0) continue;
      auto& right = symbols[left.next];
      const Merge* current = find_merge(left.id, right.id);
      if (!current || current->merged != top.merged) continue;
      left.id = top.merged;
      right.id = -1;
      left.next = right.next;
      if (left.next >= 0) symbols[left.next].prev = top.pos;
      if (left.prev >= 0) push(left.prev, symbols[left.prev].id, left.id);
      if (left.next >= 0) push(top.pos, left.id, symbols[left.next].id);
    }
    for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
  }
};

void BpeTokenizer::Impl::configure_normalizer(const json& root, const std::string& path) {
  const json& normalizer = member(root, "normalizer");
  if (normalizer.is_null()) return;
  const std::string type = type_name(normalizer);
  if (type == "Replace") {
    APUS_CHECK(
        member(normalizer, "pattern") == space_pattern() && member(normalizer, "content") == std::string(kMetaspace),
        path, ": unsupported normalizer Replace ", normalizer.dump(), " (supported: \" \" -> \"\u2581\", Gemma's)");
    space_to_metaspace = true;
    return;
  }
  APUS_CHECK(type == "NFC", path, ": unsupported normalizer.type '", type,
             "' (supported: NFC, Gemma's Replace or null)");
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* full_nfc = icu::Normalizer2::getNFCInstance(status);
  unicode9 = std::make_unique<icu::UnicodeSet>(icu::UnicodeString("[:age=9.0:]", ""), status);
  APUS_CHECK(U_SUCCESS(status), path, ": ICU NFC normalizer unavailable: ", u_errorName(status));
  unicode9->freeze();
  nfc = std::make_unique<icu::FilteredNormalizer2>(*full_nfc, *unicode9);
}

// Accepts exactly the Qwen2/GPT-4-style layout: Sequence[Split(Regex, Isolated), ByteLevel(no
// regex)].
void BpeTokenizer::Impl::configure_pre_tokenizer(const json& root, const std::string& path) {
  const char* expected =
      " (supported: Sequence[Split(Regex, Isolated), ByteLevel(add_prefix_space=false, "
      "use_regex=false)])";
  const json& pre = member(root, "pre_tokenizer");
  if (space_to_metaspace) {
    // Gemma's: no pre-tokenizer, or a split at spaces, which its normalizer has left none of.
    APUS_CHECK(pre.is_null() ||
                   (type_name(pre) == "Split" && member(pre, "pattern") == space_pattern() && !is_true(pre, "invert")),
               path, ": unsupported pre_tokenizer ", pre.dump(), " with the Replace normalizer (supported: null or ",
               "Split at \" \", Gemma's)");
    byte_level = false;
    return;
  }
  APUS_CHECK(type_name(pre) == "Sequence", path, ": unsupported pre_tokenizer.type '", type_name(pre), "'", expected);
  const json& steps = member(pre, "pretokenizers");
  APUS_CHECK(steps.is_array() && steps.size() == 2, path,
             ": unsupported pre_tokenizer.pretokenizers (need exactly Split then ByteLevel)", expected);

  const json& split = steps[0];
  APUS_CHECK(type_name(split) == "Split", path, ": unsupported pre_tokenizer.pretokenizers[0].type '", type_name(split),
             "'", expected);
  const json& pattern = member(member(split, "pattern"), "Regex");
  APUS_CHECK(pattern.is_string(), path,
             ": unsupported pre_tokenizer.pretokenizers[0].pattern (only {\"Regex\": ...} is supported)");
  APUS_CHECK(member(split, "behavior") == "Isolated", path, ": unsupported pre_tokenizer.pretokenizers[0].behavior ",
             member(split, "behavior").dump(), " (supported: Isolated)");
  APUS_CHECK(!is_true(split, "invert"), path, ": unsupported pre_tokenizer.pretokenizers[0].invert=true");

  const json& byte_level = steps[1];
  APUS_CHECK(type_name(byte_level) == "ByteLevel", path, ": unsupported pre_tokenizer.pretokenizers[1].type '",
             type_name(byte_level), "'", expected);
  APUS_CHECK(!is_true(byte_level, "add_prefix_space"), path,
             ": unsupported pre_tokenizer.pretokenizers[1].add_prefix_space=true");
  APUS_CHECK(!is_true(byte_level, "use_regex"), path, ": unsupported pre_tokenizer.pretokenizers[1].use_regex=true");

  std::string regex;
  const std::string unsupported = onig_to_pcre2(pattern.get<std::string>(), regex);
  APUS_CHECK(unsupported.empty(), path, ": unsupported pre_tokenizer.pretokenizers[0].pattern (uses ", unsupported,
             ")");
  int error = 0;
  PCRE2_SIZE offset = 0;
  split_regex.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(regex.data()), regex.size(), PCRE2_UTF | PCRE2_UCP,
                                  &error, &offset, nullptr));
  APUS_CHECK(split_regex, path, ": pre_tokenizer.pretokenizers[0].pattern does not compile: ", pcre2_message(error));
  // JIT is only a speed-up; without it (e.g. unsupported CPU) matching falls back to the
  // interpreter.
  pcre2_jit_compile(split_regex.get(), PCRE2_JIT_COMPLETE);
}

void BpeTokenizer::Impl::configure_model(const json& root, const std::string& path) {
  const json& model = member(root, "model");
  APUS_CHECK(type_name(model) == "BPE", path, ": unsupported model.type '", type_name(model), "' (supported: BPE)");
  APUS_CHECK(is_null_or_missing(model, "dropout"), path, ": unsupported model.dropout ",
             member(model, "dropout").dump(), " (only null is supported)");
  APUS_CHECK(!byte_level || !is_true(model, "byte_fallback"), path,
             ": unsupported model.byte_fallback=true with a byte-level pre-tokenizer");
  APUS_CHECK(is_null_or_empty(model, "continuing_subword_prefix"), path,
             ": unsupported model.continuing_subword_prefix ", member(model, "continuing_subword_prefix").dump());
  APUS_CHECK(is_null_or_empty(model, "end_of_word_suffix"), path, ": unsupported model.end_of_word_suffix ",
             member(model, "end_of_word_suffix").dump());
  ignore_merges = is_true(model, "ignore_merges");

  const json& vocab_json = member(model, "vocab");
  APUS_CHECK(vocab_json.is_object(), path, ": model.vocab must be an object of token -> id");
  vocab.reserve(vocab_json.size());
  for (const auto& [token, id] : vocab_json.items()) {
    const auto value = id.get<int64_t>();
    APUS_CHECK(value >= 0 && value <= INT32_MAX, path, ": model.vocab id ", value, " of '", token, "' is out of range");
    vocab.emplace(token, static_cast<int32_t>(value));
    set_token_text(static_cast<int32_t>(value), token);
  }

  for (int b = 0; b < 256; ++b) {
    const auto it = vocab.find(alphabet().symbol[b]);
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
  }
  if (!byte_level) {
    byte_fallback = is_true(model, "byte_fallback");
    fuse_unk = is_true(model, "fuse_unk");
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      const auto it = vocab.find(name);
      fallback_ids[b] = it == vocab.end() ? -1 : it->second;
    }
    if (!is_null_or_missing(model, "unk_token")) {
      const auto it = vocab.find(member(model, "unk_token").get<std::string>());
      APUS_CHECK(it != vocab.end(), path, ": model.unk_token ", member(model, "unk_token").dump(),
                 " is not in model.vocab");
      unk_id = it->second;
    }
  } else if (!is_null_or_missing(model, "unk_token")) {
    // With an unk token HF would emit it for bytes missing from the vocabulary; without one they
    // are silently dropped, which byte_ids = -1 reproduces.
    for (int b = 0; b < 256; ++b) {
      APUS_CHECK(byte_ids[b] >= 0, path, ": model.unk_token is set but byte ", b, " (symbol '", alphabet().symbol[b],
                 "') has no model.vocab entry (unknown-token fallback is not supported)");
    }
  }

  const json& merges_json = member(model, "merges");
  APUS_CHECK(merges_json.is_array(), path, ": model.merges must be an array");
  merges.reserve(merges_json.size());
  const auto lookup = [&](const std::string& token, size_t rank) {
    const auto it = vocab.find(token);
    APUS_CHECK(it != vocab.end(), path, ": model.merges[", rank, "] uses '", token, "', which is not in model.vocab");
    return it->second;
  };
  for (size_t rank = 0; rank < merges_json.size(); ++rank) {
    const json& entry = merges_json[rank];
    std::string left, right;
    if (entry.is_string()) {
      // Legacy "left right" form; byte-level symbols never contain a space.
      const auto text = entry.get<std::string>();
      const auto space = text.find(' ');
      APUS_CHECK(space != std::string::npos && text.find(' ', space + 1) == std::string::npos, path, ": model.merges[",
                 rank, "] '", text, "' is not two space-separated tokens");
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else {
      APUS_CHECK(entry.is_array() && entry.size() == 2, path, ": model.merges[", rank,
                 "] is neither \"a b\" nor [\"a\", \"b\"]");
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    }
    const int32_t merged = lookup(left + right, rank);
    // A repeated pair keeps its last rank, as HF's HashMap collection does.
    merges.insert_or_assign(pair_key(lookup(left, rank), lookup(right, rank)),
                            Merge{static_cast<uint32_t>(rank), merged});
  }
}

void BpeTokenizer::Impl::configure_added_tokens(const json& root, const std::string& path) {
  const json& added = member(root, "added_tokens");
  if (added.is_null()) return;
  APUS_CHECK(added.is_array(), path, ": added_tokens must be an array");
  for (size_t i = 0; i < added.size(); ++i) {
    const json& token = added[i];
    auto content = token.at("content").get<std::string>();
    const auto id = token.at("id").get<int64_t>();
    APUS_CHECK(id >= 0 && id <= INT32_MAX, path, ": added_tokens[", i, "].id ", id, " is out of range");
    for (const char* option : {"lstrip", "rstrip", "single_word"}) {
      APUS_CHECK(!is_true(token, option), path, ": unsupported added_tokens[", i, "].", option, "=true (token '",
                 content, "')");
    }
    if (content.empty()) continue;  // HF ignores empty added tokens
    added_ids[content] = static_cast<int32_t>(id);
    if (is_true(token, "normalized")) {
      // HF decodes such a token from its normalized spelling too.
      const std::string normalized = normalize(content);
      normalized_added.add(normalized, static_cast<int32_t>(id));
      set_token_text(static_cast<int32_t>(id), normalized);
    } else {
      raw_added.add(content, static_cast<int32_t>(id));
      set_token_text(static_cast<int32_t>(id), content);
    }
  }
}

void BpeTokenizer::Impl::set_token_text(int32_t id, const std::string& text) {
  id_to_token[id] = text;
  max_id = std::max(max_id, id);
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer BpeTokenizer::load(const std::string& source) {
  if (is_directory(source)) return load(source + "/tokenizer.json");
  if (is_gguf_file(source)) return from_gguf(GgufFile::open(source));
  return from_json(read_json(source), source);
}

BpeTokenizer BpeTokenizer::from_gguf(const GgufFile& gguf) {
  if (gguf.metadata().contains("tok.tokens"))
    return from_json(tokenizer_json_from_sa3cpp(gguf), gguf.path() + " (tok.*)");
  return from_json(tokenizer_json_from_gguf(gguf), gguf.path() + " (tokenizer.ggml.*)");
}

BpeTokenizer BpeTokenizer::from_json(const json& root, const std::string& path) {
  APUS_CHECK(root.is_object(), path, ": tokenizer JSON must be an object");
  auto impl = std::make_unique<Impl>();
  try {
    // The normalizer goes first: normalized added tokens are stored in normalized form.
    impl->configure_normalizer(root, path);
    impl->configure_pre_tokenizer(root, path);
    impl->configure_model(root, path);
    impl->configure_added_tokens(root, path);
    check_pipeline_ends(root, path, impl->byte_level);
  } catch (const json::exception& e) {
    fail(path, ": unexpected tokenizer JSON structure: ", e.what());
  }
  return BpeTokenizer(std::move(impl));
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  require_utf8(text, "text to encode");
  const Impl& t = *impl_;
  Impl::Workspace ws;
  if (t.split_regex) {
    ws.match.reset(pcre2_match_data_create_from_pattern(t.split_regex.get(), nullptr));
    APUS_CHECK(ws.match, "out of memory allocating regex match data");
  }

  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  // HF order: split out raw added tokens, normalize what is left, split out normalized added
  // tokens, then pre-tokenize and merge each remaining piece independently.
  t.raw_added.split(text, ids, [&](std::string_view segment) {
    const std::string normalized = t.normalize(segment);
    t.normalized_added.split(normalized, ids, [&](std::string_view piece) { t.encode_segment(piece, ws, ids); });
  });
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& t = *impl_;
  const auto& byte_of = alphabet().byte_of;
  std::string bytes;
  for (const int32_t id : ids) {
    const auto found = t.id_to_token.find(id);
    APUS_CHECK(found != t.id_to_token.end() && !found->second.empty(), "cannot decode token id ", id,
               ": not in the vocabulary");
    const std::string& token = found->second;
    if (!t.byte_level) {
      unsigned byte = 0;
      if (token.size() == 6 && std::sscanf(token.c_str(), "<0x%2X>", &byte) == 1) {
        bytes += static_cast<char>(byte);
        continue;
      }
      for (size_t i = 0; i < token.size();) {
        if (token.compare(i, kMetaspace.size(), kMetaspace) == 0) {
          bytes += ' ';
          i += kMetaspace.size();
        } else {
          bytes += token[i++];
        }
      }
      continue;
    }
    // HF's ByteLevel decoder maps a token back to bytes only if every character is in the byte
    // alphabet; otherwise (e.g. an added token containing a newline) the token's own UTF-8 is used.
    const size_t start = bytes.size();
    bool mapped = true;
    for (size_t i = 0; i < token.size() && mapped;) {
      const size_t length = utf8_step(token, i).length;
      const char32_t cp = decode_code_point(token, i, length);
      mapped = cp < byte_of.size() && byte_of[cp] >= 0;
      if (mapped) bytes += static_cast<char>(byte_of[cp]);
      i += length;
    }
    if (!mapped) {
      bytes.resize(start);
      bytes += token;
    }
  }
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const Utf8Step step = utf8_step(bytes, i);
    if (step.valid) {
      out.append(bytes, i, step.length);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += step.length;
  }
  return out;
}

int32_t BpeTokenizer::max_id() const { return impl_->max_id; }

int32_t BpeTokenizer::token_id(std::string_view token) const {
  const std::string key(token);
  if (const auto it = impl_->added_ids.find(key); it != impl_->added_ids.end()) return it->second;
  if (const auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  fail("token '", token, "' is not in the tokenizer vocabulary");
}

}  // namespace apus
