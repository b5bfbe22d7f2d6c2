// Small text helpers shared by the recipe loader, the plan report and the CLI:
// edit distance for "did you mean", byte/number formatting, and a plain aligned table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsrun {

// Levenshtein distance, used to suggest the nearest valid key or choice.
size_t edit_distance(const std::string& a, const std::string& b);
// The candidate closest to `word`, or "" when none is close enough to be a plausible typo.
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

std::string format_bytes(double bytes);          // "13.2 GiB"
std::string format_count(double n);              // "6.91 B", "870.4 K"
std::string format_seconds(double seconds);      // "1.25 s", "3 h 12 min"
std::string csv_field(const std::string& s);     // quoted (RFC 4180) when it holds a comma, quote or newline
std::string format_double(double v, int precision = 6);  // shortest round-trip-ish form, no trailing zeros
// The shortest text that reads back as exactly `v` ("0.1", "12345678901", "4.1234567e-05"; "nan",
// "inf", "-inf"): for values a program reads back, where six digits would lose a loss or a byte count.
std::string format_double_exact(double v);
std::string join(const std::vector<std::string>& parts, const std::string& sep);
std::vector<std::string> split(const std::string& s, char sep);
std::string trim(const std::string& s);
bool starts_with(const std::string& s, const std::string& prefix);
bool ends_with(const std::string& s, const std::string& suffix);
// Text from a store or a file, made safe to print on a terminal: control characters (ESC, CR, BEL,
// C1 controls, DEL; and newlines and tabs unless keep_lines) shown as \xNN escapes, so that a run
// name written into a shared store cannot move the cursor, retitle the window or hide a line.
std::string terminal_safe(const std::string& s, bool keep_lines = false);

// The "key = value" lines of a TOML text under [section] headers (config_to_toml's form), as
// ("section.key", value text) in the text's order.
std::vector<std::pair<std::string, std::string>> toml_settings(const std::string& toml);

// Where two TOML texts of "key = value" lines under [section] headers (config_to_toml's form)
// set something differently: "section.key = A here, B there" for each key whose value differs or
// that only one sets, in the first text's order, at most `max` of them (then "... and N more").
std::vector<std::string> settings_differences(const std::string& here, const std::string& there, size_t max = 8);

// Left-aligned text table with a header row; columns sized to their widest cell.
class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) {  // cells made terminal_safe: they often come from a store
    for (std::string& cell : row) cell = terminal_safe(cell);
    rows_.push_back(std::move(row));
  }
  std::string render(const std::string& indent = "") const;
  bool empty() const { return rows_.empty(); }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace dsrun
