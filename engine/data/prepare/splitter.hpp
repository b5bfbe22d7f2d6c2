// A chunk's text cut into units of about a megabyte: runs of whole lines, or pieces of one long
// document at the tokenizer's safe cuts; JSON lines parsed, bad ones skipped and counted.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/shard_builder.hpp"

namespace dsrun::prepare_detail {

// Cuts the text of one chunk piece, fed in blocks of any size, into units: runs of whole lines of
// about kUnitBytes (JSON lines, --line-documents), or the pieces of a document cut at the
// tokenizer's safe cuts (a text file read as one document; a line of --line-documents longer than a
// unit). What must be held whole, a JSON line (it is parsed whole) or a document with no safe cut,
// may be max_document bytes; a longer one is skipped (a skip unit) and read past without being held.
class Splitter {
 public:
  enum class Mode { document, lines, json_lines };
  Splitter(Mode mode, const Tokenizer& tokenizer, size_t max_document, std::function<void(Unit&&)> emit)
      : mode_(mode), tokenizer_(tokenizer), max_document_(max_document), emit_(std::move(emit)) {
    if (mode_ == Mode::document) start_document(1);
  }

  void feed(std::string_view text) {
    if (mode_ == Mode::document) {
      take(text, false);
      return;
    }
    for (size_t i = 0; i < text.size();) {
      const size_t newline = text.find('\n', i);
      const bool line_ends = newline != std::string_view::npos;
      const std::string_view part = text.substr(i, (line_ends ? newline : text.size()) - i);
      if (long_line_) {
        take(part, line_ends);
      } else if (partial_.size() + part.size() > kUnitBytes) {  // a long line: units of its own
        flush_lines();
        long_line_ = true;
        start_document(line_);
        const std::string head = std::move(partial_);
        partial_.clear();
        take(head, false);
        take(part, line_ends);
      } else if (!line_ends) {
        partial_.append(part);
      } else {
        if (batch_.empty()) batch_line_ = line_;
        batch_ += partial_;
        partial_.clear();
        batch_.append(part);
        batch_ += '\n';
        if (batch_.size() >= kUnitBytes) flush_lines();
      }
      if (!line_ends) break;
      long_line_ = false;
      ++line_;
      i = newline + 1;
    }
  }

  // The end of the piece's text.
  void finish() {
    if (mode_ == Mode::document || long_line_) {
      take({}, true);
    } else if (!partial_.empty()) {  // a last line without '\n'
      if (batch_.empty()) batch_line_ = line_;
      batch_ += partial_;
      partial_.clear();
    }
    long_line_ = false;
    flush_lines();
  }

  // Whether the rest of a document-mode piece is not needed: its document was skipped.
  bool skipping_document() const { return mode_ == Mode::document && dropping_; }

 private:
  void flush_lines() {
    if (batch_.empty()) return;
    Unit u;
    u.kind = Unit::Kind::lines;
    u.text = std::move(batch_);
    u.line = batch_line_;
    batch_.clear();
    emit_(std::move(u));
  }

  void start_document(int line) {
    held_.clear();
    document_line_ = line;
    started_ = false;
    dropping_ = false;
    scanned_ = 0;
  }

  // More of the current document (or long line); `ends`: it ends after this.
  void take(std::string_view part, bool ends) {
    // A JSON line is parsed whole; a document is cut where the tokenizer can cut.
    const bool cuttable = mode_ != Mode::json_lines && tokenizer_.can_cut();
    // A unit's worth at a time, so that what is held is checked against max_document_ before it
    // grows past it (a string doubling from max_document_ would hold twice that for a moment).
    while (!part.empty() && !dropping_) {
      const std::string_view slice = part.substr(0, kUnitBytes);
      part.remove_prefix(slice.size());
      if (held_.size() + slice.size() > max_document_) {
        drop();
        break;
      }
      held_.append(slice);
      while (cuttable && held_.size() > kUnitBytes) {
        const size_t cut = tokenizer_.safe_cut(held_, std::max(kUnitBytes, scanned_));
        if (cut == Tokenizer::npos) {
          scanned_ = held_.size() - 16;  // a cut depends on the few bytes around it: look again there once more comes
          break;
        }
        emit_piece(cut, false);
      }
    }
    if (!ends) return;
    if (!dropping_) {
      if (mode_ == Mode::document || started_) {
        emit_piece(held_.size(), true);
      } else {  // a long line of JSON or of a tokenizer that cannot cut: one unit of its own
        batch_line_ = document_line_;
        batch_ = std::move(held_);
        flush_lines();
      }
    }
    start_document(line_ + 1);
  }

  void emit_piece(size_t end, bool last) {
    Unit u;
    u.kind = Unit::Kind::piece;
    u.text = held_.substr(0, end);
    u.line = document_line_;
    u.first = !started_;
    u.last = last;
    held_.erase(0, end);
    scanned_ = 0;
    started_ = true;
    emit_(std::move(u));
  }

  void drop() {
    const std::string limit = std::to_string(max_document_ >> 20) + " MiB";
    Unit u;
    u.kind = Unit::Kind::skip;
    u.line = document_line_;
    u.aborts_document = started_;
    if (mode_ == Mode::json_lines) {
      u.why = "a JSON line longer than " + limit + ", the most held whole to parse";
    } else if (!tokenizer_.can_cut()) {
      u.why = "a document longer than " + limit + ", the most held whole, and this tokenizer cannot cut a document into pieces (docs/tokenizers.md)";
    } else {
      u.why = "a document with no place to cut it into pieces (a line break before a letter, or a space between letters) in " + limit + ", the most held whole";
    }
    held_.clear();
    held_.shrink_to_fit();
    dropping_ = true;
    emit_(std::move(u));
  }

  const Mode mode_;
  const Tokenizer& tokenizer_;
  const size_t max_document_;
  const std::function<void(Unit&&)> emit_;
  // Lines
  std::string batch_;    // whole lines for the next unit
  int batch_line_ = 1;   // the line of batch_[0]
  std::string partial_;  // the start of a short line whose end has not come yet
  int line_ = 1;         // the line being read
  bool long_line_ = false;
  // The document (or long line) being cut
  std::string held_;
  int document_line_ = 1;
  bool started_ = false;   // some of its pieces went out
  bool dropping_ = false;  // skipped: the rest is read past
  size_t scanned_ = 0;     // held_ before this has no safe cut past kUnitBytes
};

}  // namespace dsrun::prepare_detail
