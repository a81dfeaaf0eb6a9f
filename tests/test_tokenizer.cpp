// The tokenizer must reproduce HF `tokenizers` ids exactly: the text encoder sees nothing else, so
// one differing id changes the image. Fixtures come from tools/oracle (tokenizer_cases.json).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "text/bpe_tokenizer.h"
#include "text/klein_prompt.h"

namespace apus {
namespace {

using nlohmann::json;

std::string fixture(const std::string& rel) { return std::string(APUS_FIXTURES) + "/" + rel; }

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot open " << path;
  return json::parse(in);
}

const json& cases() {
  static const json doc = read_json_file(fixture("tokenizer_cases.json"));
  return doc;
}

const BpeTokenizer& tokenizer() {
  static const BpeTokenizer tok = BpeTokenizer::load(fixture(cases()["tokenizer"].get<std::string>()));
  return tok;
}

// Writes `contents` to a fresh file under the test temp dir and returns its path.
std::string write_temp(const std::string& name, const std::string& contents) {
  const std::string path = (std::filesystem::path(::testing::TempDir()) / name).string();
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

// The message of the apus::Error thrown by load(path), or "" if it loaded.
std::string load_error(const std::string& path) {
  try {
    BpeTokenizer::load(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string with_field(const std::string& pointer, const json& value) {
  json doc = read_json_file(fixture(cases()["tokenizer"].get<std::string>()));
  doc[json::json_pointer(pointer)] = value;
  return doc.dump();
}

TEST(Tokenizer, EncodeMatchesHuggingFace) {
  ASSERT_FALSE(cases()["cases"].empty());
  for (const json& c : cases()["cases"]) {
    const auto text = c["text"].get<std::string>();
    EXPECT_EQ(tokenizer().encode(text), c["ids"].get<std::vector<int32_t>>()) << "text: " << json(text).dump();
  }
}

TEST(Tokenizer, SpecialTokenIds) {
  for (const auto& [token, id] : cases()["special_ids"].items()) {
    EXPECT_EQ(tokenizer().token_id(token), id.get<int32_t>()) << token;
  }
  EXPECT_EQ(tokenizer().token_id("<|endoftext|>"), cases()["pad_token_id"].get<int32_t>());
}

TEST(Tokenizer, UnknownTokenIdNamesTheToken) {
  try {
    tokenizer().token_id("<|no_such_token|>");
    FAIL() << "expected apus::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("<|no_such_token|>"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, DecodeRoundTrip) {
  for (const json& c : cases()["cases"]) {
    const auto text = c["text"].get<std::string>();
    const std::vector<int32_t> ids = tokenizer().encode(text);
    const std::string decoded = tokenizer().decode(ids);
    // Decoding yields the NFC form, which re-encodes to the same ids.
    EXPECT_EQ(tokenizer().encode(decoded), ids) << "text: " << json(text).dump();
    const bool ascii =
        std::all_of(text.begin(), text.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x80; });
    if (ascii) {
      EXPECT_EQ(decoded, text);
    }
  }
  EXPECT_EQ(tokenizer().decode(tokenizer().encode("e\u0301")), "\u00e9");
  EXPECT_EQ(tokenizer().decode(tokenizer().encode("<|im_start|>user\n\u4e00\u53ea<|im_end|>")),
            "<|im_start|>user\n\u4e00\u53ea<|im_end|>");
}

TEST(Tokenizer, DecodeReplacesBrokenUtf8) {
  // Byte-level symbols: 'Ã' stands for byte 0xC3, '©' for 0xA9; together they are "é".
  const int32_t lead = tokenizer().token_id("\u00c3");
  const int32_t trail = tokenizer().token_id("\u00a9");
  EXPECT_EQ(tokenizer().decode({lead, trail}), "\u00e9");
  EXPECT_EQ(tokenizer().decode({lead}), "\ufffd");
  EXPECT_EQ(tokenizer().decode({trail, lead}), "\ufffd\ufffd");
  EXPECT_THROW(tokenizer().decode({-1}), Error);
  EXPECT_THROW(tokenizer().decode({1 << 30}), Error);
}

TEST(Tokenizer, RejectsInvalidUtf8Text) {
  EXPECT_THROW(tokenizer().encode("abc\xC3"), Error);
  EXPECT_THROW(tokenizer().encode("\xED\xA0\x80"), Error);  // encoded surrogate
}

TEST(KleinPrompt, MatchesPipeline) {
  const int max_length = cases()["max_length"].get<int>();
  ASSERT_FALSE(cases()["templated"].empty());
  for (const json& c : cases()["templated"]) {
    const auto prompt = c["prompt"].get<std::string>();
    EXPECT_EQ(klein_chat_text(prompt), c["templated_text"].get<std::string>());
    EXPECT_EQ(klein_prompt_length(tokenizer(), prompt), c["n_tokens_untruncated"].get<int>());
    std::vector<int32_t> mask;
    const std::vector<int32_t> ids = encode_klein_prompt(tokenizer(), prompt, max_length, &mask);
    EXPECT_EQ(ids, c["input_ids"].get<std::vector<int32_t>>()) << "prompt: " << json(prompt).dump();
    EXPECT_EQ(mask, c["attention_mask"].get<std::vector<int32_t>>()) << "prompt: " << json(prompt).dump();
    EXPECT_EQ(encode_klein_prompt(tokenizer(), prompt, max_length, nullptr), ids);
  }
}

TEST(KleinPrompt, RejectsNonPositiveLength) {
  EXPECT_THROW(encode_klein_prompt(tokenizer(), "a cat", 0, nullptr), Error);
}

TEST(TokenizerLoad, NormalizedAddedTokenMatchesAfterNfc) {
  // Qwen's added tokens are all normalized=false; this covers the HF path where a token is matched
  // against the normalized text, so both spellings of "café" hit it.
  json doc = read_json_file(fixture(cases()["tokenizer"].get<std::string>()));
  const int32_t id = 100000;
  doc["added_tokens"].push_back({{"id", id},
                                 {"content", "cafe\u0301"},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", true},
                                 {"special", false}});
  const BpeTokenizer tok = BpeTokenizer::load(write_temp("apus_normalized_added.json", doc.dump()));
  EXPECT_EQ(tok.encode("caf\u00e9"), std::vector<int32_t>{id});
  EXPECT_EQ(tok.encode("cafe\u0301"), std::vector<int32_t>{id});
  EXPECT_EQ(tok.token_id("cafe\u0301"), id);
}

TEST(TokenizerLoad, MissingFileNamesTheFile) {
  const std::string path = fixture("no_such_dir/tokenizer.json");
  EXPECT_NE(load_error(path).find(path), std::string::npos) << load_error(path);
}

TEST(TokenizerLoad, MalformedJsonNamesTheFile) {
  const std::string path = write_temp("apus_malformed_tokenizer.json", "{\"model\": {\"type\": \"BPE\", ");
  const std::string message = load_error(path);
  EXPECT_NE(message.find(path), std::string::npos) << message;
}

TEST(TokenizerLoad, UnsupportedSettingsNameFileAndField) {
  const std::vector<std::tuple<std::string, json, std::string>> variants = {
      {"/model/type", "WordPiece", "model.type"},
      {"/normalizer", json{{"type", "NFKC"}}, "normalizer.type"},
      {"/pre_tokenizer/type", "Whitespace", "pre_tokenizer.type"},
      {"/pre_tokenizer/pretokenizers/0/behavior", "Removed", "behavior"},
      {"/pre_tokenizer/pretokenizers/1/use_regex", true, "use_regex"},
      {"/model/byte_fallback", true, "model.byte_fallback"},
      {"/added_tokens/0/lstrip", true, "added_tokens[0].lstrip"},
      {"/decoder", json{{"type", "WordPiece"}}, "decoder.type"},
  };
  for (const auto& [pointer, value, field] : variants) {
    const std::string path = write_temp("apus_unsupported_tokenizer.json", with_field(pointer, value));
    const std::string message = load_error(path);
    EXPECT_NE(message.find(path), std::string::npos) << pointer << ": " << message;
    EXPECT_NE(message.find(field), std::string::npos) << pointer << ": " << message;
  }
}

}  // namespace
}  // namespace apus
