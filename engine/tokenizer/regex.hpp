// One compiled PCRE2 pattern (UTF, Unicode properties, JIT) for tokenizer.json's Split and Replace
// patterns and the byte-level regex; every PCRE2 return code goes through one check. Matching work
// is bounded per document (RegexBudget), so a quadratic pattern cannot stall a tokenizing thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

struct pcre2_real_code_8;

namespace dsrun {

// The matching work one document may cost, shared by every regex that runs on it. Each search
// first sees a window of 256 bytes past its start and at most 1,024 PCRE2 steps, for free; when a
// match needs more text (a long token, a far lookahead) or more steps, the search is repeated with
// twice the window (16 steps per byte of it) or eight times the steps, and each repetition is
// charged its step limit. A document of N bytes may be charged 256 N + 16 Mi steps (real patterns
// cost under 4 N; docs/tokenizers.md, "Regex work"). Running out throws TokenizerRegexError.
class RegexBudget {
 public:
  explicit RegexBudget(size_t document_bytes);
  size_t document_bytes() const { return bytes_; }

 private:
  friend class Regex;
  size_t bytes_;
  uint64_t left_;
};

class Regex {
 public:
  // `where` names the pattern for errors (a JSON path such as pre_tokenizer.pretokenizers[0].pattern.Regex),
  // `file` the tokenizer.json it comes from.
  Regex(const std::string& pattern, const std::string& where, const std::string& file = "");
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches in `text` (valid UTF-8) as byte ranges [start, end), left to right; an
  // empty match right where the previous one ended is skipped, as Oniguruma's find_iter does. The
  // matches are exactly those of an unbounded search; work beyond the free windows is charged to
  // `budget`. Throws TokenizerRegexError (tokenizer.hpp) when the budget runs out or PCRE2 fails.
  // Safe to call from several threads at once.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches, RegexBudget& budget) const;

  const std::string& pattern() const { return pattern_; }

 private:
  bool search_on(std::string_view text, size_t start, size_t end, int rc, RegexBudget& budget, size_t* match_start, size_t* match_end) const;
  [[noreturn]] void fail_match(int rc, std::string_view text, const RegexBudget& budget) const;

  std::string pattern_;
  std::string where_;
  std::string file_;
  pcre2_real_code_8* code_ = nullptr;
};

// A pattern that matches `literal` exactly (tokenizer.json's {"String": ...} patterns).
std::string regex_escape(std::string_view literal);

}  // namespace dsrun
