// PCRE2 behind Regex (see regex.hpp). JIT-compiled; a thread-local JIT stack and match data keep
// matching allocation-free and safe across the tokenizing threads of `dsrun prepare`.
//
// Bounded work. PCRE2's match limit counts backtracking, not the characters a lookahead or a
// repeat scans, so `.(?=.*$)` stays under it on every call while the document costs quadratic
// time. Each search therefore first sees only a window of kWindow bytes past its start, in
// PCRE2_PARTIAL_HARD mode: PCRE2 then reports "partial" whenever more text could change the result
// (an iterator, lookahead, $ or \b reached the window's end), so a complete match or "no match" in
// the window is exactly the answer on the whole text. On "partial" the search is repeated from the
// partial match's start with twice the window and at most kRetryStarts start positions (an offset
// limit), and on PCRE2_ERROR_MATCHLIMIT with eight times the steps; those repetitions are charged
// to the document's RegexBudget. Windows keep the free work per byte constant, the offset limit
// keeps a repetition's unmetered scanning within kRetryStarts times its window.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "engine/tokenizer/regex.hpp"

#include "engine/common/error.hpp"
#include "engine/tokenizer/tokenizer.hpp"

#include <pcre2.h>

#include <algorithm>
#include <memory>

namespace dsrun {
namespace {

constexpr size_t kWindow = 256;               // bytes past its start a search first sees
constexpr uint32_t kFirstSteps = 1024;        // PCRE2 match limit of that first search
constexpr size_t kRetryStarts = 512;          // start positions one repeated search may try
constexpr uint64_t kStepsPerWindowByte = 16;  // match limit of a repeated search per byte of its window
constexpr uint64_t kBudgetPerByte = 256;      // RegexBudget: steps per document byte ...
constexpr uint64_t kBudgetBase = 16u << 20;   // ... plus these

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

// PCRE2 calls that return a negative error code on failure.
#define DSRUN_PCRE2_CHECK(call)                                                                    \
  do {                                                                                             \
    const int pcre2_rc_ = (call);                                                                  \
    if (pcre2_rc_ < 0) ::dsrun::fail_at(__FILE__, __LINE__, std::string(#call ": ") + pcre2_message(pcre2_rc_)); \
  } while (0)

struct JitStackDeleter { void operator()(pcre2_jit_stack* s) const { pcre2_jit_stack_free(s); } };
struct MatchDataDeleter { void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); } };
struct MatchContextDeleter { void operator()(pcre2_match_context* m) const { pcre2_match_context_free(m); } };

// Per thread: a JIT stack large enough for megabyte lines of one repeated class, a match
// context that hands it out and carries the limits, and match data for one pair of offsets.
struct ThreadMatcher {
  std::unique_ptr<pcre2_jit_stack, JitStackDeleter> stack{pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr)};
  std::unique_ptr<pcre2_match_context, MatchContextDeleter> context{pcre2_match_context_create(nullptr)};
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data{pcre2_match_data_create(1, nullptr)};
  uint32_t match_limit = 0;
  PCRE2_SIZE offset_limit = PCRE2_UNSET;
  ThreadMatcher() {
    if (!stack || !context || !data) fail_at(__FILE__, __LINE__, "PCRE2: out of memory for match data");
    pcre2_jit_stack_assign(context.get(), nullptr, stack.get());
    limits(kFirstSteps, PCRE2_UNSET);
  }
  void limits(uint32_t steps, PCRE2_SIZE offset) {
    if (steps != match_limit) pcre2_set_match_limit(context.get(), match_limit = steps);
    if (offset != offset_limit) pcre2_set_offset_limit(context.get(), offset_limit = offset);
  }
};

ThreadMatcher& thread_matcher() {
  thread_local ThreadMatcher matcher;
  return matcher;
}

// The first character boundary at or after `at` (UTF-8 continuation bytes are 10xxxxxx).
size_t char_boundary(std::string_view text, size_t at) {
  while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
  return at;
}

// The pattern for a message: long ones cut on a character boundary.
std::string shown(const std::string& pattern) {
  if (pattern.size() <= 120) return "/" + pattern + "/";
  size_t cut = 100;
  while (cut > 0 && (static_cast<unsigned char>(pattern[cut]) & 0xC0) == 0x80) --cut;
  return "/" + pattern.substr(0, cut) + "…/ (" + std::to_string(pattern.size()) + " bytes)";
}

}  // namespace

RegexBudget::RegexBudget(size_t document_bytes)
    : bytes_(document_bytes), left_(kBudgetPerByte * uint64_t(document_bytes) + kBudgetBase) {}

Regex::Regex(const std::string& pattern, const std::string& where, const std::string& file)
    : pattern_(pattern), where_(where), file_(file) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  // UCP: \s, \w, \d and POSIX classes are Unicode-aware, as in Oniguruma's Unicode mode.
  // USE_OFFSET_LIMIT: repeated searches bound their start positions (see the top of this file).
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK | PCRE2_USE_OFFSET_LIMIT, &error_code, &error_offset, nullptr);
  if (!code_) {
    ErrorContext c;
    c.file = file;
    c.key = where;
    c.hint = "dsrun reads patterns with PCRE2; Oniguruma-only syntax is not supported";
    throw Error("the regex does not compile: " + pcre2_message(error_code) + " at offset " + std::to_string(error_offset) + " of /" + pattern + "/", c);
  }
  // JIT is an optimisation: PCRE2 without JIT support (rare builds) still matches, only slower.
  const int jit = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD);
  if (jit < 0 && jit != PCRE2_ERROR_JIT_BADOPTION) DSRUN_PCRE2_CHECK(jit);
}

Regex::~Regex() { pcre2_code_free(code_); }

void Regex::fail_match(int rc, std::string_view text, const RegexBudget& budget) const {
  ErrorContext c;
  c.file = file_;
  c.key = where_;
  // The JSON path is in the message too: a caller may put the document's file and line in the context.
  const std::string what = "tokenizer regex " + shown(pattern_) + " (" + where_ + ")";
  const std::string document = "a document of " + std::to_string(budget.document_bytes()) + " bytes";
  if (rc == PCRE2_ERROR_PARTIAL || rc == PCRE2_ERROR_MATCHLIMIT) {
    c.hint = "fix the pattern in the tokenizer.json: a lookahead or repeat that reaches far ahead from many positions "
             "(such as (?=.*$)), or nested repeats, make matching quadratic or worse; or leave such documents out";
    throw TokenizerRegexError(what + " exceeded its matching budget on " + document + ": " +
                                  (rc == PCRE2_ERROR_PARTIAL ? "it looks far ahead from many positions" : "it backtracks too much"),
                              c);
  }
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    c.hint = "simplify the pattern in the tokenizer.json (a repeated group recurses once per repetition), or leave such documents out";
    throw TokenizerRegexError(what + " ran out of its 16 MB stack on a text of " + std::to_string(text.size()) + " bytes in " + document, c);
  }
  c.hint = "report it with the text that triggers it";
  throw TokenizerRegexError(what + " failed on a text of " + std::to_string(text.size()) + " bytes in " + document + ": " + pcre2_message(rc), c);
}

// The free search found no match in [start, end) (rc: NOMATCH with more text after `end`,
// PARTIAL or MATCHLIMIT): search on, repeating searches where needed, for the leftmost match at or
// after `start` that an unbounded search finds. Leaves the free search's limits in place.
bool Regex::search_on(std::string_view text, size_t start, size_t end, int rc, RegexBudget& budget, size_t* match_start,
                      size_t* match_end) const {
  ThreadMatcher& m = thread_matcher();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t window = kWindow;  // kept across blocks of start positions: a long run needs it again
  for (;;) {
    PCRE2_SIZE offset_limit = PCRE2_UNSET;
    if (rc != PCRE2_ERROR_NOMATCH) {
      // Repeated, charged searches until one is decisive.
      size_t from = start;
      uint64_t steps = kFirstSteps;
      int why = rc;
      for (;;) {
        if (rc == PCRE2_ERROR_PARTIAL) {
          from = std::max<size_t>(start, pcre2_get_ovector_pointer(m.data.get())[0]);  // earlier starts cannot match
          window *= 2;
          offset_limit = from + kRetryStarts;
          steps = std::max(steps, kStepsPerWindowByte * window);
        } else if (rc == PCRE2_ERROR_MATCHLIMIT) {
          steps *= 8;
        } else {
          m.limits(kFirstSteps, PCRE2_UNSET);
          fail_match(rc, text, budget);
        }
        why = rc;
        steps = std::min<uint64_t>(steps, UINT32_MAX);
        if (steps > budget.left_) {
          m.limits(kFirstSteps, PCRE2_UNSET);
          fail_match(why, text, budget);
        }
        budget.left_ -= steps;
        end = n - from <= window ? n : char_boundary(text, from + window);
        m.limits(static_cast<uint32_t>(steps), offset_limit);
        rc = pcre2_match(code_, subject, end, from, PCRE2_NO_UTF_CHECK | (end == n ? 0 : PCRE2_PARTIAL_HARD), m.data.get(), m.context.get());
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc >= 0) {
          m.limits(kFirstSteps, PCRE2_UNSET);
          const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(m.data.get());
          *match_start = ovector[0];
          *match_end = ovector[1];
          return true;
        }
      }
      m.limits(kFirstSteps, PCRE2_UNSET);
    }
    // No match starts before `end`, nor at or before the offset limit when one was set.
    if (offset_limit != PCRE2_UNSET && offset_limit < end) {
      start = char_boundary(text, offset_limit + 1);
      window /= 2;  // the next block's first repetition doubles it back
    } else if (end == n) {
      return false;
    } else {
      start = end;  // a match may still start right at the window's end
      window = kWindow;
    }
    // The next free search.
    end = n - start <= kWindow ? n : char_boundary(text, start + kWindow);
    rc = pcre2_match(code_, subject, end, start, PCRE2_NO_UTF_CHECK | (end == n ? 0 : PCRE2_PARTIAL_HARD), m.data.get(), m.context.get());
    if (rc >= 0) {
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(m.data.get());
      *match_start = ovector[0];
      *match_end = ovector[1];
      return true;
    }
  }
}

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches, RegexBudget& budget) const {
  matches.clear();
  ThreadMatcher& m = thread_matcher();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t start = 0;
  size_t last_end = SIZE_MAX;
  while (start <= n) {
    // The free search: kWindow bytes past `start` (PARTIAL_HARD unless it reaches the end), kFirstSteps.
    const size_t end = n - start <= kWindow ? n : char_boundary(text, start + kWindow);
    const int rc = pcre2_match(code_, subject, end, start, PCRE2_NO_UTF_CHECK | (end == n ? 0 : PCRE2_PARTIAL_HARD), m.data.get(), m.context.get());
    size_t s, e;
    if (rc >= 0) {
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(m.data.get());
      s = ovector[0];
      e = ovector[1];
    } else if (rc == PCRE2_ERROR_NOMATCH && end == n) {
      break;
    } else if (!search_on(text, start, end, rc, budget, &s, &e)) {
      break;
    }
    if (s == e) {
      if (s != last_end) matches.emplace_back(s, e);
      // Step over one whole character so the next search starts on a character boundary.
      start = char_boundary(text, s + 1);
      last_end = SIZE_MAX;
      continue;
    }
    matches.emplace_back(s, e);
    start = e;
    last_end = e;
  }
}

std::string regex_escape(std::string_view literal) {
  std::string out = "\\Q";
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal.compare(i, 2, "\\E") == 0) {
      out += "\\E\\\\E\\Q";
      ++i;
    } else {
      out += literal[i];
    }
  }
  return out + "\\E";
}

}  // namespace dsrun
