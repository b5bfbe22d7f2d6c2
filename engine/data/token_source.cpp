// Token corpora read in place (see token_source.hpp). A file is mapped once; a window's tokens are
// read from the map and widened to int64 when the window is asked for. Layouts: docs/data.md.
#include "engine/data/token_source.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/mapped_file.hpp"
#include "engine/common/text.hpp"
#include "engine/data/prepare_directory.hpp"
#include "engine/recipe/recipe.hpp"

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

namespace dsrun {

Error data_error(const std::string& path, const std::string& what, const std::string& hint) {
  ErrorContext c;
  c.file = path;
  c.key = "data.path";
  c.hint = hint;
  return Error(what, c);
}

namespace {

void put32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void put64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
template <class T>
T get(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// How a file says where its documents end.
enum class Documents {
  Unknown,          // one document per file
  EndOffsets,       // dsrun's .docs: u64 end offsets
  MegatronIndex,    // sequences grouped into documents by the .idx
  SeparatorBefore,  // llm.c: a separator token opens each document
  SeparatorAfter,   // nanoGPT (and loose shards with data.document_token): it closes each one
};

// One file's tokens in its map, and its documents.
class TokenFile {
 public:
  std::string path, format;
  std::unique_ptr<MappedFile> tokens_map, index_map;
  size_t offset = 0;  // bytes before the first token
  int width = 2;
  bool is_signed = false;
  int64_t count = 0;
  Documents documents = Documents::Unknown;
  int64_t separator = -1;
  // EndOffsets: u64[doc_count] at ends. MegatronIndex: pointers i64[seqs], lengths i32[seqs],
  // document indices i64[doc_count + 1] into the sequences.
  const unsigned char *ends = nullptr, *lengths = nullptr, *pointers = nullptr, *doc_index = nullptr;
  int64_t doc_count = 0, seqs = 0;

  int64_t token(int64_t i, int64_t vocab) const {
    const unsigned char* p = tokens_map->data() + offset + static_cast<size_t>(i) * static_cast<size_t>(width);
    int64_t t = 0;
    switch (width) {
      case 1: t = *p; break;
      case 2: t = is_signed ? int64_t(get<int16_t>(p)) : int64_t(get<uint16_t>(p)); break;
      case 4: t = is_signed ? int64_t(get<int32_t>(p)) : int64_t(get<uint32_t>(p)); break;
      default: t = get<int64_t>(p); break;
    }
    if (t < 0 || t >= vocab) {
      throw data_error(path, "token " + std::to_string(t) + " at position " + std::to_string(i) + " is outside the vocabulary (model.vocab = " + std::to_string(vocab) + ")",
                       "set model.vocab above the largest token id, or check data.format and data.token_width");
    }
    return t;
  }

  // End of document d (EndOffsets, MegatronIndex), in tokens.
  int64_t document_end(int64_t d) const {
    if (documents == Documents::EndOffsets) return static_cast<int64_t>(get<uint64_t>(ends + 8 * d));
    const int64_t last_sequence = get<int64_t>(doc_index + 8 * (d + 1)) - 1;
    if (last_sequence < 0) return 0;
    return get<int64_t>(pointers + 8 * last_sequence) / width + get<int32_t>(lengths + 4 * last_sequence);
  }
  bool indexed() const { return documents == Documents::EndOffsets || documents == Documents::MegatronIndex; }

  // Appends document starts s with first < s < first + n, as s - first + base.
  void starts_in(int64_t first, int64_t n, const int64_t* window, int32_t base, std::vector<int32_t>& out) const {
    if (indexed()) {
      int64_t lo = 0, hi = doc_count;  // first document ending after `first`
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (document_end(mid) <= first) lo = mid + 1;
        else hi = mid;
      }
      for (int64_t d = lo; d < doc_count; ++d) {
        const int64_t e = document_end(d);
        if (e >= first + n) break;
        if (e > first) out.push_back(static_cast<int32_t>(e - first + base));
      }
    } else if (separator >= 0) {
      for (int64_t k = 0; k < n; ++k) {
        if (window[k] != separator) continue;
        const int64_t s = documents == Documents::SeparatorBefore ? k : k + 1;
        if (s > 0 && s < n) out.push_back(static_cast<int32_t>(s + base));
      }
    }
  }

  bool knows_documents() const { return indexed() || separator >= 0; }

  // The last document boundary at or before t; -1 when documents are unknown or none is near.
  int64_t boundary_before(int64_t t) const {
    if (indexed()) {
      int64_t lo = 0, hi = doc_count;  // documents ending at or before t: [0, lo)
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (document_end(mid) <= t) lo = mid + 1;
        else hi = mid;
      }
      return lo > 0 ? document_end(lo - 1) : -1;
    }
    if (separator >= 0) {
      for (int64_t k = t - 1; k >= std::max<int64_t>(0, t - (int64_t(1) << 22)); --k) {
        if (token(k, INT64_MAX) == separator) return documents == Documents::SeparatorBefore ? k : k + 1;
      }
    }
    return -1;
  }
};

using Files = std::vector<std::unique_ptr<TokenFile>>;

// dsrun's shard header, checked against the file's size.
void check_dsrun_shard(TokenFile& f, int64_t expected_count) {
  const MappedFile& m = *f.tokens_map;
  const unsigned char* p = m.data();
  if (m.size() < kTokenShardHeaderBytes || std::memcmp(p, "DSRUNTOK", 8) != 0)
    throw data_error(f.path, "not a dsrun token shard (no DSRUNTOK header)", "write shards with dsrun prepare, or set data.format");
  const uint32_t version = get<uint32_t>(p + 8), width = get<uint32_t>(p + 12);
  const uint64_t count = get<uint64_t>(p + 16);
  if (version != 1 || (width != 2 && width != 4) || count > (m.size() - kTokenShardHeaderBytes) / width ||
      m.size() != kTokenShardHeaderBytes + count * width || (expected_count >= 0 && int64_t(count) != expected_count)) {
    throw data_error(f.path, "token shard header does not match its size or the manifest (version " + std::to_string(version) + ", " + std::to_string(width) +
                                 " bytes per token, " + std::to_string(count) + " tokens, " + std::to_string(m.size()) + " bytes): truncated, or from another prepare",
                     "run dsrun prepare again; it keeps the shards that are whole");
  }
  f.format = "dsrun";
  f.offset = kTokenShardHeaderBytes;
  f.width = static_cast<int>(width);
  f.count = static_cast<int64_t>(count);
}

void attach_document_index(TokenFile& f, const std::string& docs_path) {
  f.index_map = std::make_unique<MappedFile>(docs_path);
  const MappedFile& m = *f.index_map;
  const uint64_t count = m.size() >= 32 ? get<uint64_t>(m.data() + 16) : 0;
  if (m.size() < 32 || std::memcmp(m.data(), "DSRUNDOC", 8) != 0 || get<uint32_t>(m.data() + 8) != 1 || count > (m.size() - 32) / 8 ||
      m.size() != 32 + count * 8 || (count > 0 && get<uint64_t>(m.data() + 32 + 8 * (count - 1)) > uint64_t(f.count))) {
    throw data_error(docs_path, "not a dsrun document index, truncated, or not this shard's", "run dsrun prepare again");
  }
  // The ends must not decrease (documents are looked up by binary search, and the split is cut at
  // one): one pass over the index, the last checked against the shard above.
  uint64_t previous = 0;
  for (uint64_t d = 0; d < count; ++d) {
    const uint64_t end = get<uint64_t>(m.data() + 32 + 8 * d);
    if (end < previous) {
      throw data_error(docs_path, "document ends decrease at entry " + std::to_string(d) + " of " + std::to_string(count) + " (" + std::to_string(end) +
                                      " after " + std::to_string(previous) + "): a corrupt index",
                       "run dsrun prepare again");
    }
    previous = end;
  }
  f.documents = Documents::EndOffsets;
  f.ends = m.data() + 32;
  f.doc_count = static_cast<int64_t>(count);
}

// Megatron-LM's .idx: "MMIDIDX\0\0", u64 version 1, u8 dtype code, u64 sequences, u64 document
// indices, then i32 lengths[sequences], i64 byte pointers[sequences], i64 document indices.
void open_megatron(TokenFile& f, const std::string& idx_path) {
  f.index_map = std::make_unique<MappedFile>(idx_path);
  const MappedFile& m = *f.index_map;
  const auto bad = [&](const std::string& why) {
    return data_error(idx_path, "not a Megatron-LM index: " + why, "rebuild it with Megatron-LM's tools/preprocess_data.py, or check that it belongs to " + f.path);
  };
  const size_t header = 9 + 8 + 1 + 8 + 8;
  if (m.size() < header || std::memcmp(m.data(), "MMIDIDX\0\0", 9) != 0) throw bad("no MMIDIDX header");
  if (get<uint64_t>(m.data() + 9) != 1) throw bad("version " + std::to_string(get<uint64_t>(m.data() + 9)) + " (dsrun reads version 1)");
  struct Dtype { int code, width; bool is_signed; };
  static const Dtype dtypes[] = {{1, 1, false}, {3, 2, true}, {4, 4, true}, {5, 8, true}, {8, 2, false}};
  const int code = m.data()[17];
  const Dtype* dt = nullptr;
  for (const Dtype& d : dtypes) if (d.code == code) dt = &d;
  if (!dt) throw bad("token dtype code " + std::to_string(code) + " (dsrun reads 1 uint8, 3 int16, 4 int32, 5 int64, 8 uint16)");
  const uint64_t seqs = get<uint64_t>(m.data() + 18), docs = get<uint64_t>(m.data() + 26);
  if (docs < 1 || seqs > (m.size() - header) / 12 || docs > (m.size() - header - 12 * seqs) / 8) throw bad("truncated (" + std::to_string(seqs) + " sequences, " + std::to_string(docs) + " document indices)");
  f.format = "megatron";
  f.width = dt->width;
  f.is_signed = dt->is_signed;
  f.seqs = static_cast<int64_t>(seqs);
  f.lengths = m.data() + header;
  f.pointers = f.lengths + 4 * seqs;
  f.doc_index = f.pointers + 8 * seqs;
  f.doc_count = static_cast<int64_t>(docs) - 1;
  f.documents = Documents::MegatronIndex;
  if (get<int64_t>(f.doc_index) != 0 || get<int64_t>(f.doc_index + 8 * f.doc_count) != f.seqs) throw bad("document indices do not span the sequences");
  for (int64_t d = 0; d < f.doc_count; ++d)
    if (get<int64_t>(f.doc_index + 8 * (d + 1)) < get<int64_t>(f.doc_index + 8 * d)) throw bad("document indices are not ascending at document " + std::to_string(d));
  const int64_t bin_bytes = static_cast<int64_t>(f.tokens_map->size());
  if (f.seqs > 0) {  // the last sequence past the end: the .bin is cut off
    const int64_t pointer = get<int64_t>(f.pointers + 8 * (f.seqs - 1)), length = get<int32_t>(f.lengths + 4 * (f.seqs - 1));
    if (pointer >= 0 && length >= 0 && (pointer > bin_bytes || pointer + length * f.width > bin_bytes)) {
      throw data_error(f.path, "shorter than its index says (" + std::to_string(bin_bytes) + " bytes, the index needs " +
                                   (pointer > bin_bytes ? "more than " + std::to_string(pointer) : std::to_string(pointer + length * f.width)) + ")",
                       "the .bin is truncated: copy it again or rebuild it");
    }
  }
  // Every sequence in order, inside the .bin, at a token boundary: one pass over the index (not
  // the tokens). Reversed or stray pointers would move document ends, and with them the split.
  int64_t end = 0;
  for (int64_t i = 0; i < f.seqs; ++i) {
    const int64_t pointer = get<int64_t>(f.pointers + 8 * i), length = get<int32_t>(f.lengths + 4 * i);
    const std::string entry = "sequence " + std::to_string(i) + " of " + std::to_string(f.seqs) + " (byte pointer " + std::to_string(pointer) +
                              ", " + std::to_string(length) + " tokens)";
    if (length < 0) throw bad(entry + " has a negative length");
    if (pointer < 0 || pointer > bin_bytes || pointer + length * f.width > bin_bytes)
      throw bad(entry + " points past the end of " + f.path + " (" + std::to_string(bin_bytes) + " bytes)");
    if (pointer % f.width != 0) throw bad(entry + " does not start at a " + std::to_string(f.width) + "-byte token");
    if (pointer < end) throw bad(entry + " starts before the end of sequence " + std::to_string(i - 1) + " (byte " + std::to_string(end) + "): pointers must ascend");
    end = pointer + length * f.width;
  }
  f.count = end / f.width;
}

// Opens one token file, recognising its format by header. `explicit_format`: data.format.
std::unique_ptr<TokenFile> open_token_file(const std::string& path, const TokenCorpusOptions& o) {
  auto f = std::make_unique<TokenFile>();
  std::string bin = path, idx;
  if (ends_with(path, ".idx")) bin = path.substr(0, path.size() - 4) + ".bin";
  if (ends_with(bin, ".bin") && file_exists(bin.substr(0, bin.size() - 4) + ".idx")) idx = bin.substr(0, bin.size() - 4) + ".idx";
  f->path = bin;
  f->tokens_map = std::make_unique<MappedFile>(regular_file_target(bin, "data.path"));
  const MappedFile& m = *f->tokens_map;
  const bool dsrun = m.size() >= 8 && std::memcmp(m.data(), "DSRUNTOK", 8) == 0;
  const int32_t magic = m.size() >= 1024 ? get<int32_t>(m.data()) : 0;
  const bool llmc = magic == 20240520 || magic == 20240801;
  TokenFormat found = dsrun ? TokenFormat::Dsrun : !idx.empty() ? TokenFormat::Megatron : llmc ? TokenFormat::Llmc : TokenFormat::Auto;
  if (found == TokenFormat::Auto && o.format == TokenFormat::Nanogpt) found = TokenFormat::Nanogpt;
  // "nanogpt" names what headerless files are; a file with a header is what its header says, so
  // one blend can mix nanoGPT files with the others.
  if (o.format != TokenFormat::Auto && o.format != TokenFormat::Nanogpt && found != o.format) {
    throw data_error(bin, std::string("data.format = \"") + to_string(o.format) + "\" but the file " +
                              (found == TokenFormat::Auto ? "has no header dsrun knows" : std::string("is ") + to_string(found)),
                     "set data.format = \"auto\" or to what the file is");
  }
  switch (found) {
    case TokenFormat::Dsrun: {
      check_dsrun_shard(*f, -1);
      const std::string docs = ends_with(bin, ".tokens") ? bin.substr(0, bin.size() - 7) + ".docs" : "";
      if (!docs.empty() && file_exists(docs)) attach_document_index(*f, docs);
      else if (o.document_token >= 0) f->documents = Documents::SeparatorAfter;
      break;
    }
    case TokenFormat::Megatron: open_megatron(*f, idx); break;
    case TokenFormat::Llmc: {
      // llm.c's header: int32[256] = {magic, version, token count, 0...}; GPT-2 files hold uint16
      // tokens with <|endoftext|> (50256) opening each document, LLaMA-3 files uint32 with
      // <|begin_of_text|> (128000).
      const bool gpt2 = magic == 20240520;
      const int32_t version = get<int32_t>(m.data() + 4), count = get<int32_t>(m.data() + 8);
      f->format = "llmc";
      f->width = gpt2 ? 2 : 4;
      f->offset = 1024;
      if ((gpt2 && version != 1) || (!gpt2 && version != 7) || count < 0 || m.size() != 1024 + size_t(count) * size_t(f->width)) {
        throw data_error(bin, "llm.c header (magic " + std::to_string(magic) + ", version " + std::to_string(version) + ", " + std::to_string(count) +
                                  " tokens) does not match the file's " + std::to_string(m.size()) + " bytes",
                         "the file is truncated or not llm.c's: write it again with llm.c's dev/data scripts");
      }
      f->count = count;
      f->documents = Documents::SeparatorBefore;
      f->separator = o.document_token >= 0 ? o.document_token : gpt2 ? 50256 : 128000;
      break;
    }
    case TokenFormat::Nanogpt: {
      if (o.token_width != 2 && o.token_width != 4)
        throw data_error(bin, "nanoGPT's .bin has no header saying how wide a token is", "set data.token_width = 2 (numpy uint16, as nanoGPT writes) or 4");
      if (m.size() % size_t(o.token_width) != 0)
        throw data_error(bin, std::to_string(m.size()) + " bytes is not a whole number of " + std::to_string(o.token_width) + "-byte tokens", "check data.token_width");
      f->format = "nanogpt";
      f->width = o.token_width;
      f->count = static_cast<int64_t>(m.size()) / o.token_width;
      f->documents = Documents::SeparatorAfter;
      f->separator = o.document_token >= 0 ? o.document_token : 50256;  // GPT-2's <|endoftext|>, as nanoGPT's prepare.py appends
      break;
    }
    default:
      throw data_error(bin, "unknown token format: no DSRUNTOK or llm.c header, and no Megatron-LM .idx beside it",
                       "for nanoGPT's headerless .bin set data.format = \"nanogpt\" and data.token_width; see docs/data.md for the formats dsrun reads");
  }
  if (f->separator < 0 && o.document_token >= 0) f->separator = o.document_token;
  return f;
}

// A file the manifest names, confined to the corpus directory: a plain name, never a path (a
// manifest from elsewhere could name ../x.tokens or /etc/passwd).
std::string corpus_file(const std::string& dir, const std::string& name, const std::string& manifest_path) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos || name.find('\0') != std::string::npos)
    throw data_error(manifest_path, "names the file \"" + name + "\": a corpus's files are plain names inside its directory", "run dsrun prepare again, or fix the manifest");
  const std::string path = path_join(dir, name);
  // ... and its own files: a link could lead anywhere (out of the corpus, to a device).
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    throw data_error(path, "is a symbolic link: a prepared corpus's shards are its own files", "run dsrun prepare again into this directory, or copy the shard here");
  return path;
}

// A `dsrun prepare` directory: the shards its manifest lists, each checked against it.
Files open_prepared(const std::string& dir, const TokenCorpusOptions& o) {
  const std::string manifest_path = path_join(dir, "manifest.json");
  struct Shard {
    std::string tokens_file, docs_file;
    int64_t tokens = -1;
  };
  std::vector<Shard> shards;
  int64_t tokenizer_vocab = 0;
  // Every field read here is checked: a malformed manifest is an error naming the field, never a
  // JSON library's message.
  const auto bad = [&](const std::string& what) { return data_error(manifest_path, what, "run dsrun prepare again"); };
  nlohmann::json m = nlohmann::json::parse(read_file(manifest_path), nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded()) throw bad("unreadable manifest: not JSON");
  if (!m.is_object() || m.value("format", nlohmann::json()) != "dsrun-tokens" || m.value("version", nlohmann::json()) != 1) throw data_error(manifest_path, "not a dsrun prepare manifest", "run dsrun prepare");
  if (m.contains("tokenizer")) {
    const nlohmann::json& t = m.at("tokenizer");
    if (!t.is_object() || (t.contains("vocab_size") && !t.at("vocab_size").is_number_unsigned())) throw bad("tokenizer.vocab_size is not a count");
    tokenizer_vocab = t.value("vocab_size", int64_t(0));
  }
  if (!m.contains("shards") || !m.at("shards").is_array()) throw bad("\"shards\" is not a list");
  for (const auto& shard : m.at("shards")) {
    const std::string which = "shard " + std::to_string(shards.size());
    if (!shard.is_object()) throw bad(which + " is not an object");
    Shard sh;
    if (!shard.contains("tokens_file") || !shard.at("tokens_file").is_string()) throw bad(which + ": tokens_file is not a file name");
    sh.tokens_file = shard.at("tokens_file").get<std::string>();
    if (shard.contains("tokens")) {  // (absent in hand-made manifests: then the shard's header alone counts)
      if (!shard.at("tokens").is_number_unsigned()) throw bad(which + ": tokens = " + shard.at("tokens").dump() + " is not a count of tokens");
      sh.tokens = shard.at("tokens").get<int64_t>();
    }
    if (shard.contains("docs_file")) {
      if (!shard.at("docs_file").is_string()) throw bad(which + ": docs_file is not a file name");
      sh.docs_file = shard.at("docs_file").get<std::string>();
    }
    shards.push_back(std::move(sh));
  }
  if (tokenizer_vocab > o.vocab) {
    ErrorContext c;
    c.file = manifest_path;
    c.key = "model.vocab";
    c.hint = "set model.vocab to at least " + std::to_string(tokenizer_vocab);
    throw Error("the corpus was tokenized with " + std::to_string(tokenizer_vocab) + " ids, more than model.vocab = " + std::to_string(o.vocab), c);
  }
  Files files;
  for (const Shard& shard : shards) {
    auto f = std::make_unique<TokenFile>();
    f->path = corpus_file(dir, shard.tokens_file, manifest_path);
    f->tokens_map = std::make_unique<MappedFile>(f->path);
    check_dsrun_shard(*f, shard.tokens);
    if (!shard.docs_file.empty()) attach_document_index(*f, corpus_file(dir, shard.docs_file, manifest_path));
    files.push_back(std::move(f));
  }
  if (files.empty()) throw data_error(manifest_path, "the manifest lists no shards", "prepare some text first");
  return files;
}

Files open_files(const std::string& path, const TokenCorpusOptions& o) {
  if (is_directory(path)) {
    if (file_exists(path_join(path, "manifest.json"))) return open_prepared(path, o);
    // A prepare's directory without its manifest is not finished (killed, failed, or still
    // writing): its shards may be of an older corpus, or missing. Never read as loose shards.
    if (is_prepare_directory(path)) {
      const int64_t pid = prepare_running_in(path);
      if (pid != 0) {
        throw data_error(path, "dsrun prepare" + (pid > 0 ? " (pid " + std::to_string(pid) + ")" : std::string()) + " is still writing this directory: it has no manifest.json yet",
                         "wait for the prepare to finish");
      }
      throw data_error(path, "holds dsrun prepare's shards but no manifest.json: the prepare that wrote them did not finish (killed, or failed)",
                       "run the same dsrun prepare command again to finish it (it keeps the shards that are whole)");
    }
    Files files;
    for (const std::string& f : data_directory_files(path, "")) {
      if (ends_with(f, ".idx") || ends_with(f, ".docs") || ends_with(f, ".json")) continue;  // read with the file they index
      files.push_back(open_token_file(f, o));
    }
    if (files.empty()) throw data_error(path, "no token files in the directory", "point data.path at the files");
    return files;
  }
  if (!file_exists(path) && file_exists(path + ".bin")) return {};  // a Megatron prefix: below
  if (!file_exists(path)) throw data_error(path, "data path not found", "check data.path (relative to the recipe)");
  Files files;
  files.push_back(open_token_file(path, o));
  return files;
}

// A permutation of 0..n-1 for epoch e computed per index, in O(1) memory: a 4-round Feistel
// network over the next even power of two, walked until it lands below n (under 4 steps on
// average).
class FeistelOrder {
 public:
  FeistelOrder(int64_t n, uint64_t seed, bool shuffle) : n_(n), seed_(seed), shuffle_(shuffle) {
    while ((int64_t(1) << (2 * half_bits_)) < n) ++half_bits_;
  }
  int64_t at(int64_t g) const {
    const int64_t epoch = g / n_, i = g % n_;
    if (!shuffle_) return i;
    uint64_t x = static_cast<uint64_t>(i);
    do x = encrypt(x, static_cast<uint64_t>(epoch));
    while (x >= static_cast<uint64_t>(n_));
    return static_cast<int64_t>(x);
  }

 private:
  uint64_t encrypt(uint64_t x, uint64_t epoch) const {
    const uint64_t mask = (uint64_t(1) << half_bits_) - 1;
    uint64_t left = x >> half_bits_, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t key[4] = {seed_, epoch, round, right};
      const uint64_t f = XXH3_64bits(key, sizeof key) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }
  int64_t n_;
  uint64_t seed_;
  bool shuffle_;
  int half_bits_ = 1;
};

// Stretches of files read as one stream of tokens.
class Stream {
 public:
  struct Part {
    const TokenFile* file;
    int64_t begin, count;
  };
  void add(const TokenFile* f, int64_t begin, int64_t count) {
    if (count <= 0) return;
    parts_.push_back({f, begin, count});
    starts_.push_back(tokens_);
    tokens_ += count;
  }
  int64_t tokens() const { return tokens_; }
  // Tokens [first, first + n), widened; document starts inside (a part's start is one too).
  void read(int64_t first, int64_t n, int64_t vocab, Window& w) const {
    w.tokens.resize(static_cast<size_t>(n));
    w.document_starts.clear();
    size_t p = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), first) - starts_.begin() - 1);
    for (int64_t done = 0; done < n; ++p) {
      const Part& part = parts_[p];
      const int64_t at = first + done - starts_[p], take = std::min(n - done, part.count - at);
      int64_t* out = w.tokens.data() + done;
      for (int64_t k = 0; k < take; ++k) out[k] = part.file->token(part.begin + at + k, vocab);
      if (done > 0) w.document_starts.push_back(static_cast<int32_t>(done));
      part.file->starts_in(part.begin + at, take, out, static_cast<int32_t>(done), w.document_starts);
      done += take;
    }
    std::sort(w.document_starts.begin(), w.document_starts.end());
    w.document_starts.erase(std::unique(w.document_starts.begin(), w.document_starts.end()), w.document_starts.end());
  }

 private:
  std::vector<Part> parts_;
  std::vector<int64_t> starts_;
  int64_t tokens_ = 0;
};

}  // namespace

struct TokenCorpus::Source {
  std::string path;
  Files files;
  Stream train, val;
  int64_t train_windows = 0, val_windows = 0;
  int files_unknown = 0;  // files whose documents are unknown: their validation tail starts at a token
  int files_inside = 0;   // files cut inside a document: none ends at or before the training share's end
  std::string warning;    // the split is far from data.val_fraction: by how much, and where it fell
  std::unique_ptr<FeistelOrder> order;
};

namespace {

std::unique_ptr<TokenCorpus::Source> open_source(const std::string& path, const TokenCorpusOptions& o, double val_fraction) {
  auto s = std::make_unique<TokenCorpus::Source>();
  s->path = path;
  s->files = open_files(path, o);
  if (s->files.empty()) {  // a Megatron prefix
    s->files.push_back(open_token_file(path + ".bin", o));
  }
  struct Cut {
    const TokenFile* file;
    int64_t target, cut;
  };
  std::vector<Cut> cuts;
  for (const auto& f : s->files) {
    // Validation is the tail of each file, cut at a document boundary: adding files changes
    // no other file's split.
    const int64_t target = static_cast<int64_t>(std::floor(static_cast<double>(f->count) * (1 - val_fraction)));
    int64_t cut = f->count;
    if (val_fraction > 0) {
      const int64_t boundary = f->boundary_before(target);
      if (boundary > 0) {
        cut = boundary;
      } else {  // documents unknown, or one document longer than the training share: cut inside it
        cut = target;
        if (target > 0) ++(f->knows_documents() ? s->files_inside : s->files_unknown);
      }
    }
    cuts.push_back({f.get(), target, cut});
    s->train.add(f.get(), 0, cut);
    s->val.add(f.get(), cut, f->count - cut);
  }
  const int64_t seq = o.seq_len;
  s->train_windows = s->train.tokens() > seq ? (s->train.tokens() - 1) / seq : 0;
  s->val_windows = s->val.tokens() > seq ? (s->val.tokens() - 1) / seq : 0;

  // Cutting at the document end before each file's share can hand validation much more than
  // asked (a file of a few long documents): more than 2x off, and by more than a window, is said,
  // with the files that moved most.
  const int64_t total = s->train.tokens() + s->val.tokens(), asked = static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(total)));
  const int64_t got = s->val.tokens();
  if (val_fraction > 0 && val_fraction < 1 && total > 0 && (got > 2 * asked || 2 * got < asked) && std::llabs(got - asked) > seq) {
    char share[160];
    std::snprintf(share, sizeof share, "validation is %.3g%% of the tokens (%lld), not the %.3g%% data.val_fraction asks (%lld)",
                  100.0 * static_cast<double>(got) / static_cast<double>(total), static_cast<long long>(got), 100.0 * val_fraction, static_cast<long long>(asked));
    std::stable_sort(cuts.begin(), cuts.end(), [](const Cut& a, const Cut& b) { return a.target - a.cut > b.target - b.cut; });
    std::string where;
    for (size_t k = 0; k < cuts.size() && k < 3 && cuts[k].cut != cuts[k].target; ++k) {
      where += (where.empty() ? "" : "; ") + cuts[k].file->path + " is cut at token " + std::to_string(cuts[k].cut) + " of " + std::to_string(cuts[k].file->count) +
               ", the last document end at or before its share's end, token " + std::to_string(cuts[k].target);
    }
    s->warning = std::string(share) + (where.empty() ? "" : ": " + where) +
                 " (each file's tail goes to validation in whole documents: give data.val_path, or split long documents)";
  }
  return s;
}

}  // namespace

TokenCorpus::TokenCorpus(const TokenCorpusOptions& o) : options_(o) {
  DSRUN_ASSERT(!o.paths.empty() && o.seq_len > 0, "a corpus needs a path and a sequence length");
  if (const auto problems = mixture_problems(o.paths.size(), o.weights); !problems.empty()) {
    ErrorContext c;
    c.key = problems.front().key;
    c.hint = problems.front().hint;
    throw Error(problems.front().message, c);
  }
  const double val_fraction = o.val_path.empty() ? o.val_fraction : 0;
  for (const std::string& p : o.paths) {
    sources_.push_back(open_source(p, o, val_fraction));
    if (sources_.back()->train_windows < 1) {
      throw data_error(p, "has " + std::to_string(sources_.back()->train.tokens()) + " training tokens: not one sequence of " + std::to_string(o.seq_len + 1),
                       "use more data or a shorter batch.seq_len");
    }
  }
  if (!o.val_path.empty()) val_source_ = open_source(o.val_path, o, 1.0);

  // Each block of kBlock training windows holds every source in proportion to its weight
  // (largest remainder), in Megatron's greedy order: the source furthest behind its share next.
  constexpr int64_t kBlock = 4096;
  const size_t n = sources_.size();
  std::vector<double> w(n, 1.0);
  if (!o.weights.empty()) w = o.weights;
  double total = 0;
  for (double x : w) total += x;
  blend_count_.assign(n, 0);
  std::vector<std::pair<double, size_t>> remainders;
  int64_t assigned = 0;
  for (size_t d = 0; d < n; ++d) {
    const double exact = kBlock * w[d] / total;
    blend_count_[d] = std::max<int64_t>(w[d] > 0 ? 1 : 0, static_cast<int64_t>(exact));
    assigned += blend_count_[d];
    remainders.push_back({exact - std::floor(exact), d});
  }
  std::sort(remainders.begin(), remainders.end(), [](auto& a, auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  for (size_t k = 0; assigned < kBlock; k = (k + 1) % n, ++assigned) ++blend_count_[remainders[k].second];
  for (size_t k = 0; assigned > kBlock; k = (k + 1) % n) {
    auto& c = blend_count_[remainders[n - 1 - k].second];
    if (c > 1) --c, --assigned;
  }
  std::vector<int64_t> used(n, 0);
  for (int64_t i = 0; i < kBlock; ++i) {
    size_t best = n;
    double best_gap = -1e300;
    for (size_t d = 0; d < n; ++d) {
      if (used[d] >= blend_count_[d]) continue;
      const double gap = static_cast<double>(blend_count_[d]) * static_cast<double>(i + 1) / kBlock - static_cast<double>(used[d]);
      if (gap > best_gap) best_gap = gap, best = d;
    }
    blend_.push_back(static_cast<uint16_t>(best));
    blend_rank_.push_back(used[best]++);
  }
  for (size_t d = 0; d < n; ++d) sources_[d]->order = std::make_unique<FeistelOrder>(sources_[d]->train_windows, o.seed + 7919 * d, o.shuffle);
}

TokenCorpus::~TokenCorpus() = default;

void TokenCorpus::train_window(int64_t g, Window& out) const {
  const int64_t block = static_cast<int64_t>(blend_.size());
  const size_t p = static_cast<size_t>(g % block);
  const Source& s = *sources_[blend_[p]];
  const int64_t k = (g / block) * blend_count_[blend_[p]] + blend_rank_[p];
  s.train.read(s.order->at(k) * options_.seq_len, options_.seq_len + 1, options_.vocab, out);
}

int64_t TokenCorpus::val_windows() const {
  if (val_source_) return val_source_->val_windows;
  int64_t n = 0;
  for (const auto& s : sources_) n += s->val_windows;
  return n;
}

void TokenCorpus::val_window(int64_t i, Window& out) const {
  const int64_t n = val_windows();
  if (n == 0) {
    ErrorContext c;
    c.key = "data.val_fraction";
    c.hint = "raise data.val_fraction, use more data, give data.val_path, or set eval.every = 0";
    throw Error("the validation split is shorter than one sequence of " + std::to_string(options_.seq_len + 1) + " tokens", c);
  }
  i %= n;
  if (val_source_) return val_source_->val.read(i * options_.seq_len, options_.seq_len + 1, options_.vocab, out);
  for (const auto& s : sources_) {  // each source's windows in turn
    if (i < s->val_windows) return s->val.read(i * options_.seq_len, options_.seq_len + 1, options_.vocab, out);
    i -= s->val_windows;
  }
}

std::vector<std::string> TokenCorpus::warnings() const {
  std::vector<std::string> out;
  for (const auto& s : sources_)
    if (!s->warning.empty()) out.push_back(s->path + ": " + s->warning);
  return out;
}

int64_t TokenCorpus::train_windows() const {
  int64_t n = 0;
  for (const auto& s : sources_) n += s->train_windows;
  return n;
}

std::string TokenCorpus::describe() const {
  std::string out;
  for (size_t d = 0; d < sources_.size(); ++d) {
    const Source& s = *sources_[d];
    if (!out.empty()) out += "; ";
    out += s.path + " (" + s.files.front()->format + ", " + std::to_string(s.files.size()) + (s.files.size() == 1 ? " file" : " files") + " mapped): " +
           std::to_string(s.train.tokens()) + " training tokens (" + std::to_string(s.train_windows) + " sequences), " + std::to_string(s.val.tokens()) +
           " validation tokens";
    if (s.val.tokens() > 0) {
      const size_t n = s.files.size();
      const auto of = [n](int k) { return n == 1 ? std::string() : " in " + std::to_string(k) + " of " + std::to_string(n) + " files"; };
      if (s.files_unknown == 0 && s.files_inside == 0) out += " (whole documents at each file's end)";
      else if (s.files_inside == 0) out += " (each file's end; documents unknown" + of(s.files_unknown) + ")";
      else {
        out += " (each file's end; cut inside a document" + of(s.files_inside) + ", where no document ends before the cut";
        if (s.files_unknown > 0) out += "; documents unknown" + of(s.files_unknown);
        out += ")";
      }
    }
    if (!s.warning.empty()) out += "; warning: " + s.warning;
    if (sources_.size() > 1) out += ", weight " + std::to_string(blend_count_[d]) + "/" + std::to_string(blend_.size());
  }
  if (val_source_) out += "; validation: " + val_source_->path + " (" + std::to_string(val_source_->val.tokens()) + " tokens)";
  return out;
}

TokenCorpusOptions token_corpus_options(const DataOptions& data, int64_t vocab, int64_t seq_len, uint64_t seed) {
  TokenCorpusOptions o;
  o.paths = data.blend.empty() ? std::vector<std::string>{data.path} : data.blend;
  o.weights = data.blend_weights;
  o.val_path = data.val_path;
  o.format = data.format;
  o.token_width = data.token_width;
  o.document_token = data.document_token;
  o.val_fraction = data.val_fraction;
  o.vocab = vocab;
  o.seq_len = seq_len;
  o.seed = seed;
  o.shuffle = data.shuffle;
  return o;
}

std::vector<std::string> TokenCorpus::files() const {
  std::vector<std::string> out;
  const auto add = [&](const Source& s) {
    for (const auto& f : s.files) {
      out.push_back(f->tokens_map->path());
      if (f->index_map) out.push_back(f->index_map->path());
    }
  };
  for (const auto& s : sources_) add(*s);
  if (val_source_) add(*val_source_);
  return out;
}

std::string token_shard_bytes(const std::vector<uint32_t>& tokens, int bytes_per_token) {
  DSRUN_ASSERT(bytes_per_token == 2 || bytes_per_token == 4, "2 or 4 bytes per token");
  std::string out("DSRUNTOK", 8);
  put32(out, 1);
  put32(out, static_cast<uint32_t>(bytes_per_token));
  put64(out, tokens.size());
  put64(out, 0);
  out.reserve(out.size() + tokens.size() * static_cast<size_t>(bytes_per_token));
  for (uint32_t t : tokens) out.append(reinterpret_cast<const char*>(&t), static_cast<size_t>(bytes_per_token));
  return out;
}

std::string document_index_bytes(const std::vector<uint64_t>& ends) {
  std::string out("DSRUNDOC", 8);
  put32(out, 1);
  put32(out, 0);
  put64(out, ends.size());
  put64(out, 0);
  for (uint64_t e : ends) put64(out, e);
  return out;
}

}  // namespace dsrun
