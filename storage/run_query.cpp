#include "storage/run_query.hpp"

#include "engine/common/error.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <sstream>

namespace dsrun {

namespace {

// Run columns by the names the query language uses.
const std::map<std::string, std::string>& columns() {
  static const std::map<std::string, std::string> c = {
      {"id", "runs.id"},           {"name", "runs.name"},         {"status", "runs.status"},       {"model", "runs.model"},
      {"hardware", "runs.hardware"}, {"zero_stage", "runs.zero_stage"}, {"world_size", "runs.world_size"}, {"host", "runs.host"},
      {"recipe", "runs.recipe_path"}, {"created_at", "runs.created_at"}, {"started_at", "runs.started_at"}, {"ended_at", "runs.ended_at"},
      {"duration", "(COALESCE(runs.ended_at, runs.heartbeat_at) - runs.started_at)"}, {"sweep", "runs.sweep_id"},
      {"trial", "runs.trial_index"}, {"parent", "runs.parent_run"}, {"git", "runs.git_revision"}};
  return c;
}

int distance(const std::string& a, const std::string& b) {
  std::vector<int> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

struct Token {
  enum Kind { Name, Number, String, Op, LParen, RParen, End } kind = End;
  std::string text;
  double number = 0;
  size_t at = 0;  // column in the expression
};

// Deeper nesting of ( and not is refused: the parser recurses once per level (30,000 levels
// overflow the stack) and SQLite's own parser gives up below a hundred levels.
constexpr int kMaxNesting = 64;
// So are longer and / or chains: SQLite nests them one level per condition and refuses
// expressions deeper than 1000.
constexpr int kMaxConditions = 256;
constexpr size_t kMaxLikeBytes = 1000;    // SQLite's own limit is 50,000; a name or key is far shorter
constexpr long kMaxLikePercents = 16;

class WhereParser {
 public:
  // `option` names the command-line option the text came from (--where, --sort), for errors.
  WhereParser(std::string text, const QueryNames& names, std::string option)
      : text_(std::move(text)), names_(names), option_(std::move(option)) {
    tokenize();
  }

  SqlFragment parse() {
    SqlFragment f = parse_or();
    if (peek().kind != Token::End) fail(peek(), "unexpected \"" + peek().text + "\"", "join conditions with and / or");
    return f;
  }

  // `is_config` (when given) tells whether the name was a config key, whose SQL depends on what it
  // is compared with on PostgreSQL.
  SqlFragment name_value(const Token& t, bool* is_config = nullptr) {
    SqlFragment f;
    if (is_config) *is_config = false;
    const std::string lower = lowercase(t.text);
    if (auto it = columns().find(lower); it != columns().end()) {
      f.sql = it->second;
      return f;
    }
    if (t.text.rfind("metrics.", 0) == 0 && t.text.size() > 8) {
      f.sql = "(SELECT ml.value FROM metrics_latest ml WHERE ml.run_id = runs.id AND ml.key = ?)";
      f.params.push_back({false, 0, t.text.substr(8)});
      return f;
    }
    if (names_.is_config_key && names_.is_config_key(t.text)) {
      if (is_config) *is_config = true;
      if (names_.dialect == SqlDialect::Postgres) {
        f.sql = "(runs.config_json::jsonb -> ?)";  // jsonb orders numbers as numbers, text as text
        f.params.push_back({false, 0, t.text});
        return f;
      }
      f.sql = "json_extract(runs.config_json, ?)";
      f.params.push_back({false, 0, "$.\"" + t.text + "\""});
      return f;
    }
    if (names_.bare_names_are_metrics) {
      f.sql = "(SELECT ml.value FROM metrics_latest ml WHERE ml.run_id = runs.id AND ml.key = ?)";
      f.params.push_back({false, 0, t.text});
      return f;
    }
    std::vector<std::string> known = names_.known_names;
    for (const auto& [k, v] : columns()) known.push_back(k);
    std::string best;
    int best_d = 1 << 30;
    for (const auto& k : known) {
      int d = distance(t.text, k);
      if (d < best_d) {
        best_d = d;
        best = k;
      }
    }
    fail(t, "unknown name \"" + t.text + "\"",
         (best_d <= std::max<int>(2, static_cast<int>(t.text.size()) / 3) ? "did you mean " + best + "? " : std::string()) +
             "Names are run columns (status, name, model, ...), config keys (optimizer.lr) and metrics.KEY (metrics.val_loss)");
  }

 private:
  static std::string lowercase(std::string s) {
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  }

  [[noreturn]] void fail(const Token& t, const std::string& message, const std::string& hint) const {
    ErrorContext c;
    c.key = option_;
    c.hint = hint;
    // A long expression is shown as a window around the caret.
    const size_t width = 160, from = text_.size() > width && t.at > 60 ? t.at - 60 : 0;
    const std::string shown = (from > 0 ? "..." : "") + text_.substr(from, width) + (from + width < text_.size() ? "..." : "");
    throw Error(message + " at column " + std::to_string(t.at + 1) + "\n    " + shown + "\n    " + std::string(t.at - from + (from > 0 ? 3 : 0), ' ') + "^", c);
  }

  void tokenize() {
    size_t i = 0;
    while (i < text_.size()) {
      const char ch = text_[i];
      if (std::isspace(static_cast<unsigned char>(ch))) {
        ++i;
        continue;
      }
      Token t;
      t.at = i;
      if (std::isalpha(static_cast<unsigned char>(ch)) || ch == '_') {
        size_t j = i;
        while (j < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[j])) || text_[j] == '_' || text_[j] == '.' || text_[j] == '/' || text_[j] == '-'))
          ++j;
        t.kind = Token::Name;
        t.text = text_.substr(i, j - i);
        i = j;
      } else if (std::isdigit(static_cast<unsigned char>(ch)) || ((ch == '-' || ch == '.') && i + 1 < text_.size() && (std::isdigit(static_cast<unsigned char>(text_[i + 1])) || text_[i + 1] == '.'))) {
        const char* begin = text_.c_str() + i;
        char* end = nullptr;
        t.number = std::strtod(begin, &end);
        if (end == begin) {
          t.text = std::string(1, ch);
          fail(t, "not a number", "");
        }
        t.kind = Token::Number;
        t.text = text_.substr(i, static_cast<size_t>(end - begin));
        i += static_cast<size_t>(end - begin);
      } else if (ch == '\'' || ch == '"') {
        std::string value;
        size_t j = i + 1;
        bool closed = false;
        while (j < text_.size()) {
          if (text_[j] == ch) {
            if (j + 1 < text_.size() && text_[j + 1] == ch) {  // a doubled quote is a quote
              value += ch;
              j += 2;
              continue;
            }
            closed = true;
            ++j;
            break;
          }
          value += text_[j++];
        }
        t.text = std::string(1, ch);
        if (!closed) fail(t, "unterminated string", "close it with " + std::string(1, ch));
        t.kind = Token::String;
        t.text = value;
        i = j;
      } else if (ch == '(' || ch == ')') {
        t.kind = ch == '(' ? Token::LParen : Token::RParen;
        t.text = std::string(1, ch);
        ++i;
      } else {
        static const char* ops[] = {"<=", ">=", "!=", "<>", "==", "=", "<", ">"};
        bool matched = false;
        for (const char* op : ops)
          if (text_.compare(i, std::strlen(op), op) == 0) {
            t.kind = Token::Op;
            t.text = op;
            i += std::strlen(op);
            matched = true;
            break;
          }
        if (!matched) {
          t.text = std::string(1, ch);
          fail(t, "unexpected character \"" + t.text + "\"", "use names, numbers, 'strings', = != < <= > >=, like, is null, and, or, not, ( )");
        }
      }
      tokens_.push_back(t);
    }
    Token end;
    end.at = text_.size();
    end.text = "end of expression";
    tokens_.push_back(end);
  }

  const Token& peek() const { return tokens_[pos_]; }
  Token next() { return tokens_[pos_ < tokens_.size() - 1 ? pos_++ : pos_]; }
  bool word(const std::string& w) const { return peek().kind == Token::Name && lowercase(peek().text) == w; }

  SqlFragment parse_or() {
    SqlFragment f = parse_and();
    while (word("or")) {
      next();
      f = join(f, " OR ", parse_and());
    }
    return f;
  }

  SqlFragment parse_and() {
    SqlFragment f = parse_not();
    while (word("and")) {
      next();
      f = join(f, " AND ", parse_not());
    }
    return f;
  }

  // Called on the token that opens a level (a "(" or a "not"), before parsing inside it.
  void enter_level() {
    if (++depth_ > kMaxNesting)
      fail(peek(), "nested deeper than " + std::to_string(kMaxNesting) + " levels of ( and not",
           "write the condition flatter: and / or chains need no parentheses");
  }

  SqlFragment parse_not() {
    if (word("not")) {
      enter_level();
      next();
      SqlFragment inner = parse_not();
      --depth_;
      // The inner fragment is already parenthesised (or another NOT): no parentheses of our own,
      // so each level costs SQLite's parser one stack slot, not two.
      inner.sql = "NOT " + inner.sql;
      return inner;
    }
    return parse_comparison();
  }

  SqlFragment parse_comparison() {
    if (peek().kind == Token::LParen) {
      enter_level();
      next();
      SqlFragment inner = parse_or();
      if (peek().kind != Token::RParen) fail(peek(), "expected \")\"", "close the parenthesis");
      next();
      --depth_;
      inner.sql = "(" + inner.sql + ")";
      return inner;
    }
    if (++conditions_ > kMaxConditions)
      fail(peek(), "more than " + std::to_string(kMaxConditions) + " conditions", "shorten the and / or chain, e.g. with like or a range (x >= a and x <= b)");
    const Token left = next();
    if (left.kind != Token::Name) fail(left, "expected a name (a column, config key or metrics.KEY)", "for example: optimizer.lr > 1e-4");
    bool is_config = false;
    SqlFragment f = name_value(left, &is_config);
    const bool postgres = names_.dialect == SqlDialect::Postgres;
    if (postgres && is_config) f.sql = "(runs.config_json::jsonb ->> ?)";  // as text, NULL when absent or JSON null
    if (word("is")) {
      next();
      bool negated = false;
      if (word("not")) {
        next();
        negated = true;
      }
      if (!word("null")) fail(peek(), "expected null after is", "");
      next();
      f.sql = "(" + f.sql + (negated ? " IS NOT NULL)" : " IS NULL)");
      return f;
    }
    std::string op;
    if (peek().kind == Token::Op) op = next().text;
    else if (word("like")) {
      next();
      op = "LIKE";
    } else {
      fail(peek(), "expected a comparison (= != < <= > >= like) after " + left.text, "");
    }
    if (op == "==") op = "=";
    if (op == "<>") op = "!=";
    const Token right = next();
    SqlFragment::Param value;
    if (right.kind == Token::Number) {
      value.is_number = true;
      value.number = right.number;
    } else if (right.kind == Token::Name && (lowercase(right.text) == "true" || lowercase(right.text) == "false")) {
      // Config booleans are stored as JSON true/false, which json_extract reads as 1/0.
      value.is_number = true;
      value.number = lowercase(right.text) == "true" ? 1 : 0;
    } else if (right.kind == Token::String || right.kind == Token::Name) {
      value.text = right.text;  // a bare word is a string: status = finished
      if (op == "LIKE") check_like_pattern(right);
    } else {
      fail(right, "expected a value after " + op, "a number, a 'string' or a word");
    }
    if (postgres && is_config && value.is_number) f.sql = "dsrun_json_number(runs.config_json, ?)";  // see the store's schema
    if (postgres && op == "LIKE") {
      op = "ILIKE";  // SQLite's LIKE folds ASCII case
      f.sql = "CAST(" + f.sql + " AS TEXT)";
    }
    f.sql = "(" + f.sql + " " + op + " ?)";
    f.params.push_back(value);
    return f;
  }

  // SQLite refuses long LIKE patterns, and each % lets its matcher try every position again:
  // bounded here, with the place in the expression, rather than as a raw SQLite error.
  void check_like_pattern(const Token& t) const {
    if (t.text.size() > kMaxLikeBytes)
      fail(t, "a like pattern of " + std::to_string(t.text.size()) + " bytes (at most " + std::to_string(kMaxLikeBytes) + ")",
           "shorten the pattern: % matches any run of characters, _ any one");
    const auto percents = std::count(t.text.begin(), t.text.end(), '%');
    if (percents > kMaxLikePercents)
      fail(t, "a like pattern with " + std::to_string(percents) + " % wildcards (at most " + std::to_string(kMaxLikePercents) + ")",
           "one % between fixed parts is enough: '%lr%sweep%'");
  }

  static SqlFragment join(SqlFragment a, const std::string& how, const SqlFragment& b) {
    a.sql = a.sql + how + b.sql;
    a.params.insert(a.params.end(), b.params.begin(), b.params.end());
    return a;
  }

  std::string text_;
  const QueryNames& names_;
  std::string option_;
  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;       // ( and not levels open at the current token
  int conditions_ = 0;  // comparisons so far
};

}  // namespace

SqlFragment parse_where(const std::string& expression, const QueryNames& names) {
  WhereParser p(expression, names, "--where");
  return p.parse();
}

SqlFragment sort_expression(const std::string& name, const QueryNames& names) {
  WhereParser p(name, names, "--sort");
  Token t;
  t.kind = Token::Name;
  t.text = name;
  return p.name_value(t);
}

namespace {

std::string normalized_phrase(const std::string& text) {
  std::istringstream in(text);
  std::string word, out;
  while (in >> word) out += (out.empty() ? "" : " ") + word;
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool strip_prefix(std::string& s, const std::string& prefix) {
  if (s.rfind(prefix, 0) != 0) return false;
  s.erase(0, prefix.size());
  return true;
}

bool strip_suffix(std::string& s, const std::string& suffix) {
  if (s.size() < suffix.size() || s.compare(s.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  s.erase(s.size() - suffix.size());
  return true;
}

// Seconds from the start of yesterday (local midnight) to now.
double seconds_since_yesterday_began() {
  const std::time_t now = std::time(nullptr);
  std::tm day{};
  localtime_r(&now, &day);
  day.tm_hour = day.tm_min = day.tm_sec = 0;
  day.tm_mday -= 1;
  day.tm_isdst = -1;  // let mktime work out daylight saving for that day
  return std::difftime(now, std::mktime(&day));
}

}  // namespace

double parse_duration(const std::string& text) {
  ErrorContext c;
  c.key = "--since";
  c.hint = "write a number and a unit, or a phrase: 30 min, 3h, 2 days, 1 week, last 2 days, 2 days ago, last day, yesterday";
  std::string phrase = normalized_phrase(text);
  if (phrase == "yesterday") return seconds_since_yesterday_began();
  // "last 2 days", "past week" and "2 days ago" mean what "2 days" and "1 week" mean.
  const bool last = strip_prefix(phrase, "last ") || strip_prefix(phrase, "past ");
  if (!last) strip_suffix(phrase, " ago");

  const char* begin = phrase.c_str();
  char* end = nullptr;
  double n = std::strtod(begin, &end);
  if (end == begin) {
    if (!last) throw Error("cannot read \"" + text + "\" as a duration", c);
    n = 1;  // "last day"
  }
  std::string unit(end);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char ch) { return std::isspace(ch); }), unit.end());
  static const std::vector<std::pair<std::vector<std::string>, double>> units = {
      {{"s", "sec", "secs", "second", "seconds"}, 1},   {{"m", "min", "mins", "minute", "minutes"}, 60}, {{"h", "hour", "hours"}, 3600},
      {{"d", "day", "days"}, 86400},                    {{"w", "week", "weeks"}, 604800}};
  for (const auto& [names, seconds] : units) {
    if (std::find(names.begin(), names.end(), unit) == names.end()) continue;
    if (!std::isfinite(n) || n <= 0 || !std::isfinite(n * seconds)) {
      c.hint = "give a finite number above zero: 30 min, 2 days";
      throw Error("\"" + text + "\" is not a duration above zero", c);
    }
    return n * seconds;
  }
  throw Error("cannot read \"" + text + "\" as a duration", c);
}

}  // namespace dsrun
