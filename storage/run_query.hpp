// The query language of `dsrun history --where` and `--sort`: an expression over run columns,
// config keys and latest metrics, parsed into parameterised SQL (values never enter the SQL text).
// Anything else is an error that points at the offending token.
#pragma once

#include "storage/database.hpp"

#include <functional>
#include <string>
#include <vector>

namespace dsrun {

// A piece of SQL with its parameters (bound in order: text or number).
struct SqlFragment {
  std::string sql;
  struct Param {
    bool is_number = false;
    double number = 0;
    std::string text;
  };
  std::vector<Param> params;
};

// What names mean: run columns are fixed; `metrics.KEY` is the latest value of a metric; any name
// `is_config_key` accepts is that config value. `known_names` feeds did-you-mean.
struct QueryNames {
  std::function<bool(const std::string&)> is_config_key;
  std::vector<std::string> known_names;
  SqlDialect dialect = SqlDialect::Sqlite;  // the store's: config values are read from JSON differently
  bool bare_names_are_metrics = false;      // alert conditions: "val_loss > 3" means metrics.val_loss
};

// "optimizer.lr > 1e-4 and metrics.val_loss < 2.5 and status = finished" -> a WHERE condition.
// Bare words on the right of a comparison are strings (status = finished), except true and false,
// which are 1 and 0 (how config booleans compare). Throws dsrun::Error with the expression and a
// caret under the bad token, also for ( and not nested deeper than 64 levels and for more than
// 256 conditions.
SqlFragment parse_where(const std::string& expression, const QueryNames& names);
// One name (column, config key or metrics.KEY) as a sortable SQL value; errors name --sort.
SqlFragment sort_expression(const std::string& name, const QueryNames& names);
// "2 days", "3h", "30 min", "1 week", "last 2 days", "2 days ago", "last day" -> seconds;
// "yesterday" -> seconds since yesterday's local midnight. Throws (naming --since) on anything
// else, and on zero, negative or non-finite numbers.
double parse_duration(const std::string& text);

}  // namespace dsrun
