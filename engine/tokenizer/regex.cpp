// PCRE2 behind Regex (see regex.hpp). JIT-compiled; a thread-local JIT stack and match data keep
// matching allocation-free and safe across the tokenizing threads of `dsrun prepare`.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "engine/tokenizer/regex.hpp"

#include "engine/common/error.hpp"

#include <pcre2.h>

#include <memory>

namespace dsrun {
namespace {

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
// context that hands it out, and match data for one pair of offsets.
struct ThreadMatcher {
  std::unique_ptr<pcre2_jit_stack, JitStackDeleter> stack{pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr)};
  std::unique_ptr<pcre2_match_context, MatchContextDeleter> context{pcre2_match_context_create(nullptr)};
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data{pcre2_match_data_create(1, nullptr)};
  ThreadMatcher() {
    if (!stack || !context || !data) fail_at(__FILE__, __LINE__, "PCRE2: out of memory for match data");
    pcre2_jit_stack_assign(context.get(), nullptr, stack.get());
  }
};

Error regex_error(const std::string& where, const std::string& message, const std::string& hint) {
  ErrorContext c;
  c.key = where;
  c.hint = hint;
  return Error(message, c);
}

ThreadMatcher& thread_matcher() {
  thread_local ThreadMatcher matcher;
  return matcher;
}

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where) : pattern_(pattern), where_(where) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  // UCP: \s, \w, \d and POSIX classes are Unicode-aware, as in Oniguruma's Unicode mode.
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK,
                        &error_code, &error_offset, nullptr);
  if (!code_) {
    throw regex_error(where, "the regex does not compile: " + pcre2_message(error_code) + " at offset " +
                                 std::to_string(error_offset) + " of /" + pattern + "/",
                      "dsrun reads patterns with PCRE2; Oniguruma-only syntax is not supported");
  }
  // JIT is an optimisation: PCRE2 without JIT support (rare builds) still matches, only slower.
  const int jit = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  if (jit < 0 && jit != PCRE2_ERROR_JIT_BADOPTION) DSRUN_PCRE2_CHECK(jit);
}

Regex::~Regex() { pcre2_code_free(code_); }

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  matches.clear();
  ThreadMatcher& m = thread_matcher();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  size_t last_end = SIZE_MAX;
  while (start <= text.size()) {
    const int rc = pcre2_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK, m.data.get(), m.context.get());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      throw regex_error(where_, "the regex failed on a text of " + std::to_string(text.size()) + " bytes: " + pcre2_message(rc),
                        "report it with the text that triggers it");
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(m.data.get());
    const size_t s = ovector[0], e = ovector[1];
    if (s == e) {
      if (s != last_end) matches.emplace_back(s, e);
      // Step over one whole character so the next search starts on a character boundary.
      size_t next = s + 1;
      while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
      start = next;
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
