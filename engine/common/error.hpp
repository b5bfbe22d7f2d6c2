// The one error type of dsrun, and the check macros that turn C return codes into it.
// Every failure carries where it happened (file, line, key, rank) so main can print one clear line.
#pragma once

#include <stdexcept>
#include <string>

namespace dsrun {

// Context of an error. Empty fields are simply not printed.
struct ErrorContext {
  std::string file;   // recipe, checkpoint or database file the error is about
  int line = 0;       // line in that file (1-based), 0 when unknown
  int column = 0;
  std::string key;    // dotted recipe key, e.g. "parallel.zero_stage"
  int rank = -1;      // distributed rank, -1 when not in a rank
  std::string hint;   // how to fix it
  int system_errno = 0;  // errno of the failed system call (ENOSPC, ...), 0 when none
};

class Error : public std::runtime_error {
 public:
  explicit Error(std::string message, ErrorContext context = {})
      : std::runtime_error(std::move(message)), context_(std::move(context)) {}
  const ErrorContext& context() const { return context_; }
  // Where in dsrun's own source (and what statement), for bug reports: shown only with
  // DSRUN_DEBUG=1, never in an ordinary message.
  Error& with_origin(std::string origin) {
    origin_ = std::move(origin);
    return *this;
  }
  const std::string& origin() const { return origin_; }
  // "file:line:col: [rank R] key: message (fix: hint)"; the origin too with DSRUN_DEBUG=1
  std::string describe() const;

 private:
  ErrorContext context_;
  std::string origin_;
};

// "store.cpp:123": where in dsrun's source, for ErrorContext::origin.
std::string source_origin(const char* where_file, int where_line);

// Throws dsrun::Error with its source location as origin; for system failures and invariants
// that validation already guaranteed.
[[noreturn]] void fail_at(const char* where_file, int where_line, const std::string& message);

}  // namespace dsrun

#define DSRUN_STR2(x) #x
#define DSRUN_STR(x) DSRUN_STR2(x)
#define DSRUN_ASSERT(cond, msg)                                                       \
  do {                                                                                \
    if (!(cond)) ::dsrun::fail_at(__FILE__, __LINE__, std::string("assertion `" #cond "` failed: ") + (msg)); \
  } while (0)
