// Helpers shared by the tests: temporary directories, a fixed host, recipe loading from text.
#pragma once

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/recipe/load.hpp"

#include <catch2/catch.hpp>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace dsrun::test {

// A fresh directory under /tmp, removed when the object goes away.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/dsrun-test-XXXXXX";
    path_ = ::mkdtemp(pattern);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  std::string write(const std::string& name, const std::string& text) const {
    std::string p = file(name);
    make_directories(parent_directory(p));
    write_file_atomic(p, text);
    return p;
  }

 private:
  std::string path_;
};

// A made-up 2-core, 16 GiB host without GPUs, so results do not depend on the test machine.
inline HostFacts small_host() {
  HostFacts h;
  h.cpu_cores = 2;
  h.memory_bytes = 16.0 * 1024 * 1024 * 1024;
  h.hostname = "testhost";
  return h;
}

inline LoadedRecipe load_text(const std::string& text, std::vector<std::string> overrides = {}, const std::string& name = "test.toml") {
  LoadOptions o;
  o.overrides = std::move(overrides);
  o.host = small_host();
  return load_recipe_text(text, name, o);
}

inline std::string source_dir() { return DSRUN_TEST_DIR "/.."; }

// A recipe at any path, loaded as on the small host.
inline LoadedRecipe load_recipe_at(const std::string& path) {
  LoadOptions o;
  o.host = small_host();
  return load_recipe_file(path, o);
}

// A recipe of the repository (path relative to its root), loaded as on the small host.
inline LoadedRecipe load_file(const std::string& path, std::vector<std::string> overrides = {}) {
  LoadOptions o;
  o.overrides = std::move(overrides);
  o.host = small_host();
  return load_recipe_file(source_dir() + "/" + path, o);
}

struct CommandOutput {
  int code = -1;     // exit status, -1 when killed by a signal
  std::string text;  // stdout and stderr together
};

// Runs a shell command (a real process) and collects what it prints.
inline CommandOutput run_command(const std::string& command) {
  CommandOutput out;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.text.append(buf, n);
  int status = pclose(pipe);
  out.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

inline bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

// The dsrun::Error a call raises, described ("" when it raises none).
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.describe();
  }
  return "";
}

// Errors only (warnings dropped).
inline std::vector<Diagnostic> errors_of(const LoadedRecipe& r) {
  std::vector<Diagnostic> out;
  for (const auto& d : r.diagnostics)
    if (d.severity == Diagnostic::Severity::Error) out.push_back(d);
  return out;
}

// The recipe's one error (the test fails, with the report, if it has none or several).
inline const Diagnostic& only_error(const LoadedRecipe& r) {
  static Diagnostic kept;
  const std::vector<Diagnostic> errors = errors_of(r);
  INFO(r.report());
  REQUIRE(errors.size() == 1);
  kept = errors[0];
  return kept;
}

}  // namespace dsrun::test
