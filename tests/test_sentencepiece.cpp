// T5Gemma's tokenizer (Gemma SentencePiece through libsentencepiece) against the ids HF's
// GemmaTokenizer gives on a Gemma-format model (tools/oracle/make_t5gemma_tokenizer.py): 313
// prompts, unpadded and padded to the fixture's max_length on either side.
#include <fstream>

#include "test_util.h"
#include "text/sentencepiece_tokenizer.h"

namespace apus {
namespace {

const Json& cases() {
  static const Json j = read_json(test::fixture("t5gemma_tokenizer_cases.json"));
  return j;
}

const SentencePieceTokenizer& tokenizer() {
  static const SentencePieceTokenizer t = SentencePieceTokenizer::load(test::fixture("t5gemma_tok/tokenizer.model"));
  return t;
}

TEST(SentencePiece, IdsEqualHfGemmaTokenizer) {
  size_t n = 0;
  for (const Json& c : cases()["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tokenizer().encode(text), c["ids"].get<std::vector<int32_t>>()) << Json(text).dump();
    ++n;
  }
  EXPECT_GT(n, 300u);
  EXPECT_EQ(tokenizer().vocab_size(), cases()["vocab_size"].get<int32_t>());
  EXPECT_EQ(tokenizer().pad_id(), 0);
}

TEST(SentencePiece, PaddingAndTruncationAsTheConfigSays) {
  const int max_length = cases()["max_length"];
  const PaddingSide side = read_padding_side(test::fixture("t5gemma_tok/tokenizer_config.json"));
  EXPECT_EQ(side, cases()["padding_side"] == "left" ? PaddingSide::left : PaddingSide::right);
  bool saw_truncation = false, saw_empty = false;
  for (const Json& c : cases()["cases"]) {
    const std::string text = c["text"];
    const PaddedIds p = pad_ids(tokenizer().encode(text), max_length, tokenizer().pad_id(), side);
    EXPECT_EQ(p.ids, c["padded_ids"].get<std::vector<int32_t>>()) << Json(text).dump();
    EXPECT_EQ(p.mask, c["mask"].get<std::vector<int32_t>>()) << Json(text).dump();
    EXPECT_EQ(p.truncated, c["ids"].size() > size_t(max_length));
    saw_truncation |= p.truncated;
    saw_empty |= text.empty();
    if (c.contains("default_side_padded_ids")) {
      // A tokenizer_config.json without padding_side: transformers 5 pads on the left.
      const PaddingSide fallback = cases()["default_padding_side"] == "left" ? PaddingSide::left : PaddingSide::right;
      EXPECT_EQ(pad_ids(tokenizer().encode(text), max_length, 0, fallback).ids,
                c["default_side_padded_ids"].get<std::vector<int32_t>>());
    }
  }
  EXPECT_TRUE(saw_truncation);
  EXPECT_TRUE(saw_empty);  // the empty prompt: all padding, an all-zero mask
  const std::string bare = ::testing::TempDir() + "apus_tok_config.json";
  { std::ofstream(bare) << R"({"tokenizer_class": "GemmaTokenizer"})"; }
  EXPECT_EQ(read_padding_side(bare),
            cases()["default_padding_side"] == "left" ? PaddingSide::left : PaddingSide::right);
  { std::ofstream(bare) << R"({"padding_side": "middle"})"; }
  test::expect_error([&] { read_padding_side(bare); }, {bare, "padding_side 'middle'"});
  std::remove(bare.c_str());
}

TEST(SentencePiece, BadFilesAndTextAreRefused) {
  test::expect_error([] { SentencePieceTokenizer::load("/nonexistent/tokenizer.model"); },
                     {"/nonexistent/tokenizer.model", "cannot open"});
  const std::string junk = ::testing::TempDir() + "apus_junk.model";
  { std::ofstream(junk) << "this is not a protobuf"; }
  test::expect_error([&] { SentencePieceTokenizer::load(junk); }, {junk, "not a SentencePiece model"});
  std::remove(junk.c_str());
  test::expect_error([] { SentencePieceTokenizer::load(::testing::TempDir()); }, {"directory"});
  // Found by fuzz_sentencepiece: a model with an empty piece made the library throw from its trie
  // builder, past the documented error type.
  const std::string empty_piece = std::string(APUS_FIXTURES) + "/../fuzz/sentencepiece_corpus/empty_piece_crash";
  test::expect_error([&] { SentencePieceTokenizer::load(empty_piece); },
                     {empty_piece, "not a SentencePiece model", "zero-length key"});
  test::expect_error([] { tokenizer().encode("bad \xff byte"); }, {"not valid UTF-8"});
  test::expect_error([] { tokenizer().encode("overlong \xc0\xaf"); }, {"not valid UTF-8"});
}

}  // namespace
}  // namespace apus
