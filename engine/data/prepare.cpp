// `dsrun prepare` (see prepare.hpp). The input is cut into chunks (byte ranges at line ends, or
// whole files) before any tokenizing, so shard k is a pure function of chunk k and the tokenizer:
// that is what lets a killed prepare keep the shards it finished. A chunk's text is read as a
// stream and cut into units of about a megabyte (runs of whole lines, or pieces of one long
// document at the tokenizer's safe cuts, which give the ids of the whole), tokenized on every
// thread and appended to the shard in order, so memory is bounded by the units in flight and a
// document of gigabytes uses every core. Each shard is three files written atomically in order
// (.tokens, .docs, then .json, the mark of a finished shard); the manifest is written last, so a
// directory without one is never taken as a finished corpus. One prepare at a time writes to a
// directory (flock on its lock file); an input file that changes while it is read is an error,
// not a corpus of old and new text.
#include "engine/data/prepare.hpp"
#include "engine/data/prepare/output_lock.hpp"
#include "engine/data/prepare/pipeline.hpp"

namespace dsrun {
namespace prepare_detail {

PrepareSummary prepare(const PrepareOptions& o, const PrepareProgress& progress) {
  if (o.inputs.empty()) throw input_error("", 0, "no inputs", "name text, .jsonl, .gz or .zst files or directories");
  // An empty -o would put the lock, shards and manifest into the current directory.
  if (o.out.find_first_not_of(" \t") == std::string::npos) throw input_error(o.out, 0, o.out.empty() ? "no output directory (-o is empty)" : "no output directory (-o is only blanks: \"" + o.out + "\")",
                      "name a directory for the shards: -o corpus/");
  OutputDirectory output;
  struct stat out_st {};
  if (::stat(o.out.c_str(), &out_st) == 0 && S_ISDIR(out_st.st_mode)) output = {true, out_st.st_dev, out_st.st_ino};
  std::vector<std::string> paths, skipped_directories;
  for (const std::string& in : o.inputs) collect(in, paths, output, true, skipped_directories);
  {  // A file named twice (or inside two named directories) is read once.
    std::set<std::pair<dev_t, ino_t>> seen;
    std::vector<std::string> once;
    for (const std::string& p : paths) {
      struct stat st {};
      if (::stat(p.c_str(), &st) == 0 && !seen.insert({st.st_dev, st.st_ino}).second) {
        skipped_directories.push_back(p + ": named more than once, read once");
        continue;
      }
      once.push_back(p);
    }
    paths = std::move(once);
  }
  if (paths.empty()) throw input_error(o.inputs.front(), 0, "no input files", "name text, .jsonl, .gz or .zst files or directories");
  std::vector<InputFile> files;
  int64_t total_bytes = 0;
  for (const std::string& p : paths) {
    files.push_back(describe_input(p));
    total_bytes += files.back().size;
  }
  const std::vector<PlannedChunk> planned = make_chunks(files, o);
  make_directories(o.out);
  const OutputLock lock(o.out);  // a second prepare into this directory is refused until this one ends
  const std::string manifest_path = path_join(o.out, "manifest.json");
  if (file_exists(manifest_path)) ::unlink(manifest_path.c_str());  // re-preparing: not finished until written again

  Preparer preparer(o, std::move(files));
  const int threads = std::max(1, o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency()));
  Pipeline pipeline(o, preparer, threads, total_bytes, progress);
  const std::vector<ShardResult> results = pipeline.run(planned);
  const size_t n = results.size();
  if (progress) progress(static_cast<int>(n), static_cast<int>(n), total_bytes, total_bytes);

  PrepareSummary s;
  s.shards = static_cast<int>(n);
  s.token_bytes = preparer.token_bytes_;
  s.threads = threads;
  s.skipped_directories = std::move(skipped_directories);
  s.stale_files_removed = remove_stale_files(o.out, n);
  json shards = json::array();
  for (const ShardResult& r : results) {
    s.documents += r.documents;
    s.tokens += r.tokens;
    s.input_bytes += r.bytes;
    s.skipped_lines += r.skipped;
    s.blank_lines += r.blank;
    s.shards_reused += r.reused ? 1 : 0;
    s.cut_documents += r.cut_documents;
    s.cut_pieces += r.cut_pieces;
    for (const auto& e : r.skipped_examples) if (s.skipped_examples.size() < 5) s.skipped_examples.push_back(e);
    json entry = r.record;
    entry.erase("identity");
    entry.erase("skipped_examples");  // in the shard records only, for a prepare that keeps the shard
    shards.push_back(entry);
  }
  const json manifest = {{"format", "dsrun-tokens"},
                         {"version", 1},
                         {"tokenizer", {{"file", preparer.tokenizer_path_}, {"checksum", preparer.tokenizer_hash_},
                                        {"vocab_size", preparer.tokenizer_->vocab_size()}, {"describe", preparer.tokenizer_->describe()}}},
                         {"end_of_document", preparer.end_of_document()},
                         {"token_bytes", s.token_bytes},
                         {"documents", s.documents},
                         {"tokens", s.tokens},
                         {"input_bytes", s.input_bytes},
                         {"skipped_lines", s.skipped_lines},
                         {"blank_lines", s.blank_lines},
                         {"shards", shards}};
  write_file_atomic(manifest_path, manifest.dump(1, ' ', false, json::error_handler_t::replace) + "\n");  // (file names need not be UTF-8)
  return s;
}

}  // namespace prepare_detail

PrepareSummary prepare_corpus(const PrepareOptions& o, const PrepareProgress& progress) {
  try {
    return prepare_detail::prepare(o, progress);
  } catch (const std::bad_alloc&) {  // where no nearer handler named the file (loading the tokenizer, listing inputs)
    throw prepare_detail::input_error(o.out, 0, "out of memory while preparing this corpus", "prepare with fewer --threads, or on a machine with more memory");
  }
}

}  // namespace dsrun
