// Hugging Face tokenizer.json: added tokens, normalizers, pre-tokenizers, the BPE model, the
// post-processor and decoders, each following the `tokenizers` crate (Rust) so ids are identical.
// Anything in the file dsrun does not implement is an error naming its JSON path; so is every value
// of the wrong type (all reads go through the checked accessors below), an id out of range, and
// Sequences nested deeper than kMaxNesting.
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/tokenizer/bpe.hpp"
#include "engine/tokenizer/regex.hpp"
#include "engine/tokenizer/tokenizer.hpp"
#include "engine/tokenizer/unicode.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <set>

namespace dsrun {
namespace {

using json = nlohmann::json;

// Sequences inside Sequences (normalizer, pre_tokenizer, post_processor, decoder): real files use
// one or two levels; each level is a recursion here and a longer JSON path.
constexpr int kMaxNesting = 64;

// Where in which file, for every error while reading a tokenizer.json.
struct JsonPlace {
  const std::string* file;
  std::string path;  // "pre_tokenizer.pretokenizers[1]"
  JsonPlace at(const std::string& key) const { return {file, path.empty() ? key : path + "." + key}; }
  JsonPlace at(size_t index) const { return {file, path + "[" + std::to_string(index) + "]"}; }
  // A key of a map such as model.vocab: any text, so quoted as JSON ("model.vocab[\"zz\"]").
  JsonPlace entry(const std::string& key) const { return {file, path + "[" + json(key).dump(-1, ' ', false, json::error_handler_t::replace) + "]"}; }
};

[[noreturn]] void fail(const JsonPlace& place, const std::string& message, const std::string& hint) {
  ErrorContext c;
  c.file = *place.file;
  c.key = place.path;
  c.hint = hint;
  throw Error(message, c);
}

[[noreturn]] void unsupported(const JsonPlace& place, const std::string& what) {
  fail(place, what + " is not supported by dsrun's tokenizer",
       "use a tokenizer.json without it (docs/tokenizers.md lists what is supported); dsrun never guesses, since ids would differ");
}

// "a string", "a list", ...: what a value is, for "expected X, found Y".
std::string kind_of(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "a list";
    case json::value_t::string: {
      std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
      if (text.size() > 40) {  // cut on a character boundary
        text.resize(unicode::previous_char_start(text, 36));
        text += "...\"";
      }
      return "a string (" + text + ")";
    }
    case json::value_t::boolean: return v.get<bool>() ? "true" : "false";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "the number " + v.dump();
    default: return "an unexpected value";
  }
}

[[noreturn]] void wrong_type(const JsonPlace& place, const json& v, const std::string& expected) {
  fail(place, "expected " + expected + ", found " + kind_of(v), "write " + expected + " there, as Hugging Face's libraries do");
}

void expect_object(const json& v, const JsonPlace& place) {
  if (!v.is_object()) wrong_type(place, v, "an object {...}");
}

// `object` must be an object; its `key` must be there.
const json& member(const json& object, const JsonPlace& place, const char* key) {
  expect_object(object, place);
  const auto it = object.find(key);
  if (it == object.end()) fail(place.at(key), std::string("missing key \"") + key + "\"", "check the tokenizer.json");
  return *it;
}

// The value of `key`, or nullptr when it is absent or null.
const json* optional_member(const json& object, const JsonPlace& place, const char* key) {
  expect_object(object, place);
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

std::string string_member(const json& object, const JsonPlace& place, const char* key) {
  const json& v = member(object, place, key);
  if (!v.is_string()) wrong_type(place.at(key), v, "a string");
  return v.get<std::string>();
}

std::optional<std::string> optional_string(const json& object, const JsonPlace& place, const char* key) {
  const json* v = optional_member(object, place, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(place.at(key), *v, "a string or null");
  return v->get<std::string>();
}

bool bool_member(const json& object, const JsonPlace& place, const char* key, bool fallback) {
  const json* v = optional_member(object, place, key);
  if (!v) return fallback;
  if (!v->is_boolean()) wrong_type(place.at(key), *v, "true or false");
  return v->get<bool>();
}

const json& array_member(const json& object, const JsonPlace& place, const char* key) {
  const json& v = member(object, place, key);
  if (!v.is_array()) wrong_type(place.at(key), v, "a list [...]");
  return v;
}

const json& object_member(const json& object, const JsonPlace& place, const char* key) {
  const json& v = member(object, place, key);
  expect_object(v, place.at(key));
  return v;
}

// A count (Strip's start and stop).
size_t count_member(const json& object, const JsonPlace& place, const char* key) {
  const json& v = member(object, place, key);
  if (!v.is_number_unsigned()) wrong_type(place.at(key), v, "a count (an integer from 0)");
  return v.get<size_t>();
}

// Token ids: integers from 0 to max_id (-1: none is allowed). `place_of` makes the JSON path, only
// for an error (model.vocab holds 100,000s of ids). `rule` says which ids are allowed.
template <class PlaceOf>
uint32_t id_value(const json& v, const PlaceOf& place_of, int64_t max_id, const std::string& rule) {
  if (v.is_number_unsigned()) {
    const uint64_t id = v.get<uint64_t>();
    if (id <= uint64_t(INT64_MAX) && int64_t(id) <= max_id) return static_cast<uint32_t>(id);
    fail(place_of(), "id " + std::to_string(id) + " is out of range", rule);
  }
  if (v.is_number_integer()) fail(place_of(), "id " + v.dump() + " is negative", "token ids run from 0; fix the tokenizer.json");
  wrong_type(place_of(), v, "an id (an integer from 0)");
}

// The largest id a tokenizer.json with `entries` tokens (model vocabulary and added tokens) may
// use: ids below 2^31, and at most 4 x entries + 65535 (room for gaps of three unused ids per token,
// and for any numbering of a small vocabulary). Real files number their tokens densely (Llama-3:
// 128256 tokens, largest id 128255); dsrun sizes id-indexed tables (and `dsrun prepare` the token
// width, a model its embedding) by the largest id, so one far id would cost memory for every id
// below it: 9 GB for "zz": 300000000. The `tokenizers` crate refuses ids of 2^32 and more.
int64_t id_ceiling(uint64_t entries) { return static_cast<int64_t>(std::min<uint64_t>(INT32_MAX, 4 * entries + 65535)); }

std::string id_rule(uint64_t entries) {
  return "ids must lie within 0.." + std::to_string(id_ceiling(entries)) + ": below 2^31 and at most 4 x " + std::to_string(entries) +
         " tokens + 65535, since dsrun sizes its tables by the largest id; fix the id in the tokenizer.json";
}

// Keys a component may carry; any other key could change ids, so it is refused.
void expect_keys(const json& object, const JsonPlace& place, std::initializer_list<const char*> known) {
  expect_object(object, place);
  for (const auto& item : object.items()) {
    if (item.key() == "type") continue;
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return item.key() == k; })) {
      unsupported(place.at(item.key()), "the key \"" + item.key() + "\"");
    }
  }
}

// A JSON path for a message: a deeply nested one shortened in the middle.
std::string shortened(const std::string& path) {
  if (path.size() <= 160) return path;
  size_t head = path.find('.', 60), tail = path.rfind('.', path.size() - 60);
  if (head == std::string::npos || tail == std::string::npos || tail <= head) return path;
  return path.substr(0, head) + ". ... " + path.substr(tail);
}

// Guards the recursion of a Sequence.
void check_nesting(int depth, const JsonPlace& place) {
  if (depth < kMaxNesting) return;
  ErrorContext c;
  c.file = *place.file;
  c.key = shortened(place.path);
  c.hint = "real tokenizer.json files nest one or two Sequences; flatten the Sequence into one list";
  throw Error("Sequence nested more than " + std::to_string(kMaxNesting) + " levels deep", c);
}

// Metaspace's replacement: exactly one character.
char32_t one_character(const std::string& text, const JsonPlace& place) {
  int len = 0;
  const char32_t cp = text.empty() ? 0 : unicode::decode_at(text, 0, &len);
  if (text.empty() || size_t(len) != text.size()) fail(place, "the replacement must be one character", "check the tokenizer.json");
  return cp;
}

// {"String": "..."} or {"Regex": "..."}: tokenizer.json's patterns.
std::unique_ptr<Regex> pattern_member(const json& object, const JsonPlace& place, const char* key) {
  const json& p = member(object, place, key);
  const JsonPlace where = place.at(key);
  if (p.is_object() && p.contains("String") && p["String"].is_string()) {
    return std::make_unique<Regex>(regex_escape(p["String"].get<std::string>()), where.path + ".String", *place.file);
  }
  if (p.is_object() && p.contains("Regex") && p["Regex"].is_string()) {
    return std::make_unique<Regex>(p["Regex"].get<std::string>(), where.path + ".Regex", *place.file);
  }
  fail(where, "expected {\"String\": \"...\"} or {\"Regex\": \"...\"}, found " + kind_of(p), "check the tokenizer.json");
}

// ---------------------------------------------------------------- normalizers

struct Normalizer {
  enum class Kind { nfc, nfd, nfkc, nfkd, lowercase, replace, prepend, strip, strip_accents };
  Kind kind;
  std::unique_ptr<Regex> pattern;  // replace
  std::string content;             // replace, prepend
  bool left = false, right = false;  // strip
};

void parse_normalizer(const json& j, const JsonPlace& place, std::vector<Normalizer>& out, int depth = 0) {
  if (j.is_null()) return;
  const std::string type = string_member(j, place, "type");
  Normalizer n;
  if (type == "Sequence") {
    check_nesting(depth, place);
    expect_keys(j, place, {"normalizers"});
    const json& list = array_member(j, place, "normalizers");
    for (size_t i = 0; i < list.size(); ++i) parse_normalizer(list[i], place.at("normalizers").at(i), out, depth + 1);
    return;
  }
  static const std::map<std::string, Normalizer::Kind> forms = {
      {"NFC", Normalizer::Kind::nfc}, {"NFD", Normalizer::Kind::nfd}, {"NFKC", Normalizer::Kind::nfkc},
      {"NFKD", Normalizer::Kind::nfkd}, {"Lowercase", Normalizer::Kind::lowercase}, {"StripAccents", Normalizer::Kind::strip_accents}};
  if (const auto it = forms.find(type); it != forms.end()) {
    expect_keys(j, place, {});
    n.kind = it->second;
  } else if (type == "Replace") {
    expect_keys(j, place, {"pattern", "content"});
    n.kind = Normalizer::Kind::replace;
    n.pattern = pattern_member(j, place, "pattern");
    n.content = string_member(j, place, "content");
  } else if (type == "Prepend") {
    expect_keys(j, place, {"prepend"});
    n.kind = Normalizer::Kind::prepend;
    n.content = string_member(j, place, "prepend");
  } else if (type == "Strip") {
    expect_keys(j, place, {"strip_left", "strip_right"});
    n.kind = Normalizer::Kind::strip;
    n.left = bool_member(j, place, "strip_left", false);
    n.right = bool_member(j, place, "strip_right", false);
  } else {
    unsupported(place.at("type"), "the normalizer \"" + type + "\"");
  }
  out.push_back(std::move(n));
}

std::string replace_all(const Regex& pattern, std::string_view text, const std::string& content, RegexBudget& budget) {
  thread_local std::vector<std::pair<size_t, size_t>> matches;
  pattern.find_all(text, matches, budget);
  if (matches.empty()) return std::string(text);
  std::string out;
  size_t at = 0;
  for (const auto& [s, e] : matches) {
    out.append(text.substr(at, s - at));
    out += content;
    at = e;
  }
  out.append(text.substr(at));
  return out;
}

std::string apply_normalizers(const std::vector<Normalizer>& normalizers, std::string text, RegexBudget& budget) {
  for (const Normalizer& n : normalizers) {
    switch (n.kind) {
      case Normalizer::Kind::nfc: text = unicode::normalize(text, unicode::NormalForm::nfc); break;
      case Normalizer::Kind::nfd: text = unicode::normalize(text, unicode::NormalForm::nfd); break;
      case Normalizer::Kind::nfkc: text = unicode::normalize(text, unicode::NormalForm::nfkc); break;
      case Normalizer::Kind::nfkd: text = unicode::normalize(text, unicode::NormalForm::nfkd); break;
      case Normalizer::Kind::lowercase: text = unicode::lowercase(text); break;
      case Normalizer::Kind::replace: text = replace_all(*n.pattern, text, n.content, budget); break;
      case Normalizer::Kind::prepend:
        if (!text.empty()) text = n.content + text;  // the crate prepends to non-empty text only
        break;
      case Normalizer::Kind::strip: {
        size_t b = 0, e = text.size();
        int len;
        while (n.left && b < e && unicode::is_whitespace(unicode::decode_at(text, b, &len))) b += len;
        while (n.right && e > b) {
          const size_t k = unicode::previous_char_start(text, e);
          if (!unicode::is_whitespace(unicode::decode_at(text, k, &len))) break;
          e = k;
        }
        text = text.substr(b, e - b);
        break;
      }
      case Normalizer::Kind::strip_accents: {
        std::string out;
        for (size_t i = 0; i < text.size();) {
          int len;
          const char32_t cp = unicode::decode_at(text, i, &len);
          if (!unicode::is_nonspacing_mark(cp)) out.append(text, i, len);
          i += len;
        }
        text = std::move(out);
        break;
      }
    }
  }
  return text;
}

// ---------------------------------------------------------------- pre-tokenizers

// One table feeds parsing and the error listing the accepted names.
enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };
const std::map<std::string, SplitBehavior>& split_behaviors() {
  static const std::map<std::string, SplitBehavior> table = {
      {"Removed", SplitBehavior::removed}, {"Isolated", SplitBehavior::isolated},
      {"MergedWithPrevious", SplitBehavior::merged_with_previous}, {"MergedWithNext", SplitBehavior::merged_with_next},
      {"Contiguous", SplitBehavior::contiguous}};
  return table;
}

SplitBehavior behavior_member(const json& j, const JsonPlace& place, const char* key, SplitBehavior fallback) {
  if (!j.contains(key)) return fallback;
  const std::string name = string_member(j, place, key);
  const auto it = split_behaviors().find(name);
  if (it == split_behaviors().end()) {
    std::string names;
    for (const auto& [k, v] : split_behaviors()) names += (names.empty() ? "" : ", ") + k;
    fail(place.at(key), "unknown split behavior \"" + name + "\"", "one of " + names);
  }
  return it->second;
}

// A piece of text on its way through the pre-tokenizers; `at_start`: it begins the input
// (Metaspace's prepend_scheme "first" needs to know).
struct Piece {
  std::string text;
  bool at_start;
};

struct Segment {
  size_t start, end;
  bool match;
};

// The crate's NormalizedString::split: segments (matches and the text between) combined by
// `behavior`, empty pieces dropped.
void split_piece(const Piece& piece, std::vector<Segment>& segments, SplitBehavior behavior, bool invert, std::vector<Piece>& out) {
  if (invert) for (Segment& s : segments) s.match = !s.match;
  std::vector<std::pair<size_t, size_t>> spans;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::removed:
      for (const Segment& s : segments) if (!s.match) spans.emplace_back(s.start, s.end);
      break;
    case SplitBehavior::isolated:
      for (const Segment& s : segments) spans.emplace_back(s.start, s.end);
      break;
    case SplitBehavior::merged_with_previous:
      for (const Segment& s : segments) {
        if (s.match && !previous_match && !spans.empty()) spans.back().second = s.end;
        else spans.emplace_back(s.start, s.end);
        previous_match = s.match;
      }
      break;
    case SplitBehavior::merged_with_next:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->match && !previous_match && !spans.empty()) spans.back().first = it->start;
        else spans.emplace_back(it->start, it->end);
        previous_match = it->match;
      }
      std::reverse(spans.begin(), spans.end());
      break;
    case SplitBehavior::contiguous:
      for (const Segment& s : segments) {
        if (s.match == previous_match && !spans.empty()) spans.back().second = s.end;
        else spans.emplace_back(s.start, s.end);
        previous_match = s.match;
      }
      break;
  }
  for (const auto& [s, e] : spans) {
    if (e > s) out.push_back({piece.text.substr(s, e - s), piece.at_start && s == 0});
  }
}

// Segments from a regex: each match, and the text between matches.
void regex_segments(const Regex& regex, std::string_view text, std::vector<Segment>& segments, RegexBudget& budget) {
  thread_local std::vector<std::pair<size_t, size_t>> matches;
  segments.clear();
  if (text.empty()) {
    segments.push_back({0, 0, false});
    return;
  }
  regex.find_all(text, matches, budget);
  size_t previous = 0;
  for (const auto& [s, e] : matches) {
    if (previous != s) segments.push_back({previous, s, false});
    segments.push_back({s, e, true});
    previous = e;
  }
  if (previous != text.size()) segments.push_back({previous, text.size(), false});
}

// Segments from a character predicate: each matching character alone, runs of the others.
void char_segments(std::string_view text, const std::function<bool(char32_t)>& is_match, std::vector<Segment>& segments) {
  segments.clear();
  if (text.empty()) {
    segments.push_back({0, 0, false});
    return;
  }
  size_t last = 0;
  for (size_t i = 0; i < text.size();) {
    int len;
    const char32_t cp = unicode::decode_at(text, i, &len);
    if (is_match(cp)) {
      if (last < i) segments.push_back({last, i, false});
      segments.push_back({i, i + len, true});
      last = i + len;
    }
    i += len;
  }
  if (last < text.size()) segments.push_back({last, text.size(), false});
}

constexpr const char* kByteLevelRegex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct PreTokenizer {
  enum class Kind { split, byte_level, digits, metaspace, whitespace, whitespace_split, punctuation, bert };
  Kind kind;
  std::unique_ptr<Regex> regex;  // split, byte_level with use_regex, whitespace
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  bool add_prefix_space = false;   // byte_level
  bool individual_digits = false;  // digits
  char32_t replacement = 0x2581;   // metaspace
  std::string replacement_text;
  enum class Prepend { always, never, first } prepend = Prepend::always;
  bool metaspace_split = true;
};

void parse_pre_tokenizer(const json& j, const JsonPlace& place, std::vector<PreTokenizer>& out, int depth = 0) {
  if (j.is_null()) return;
  const std::string type = string_member(j, place, "type");
  PreTokenizer p;
  if (type == "Sequence") {
    check_nesting(depth, place);
    expect_keys(j, place, {"pretokenizers"});
    const json& list = array_member(j, place, "pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) parse_pre_tokenizer(list[i], place.at("pretokenizers").at(i), out, depth + 1);
    return;
  } else if (type == "Split") {
    expect_keys(j, place, {"pattern", "behavior", "invert"});
    p.kind = PreTokenizer::Kind::split;
    p.regex = pattern_member(j, place, "pattern");
    p.behavior = behavior_member(j, place, "behavior", SplitBehavior::isolated);
    p.invert = bool_member(j, place, "invert", false);
  } else if (type == "ByteLevel") {
    expect_keys(j, place, {"add_prefix_space", "trim_offsets", "use_regex"});  // trim_offsets: offsets only
    p.kind = PreTokenizer::Kind::byte_level;
    p.add_prefix_space = bool_member(j, place, "add_prefix_space", true);
    if (bool_member(j, place, "use_regex", true)) p.regex = std::make_unique<Regex>(kByteLevelRegex, place.path + " (byte-level regex)", *place.file);
  } else if (type == "Digits") {
    expect_keys(j, place, {"individual_digits"});
    p.kind = PreTokenizer::Kind::digits;
    p.individual_digits = bool_member(j, place, "individual_digits", false);
  } else if (type == "Metaspace") {
    expect_keys(j, place, {"replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"});
    p.kind = PreTokenizer::Kind::metaspace;
    p.replacement_text = string_member(j, place, "replacement");
    p.replacement = one_character(p.replacement_text, place.at("replacement"));
    if (j.contains("prepend_scheme")) {
      const std::string scheme = string_member(j, place, "prepend_scheme");
      if (scheme == "always") p.prepend = PreTokenizer::Prepend::always;
      else if (scheme == "never") p.prepend = PreTokenizer::Prepend::never;
      else if (scheme == "first") p.prepend = PreTokenizer::Prepend::first;
      else fail(place.at("prepend_scheme"), "unknown prepend_scheme \"" + scheme + "\"", "always, never or first");
    } else {
      p.prepend = bool_member(j, place, "add_prefix_space", true) ? PreTokenizer::Prepend::always : PreTokenizer::Prepend::never;
    }
    p.metaspace_split = bool_member(j, place, "split", true);
  } else if (type == "Whitespace") {
    expect_keys(j, place, {});
    p.kind = PreTokenizer::Kind::whitespace;
    p.regex = std::make_unique<Regex>(R"(\w+|[^\w\s]+)", place.path + " (whitespace regex)", *place.file);
  } else if (type == "WhitespaceSplit") {
    expect_keys(j, place, {});
    p.kind = PreTokenizer::Kind::whitespace_split;
  } else if (type == "Punctuation") {
    expect_keys(j, place, {"behavior"});
    p.kind = PreTokenizer::Kind::punctuation;
    p.behavior = behavior_member(j, place, "behavior", SplitBehavior::isolated);
  } else if (type == "BertPreTokenizer") {
    expect_keys(j, place, {});
    p.kind = PreTokenizer::Kind::bert;
  } else {
    unsupported(place.at("type"), "the pre-tokenizer \"" + type + "\"");
  }
  out.push_back(std::move(p));
}

// Bytes to GPT-2's byte alphabet, in place: one or two UTF-8 bytes per byte, from a table.
void byte_level_map(std::string& text) {
  struct Table {
    char bytes[256][2];
    uint8_t length[256];
    Table() {
      const auto& alphabet = unicode::byte_to_char();
      for (int b = 0; b < 256; ++b) {
        length[b] = static_cast<uint8_t>(alphabet[b].size());
        for (size_t k = 0; k < alphabet[b].size(); ++k) bytes[b][k] = alphabet[b][k];
      }
    }
  };
  static const Table table;
  thread_local std::string mapped;
  mapped.resize(text.size() * 2);
  size_t n = 0;
  for (const char c : text) {
    const auto b = static_cast<unsigned char>(c);
    mapped[n] = table.bytes[b][0];
    mapped[n + 1] = table.bytes[b][1];
    n += table.length[b];
  }
  text.assign(mapped, 0, n);
}

bool is_bert_punctuation(char32_t cp) {
  return (cp < 0x80 && std::ispunct(static_cast<int>(cp))) || unicode::is_punctuation(cp);
}

void apply_pre_tokenizer(const PreTokenizer& p, std::vector<Piece>& pieces, RegexBudget& budget) {
  thread_local std::vector<Piece> out;  // reused: short lines would otherwise allocate per step
  out.clear();
  thread_local std::vector<Segment> segments;
  for (Piece& piece : pieces) {
    switch (p.kind) {
      case PreTokenizer::Kind::split:
        regex_segments(*p.regex, piece.text, segments, budget);
        split_piece(piece, segments, p.behavior, p.invert, out);
        break;
      case PreTokenizer::Kind::byte_level: {
        if (p.add_prefix_space && piece.text.compare(0, 1, " ") != 0) piece.text.insert(0, " ");
        const size_t first = out.size();
        if (p.regex) {
          regex_segments(*p.regex, piece.text, segments, budget);
          split_piece(piece, segments, SplitBehavior::isolated, false, out);
        } else {
          out.push_back(std::move(piece));
        }
        for (size_t k = first; k < out.size(); ++k) byte_level_map(out[k].text);
        break;
      }
      case PreTokenizer::Kind::digits:
        char_segments(piece.text, unicode::is_numeric, segments);
        split_piece(piece, segments, p.individual_digits ? SplitBehavior::isolated : SplitBehavior::contiguous, false, out);
        break;
      case PreTokenizer::Kind::metaspace: {
        std::string text;
        text.reserve(piece.text.size() + 3);
        for (const char c : piece.text) {
          if (c == ' ') text += p.replacement_text;
          else text += c;
        }
        const bool starts = text.compare(0, p.replacement_text.size(), p.replacement_text) == 0;
        if (!starts && (p.prepend == PreTokenizer::Prepend::always || (p.prepend == PreTokenizer::Prepend::first && piece.at_start))) {
          text.insert(0, p.replacement_text);
        }
        Piece replaced{std::move(text), piece.at_start};
        if (p.metaspace_split) {
          char_segments(replaced.text, [&](char32_t cp) { return cp == p.replacement; }, segments);
          split_piece(replaced, segments, SplitBehavior::merged_with_next, false, out);
        } else if (!replaced.text.empty()) {
          out.push_back(std::move(replaced));
        }
        break;
      }
      case PreTokenizer::Kind::whitespace:
        regex_segments(*p.regex, piece.text, segments, budget);
        split_piece(piece, segments, SplitBehavior::removed, true, out);
        break;
      case PreTokenizer::Kind::whitespace_split:
        char_segments(piece.text, unicode::is_whitespace, segments);
        split_piece(piece, segments, SplitBehavior::removed, false, out);
        break;
      case PreTokenizer::Kind::punctuation:
        char_segments(piece.text, is_bert_punctuation, segments);
        split_piece(piece, segments, p.behavior, false, out);
        break;
      case PreTokenizer::Kind::bert: {
        std::vector<Piece> words;
        char_segments(piece.text, unicode::is_whitespace, segments);
        split_piece(piece, segments, SplitBehavior::removed, false, words);
        for (const Piece& w : words) {
          char_segments(w.text, is_bert_punctuation, segments);
          split_piece(w, segments, SplitBehavior::isolated, false, out);
        }
        break;
      }
    }
  }
  pieces.swap(out);
}

// ---------------------------------------------------------------- added tokens

struct AddedToken {
  uint32_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Leftmost-longest matching of the added tokens (the crate uses Aho-Corasick with that rule): a
// byte trie walked from each position.
class AddedTokenMatcher {
 public:
  void add(const std::string& text, int token) {
    if (text.empty()) return;
    int node = 0;
    for (const char c : text) {
      auto& children = nodes_[node].children;
      auto it = std::find_if(children.begin(), children.end(), [&](const auto& e) { return e.first == c; });
      if (it == children.end()) {
        children.emplace_back(c, static_cast<int>(nodes_.size()));
        node = static_cast<int>(nodes_.size());
        nodes_.push_back({});
      } else {
        node = it->second;
      }
    }
    if (nodes_[node].token < 0) nodes_[node].token = token;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The longest token starting at text[i]: its index and length, or -1.
  int longest_at(std::string_view text, size_t i, size_t* length) const {
    int node = 0, best = -1;
    for (size_t k = i; k < text.size(); ++k) {
      const auto& children = nodes_[node].children;
      auto it = std::find_if(children.begin(), children.end(), [&](const auto& e) { return e.first == text[k]; });
      if (it == children.end()) break;
      node = it->second;
      if (nodes_[node].token >= 0) {
        best = nodes_[node].token;
        *length = k + 1 - i;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<char, int>> children;
    int token = -1;
  };
  std::vector<Node> nodes_{Node{}};
};

bool ends_with_word_char(std::string_view text) {
  if (text.empty()) return false;
  int len;
  const char32_t cp = unicode::decode_at(text, unicode::previous_char_start(text, text.size()), &len);
  return cp == '_' || unicode::is_alphanumeric(cp);
}

bool starts_with_word_char(std::string_view text) {
  if (text.empty()) return false;
  int len;
  const char32_t cp = unicode::decode_at(text, 0, &len);
  return cp == '_' || unicode::is_alphanumeric(cp);
}

// A stretch of input: an added token (token >= 0) or text for the rest of the pipeline.
struct Split {
  size_t start, end;
  int token;
};

// The crate's AddedVocabulary::find_matches: single_word, lstrip and rstrip as it applies them.
void find_added(const AddedTokenMatcher& matcher, const std::vector<AddedToken>& tokens, std::string_view text, std::vector<Split>& out) {
  out.clear();
  size_t offset = 0;
  if (!matcher.empty()) {
    for (size_t i = 0; i < text.size();) {
      size_t length = 0;
      const int t = matcher.longest_at(text, i, &length);
      if (t < 0) {
        ++i;
        continue;
      }
      const AddedToken& token = tokens[t];
      size_t start = i, stop = i + length;
      i = stop;
      if (token.single_word && (ends_with_word_char(text.substr(0, start)) || starts_with_word_char(text.substr(stop)))) continue;
      if (token.lstrip) {
        size_t s = start;
        while (s > 0) {
          const size_t k = unicode::previous_char_start(text, s);
          int len;
          if (!unicode::is_whitespace(unicode::decode_at(text, k, &len))) break;
          s = k;
        }
        start = std::max(s, offset);
      }
      if (token.rstrip) {
        int len;
        while (stop < text.size() && unicode::is_whitespace(unicode::decode_at(text, stop, &len))) stop += len;
        i = stop;
      }
      if (offset < start) out.push_back({offset, start, -1});
      out.push_back({start, stop, t});
      offset = stop;
    }
  }
  if (offset < text.size() || text.empty()) out.push_back({offset, text.size(), -1});
}

// ---------------------------------------------------------------- decoders

struct Decoder {
  enum class Kind { byte_level, metaspace, replace, byte_fallback, fuse, strip, bpe };
  Kind kind;
  std::unique_ptr<Regex> pattern;  // replace
  std::string content;             // replace: the new text; strip: the character; bpe: the suffix
  char32_t replacement = 0x2581;   // metaspace
  bool prepend = true;             // metaspace: prepend_scheme is not "never"
  size_t start = 0, stop = 0;      // strip
};

void parse_decoder(const json& j, const JsonPlace& place, std::vector<Decoder>& out, int depth = 0) {
  if (j.is_null()) return;
  const std::string type = string_member(j, place, "type");
  Decoder d;
  if (type == "Sequence") {
    check_nesting(depth, place);
    expect_keys(j, place, {"decoders"});
    const json& list = array_member(j, place, "decoders");
    for (size_t i = 0; i < list.size(); ++i) parse_decoder(list[i], place.at("decoders").at(i), out, depth + 1);
    return;
  } else if (type == "ByteLevel") {
    expect_keys(j, place, {"add_prefix_space", "trim_offsets", "use_regex"});
    d.kind = Decoder::Kind::byte_level;
  } else if (type == "Metaspace") {
    expect_keys(j, place, {"replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"});
    d.kind = Decoder::Kind::metaspace;
    d.replacement = one_character(string_member(j, place, "replacement"), place.at("replacement"));
    d.prepend = j.contains("prepend_scheme") ? string_member(j, place, "prepend_scheme") != "never" : bool_member(j, place, "add_prefix_space", true);
  } else if (type == "Replace") {
    expect_keys(j, place, {"pattern", "content"});
    d.kind = Decoder::Kind::replace;
    d.pattern = pattern_member(j, place, "pattern");
    d.content = string_member(j, place, "content");
  } else if (type == "ByteFallback") {
    expect_keys(j, place, {});
    d.kind = Decoder::Kind::byte_fallback;
  } else if (type == "Fuse") {
    expect_keys(j, place, {});
    d.kind = Decoder::Kind::fuse;
  } else if (type == "Strip") {
    expect_keys(j, place, {"content", "start", "stop"});
    d.kind = Decoder::Kind::strip;
    d.content = string_member(j, place, "content");
    d.start = count_member(j, place, "start");
    d.stop = count_member(j, place, "stop");
  } else if (type == "BPEDecoder") {
    expect_keys(j, place, {"suffix"});
    d.kind = Decoder::Kind::bpe;
    d.content = j.contains("suffix") ? string_member(j, place, "suffix") : "</w>";
  } else {
    unsupported(place.at("type"), "the decoder \"" + type + "\"");
  }
  out.push_back(std::move(d));
}

std::vector<std::string> apply_decoder(const Decoder& d, std::vector<std::string> tokens, RegexBudget& budget) {
  switch (d.kind) {
    case Decoder::Kind::byte_level: {
      std::string bytes;
      for (const std::string& t : tokens) {
        std::string mapped;
        bool all_mapped = true;
        for (size_t i = 0; i < t.size();) {
          int len;
          const int b = unicode::char_to_byte(unicode::decode_at(t, i, &len));
          if (b < 0) { all_mapped = false; break; }
          mapped += static_cast<char>(b);
          i += len;
        }
        bytes += all_mapped ? mapped : t;  // a token outside the alphabet (an added token) as written
      }
      return {unicode::repair_utf8(bytes)};
    }
    case Decoder::Kind::metaspace:
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string out;
        for (size_t k = 0; k < tokens[i].size();) {
          int len;
          const char32_t cp = unicode::decode_at(tokens[i], k, &len);
          if (cp != d.replacement) out.append(tokens[i], k, len);
          else if (!(i == 0 && d.prepend)) out += ' ';
          k += len;
        }
        tokens[i] = std::move(out);
      }
      return tokens;
    case Decoder::Kind::replace:
      for (std::string& t : tokens) t = replace_all(*d.pattern, t, d.content, budget);
      return tokens;
    case Decoder::Kind::byte_fallback: {
      std::vector<std::string> out;
      std::string bytes;
      size_t byte_tokens = 0;
      const auto flush = [&] {
        if (byte_tokens == 0) return;
        if (unicode::is_valid_utf8(bytes)) {
          out.push_back(bytes);
        } else {
          for (size_t k = 0; k < byte_tokens; ++k) out.push_back("\xEF\xBF\xBD");
        }
        bytes.clear();
        byte_tokens = 0;
      };
      for (std::string& t : tokens) {
        const bool is_byte = t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
                             std::isxdigit(static_cast<unsigned char>(t[4]));
        if (is_byte) {
          bytes += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
          ++byte_tokens;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      return out;
    }
    case Decoder::Kind::fuse: {
      std::string all;
      for (const std::string& t : tokens) all += t;
      return {all};
    }
    case Decoder::Kind::strip:
      for (std::string& t : tokens) {
        std::vector<std::pair<size_t, int>> chars;  // offset, length
        for (size_t k = 0; k < t.size();) {
          int len;
          unicode::decode_at(t, k, &len);
          chars.emplace_back(k, len);
          k += len;
        }
        size_t cut_start = 0, cut_stop = chars.size();
        for (size_t i = 0; i < std::min(d.start, chars.size()); ++i) {
          if (t.compare(chars[i].first, chars[i].second, d.content) != 0) break;
          cut_start = i + 1;
        }
        for (size_t i = 0; i < std::min(d.stop, chars.size()); ++i) {
          const size_t index = chars.size() - i - 1;
          if (t.compare(chars[index].first, chars[index].second, d.content) != 0) break;
          cut_stop = index;
        }
        if (cut_start >= cut_stop) t.clear();
        else t = t.substr(chars[cut_start].first, chars[cut_stop - 1].first + chars[cut_stop - 1].second - chars[cut_start].first);
      }
      return tokens;
    case Decoder::Kind::bpe:
      for (size_t i = 0; i < tokens.size(); ++i) {
        const std::string with = i + 1 == tokens.size() ? "" : " ";
        std::string out;
        size_t at = 0, found;
        while (!d.content.empty() && (found = tokens[i].find(d.content, at)) != std::string::npos) {
          out.append(tokens[i], at, found - at);
          out += with;
          at = found + d.content.size();
        }
        out.append(tokens[i], at, std::string::npos);
        tokens[i] = std::move(out);
      }
      return tokens;
  }
  return tokens;
}

// ---------------------------------------------------------------- safe cuts

// Where a long document may be cut so that its two pieces, each encoded alone, give the ids of the
// whole (Tokenizer::safe_cut). Two kinds of cut at offset c of the document D:
//   after a line break: D[c-1] is '\n', the character before it is not whitespace, D[c] is a letter;
//   before a space:     D[c] is ' ', the characters on both sides are letters.
// Encoding runs the added tokens, the normalizers, the normalized added tokens, the pre-tokenizers,
// then BPE on each pre-token. The pieces give the whole's ids when each stage maps the whole to the
// concatenation of what it maps the pieces to, and some pre-tokenizer puts a pre-token boundary at
// the cut (BPE merges within a pre-token only). find_cut_rules checks this stage by stage and keeps
// only the kinds of cut it can show for this tokenizer.json; anything it does not know drops them.
enum CutRule : unsigned { kCutAfterNewline = 1, kCutBeforeSpace = 2 };

// Split patterns (and ByteLevel's own regex) whose matches at a cut are known. `bounds`: there is a
// match boundary at every cut of both kinds, and the matches of the whole are those of the pieces.
// Otherwise no match can touch a cut (its characters are never matched), so the whole's text
// around the cut stays one segment and the pieces' two halves of it stay two: nothing changes.
//
// Why the `bounds` patterns bound: a piece differs from the whole only in what a match attempt
// sees at the cut: end of text instead of D[c] (a letter after '\n'; a space before a letter).
//  - No alternative matches across the cut. Before a space: every alternative that consumes a
//    letter goes on with letters, marks, digits or an apostrophe only, and a space is taken only as
//    an alternative's first character (` ?`, `[^\r\n\p{L}\p{N}]?`, `\s`). After '\n': '\n' is taken
//    only by whitespace runs (`\s+`, `\s*[\r\n]+`) and by trailing `[\r\n]*` / `[\r\n/]*`, none of
//    which goes on with a letter; the optional first characters exclude \r and \n.
//  - An attempt that stops at the cut stops there both ways: a letter after a letter run's end is
//    impossible (the run would have taken it), and classes of whitespace, newlines, digits and
//    punctuation fail on both a letter and the end of text; `(?i:'s|...)?` fails on both a space
//    and the end. The one test that differs is `(?!\S)` (true at the end of text, false before a
//    letter). In the Llama-3, Qwen, GPT-4o and DeepSeek-V3 patterns it follows `\s+`, which is tried
//    only where `\s*[\r\n]+`, an earlier alternative, failed: never on a whitespace run that ends
//    at a '\n' before the cut. In GPT-2's pattern `\s+(?!\S)` comes first, so the whole splits a
//    run "  \n" before a letter into "  " and "\n" while a piece ending there keeps "  \n": hence a
//    cut after '\n' needs a character other than whitespace before the '\n' (the run is "\n" alone,
//    matched whole either way).
//  - So the whole's last match before the cut ends exactly at it (the '\n', or the letter before the
//    space, is matched by an alternative that stops there), and the search resumes there as a
//    piece's starts: no pattern here looks behind.
// The other patterns (digits, DeepSeek-V3's kana and CJK runs) never match '\n', ' ' or a letter
// that is not theirs, and their runs cannot cross a space or a line break.
struct KnownSplit {
  const char* pattern;
  bool bounds;
};
const KnownSplit kKnownSplits[] = {
    // GPT-2 (ByteLevel's own regex, also written as a Split by some files)
    {kByteLevelRegex, true},
    // Llama-3's (any file with exactly this pattern is covered, whatever its model)
    {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re", true},
    // Qwen3's
    {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re", true},
    // GPT-4o's (o200k)
    {R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re", true},
    // DeepSeek-V3 (its file writes \r and \n as the characters themselves), after its two below
    {"[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+", true},
    {R"re(\p{N}{1,3})re", false},
    {"[\u4E00-\u9FA5\u3040-\u309F\u30A0-\u30FF]+", false},
};

const KnownSplit* known_split(const std::string& pattern) {
  for (const KnownSplit& k : kKnownSplits) {
    if (pattern == k.pattern) return &k;
  }
  return nullptr;
}

// Whitespace as any regex engine of a tokenizer may see it: Unicode's White_Space, and U+180E
// (MONGOLIAN VOWEL SEPARATOR, a space until Unicode 6.3 and still in PCRE2's \h).
bool is_space_for_cut(char32_t cp) { return unicode::is_whitespace(cp) || cp == 0x180E; }

bool starts_with_letter(std::string_view text) {
  char32_t cp;
  int len;
  return unicode::decode_checked(text, 0, &cp, &len) && unicode::is_letter(cp);
}

bool ends_with_letter(std::string_view text) {
  if (text.empty()) return false;
  const size_t k = unicode::previous_char_start(text, text.size());
  char32_t cp;
  int len;
  return unicode::decode_checked(text, k, &cp, &len) && unicode::is_letter(cp);
}

// ---------------------------------------------------------------- the tokenizer

// "[json.exception.parse_error.101] parse error at line 1, column 11: syntax error ..." -> the
// text after the library's prefixes, with the line and column for the error's context.
std::string library_message(const std::exception& e, int* line = nullptr, int* column = nullptr) {
  std::string m = e.what();
  if (m.rfind("[json.exception.", 0) == 0 && m.find("] ") != std::string::npos) m = m.substr(m.find("] ") + 2);
  int l = 0, c = 0;
  if (sscanf(m.c_str(), "parse error at line %d, column %d", &l, &c) == 2 && m.find(": ") != std::string::npos) {
    m = m.substr(m.find(": ") + 2);
    if (line) *line = l;
    if (column) *column = c;
  }
  return m;
}

// A JSON file, parsed; a syntax error names the file, line and column. (nlohmann's parser and
// destructor do not recurse: a file nested 1,000,000 deep parses in bounded stack.)
// Tokenizer files are tens of MiB (Llama 3's tokenizer.json is 9 MB): one past kMaxJsonFileBytes is
// refused by its size before it is read whole into memory.
constexpr int64_t kMaxJsonFileBytes = int64_t{1} << 30;

json parse_json_file(const std::string& path, const std::string& what, const std::string& hint) {
  const int64_t size = file_size(path);
  if (size > kMaxJsonFileBytes) {
    ErrorContext c;
    c.file = path;
    c.hint = "a tokenizer's JSON is tens of MiB at most: is this the right file?";
    throw Error(what + " is " + std::to_string(size >> 20) + " MiB, past the 1024 MiB dsrun reads", c);
  }
  try {
    return json::parse(read_file(path));
  } catch (const json::parse_error& e) {
    ErrorContext c;
    c.file = path;
    c.hint = hint;
    const std::string message = library_message(e, &c.line, &c.column);
    throw Error("cannot parse " + what + ": " + message, c);
  } catch (const json::out_of_range& e) {  // a number past double's range (1e400)
    ErrorContext c;
    c.file = path;
    c.hint = hint;
    throw Error("cannot parse " + what + ": a number JSON cannot hold (" + std::string(e.what()) + ")", c);
  }
}

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& path);

  void encode(std::string_view input, bool add_special, std::vector<uint32_t>& ids) const override;
  std::string decode(const std::vector<uint32_t>& ids, bool skip_special) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<uint32_t> bos() const override { return bos_; }
  std::optional<uint32_t> eos() const override { return eos_; }
  std::string describe() const override {
    return path_ + " (BPE, " + std::to_string(vocab_size_) + " ids, " + std::to_string(added_.size()) + " added tokens)";
  }
  void document_marks(std::vector<uint32_t>& before, std::vector<uint32_t>& after) const override {
    before = prefix_;
    after = suffix_;
  }
  size_t safe_cut(std::string_view text, size_t near) const override;
  bool can_cut() const override { return cut_rules_ != 0; }

 private:
  void load(const json& root);
  void load_config(const std::string& config_path);
  void encode_pieces(std::string_view input, bool add_special, std::vector<uint32_t>& ids) const;
  unsigned find_cut_rules() const;
  bool neighbours_survive_normalizers(char32_t before, char32_t after, bool letter_before) const;
  void encode_text(std::string_view text, bool at_start, std::vector<uint32_t>& ids, RegexBudget& budget) const;
  void parse_post_processor(const json& j, const JsonPlace& place, int depth = 0);
  uint32_t special_id(const json& v, const JsonPlace& place) const;
  std::optional<uint32_t> config_token(const json& config, const JsonPlace& place, const char* key) const;

  std::string path_;
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::unique_ptr<Bpe> model_;
  std::vector<Decoder> decoders_;
  std::vector<AddedToken> added_;
  std::map<uint32_t, size_t> added_by_id_;
  AddedTokenMatcher raw_added_, normalized_added_;
  // What `add_special` puts around the ids (the post-processor, or tokenizer_config.json's flags).
  std::vector<uint32_t> prefix_, suffix_;
  std::optional<uint32_t> bos_, eos_;
  int64_t vocab_size_ = 0;
  unsigned cut_rules_ = 0;  // CutRule bits: the kinds of safe cut shown for this file
};

std::optional<uint32_t> HfTokenizer::config_token(const json& config, const JsonPlace& place, const char* key) const {
  const json* v = optional_member(config, place, key);
  if (!v) return std::nullopt;
  std::string content;
  if (v->is_string()) content = v->get<std::string>();
  else if (v->is_object()) content = string_member(*v, place.at(key), "content");
  else wrong_type(place.at(key), *v, "a token: a string, or {\"content\": \"...\"}");
  for (const AddedToken& t : added_) if (t.content == content) return t.id;
  return model_->token_id(content);
}

// Ids the post-processor adds: tokens of the vocabulary.
uint32_t HfTokenizer::special_id(const json& v, const JsonPlace& place) const {
  return id_value(v, [&] { return place; }, vocab_size_ - 1,
                  "the post-processor's ids must be in the vocabulary (0.." + std::to_string(vocab_size_ - 1) + "); fix the tokenizer.json");
}

void HfTokenizer::parse_post_processor(const json& j, const JsonPlace& place, int depth) {
  if (j.is_null()) return;
  const std::string type = string_member(j, place, "type");
  if (type == "Sequence") {
    check_nesting(depth, place);
    expect_keys(j, place, {"processors"});
    const json& list = array_member(j, place, "processors");
    for (size_t i = 0; i < list.size(); ++i) parse_post_processor(list[i], place.at("processors").at(i), depth + 1);
  } else if (type == "ByteLevel") {
    expect_keys(j, place, {"add_prefix_space", "trim_offsets", "use_regex"});  // offsets only
  } else if (type == "TemplateProcessing") {
    expect_keys(j, place, {"single", "pair", "special_tokens"});
    const json& single = array_member(j, place, "single");
    const json& specials = object_member(j, place, "special_tokens");
    bool after = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const JsonPlace at = place.at("single").at(i);
      expect_object(single[i], at);
      if (single[i].contains("Sequence")) {
        if (after) unsupported(at, "a template with the sequence twice");
        after = true;
      } else if (single[i].contains("SpecialToken")) {
        const std::string name = string_member(object_member(single[i], at, "SpecialToken"), at.at("SpecialToken"), "id");
        const auto it = specials.find(name);
        if (it == specials.end()) fail(at, "special token \"" + name + "\" is not in special_tokens", "check the tokenizer.json");
        const JsonPlace sp = place.at("special_tokens").entry(name);
        const json& ids = array_member(*it, sp, "ids");
        for (size_t k = 0; k < ids.size(); ++k) (after ? suffix_ : prefix_).push_back(special_id(ids[k], sp.at("ids").at(k)));
      } else {
        fail(at, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}", "check the tokenizer.json");
      }
    }
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {  // ["<s>", 0]
      const json& token = array_member(j, place, key);
      if (token.size() != 2 || !token[0].is_string()) wrong_type(place.at(key), token, "[\"token\", id]");
      (key[0] == 'c' ? prefix_ : suffix_).push_back(special_id(token[1], place.at(key).at(1)));
    }
  } else {
    unsupported(place.at("type"), "the post-processor \"" + type + "\"");
  }
}

HfTokenizer::HfTokenizer(const std::string& path) : path_(path) {
  const json root = parse_json_file(path, "tokenizer.json", "the file is not valid JSON; download it again");
  try {
    load(root);
  } catch (const json::exception& e) {  // every read is checked, so only for a case missed
    ErrorContext c;
    c.file = path;
    c.hint = "check the tokenizer.json against one the `tokenizers` crate writes";
    throw Error("unexpected JSON in the tokenizer.json: " + library_message(e), c);
  }
  // transformers' Llama-style tokenizers rebuild the template from tokenizer_config.json's flags.
  const std::string config_path = path_join(parent_directory(path), "tokenizer_config.json");
  if (file_exists(config_path)) {
    try {
      load_config(config_path);
    } catch (const json::exception& e) {
      ErrorContext c;
      c.file = config_path;
      c.hint = "fix the file or remove it";
      throw Error("unexpected JSON in tokenizer_config.json: " + library_message(e), c);
    }
  }
  cut_rules_ = find_cut_rules();
}

void HfTokenizer::load(const json& root) {
  const JsonPlace top{&path_, ""};
  if (!root.is_object()) fail(top, "expected a JSON object, found " + kind_of(root), "is this a tokenizer.json?");
  for (const char* key : {"truncation", "padding"}) {
    if (optional_member(root, top, key)) unsupported(top.at(key), std::string("\"") + key + "\" other than null");
  }

  const json& model = object_member(root, top, "model");
  const JsonPlace mp = top.at("model");
  const std::string type = model.contains("type") ? string_member(model, mp, "type") : "BPE";
  if (type != "BPE") unsupported(mp.at("type"), "the model \"" + type + "\" (only BPE)");
  expect_keys(model, mp, {"dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  if (const json* dropout = optional_member(model, mp, "dropout")) {
    if (!dropout->is_number()) wrong_type(mp.at("dropout"), *dropout, "a number or null");
    if (dropout->get<double>() != 0.0) unsupported(mp.at("dropout"), "BPE dropout");
  }

  // Ids: the model's and the added tokens' together decide how far they may go.
  const json& vocab = object_member(model, mp, "vocab");
  const json* added = optional_member(root, top, "added_tokens");
  if (added && !added->is_array()) wrong_type(top.at("added_tokens"), *added, "a list [...]");
  const uint64_t entries = vocab.size() + (added ? added->size() : 0);
  const int64_t max_id = id_ceiling(entries);
  const std::string rule = id_rule(entries);

  BpeOptions options;
  options.vocab.reserve(vocab.size());
  const JsonPlace vp = mp.at("vocab");
  for (const auto& item : vocab.items()) {
    options.vocab.emplace_back(item.key(), id_value(item.value(), [&] { return vp.entry(item.key()); }, max_id, rule));
  }
  const json& merges = array_member(model, mp, "merges");
  options.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    if (m.is_string()) {  // "a b": exactly one space
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        fail(mp.at("merges").at(i), "merge \"" + s + "\" is not two tokens separated by one space", "write it as [\"a\", \"b\"]");
      }
      options.merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      options.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      fail(mp.at("merges").at(i), "expected \"a b\" or [\"a\", \"b\"], found " + kind_of(m), "check the tokenizer.json");
    }
  }
  options.unk_token = optional_string(model, mp, "unk_token");
  options.continuing_subword_prefix = optional_string(model, mp, "continuing_subword_prefix").value_or("");
  options.end_of_word_suffix = optional_string(model, mp, "end_of_word_suffix").value_or("");
  options.fuse_unk = bool_member(model, mp, "fuse_unk", false);
  options.byte_fallback = bool_member(model, mp, "byte_fallback", false);
  options.ignore_merges = bool_member(model, mp, "ignore_merges", false);
  try {
    model_ = std::make_unique<Bpe>(std::move(options), "model");
  } catch (const Error& e) {
    fail({&path_, e.context().key}, e.what(), e.context().hint);  // the same error, with the file
  }
  vocab_size_ = model_->size();

  if (const json* j = optional_member(root, top, "normalizer")) parse_normalizer(*j, top.at("normalizer"), normalizers_);
  if (const json* j = optional_member(root, top, "pre_tokenizer")) parse_pre_tokenizer(*j, top.at("pre_tokenizer"), pre_tokenizers_);
  if (const json* j = optional_member(root, top, "decoder")) parse_decoder(*j, top.at("decoder"), decoders_);

  if (added) {
    for (size_t i = 0; i < added->size(); ++i) {
      const json& token = (*added)[i];
      const JsonPlace at = top.at("added_tokens").at(i);
      AddedToken t;
      t.id = id_value(member(token, at, "id"), [&] { return at.at("id"); }, max_id, rule);
      t.content = string_member(token, at, "content");
      t.single_word = bool_member(token, at, "single_word", false);
      t.lstrip = bool_member(token, at, "lstrip", false);
      t.rstrip = bool_member(token, at, "rstrip", false);
      t.normalized = bool_member(token, at, "normalized", true);
      t.special = bool_member(token, at, "special", false);
      added_by_id_[t.id] = added_.size();
      vocab_size_ = std::max<int64_t>(vocab_size_, int64_t(t.id) + 1);
      added_.push_back(std::move(t));
    }
    for (size_t i = 0; i < added_.size(); ++i) {
      // Normalized tokens are matched in normalized text, so the crate matches their normalized form.
      RegexBudget budget(added_[i].content.size());
      if (added_[i].normalized) normalized_added_.add(apply_normalizers(normalizers_, added_[i].content, budget), static_cast<int>(i));
      else raw_added_.add(added_[i].content, static_cast<int>(i));
    }
  }

  if (const json* j = optional_member(root, top, "post_processor")) parse_post_processor(*j, top.at("post_processor"));
  for (uint32_t id : prefix_) if (!bos_) bos_ = id;
  for (uint32_t id : suffix_) eos_ = id;
}

void HfTokenizer::load_config(const std::string& config_path) {
  const json config = parse_json_file(config_path, "tokenizer_config.json", "fix the file or remove it");
  const JsonPlace top{&config_path, ""};
  if (!config.is_object()) fail(top, "expected a JSON object, found " + kind_of(config), "fix the file or remove it");
  if (const auto id = config_token(config, top, "bos_token")) bos_ = id;
  if (const auto id = config_token(config, top, "eos_token")) eos_ = id;
  if (config.contains("add_bos_token") || config.contains("add_eos_token")) {
    prefix_.clear();
    suffix_.clear();
    if (bool_member(config, top, "add_bos_token", false) && bos_) prefix_.push_back(*bos_);
    if (bool_member(config, top, "add_eos_token", false) && eos_) suffix_.push_back(*eos_);
  }
}

void HfTokenizer::encode_text(std::string_view text, bool at_start, std::vector<uint32_t>& ids, RegexBudget& budget) const {
  thread_local std::vector<Piece> pieces;
  pieces.clear();
  pieces.push_back({std::string(text), at_start});
  for (const PreTokenizer& p : pre_tokenizers_) apply_pre_tokenizer(p, pieces, budget);
  for (const Piece& piece : pieces) model_->encode_word(piece.text, ids);
}

void HfTokenizer::encode(std::string_view input, bool add_special, std::vector<uint32_t>& ids) const {
  const size_t before = ids.size();
  try {
    encode_pieces(input, add_special, ids);
  } catch (...) {
    ids.resize(before);  // all of the text's ids or none
    throw;
  }
}

void HfTokenizer::encode_pieces(std::string_view input, bool add_special, std::vector<uint32_t>& ids) const {
  std::string repaired;
  if (!unicode::is_valid_utf8(input)) {
    repaired = unicode::repair_utf8(input);
    input = repaired;
  }
  RegexBudget budget(input.size());  // for every regex of this text
  if (add_special) ids.insert(ids.end(), prefix_.begin(), prefix_.end());
  thread_local std::vector<Split> raw, normalized_splits;
  find_added(raw_added_, added_, input, raw);
  for (const Split& s : raw) {
    if (s.token >= 0) {
      ids.push_back(added_[s.token].id);
      continue;
    }
    if (s.start == s.end) continue;
    const std::string_view raw_text = input.substr(s.start, s.end - s.start);
    std::string normalized_text;
    if (!normalizers_.empty()) normalized_text = apply_normalizers(normalizers_, std::string(raw_text), budget);
    const std::string_view normalized = normalizers_.empty() ? raw_text : std::string_view(normalized_text);
    find_added(normalized_added_, added_, normalized, normalized_splits);
    for (const Split& n : normalized_splits) {
      if (n.token >= 0) ids.push_back(added_[n.token].id);
      else if (n.end > n.start) encode_text(normalized.substr(n.start, n.end - n.start), s.start == 0 && n.start == 0, ids, budget);
    }
  }
  if (add_special) ids.insert(ids.end(), suffix_.begin(), suffix_.end());
}

unsigned HfTokenizer::find_cut_rules() const {
  unsigned rules = kCutAfterNewline | kCutBeforeSpace;
  // Normalizers. Unicode normalization, Lowercase and StripAccents work character by character,
  // except that NFC/NFKC compose a starter with what follows and reorder combining marks, which
  // never reaches across '\n' or ' ' (starters that compose with nothing), and Lowercase's final
  // sigma looks at the characters next to it, which a '\n' or ' ' stops. Whether the neighbours
  // stay a letter / no space is checked per cut (neighbours_survive_normalizers). Prepend and Strip
  // act on the ends of each text (the second piece would get a prefix, the first lose its '\n'),
  // Replace's pattern could match across a cut: no cut with them.
  for (const Normalizer& n : normalizers_) {
    switch (n.kind) {
      case Normalizer::Kind::nfc:
      case Normalizer::Kind::nfd:
      case Normalizer::Kind::nfkc:
      case Normalizer::Kind::nfkd:
      case Normalizer::Kind::lowercase:
      case Normalizer::Kind::strip_accents:
        break;
      case Normalizer::Kind::replace:
      case Normalizer::Kind::prepend:
      case Normalizer::Kind::strip:
        return 0;
    }
  }
  // Added tokens are matched before anything else (raw ones in the text, normalized ones in the
  // normalized text). One matched across a cut would hold '\n' or ' '; lstrip on a token that
  // starts at a cut after '\n' would take the '\n' into it, and rstrip on a token that ends before
  // a cut's space the space; single_word sees a '\n', a space or the end of text beside the cut,
  // none of them a word character, either way.
  for (const AddedToken& t : added_) {
    std::vector<std::string> forms{t.content};
    if (t.normalized && !normalizers_.empty()) {
      RegexBudget budget(t.content.size());
      forms.push_back(apply_normalizers(normalizers_, t.content, budget));
    }
    for (const std::string& form : forms) {
      if (form.find('\n') != std::string::npos || (t.lstrip && starts_with_letter(form))) rules &= ~unsigned(kCutAfterNewline);
      if (form.find(' ') != std::string::npos || (t.rstrip && ends_with_letter(form))) rules &= ~unsigned(kCutBeforeSpace);
    }
  }
  // Pre-tokenizers, in order, on the pieces the one before made. `bounded`: the rules whose cuts are
  // already a boundary between pieces; from there on every step sees the same pieces in the whole
  // and in the cut text (only Metaspace's prepend_scheme "first" tells a text's first piece apart).
  unsigned bounded = 0;
  for (const PreTokenizer& p : pre_tokenizers_) {
    switch (p.kind) {
      case PreTokenizer::Kind::split: {
        const KnownSplit* known = known_split(p.regex->pattern());
        const bool per_segment = p.behavior == SplitBehavior::isolated || p.behavior == SplitBehavior::removed;
        if (known && known->bounds && per_segment) bounded |= rules;
        else if (!(known && !known->bounds && p.behavior == SplitBehavior::isolated && !p.invert)) rules &= bounded;
        break;
      }
      case PreTokenizer::Kind::byte_level:
        if (p.add_prefix_space) rules &= bounded;  // a space before each piece: before the second half of a cut piece too
        if (p.regex) bounded |= rules;             // GPT-2's pattern (kKnownSplits)
        break;
      case PreTokenizer::Kind::digits:
      case PreTokenizer::Kind::punctuation:
        break;  // they split at digits or punctuation only, none of which is next to a cut
      case PreTokenizer::Kind::whitespace:        // \w+|[^\w\s]+, the rest removed: '\n' and ' ' go
      case PreTokenizer::Kind::whitespace_split:  // split at whitespace, which goes
      case PreTokenizer::Kind::bert:
        bounded |= rules;
        break;
      case PreTokenizer::Kind::metaspace:
        return 0;  // prepends its replacement to pieces (always, or to the first): not shown here
    }
  }
  return rules & bounded;
}

bool HfTokenizer::neighbours_survive_normalizers(char32_t before, char32_t after, bool letter_before) const {
  std::string a, b;
  unicode::append_utf8(a, before);
  unicode::append_utf8(b, after);
  RegexBudget budget(16);
  a = apply_normalizers(normalizers_, std::move(a), budget);
  b = apply_normalizers(normalizers_, std::move(b), budget);
  if (a.empty() || !starts_with_letter(b)) return false;  // StripAccents may remove the character before
  if (letter_before) return ends_with_letter(a);
  int len;
  return !is_space_for_cut(unicode::decode_at(a, unicode::previous_char_start(a, a.size()), &len));
}

size_t HfTokenizer::safe_cut(std::string_view text, size_t near) const {
  if (cut_rules_ == 0) return npos;
  char32_t before, after;
  int len;
  // The character ending at `end`, when it is whole and well formed.
  const auto char_before = [&](size_t end, char32_t* cp) {
    const size_t k = unicode::previous_char_start(text, end);
    return unicode::decode_checked(text, k, cp, &len) && k + static_cast<size_t>(len) == end;
  };
  for (size_t c = std::max<size_t>(near, 2); c + 1 < text.size(); ++c) {
    if (text[c - 1] == '\n' && (cut_rules_ & kCutAfterNewline) && char_before(c - 1, &before) && !is_space_for_cut(before) &&
        unicode::decode_checked(text, c, &after, &len) && unicode::is_letter(after) &&
        (normalizers_.empty() || neighbours_survive_normalizers(before, after, false))) {
      return c;
    }
    if (text[c] == ' ' && (cut_rules_ & kCutBeforeSpace) && char_before(c, &before) && unicode::is_letter(before) &&
        unicode::decode_checked(text, c + 1, &after, &len) && unicode::is_letter(after) &&
        (normalizers_.empty() || neighbours_survive_normalizers(before, after, true))) {
      return c;
    }
  }
  return npos;
}

std::string HfTokenizer::decode(const std::vector<uint32_t>& ids, bool skip_special) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  size_t bytes = 0;
  for (const uint32_t id : ids) {
    if (const auto it = added_by_id_.find(id); it != added_by_id_.end()) {
      if (!(skip_special && added_[it->second].special)) tokens.push_back(added_[it->second].content);
    } else if (const std::string* t = model_->token(id)) {
      tokens.push_back(*t);
    } else {
      ErrorContext c;
      c.file = path_;
      c.hint = "ids run from 0 to " + std::to_string(vocab_size_ - 1);
      throw Error("id " + std::to_string(id) + " is not in the vocabulary", c);
    }
    if (!tokens.empty()) bytes += tokens.back().size();
  }
  if (decoders_.empty()) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  RegexBudget budget(bytes);
  for (const Decoder& d : decoders_) tokens = apply_decoder(d, std::move(tokens), budget);
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

}  // namespace

std::unique_ptr<Tokenizer> open_hf_tokenizer(const std::string& json_path) { return std::make_unique<HfTokenizer>(json_path); }

void Tokenizer::encode_in_pieces(std::string_view text, bool add_special, std::vector<uint32_t>& ids, size_t piece_bytes) const {
  if (text.size() <= piece_bytes || !can_cut()) {
    encode(text, add_special, ids);
    return;
  }
  const size_t before_size = ids.size();
  try {
    std::vector<uint32_t> before, after;
    if (add_special) document_marks(before, after);
    ids.insert(ids.end(), before.begin(), before.end());
    for (size_t at = 0; at < text.size();) {
      const std::string_view rest = text.substr(at);
      const size_t cut = rest.size() > piece_bytes ? safe_cut(rest, piece_bytes) : npos;
      const size_t n = cut == npos ? rest.size() : cut;
      encode(rest.substr(0, n), false, ids);
      at += n;
    }
    ids.insert(ids.end(), after.begin(), after.end());
  } catch (...) {
    ids.resize(before_size);  // all of the text's ids or none, as encode
    throw;
  }
}

std::string tokenizer_file(const std::string& path) {
  if (!is_directory(path)) return path;
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    const std::string candidate = path_join(path, name);
    if (file_exists(candidate)) return candidate;
  }
  ErrorContext c;
  c.file = path;
  c.hint = "point at a tokenizer.json or tokenizer.model, or a directory holding one";
  throw Error("no tokenizer.json or tokenizer.model in the directory", c);
}

std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path) {
  const std::string file = tokenizer_file(path);
  if (!file_exists(file)) {
    ErrorContext c;
    c.file = file;
    c.hint = "check the path";
    throw Error("tokenizer file not found", c);
  }
  const bool is_model = file.size() >= 6 && file.compare(file.size() - 6, 6, ".model") == 0;
  return is_model ? open_sentencepiece_tokenizer(file) : open_hf_tokenizer(file);
}

}  // namespace dsrun
