// What both backends share: reading cells, telling a server URL from a file, opening either, and
// the error for a schema newer than this dsrun.
#include "storage/database.hpp"

#include "engine/common/error.hpp"

#include <cstdio>
#include <cstring>
#include <cstdlib>

namespace dsrun {

std::string SqlRow::text(size_t col) const {
  const SqlValue& v = cells.at(col);
  switch (v.kind) {
    case SqlValue::Kind::Null: return "";
    case SqlValue::Kind::Integer: return std::to_string(v.integer);
    case SqlValue::Kind::Real: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", v.real);
      return buf;
    }
    case SqlValue::Kind::Text: return v.text;
  }
  return "";
}

int64_t SqlRow::integer(size_t col) const {
  const SqlValue& v = cells.at(col);
  switch (v.kind) {
    case SqlValue::Kind::Null: return 0;
    case SqlValue::Kind::Integer: return v.integer;
    case SqlValue::Kind::Real: return static_cast<int64_t>(v.real);
    case SqlValue::Kind::Text: return std::strtoll(v.text.c_str(), nullptr, 10);
  }
  return 0;
}

double SqlRow::real(size_t col) const {
  const SqlValue& v = cells.at(col);
  switch (v.kind) {
    case SqlValue::Kind::Null: return 0;
    case SqlValue::Kind::Integer: return static_cast<double>(v.integer);
    case SqlValue::Kind::Real: return v.real;
    case SqlValue::Kind::Text: return std::strtod(v.text.c_str(), nullptr);
  }
  return 0;
}

bool is_postgres_location(const std::string& location) {
  if (location.rfind("postgresql://", 0) == 0 || location.rfind("postgres://", 0) == 0) return true;
  // libpq's keyword/value form ("host=db dbname=runs user=me"): its first word is a libpq keyword.
  static const char* const keywords[] = {"host=", "hostaddr=", "port=", "dbname=", "user=", "password=", "passfile=", "service=", "sslmode=", "connect_timeout="};
  const size_t start = location.find_first_not_of(" \t");
  if (start == std::string::npos) return false;
  for (const char* k : keywords)
    if (location.compare(start, std::strlen(k), k) == 0) return true;
  return false;
}

std::unique_ptr<Database> open_database(const std::string& location) {
  return is_postgres_location(location) ? open_postgres_database(location) : open_sqlite_database(location);
}

void throw_newer_schema(const std::string& location, int found, int known) {
  ErrorContext c;
  c.file = redact_location(location);
  c.hint = "use a newer dsrun, or point --db at another store";
  throw Error("the run store has schema version " + std::to_string(found) + ", newer than this dsrun's " + std::to_string(known), c);
}

}  // namespace dsrun
