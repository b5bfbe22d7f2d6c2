#include "engine/common/text.hpp"

#include <cstdlib>

#include "engine/common/error.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

namespace dsrun {

std::string Error::describe() const {
  std::string out;
  const ErrorContext& c = context_;
  if (!c.file.empty()) {
    out += c.file;
    if (c.line > 0) out += ":" + std::to_string(c.line);
    if (c.column > 0) out += ":" + std::to_string(c.column);
    out += ": ";
  }
  if (c.rank >= 0) out += "[rank " + std::to_string(c.rank) + "] ";
  if (!c.key.empty()) out += c.key + ": ";
  out += what();
  if (!c.hint.empty()) out += "\n  fix: " + c.hint;
  const char* debug = std::getenv("DSRUN_DEBUG");
  if (!origin_.empty() && debug && *debug && std::string(debug) != "0") out += "\n  (raised at " + origin_ + ")";
  return out;
}

std::string source_origin(const char* where_file, int where_line) {
  std::string f = where_file;
  const size_t slash = f.rfind('/');
  return (slash == std::string::npos ? f : f.substr(slash + 1)) + ":" + std::to_string(where_line);
}

void fail_at(const char* where_file, int where_line, const std::string& message) {
  throw Error(message).with_origin(source_origin(where_file, where_line));
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t substitute = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, substitute});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = SIZE_MAX;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  // A plausible typo changes at most a third of the word (and at least allows 2 edits).
  size_t allowed = std::max<size_t>(2, word.size() / 3);
  return best_distance <= allowed ? best : "";
}

static std::string printf_string(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// "12.3 GiB", "870 K": divides by `base` until under it; 3 significant digits from 100 up.
static std::string with_unit(double v, double base, const std::vector<const char*>& units, const char* whole_format) {
  size_t u = 0;
  while (std::fabs(v) >= base && u + 1 < units.size()) {
    v /= base;
    ++u;
  }
  if (u == 0) return printf_string(whole_format, v) + units[0];
  return printf_string(std::fabs(v) >= 100 ? "%.0f" : "%.2f", v) + units[u];
}

std::string format_bytes(double bytes) { return with_unit(bytes, 1024.0, {" B", " KiB", " MiB", " GiB", " TiB", " PiB"}, "%.0f"); }

std::string format_count(double n) { return with_unit(n, 1000.0, {"", " K", " M", " B", " T", " P", " E"}, "%.0f"); }

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string format_seconds(double s) {
  if (!std::isfinite(s)) return "n/a";
  if (s < 1e-3) return printf_string("%.1f us", s * 1e6);
  if (s < 1.0) return printf_string("%.1f ms", s * 1e3);
  if (s < 120.0) return printf_string("%.2f s", s);
  if (s < 7200.0) return printf_string("%.1f min", s / 60.0);
  if (s < 3 * 86400.0) return printf_string("%.1f h", s / 3600.0);
  return printf_string("%.1f days", s / 86400.0);
}

std::string format_double(double v, int precision) {
  std::ostringstream os;
  os.precision(precision);
  os << v;
  return os.str();
}

std::string format_double_exact(double v) {
  char buf[64];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string terminal_safe(const std::string& s, bool keep_lines) {
  std::string out;
  out.reserve(s.size());
  char hex[8];
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const bool c1 = c == 0xC2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 && static_cast<unsigned char>(s[i + 1]) <= 0x9F;  // U+0080-U+009F
    if ((c < 0x20 && !(keep_lines && (c == '\n' || c == '\t'))) || c == 0x7F) {
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else if (c1) {
      std::snprintf(hex, sizeof hex, "\\u%04x", static_cast<unsigned char>(s[++i]));
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string TextTable::render(const std::string& indent) const {
  std::vector<size_t> width(header_.size(), 0);
  auto measure = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size() && i < width.size(); ++i) width[i] = std::max(width[i], row[i].size());
  };
  measure(header_);
  for (const auto& r : rows_) measure(r);
  auto line = [&](const std::vector<std::string>& row) {
    std::string out = indent;
    for (size_t i = 0; i < width.size(); ++i) {
      std::string cell = i < row.size() ? row[i] : "";  // (made terminal-safe in add)
      out += cell;
      if (i + 1 < width.size()) out += std::string(width[i] - cell.size() + 2, ' ');
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out + "\n";
  };
  std::string out = line(header_);
  for (const auto& r : rows_) out += line(r);
  return out;
}

std::vector<std::pair<std::string, std::string>> toml_settings(const std::string& toml) {
  std::vector<std::pair<std::string, std::string>> out;
  std::string section;
  for (const std::string& raw : split(toml, '\n')) {
    const std::string line = trim(raw);
    if (line.empty() || line[0] == '#') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = trim(line.substr(1, line.size() - 2));
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = trim(line.substr(0, eq));
    out.push_back({section.empty() ? key : section + "." + key, trim(line.substr(eq + 1))});
  }
  return out;
}

std::vector<std::string> settings_differences(const std::string& here, const std::string& there, size_t max) {
  const auto mine = toml_settings(here), theirs = toml_settings(there);
  std::map<std::string, std::string> their_value(theirs.begin(), theirs.end()), my_value(mine.begin(), mine.end());
  std::vector<std::string> found;
  for (const auto& [key, value] : mine) {
    auto it = their_value.find(key);
    if (it == their_value.end()) found.push_back(key + " = " + value + " here, unset there");
    else if (it->second != value) found.push_back(key + " = " + value + " here, " + it->second + " there");
  }
  for (const auto& [key, value] : theirs)
    if (!my_value.count(key)) found.push_back(key + " unset here, " + value + " there");
  if (found.size() > max) {
    const size_t more = found.size() - max;
    found.resize(max);
    found.push_back("... and " + std::to_string(more) + " more");
  }
  return found;
}

}  // namespace dsrun
