// One compiled PCRE2 pattern (UTF, Unicode properties, JIT) for tokenizer.json's Split and Replace
// patterns and the byte-level regex; every PCRE2 return code goes through one check.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

struct pcre2_real_code_8;

namespace dsrun {

class Regex {
 public:
  // `where` names the pattern for errors (a JSON path such as pre_tokenizer.pretokenizers[0].pattern.Regex).
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches in `text` (valid UTF-8) as byte ranges [start, end), left to right; an
  // empty match right where the previous one ended is skipped, as Oniguruma's find_iter does.
  // Safe to call from several threads at once.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;

  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  std::string where_;
  pcre2_real_code_8* code_ = nullptr;
};

// A pattern that matches `literal` exactly (tokenizer.json's {"String": ...} patterns).
std::string regex_escape(std::string_view literal);

}  // namespace dsrun
