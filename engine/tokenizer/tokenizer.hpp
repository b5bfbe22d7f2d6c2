// Text to token ids and back: Hugging Face tokenizer.json files (BPE; ids identical to the
// `tokenizers` crate) and SentencePiece tokenizer.model files. docs/tokenizers.md has the details.
#pragma once

#include "engine/common/error.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsrun {

// Thrown by encode (and decode) when a tokenizer.json regex exceeds its matching budget on a text
// (a pattern that is quadratic or worse there, such as `.(?=.*$)`) or PCRE2 fails on it. The
// message starts with "tokenizer regex" and names the pattern; context: the tokenizer.json and the
// pattern's JSON path. The tokenizer stays usable: a caller may skip that text and go on.
class TokenizerRegexError : public Error {
 public:
  using Error::Error;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Appends the ids of `text` to `ids`. `text` may hold invalid UTF-8 (repaired to U+FFFD first).
  // With `add_special`, the post-processor's tokens (BOS/EOS) too. Safe from several threads.
  // Throws TokenizerRegexError when a regex needs too much work on `text`.
  virtual void encode(std::string_view text, bool add_special, std::vector<uint32_t>& ids) const = 0;
  // The text of `ids`; special tokens left out with `skip_special`. Ids outside the vocabulary are
  // an error.
  virtual std::string decode(const std::vector<uint32_t>& ids, bool skip_special) const = 0;
  // One more than the largest id (model vocabulary and added tokens together).
  virtual int64_t vocab_size() const = 0;
  // The tokens that begin and end a document, when the tokenizer names them.
  virtual std::optional<uint32_t> bos() const = 0;
  virtual std::optional<uint32_t> eos() const = 0;
  // "tokenizer.json (BPE, 128000 ids)"
  virtual std::string describe() const = 0;
  // The ids encode(text, true, ids) puts before and after the text's own ids (BOS, EOS; either
  // may be empty), so that a text encoded in pieces gets them once.
  virtual void document_marks(std::vector<uint32_t>& before, std::vector<uint32_t>& after) const = 0;

  // Cutting a long text into pieces that encode to the ids of the whole: the first offset c >= near
  // in `text` where encode(D[0, a + c)) followed by encode(D[a + c, end)) gives encode(D) for every
  // document D holding `text` at offset a (both without add_special: the marks go around the whole,
  // document_marks). Only the bytes next to c decide, and they must lie inside `text`, so `text`
  // may be any window of a document. npos when there is none in `text`, and always when the
  // tokenizer cannot promise it (can_cut() false): then a text must be encoded whole.
  static constexpr size_t npos = std::string_view::npos;
  virtual size_t safe_cut(std::string_view /*text*/, size_t /*near*/) const { return npos; }
  virtual bool can_cut() const { return false; }

  std::vector<uint32_t> encode(std::string_view text, bool add_special = false) const {
    std::vector<uint32_t> ids;
    encode(text, add_special, ids);
    return ids;
  }
  // The ids encode(text, add_special, ids) appends, encoded a piece of about `piece_bytes` at a time
  // (cut at safe_cut), so that the tokenizer's working memory, many bytes per byte of text, is a
  // piece's and not a long document's. All of the text's ids or none, as encode.
  void encode_in_pieces(std::string_view text, bool add_special, std::vector<uint32_t>& ids, size_t piece_bytes = kPieceBytes) const;
  // The piece size `dsrun prepare` and `dsrun tokenize` cut long texts into.
  static constexpr size_t kPieceBytes = size_t(1) << 20;
};

// `path` is a tokenizer.json, a SentencePiece tokenizer.model, or a directory holding one of them
// (tokenizer.json first). A tokenizer_config.json beside a tokenizer.json is read for the BOS and EOS
// tokens and add_bos_token / add_eos_token, as transformers does. Errors name the file and the JSON path.
std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path);

// The file open_tokenizer reads for `path`.
std::string tokenizer_file(const std::string& path);

std::unique_ptr<Tokenizer> open_hf_tokenizer(const std::string& json_path);
std::unique_ptr<Tokenizer> open_sentencepiece_tokenizer(const std::string& model_path);

}  // namespace dsrun
