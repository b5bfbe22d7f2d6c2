// What one chunk becomes: its text read and split, tokenized, its shard written; a shard left by an
// earlier prepare of the same input and tokenizer is kept.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/shard_builder.hpp"
#include "engine/data/prepare/splitter.hpp"

namespace dsrun::prepare_detail {

class Preparer {
 public:
  Preparer(const PrepareOptions& o, std::vector<InputFile> files) : o_(o), files_(std::move(files)) {
    tokenizer_ = open_tokenizer(o.tokenizer);
    tokenizer_path_ = tokenizer_file(o.tokenizer);
    const std::string bytes = read_file(tokenizer_path_);
    tokenizer_hash_ = "xxh3:" + hex64(XXH3_64bits(bytes.data(), bytes.size()));
    token_bytes_ = tokenizer_->vocab_size() <= 65536 ? 2 : 4;
    // Documents are marked as the post-processor says (BOS and/or EOS); if it adds nothing, EOS.
    tokenizer_->document_marks(before_, after_);
    marks_from_post_processor_ = !before_.empty() || !after_.empty();
    if (!marks_from_post_processor_) {
      if (!tokenizer_->eos()) {
        ErrorContext c;
        c.file = tokenizer_path_;
        c.hint = "use a tokenizer whose tokenizer_config.json names an eos_token";
        throw Error("the tokenizer marks no document boundary: no BOS/EOS from its post-processor and no EOS token", c);
      }
      after_ = {*tokenizer_->eos()};
    }
  }

  json identity(const Chunk& chunk) const {
    json pieces = json::array();
    for (const Piece& p : chunk.pieces) {
      const InputFile& f = files_[p.file];
      pieces.push_back({{"file", f.path}, {"size", f.size}, {"mtime_ns", f.mtime_ns}, {"begin", p.begin}, {"end", p.end}});
    }
    json id = {{"pieces", pieces}, {"tokenizer", tokenizer_hash_}, {"field", o_.field}, {"line_documents", o_.line_documents},
               {"token_bytes", token_bytes_}};
    if (o_.line_documents) id["blank_lines"] = "skipped";  // (shards of earlier prepares made them EOS-only documents)
    return id;
  }

  json end_of_document() const {
    if (!marks_from_post_processor_) return {{"eos", after_.front()}};
    return {{"post_processor", tokenizer_->encode("", true)}};
  }

  // The record of shard k when it holds this chunk's shard whole (finished by an earlier prepare).
  std::optional<json> finished_record(size_t k, const json& id) const {
    const std::string base = path_join(o_.out, shard_name(k));
    if (!file_exists(base + ".json")) return std::nullopt;
    try {
      json done = json::parse(read_file(base + ".json"));
      // --strict is not in the identity: a shard that skipped lines is made again, to fail.
      if (done.value("identity", json()) == id && file_size(base + ".tokens") == done.value("tokens_file_bytes", int64_t(-1)) &&
          file_size(base + ".docs") == done.value("docs_file_bytes", int64_t(-1)) && !(o_.strict && done.value("skipped_lines", 0) > 0)) {
        return done;
      }
    } catch (const json::exception&) {
      // An unreadable record is not a finished shard: it is written again.
    }
    return std::nullopt;
  }

  static ShardResult reused(const json& done) {
    ShardResult r;
    r.record = done;
    r.documents = done.value("documents", int64_t(0));
    r.tokens = done.value("tokens", int64_t(0));
    r.bytes = done.value("input_bytes", int64_t(0));
    r.skipped = done.value("skipped_lines", int64_t(0));
    r.blank = done.value("blank_lines", int64_t(0));
    if (done.contains("skipped_examples")) r.skipped_examples = done["skipped_examples"].get<std::vector<std::string>>();
    r.reused = true;
    return r;
  }

  // Where a streamed chunk starting as `chunk` does (its last piece's begin) ended when an earlier
  // prepare finished its shard k, if it matches in everything else; -1 if none.
  int64_t recorded_end(size_t k, Chunk chunk) const {
    const std::string path = path_join(o_.out, shard_name(k) + ".json");
    if (!file_exists(path)) return -1;
    try {
      const json done = json::parse(read_file(path));
      const json& pieces = done.at("identity").at("pieces");
      if (pieces.size() != 1) return -1;
      chunk.pieces.back().end = pieces[0].at("end").get<int64_t>();
      if (finished_record(k, identity(chunk))) return chunk.pieces.back().end;
    } catch (const json::exception&) {
      // Not a record of this chunk.
    }
    return -1;
  }

  Splitter::Mode mode_of(const InputFile& f) const {
    if (f.json_lines) return Splitter::Mode::json_lines;
    return o_.line_documents ? Splitter::Mode::lines : Splitter::Mode::document;
  }

  // A unit's ids. A document the tokenizer cannot take (a regex past its work budget) is skipped and
  // counted like a bad line, or with --strict fails the prepare.
  UnitIds tokenize(const Unit& u) const {
    UnitIds r;
    r.kind = u.kind;
    r.first = u.first;
    r.last = u.last;
    r.aborts_document = u.aborts_document;
    const Piece& p = u.shard->piece(u.piece);
    const InputFile& f = files_[p.file];
    // "file:line: why" for a skipped line or document; with --strict, the error.
    const auto report = [&](int relative_line, const std::string& why, const char* strict_hint) {
      const int at = u.shard->absolute_line(u.piece, relative_line, f.path);
      if (o_.strict) throw input_error(f.path, at, why, strict_hint);
      r.examples.push_back(f.path + ":" + std::to_string(at) + ": " + why);
    };
    const char* const refused_hint = "drop --strict to skip and count such documents, or change the tokenizer's pattern";
    switch (u.kind) {
      case Unit::Kind::skip:
        report(u.line, u.why, "split the document, or drop --strict to skip and count such documents");
        return r;
      case Unit::Kind::piece:
        try {
          if (u.first && u.last) {
            tokenizer_->encode_in_pieces(u.text, marks_from_post_processor_, r.ids);
            if (!marks_from_post_processor_) r.ids.insert(r.ids.end(), after_.begin(), after_.end());
          } else {
            if (u.first) r.ids = before_;
            tokenizer_->encode_in_pieces(u.text, false, r.ids);
            if (u.last) r.ids.insert(r.ids.end(), after_.begin(), after_.end());
          }
        } catch (const TokenizerRegexError& e) {
          r.ids.clear();
          r.refused = true;
          report(u.line, excerpt(e.what()), refused_hint);
        }
        return r;
      case Unit::Kind::lines:
        break;
    }
    int line = u.line;
    std::vector<uint32_t> ids;
    for (size_t start = 0; start < u.text.size(); ++line) {
      size_t end = u.text.find('\n', start);
      if (end == std::string::npos) end = u.text.size();
      const std::string_view text(u.text.data() + start, end - start);
      start = end + 1;
      const auto add_document = [&](std::string_view document) -> std::string {
        ids.clear();
        try {
          tokenizer_->encode_in_pieces(document, marks_from_post_processor_, ids);
        } catch (const TokenizerRegexError& e) {
          return excerpt(e.what());
        }
        if (!marks_from_post_processor_) ids.insert(ids.end(), after_.begin(), after_.end());
        r.ids.insert(r.ids.end(), ids.begin(), ids.end());
        r.ends.push_back(r.ids.size());
        return "";
      };
      std::string why;
      if (!f.json_lines && text.find_first_not_of(" \t\r") == std::string_view::npos) {
        ++r.blank;  // --line-documents: a blank line is no document (not an EOS alone)
      } else if (!f.json_lines) {
        why = add_document(text);
      } else if (!text.empty() && text.find_first_not_of(" \t\r") != std::string_view::npos) {
        try {
          const json doc = json::parse(text);
          if (!doc.is_object() || !doc.contains(o_.field)) why = "no field \"" + o_.field + "\"";
          else if (!doc[o_.field].is_string()) why = "field \"" + o_.field + "\" is not a string";
          else why = add_document(doc[o_.field].get_ref<const std::string&>());
        } catch (const json::parse_error& e) {
          why = excerpt(std::string("not JSON: ") + e.what());  // the parser quotes the whole bad token, maybe megabytes
        } catch (const json::out_of_range& e) {  // a number past double's range (1e999): one bad line, not the whole prepare
          why = excerpt(std::string("a number JSON cannot hold: ") + e.what());
        }
      }
      if (!why.empty()) {
        ++r.skipped;
        if (r.examples.size() < 5 || o_.strict) report(line, why, "fix the line, or drop --strict to skip and count such lines");
      }
    }
    return r;
  }

  const PrepareOptions& o_;
  std::vector<InputFile> files_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string tokenizer_path_, tokenizer_hash_;
  int token_bytes_ = 4;
  bool marks_from_post_processor_ = false;
  std::vector<uint32_t> before_, after_;  // around each document: the post-processor's marks, or EOS after
};

}  // namespace dsrun::prepare_detail
