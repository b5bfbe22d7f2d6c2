// SentencePiece tokenizer.model files (Llama-2 style) through Debian's libsentencepiece: the
// library itself encodes, so ids are SentencePiece's own.
#include "engine/common/error.hpp"
#include "engine/tokenizer/tokenizer.hpp"

#include <sentencepiece_processor.h>

namespace dsrun {
namespace {

// Every sentencepiece::util::Status goes through here: the file it concerns and the library's words.
#define DSRUN_SENTENCEPIECE_CHECK(call, about)                                                    \
  do {                                                                                           \
    const auto sp_status_ = (call);                                                              \
    if (!sp_status_.ok()) {                                                                      \
      ::dsrun::ErrorContext c_;                                                                  \
      c_.file = (about);                                                                         \
      c_.hint = "is it a SentencePiece model (tokenizer.model)?";                              \
      throw ::dsrun::Error(std::string("SentencePiece: ") + sp_status_.ToString(), c_)          \
          .with_origin(::dsrun::source_origin(__FILE__, __LINE__));                              \
    }                                                                                            \
  } while (0)

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    DSRUN_SENTENCEPIECE_CHECK(processor_.Load(path), path);
  }
  void encode(std::string_view text, bool add_special, std::vector<uint32_t>& ids) const override {
    std::vector<int> pieces;
    DSRUN_SENTENCEPIECE_CHECK(processor_.Encode(text, &pieces), path_);
    if (add_special && processor_.bos_id() >= 0) ids.push_back(static_cast<uint32_t>(processor_.bos_id()));
    for (int id : pieces) ids.push_back(static_cast<uint32_t>(id));
  }
  std::string decode(const std::vector<uint32_t>& ids, bool skip_special) const override {
    std::vector<int> pieces;
    for (uint32_t id : ids) {
      if (id >= static_cast<uint32_t>(processor_.GetPieceSize())) {
        ErrorContext c;
        c.file = path_;
        c.hint = "ids run from 0 to " + std::to_string(processor_.GetPieceSize() - 1);
        throw Error("id " + std::to_string(id) + " is not in the vocabulary", c);
      }
      if (skip_special && processor_.IsControl(static_cast<int>(id))) continue;
      pieces.push_back(static_cast<int>(id));
    }
    std::string text;
    DSRUN_SENTENCEPIECE_CHECK(processor_.Decode(pieces, &text), path_);
    return text;
  }
  int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::optional<uint32_t> bos() const override { return id_or_none(processor_.bos_id()); }
  std::optional<uint32_t> eos() const override { return id_or_none(processor_.eos_id()); }
  std::string describe() const override { return path_ + " (SentencePiece, " + std::to_string(vocab_size()) + " ids)"; }
  // As encode: BOS before, nothing after. No safe cuts: SentencePiece's normalizer adds a dummy
  // prefix to each text and folds whitespace at its ends, which a cut would change.
  void document_marks(std::vector<uint32_t>& before, std::vector<uint32_t>& after) const override {
    before.clear();
    after.clear();
    if (processor_.bos_id() >= 0) before.push_back(static_cast<uint32_t>(processor_.bos_id()));
  }

 private:
  static std::optional<uint32_t> id_or_none(int id) { return id >= 0 ? std::optional<uint32_t>(static_cast<uint32_t>(id)) : std::nullopt; }
  std::string path_;
  sentencepiece::SentencePieceProcessor processor_;
};

}  // namespace

std::unique_ptr<Tokenizer> open_sentencepiece_tokenizer(const std::string& model_path) {
  return std::make_unique<SentencePieceTokenizer>(model_path);
}

}  // namespace dsrun
