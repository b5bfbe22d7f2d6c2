// The tokenizer.json components one at a time, on tiny hand-written tokenizers whose expected
// pieces follow the `tokenizers` crate's documentation; errors for what dsrun does not implement.
// Real tokenizers against the reference: tests/tokenizer_reference.sh.
#include "engine/tokenizer/tokenizer.hpp"
#include "engine/tokenizer/unicode.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using dsrun::test::TempDir;
using json = nlohmann::json;

namespace {

// A BPE tokenizer.json whose vocabulary is `tokens` (ids in order); ignore_merges, so a piece
// that is in the vocabulary comes out whole and the pieces can be read back from the ids.
json tiny(const std::vector<std::string>& tokens) {
  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", json::array()},
              {"normalizer", nullptr},
              {"pre_tokenizer", nullptr},
              {"post_processor", nullptr},
              {"decoder", nullptr},
              {"model", {{"type", "BPE"}, {"unk_token", nullptr}, {"ignore_merges", true}, {"vocab", vocab}, {"merges", json::array()}}}};
}

// Every single character of `text`, then `pieces`.
std::vector<std::string> chars_and(const std::string& text, const std::vector<std::string>& pieces) {
  std::vector<std::string> tokens;
  for (size_t i = 0; i < text.size();) {
    int len;
    dsrun::unicode::decode_at(text, i, &len);
    std::string c = text.substr(i, len);
    if (std::find(tokens.begin(), tokens.end(), c) == tokens.end()) tokens.push_back(c);
    i += len;
  }
  for (const auto& p : pieces) {
    if (std::find(tokens.begin(), tokens.end(), p) == tokens.end()) tokens.push_back(p);
  }
  return tokens;
}

std::unique_ptr<dsrun::Tokenizer> open(const TempDir& dir, const json& j) {
  return dsrun::open_tokenizer(dir.write("tok/tokenizer.json", j.dump()));
}

// The pieces of `text`: each id's token (no decoder: tokens come back joined by spaces).
std::vector<std::string> pieces(const dsrun::Tokenizer& t, const std::string& text, bool special = false) {
  std::vector<std::string> out;
  for (uint32_t id : t.encode(text, special)) out.push_back(t.decode({id}, false));
  return out;
}

// The JSON path an error names for tokenizer `j`.
std::string error_key(const TempDir& dir, const json& j) {
  try {
    open(dir, j);
  } catch (const dsrun::Error& e) {
    return e.context().key;
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("Split behaviours cut text as the crate documents", "[tokenizer]") {
  TempDir dir;
  const std::string text = "the-final--countdown";
  json j = tiny(chars_and(text, {"the", "final", "countdown", "the-", "final-", "-final", "-countdown", "--"}));
  const auto split = [&](const std::string& behavior, bool invert = false, const std::string& regex = "-") {
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", behavior}, {"invert", invert}};
    return pieces(*open(dir, j), text);
  };
  using V = std::vector<std::string>;
  CHECK(split("Removed") == V{"the", "final", "countdown"});
  CHECK(split("Isolated") == V{"the", "-", "final", "-", "-", "countdown"});
  CHECK(split("MergedWithPrevious") == V{"the-", "final-", "-", "countdown"});
  CHECK(split("MergedWithNext") == V{"the", "-final", "-", "-countdown"});
  CHECK(split("Contiguous") == V{"the", "-", "final", "--", "countdown"});
  CHECK(split("Removed", true, "[a-z]+") == V{"the", "final", "countdown"});
  CHECK(split("Removed", true, "-") == V{"-", "-", "-"});
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", "Removed"}, {"invert", false}};
  CHECK(pieces(*open(dir, j), text) == V{"the", "final", "countdown"});
}

TEST_CASE("Digits, Whitespace, WhitespaceSplit, Punctuation and Metaspace pre-tokenizers", "[tokenizer]") {
  TempDir dir;
  using V = std::vector<std::string>;
  json j = tiny(chars_and("ab12345 ,.x\xE2\x96\x81", {"ab", "12345", "x", ",.", "\xE2\x96\x81" "ab", "\xE2\x96\x81" "x"}));
  j["pre_tokenizer"] = {{"type", "Digits"}, {"individual_digits", false}};
  CHECK(pieces(*open(dir, j), "ab12345") == V{"ab", "12345"});
  j["pre_tokenizer"] = {{"type", "Digits"}, {"individual_digits", true}};
  CHECK(pieces(*open(dir, j), "ab123") == V{"ab", "1", "2", "3"});
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  CHECK(pieces(*open(dir, j), "ab  ,.x") == V{"ab", ",.", "x"});
  j["pre_tokenizer"] = {{"type", "WhitespaceSplit"}};
  CHECK(pieces(*open(dir, j), " ab ,. ") == V{"ab", ",."});
  j["pre_tokenizer"] = {{"type", "Punctuation"}, {"behavior", "Isolated"}};
  CHECK(pieces(*open(dir, j), "ab,.x") == V{"ab", ",", ".", "x"});
  // Metaspace: spaces become U+2581, which starts every piece; "first" prepends at the input's start only.
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "always"}, {"split", true}};
  CHECK(pieces(*open(dir, j), "ab x") == V{"\xE2\x96\x81" "ab", "\xE2\x96\x81" "x"});
  j["pre_tokenizer"]["prepend_scheme"] = "never";
  CHECK(pieces(*open(dir, j), "ab x") == V{"ab", "\xE2\x96\x81" "x"});
}

TEST_CASE("normalizers: NFKC, Lowercase, Replace, Prepend, Strip in sequence", "[tokenizer]") {
  TempDir dir;
  using V = std::vector<std::string>;
  json j = tiny(chars_and("_fi abc", {"_fiabc"}));
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}},
                       {{"type", "NFKC"}},
                       {{"type", "Lowercase"}},
                       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", ""}},
                       {{"type", "Prepend"}, {"prepend", "_"}}}}};
  // U+FB01 (the "fi" ligature) is "fi" under NFKC; Prepend leaves empty text alone.
  CHECK(pieces(*open(dir, j), "  \xEF\xAC\x81 ABC \t") == V{"_fiabc"});
  CHECK(open(dir, j)->encode("   ").empty());
  CHECK(dsrun::unicode::lowercase("\xCE\xA3\xCE\x99\xCE\xA3") == "\xCF\x83\xCE\xB9\xCF\x82");  // ΣΙΣ -> σις (final sigma)
}

TEST_CASE("BPE merges by rank, byte fallback, unknown tokens fused", "[tokenizer]") {
  TempDir dir;
  json j = tiny({"a", "b", "c", "ab", "bc", "abc", "<unk>", "<0xC3>", "<0xA9>"});
  j["model"]["ignore_merges"] = false;
  j["model"]["merges"] = {"b c", {"a", "bc"}, "a b"};  // both forms; "b c" ranks first
  j["model"]["unk_token"] = "<unk>";
  using V = std::vector<std::string>;
  CHECK(pieces(*open(dir, j), "abc") == V{"abc"});
  CHECK(pieces(*open(dir, j), "abab") == V{"ab", "ab"});
  // Unknown characters: one <unk> each, or fused runs with fuse_unk; bytes with byte_fallback.
  CHECK(pieces(*open(dir, j), "xya") == V{"<unk>", "<unk>", "a"});
  j["model"]["fuse_unk"] = true;
  CHECK(pieces(*open(dir, j), "xya") == V{"<unk>", "a"});
  j["model"]["byte_fallback"] = true;
  CHECK(pieces(*open(dir, j), "\xC3\xA9" "a") == V{"<0xC3>", "<0xA9>", "a"});
}

TEST_CASE("added tokens: split out first, single_word, lstrip, rstrip, special only with --special", "[tokenizer]") {
  TempDir dir;
  using V = std::vector<std::string>;
  json j = tiny(chars_and("ab <s></s>[M]", {}));
  // Added tokens need not be in the model's vocabulary: ids 100-103 are the added vocabulary's own.
  j["added_tokens"] = {{{"id", 100}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
                       {{"id", 101}, {"content", "</s>"}, {"special", true}, {"normalized", false}},
                       {{"id", 102}, {"content", "[M]"}, {"special", false}, {"normalized", false}, {"lstrip", true}, {"rstrip", true}},
                       {{"id", 103}, {"content", "ab"}, {"special", false}, {"normalized", true}, {"single_word", true}}};
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                     {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
                         {"pair", json::array()},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {100}}, {"tokens", {"<s>"}}}}, {"</s>", {{"id", "</s>"}, {"ids", {101}}, {"tokens", {"</s>"}}}}}}};
  const auto t = open(dir, j);
  CHECK(t->encode("a<s>b") == std::vector<uint32_t>{0, 100, 1});
  CHECK(t->encode("a", true) == std::vector<uint32_t>{100, 0, 101});
  CHECK(t->bos() == 100u);
  CHECK(t->eos() == 101u);
  CHECK(t->vocab_size() == 104);
  CHECK(pieces(*t, "a  [M]  b") == V{"a", "[M]", "b"});  // lstrip and rstrip take the spaces
  CHECK(pieces(*t, "ab aab") == V{"ab", " ", "a", "a", "b"});  // single_word: not inside a word
  CHECK(t->decode({100, 0, 101}, true) == "a");
}

TEST_CASE("decoders: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace", "[tokenizer]") {
  TempDir dir;
  json j = tiny({"\xE2\x96\x81" "a", "\xE2\x96\x81" "b", "<0xC3>", "<0xA9>", "<0xFF>", "\xC4\xA0" "x"});
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  auto t = open(dir, j);
  CHECK(t->decode({0, 2, 3, 1}, false) == "a\xC3\xA9 b");
  CHECK(t->decode({0, 4, 1}, false) == "a\xEF\xBF\xBD b");  // a lone 0xFF byte: U+FFFD per byte token
  j["decoder"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "always"}, {"split", true}};
  CHECK(open(dir, j)->decode({0, 1}, false) == "a b");
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  CHECK(open(dir, j)->decode({5}, false) == " x");  // U+0120 is the byte 0x20
  CHECK_THROWS_WITH(open(dir, j)->decode({99}, false), Catch::Contains("not in the vocabulary"));
}

TEST_CASE("what dsrun does not implement is an error naming its JSON path", "[tokenizer]") {
  TempDir dir;
  json j = tiny({"a", "b"});
  {
    json k = j;
    k["model"]["type"] = "WordPiece";
    CHECK(error_key(dir, k) == "model.type");
  }
  {
    json k = j;
    k["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Precompiled"}, {"precompiled_charsmap", "x"}}}}};
    CHECK(error_key(dir, k) == "normalizer.normalizers[1].type");
  }
  {
    json k = j;
    k["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Isolated"}, {"invert", false}, {"new_option", 1}};
    CHECK(error_key(dir, k) == "pre_tokenizer.new_option");
  }
  {
    json k = j;
    k["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(a"}}}, {"behavior", "Isolated"}};
    CHECK(error_key(dir, k) == "pre_tokenizer.pattern.Regex");
  }
  {
    json k = j;
    k["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}};
    CHECK(error_key(dir, k) == "pre_tokenizer.behavior");
  }
  {
    json k = j;
    k["truncation"] = {{"max_length", 8}};
    CHECK(error_key(dir, k) == "truncation");
  }
  {
    json k = j;
    k["model"]["merges"] = {"a b c"};
    CHECK(error_key(dir, k) == "model.merges[0]");
  }
  {
    json k = j;
    k["model"]["merges"] = {"a z"};
    CHECK(error_key(dir, k) == "model.merges[0]");
  }
  {
    json k = j;
    k["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}};
    CHECK(error_key(dir, k) == "decoder.type");
  }
  // The file is named too, and a directory without a tokenizer is refused.
  try {
    json k = j;
    k["post_processor"] = {{"type", "Nonsense"}};
    open(dir, k);
    FAIL("no error");
  } catch (const dsrun::Error& e) {
    CHECK(e.context().file == dir.file("tok/tokenizer.json"));
    CHECK(e.context().key == "post_processor.type");
  }
  CHECK_THROWS_WITH(dsrun::open_tokenizer(dir.path()), Catch::Contains("no tokenizer.json or tokenizer.model"));
  dir.write("bad/tokenizer.json", "{\"model\": ");
  CHECK_THROWS_WITH(dsrun::open_tokenizer(dir.file("bad")), Catch::Contains("cannot parse tokenizer.json"));
}

TEST_CASE("invalid UTF-8 is repaired one U+FFFD per maximal subpart", "[tokenizer]") {
  using dsrun::unicode::repair_utf8;
  const std::string r = "\xEF\xBF\xBD";
  CHECK(repair_utf8("a\x80" "b") == "a" + r + "b");
  CHECK(repair_utf8("\xE2\x82 ") == r + " ");                      // truncated 3-byte sequence: one
  CHECK(repair_utf8("\xC0\xAF") == r + r);                          // overlong: each byte
  CHECK(repair_utf8("\xED\xA0\x80") == r + r + r);                  // surrogate: each byte
  CHECK(repair_utf8("\xF0\x9F\x91\x8D") == "\xF0\x9F\x91\x8D");     // valid 4-byte: kept
  CHECK(repair_utf8("\xF0\x9F\x91") == r);
}
