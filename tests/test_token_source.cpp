// Token corpora read in place: Megatron-LM, llm.c and nanoGPT files written by an independent
// writer (tests/formats/write_token_formats.cjs, in Node) read back token for token with their
// document boundaries; bad files refused naming the file; mixtures, shuffling and validation.
// Then `dsrun prepare`: compressed input, one writer per directory, unfinished and stale
// directories, output inside the input, inputs changing under it, bad lines, bad indexes.
#include "engine/common/mapped_file.hpp"
#include "engine/data/data_identity.hpp"
#include "engine/data/token_source.hpp"
#include "engine/data/prepare.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <csignal>
#include <atomic>
#include <chrono>
#include <future>
#include <random>
#include <set>
#include <thread>

using dsrun::TokenCorpus;
using dsrun::TokenCorpusOptions;
using dsrun::TokenFormat;
using dsrun::Window;
using dsrun::test::TempDir;
using dsrun::test::contains;
using json = nlohmann::json;

namespace {

// Documents of 1-40 ids below 50000, written in every format by the Node writer.
json write_formats(const TempDir& dir, int documents) {
  std::mt19937 rng(7);
  json docs = json::array();
  for (int d = 0; d < documents; ++d) {
    json ids = json::array();
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) ids.push_back(static_cast<int>(rng() % 50000));
    docs.push_back(ids);
  }
  dir.write("in.json", json{{"documents", docs}, {"eos", 50256}}.dump());
  const std::string cmd = "node '" DSRUN_SOURCE_DIR "/tests/formats/write_token_formats.cjs' '" + dir.file("in.json") + "' '" + dir.path() + "' > /dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0);
  return json::parse(dsrun::read_file(dir.file("expected.json")));
}

TokenCorpusOptions options(const std::string& path, int64_t seq) {
  TokenCorpusOptions o;
  o.paths = {path};
  o.vocab = 50257;
  o.seq_len = seq;
  o.val_fraction = 0;
  o.shuffle = false;
  return o;
}

// Window w of an unshuffled corpus is stream[w·seq, w·seq + seq]; its document starts are the
// boundaries strictly inside it.
void check_windows(const TokenCorpus& corpus, const std::vector<int64_t>& stream, const std::set<int64_t>& boundaries, int64_t seq) {
  REQUIRE(corpus.train_windows() == (static_cast<int64_t>(stream.size()) - 1) / seq);
  Window w;
  for (int64_t i = 0; i < corpus.train_windows(); ++i) {
    corpus.train_window(i, w);
    std::vector<int64_t> want(stream.begin() + i * seq, stream.begin() + i * seq + seq + 1);
    REQUIRE(w.tokens == want);
    std::vector<int32_t> starts;
    for (int64_t b : boundaries)
      if (b > i * seq && b < i * seq + seq + 1) starts.push_back(static_cast<int32_t>(b - i * seq));
    REQUIRE(w.document_starts == starts);
  }
}

}  // namespace

// The Node writer needs node, which every machine of the project has but the GPU machines.
static bool have_node() { return std::system("command -v node > /dev/null 2>&1") == 0; }

TEST_CASE("Megatron-LM, llm.c and nanoGPT files are read in place, token for token, with their documents", "[data][formats]") {
  if (!have_node()) {
    WARN("node not found: the independent writer cannot run here");
    return;
  }
  TempDir dir;
  const json expected = write_formats(dir, 60);
  const auto after = expected["stream_eos_after"].get<std::vector<int64_t>>(), before = expected["stream_eos_before"].get<std::vector<int64_t>>();
  std::set<int64_t> ends;
  for (int64_t e : expected["document_ends_after"].get<std::vector<int64_t>>()) ends.insert(e);
  std::set<int64_t> opens;  // llm.c: the separator opens each document
  for (size_t k = 0; k < before.size(); ++k)
    if (before[k] == 50256) opens.insert(static_cast<int64_t>(k));
  const int64_t seq = 16;
  for (const char* megatron : {"megatron_u16", "megatron_i32"}) {
    INFO(megatron);
    check_windows(TokenCorpus(options(dir.file(megatron) + ".bin", seq)), after, ends, seq);
    check_windows(TokenCorpus(options(dir.file(megatron), seq)), after, ends, seq);  // the prefix, as Megatron names it
  }
  for (const char* llmc : {"llmc_gpt2.bin", "llmc_llama3.bin"}) {
    INFO(llmc);
    TokenCorpusOptions o = options(dir.file(llmc), seq);
    o.document_token = 50256;  // the LLaMA-3 default is <|begin_of_text|>; this corpus uses GPT-2's
    check_windows(TokenCorpus(o), before, opens, seq);
  }
  for (int width : {2, 4}) {
    TokenCorpusOptions o = options(dir.file(width == 2 ? "nanogpt_u16.bin" : "nanogpt_u32.bin"), seq);
    o.format = TokenFormat::Nanogpt;
    o.token_width = width;
    check_windows(TokenCorpus(o), after, ends, seq);
  }
}

TEST_CASE("bad token files are refused naming the file and what to change", "[data][formats]") {
  if (!have_node()) {
    WARN("node not found: the independent writer cannot run here");
    return;
  }
  TempDir dir;
  write_formats(dir, 30);
  const auto refused = [&](TokenCorpusOptions o, const std::string& what) {
    INFO(what);
    try {
      TokenCorpus corpus(o);
      Window w;
      for (int64_t i = 0; i < corpus.train_windows(); ++i) corpus.train_window(i, w);
      FAIL("accepted");
    } catch (const dsrun::Error& e) {
      CHECK_THAT(e.what(), Catch::Contains(what));
      CHECK(!e.context().file.empty());
      CHECK(!e.context().hint.empty());
    }
  };
  dir.write("noise.bin", std::string(4000, '\x07'));
  refused(options(dir.file("noise.bin"), 8), "unknown token format");
  TokenCorpusOptions nano = options(dir.file("noise.bin"), 8);
  nano.format = TokenFormat::Nanogpt;
  refused(nano, "no header saying how wide");
  nano.token_width = 2;
  nano.vocab = 1000;
  refused(nano, "outside the vocabulary");  // 0x0707 = 1799
  TokenCorpusOptions wrong = options(dir.file("llmc_gpt2.bin"), 8);
  wrong.format = TokenFormat::Megatron;
  refused(wrong, "data.format = \"megatron\" but the file is llmc");
  // Truncations: llm.c's header count, Megatron's .bin against its index, the index itself.
  const std::string llmc = dsrun::read_file(dir.file("llmc_gpt2.bin"));
  dir.write("short_llmc.bin", llmc.substr(0, llmc.size() - 2));
  refused(options(dir.file("short_llmc.bin"), 8), "does not match the file");
  const std::string bin = dsrun::read_file(dir.file("megatron_u16.bin")), idx = dsrun::read_file(dir.file("megatron_u16.idx"));
  dir.write("short.bin", bin.substr(0, bin.size() - 2));
  dir.write("short.idx", idx);
  refused(options(dir.file("short.bin"), 8), "shorter than its index says");
  dir.write("cut.bin", bin);
  dir.write("cut.idx", idx.substr(0, 40));
  refused(options(dir.file("cut.bin"), 8), "not a Megatron-LM index");
  dir.write("magic.bin", bin);
  dir.write("magic.idx", "XXIDIDX" + idx.substr(7));
  refused(options(dir.file("magic.bin"), 8), "no MMIDIDX header");
  dir.write("shard.tokens", dsrun::token_shard_bytes({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 2).substr(0, 40));
  refused(options(dir.file("shard.tokens"), 4), "does not match its size");
}

TEST_CASE("shuffled epochs visit every window once, mixtures follow their weights, validation is each file's tail in whole documents", "[data][formats]") {
  TempDir dir;
  // Headerless u32 streams whose tokens are their own positions, so a window names itself.
  const auto stream = [&](const std::string& name, int64_t n, int64_t offset, int64_t separator_every) {
    std::string bytes;
    for (int64_t k = 0; k < n; ++k) {
      const uint32_t t = (separator_every > 0 && k % separator_every == separator_every - 1) ? 0 : static_cast<uint32_t>(offset + k);
      bytes.append(reinterpret_cast<const char*>(&t), 4);
    }
    return dir.write(name, bytes);
  };
  TokenCorpusOptions o = options(stream("a.bin", 8001, 1, 0), 8);
  o.format = TokenFormat::Nanogpt;
  o.token_width = 4;
  o.vocab = 1 << 30;
  o.shuffle = true;
  o.seed = 11;
  {
    TokenCorpus corpus(o);
    std::set<int64_t> seen;
    Window w;
    for (int64_t g = 0; g < corpus.train_windows(); ++g) {
      corpus.train_window(g, w);
      seen.insert(w.tokens[0]);
    }
    CHECK(static_cast<int64_t>(seen.size()) == corpus.train_windows());  // a permutation
    corpus.train_window(5, w);
    const int64_t fifth = w.tokens[0];
    corpus.train_window(5 + corpus.train_windows(), w);
    CHECK(w.tokens[0] != fifth);  // the next epoch is another order (1 in 1000 to fail by chance)
    TokenCorpus again(o);
    again.train_window(5, w);
    CHECK(w.tokens[0] == fifth);  // the same seed, the same window: what exact resume needs
  }
  // Mixture 3:1 of two sources (tokens below and above 10^6): exactly 3/4 of every block of windows.
  o.paths = {dir.file("a.bin"), stream("b.bin", 4001, 1000000, 0)};
  o.weights = {3, 1};
  {
    TokenCorpus corpus(o);
    Window w;
    int64_t from_a = 0;
    for (int64_t g = 0; g < 8192; ++g) {
      corpus.train_window(g, w);
      from_a += w.tokens[0] < 1000000;
    }
    CHECK(from_a == 6144);
    CHECK_THAT(corpus.describe(), Catch::Contains("weight 3072/4096"));
  }
  // Validation: the last 10% of each file, cut where a document ends (token 0 closes one every 100).
  o.paths = {stream("docs.bin", 1000, 1, 100)};
  o.weights.clear();
  o.document_token = 0;
  o.val_fraction = 0.1;
  o.shuffle = false;
  {
    TokenCorpus corpus(o);
    Window w;
    corpus.val_window(0, w);
    CHECK(w.tokens[0] == 901);  // document 9 starts at 900; the cut is there, at a document start
    CHECK(corpus.train_windows() == (900 - 1) / 8);
  }
  // A directory: adding a file leaves the split of the others as it was.
  stream("dir/1.bin", 1000, 1, 100);
  o.paths = {dir.file("dir")};
  Window first, later;
  TokenCorpus(o).val_window(0, first);
  stream("dir/2.bin", 500, 5000, 50);
  TokenCorpus(o).val_window(0, later);
  CHECK(first.tokens == later.tokens);
}

// ---- dsrun prepare's output and the checks made when a corpus is mapped ----------------------
// `dsrun prepare` runs in this process (prepare_corpus) or as the built binary where a second
// process matters, on a tokenizer of bytes: id b for byte b, and <eos> (256) closing each
// document, so a document of n bytes is n + 1 tokens.

namespace {

std::string byte_tokenizer(const TempDir& dir, const std::string& name = "tok", const std::string& eos = "<eos>", const json& pre_tokenizer = nullptr) {
  json vocab = json::object();
  char piece[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(piece, sizeof piece, "<0x%02X>", b);
    vocab[piece] = b;
  }
  vocab[eos] = 256;
  const json added = json::array({{{"id", 256}, {"content", eos}, {"single_word", false}, {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}}});
  const json t = {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added}, {"normalizer", nullptr}, {"pre_tokenizer", pre_tokenizer},
                  {"post_processor", nullptr}, {"decoder", nullptr},
                  {"model", {{"type", "BPE"}, {"unk_token", nullptr}, {"byte_fallback", true}, {"ignore_merges", true}, {"vocab", vocab}, {"merges", json::array()}}}};
  dir.write(name + "/tokenizer.json", t.dump());
  dir.write(name + "/tokenizer_config.json", json{{"eos_token", eos}}.dump());
  return dir.file(name);
}

dsrun::PrepareOptions prepare_options(const std::string& tokenizer, const std::string& out, std::vector<std::string> inputs) {
  dsrun::PrepareOptions o;
  o.tokenizer = tokenizer;
  o.out = out;
  o.inputs = std::move(inputs);
  o.threads = 2;
  return o;
}

// Every shard's tokens (headers included), in order.
std::string all_tokens(const std::string& dir) {
  std::string out;
  for (const std::string& f : dsrun::data_directory_files(dir, ".tokens")) out += dsrun::read_file(f);
  return out;
}

// Lines of 64 bytes, cut to `size` bytes, ending in a newline.
std::string lines_of(size_t size) {
  std::string text;
  while (text.size() < size) text += std::string(63, static_cast<char>('a' + text.size() / 64 % 26)) + "\n";
  text.resize(size);
  text.back() = '\n';
  return text;
}

std::string zstd_bytes(const std::string& text) {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1);  // as the zstd tool writes
  std::string out(ZSTD_compressBound(text.size()), '\0');
  const size_t n = ZSTD_compress2(c, out.data(), out.size(), text.data(), text.size());
  ZSTD_freeCCtx(c);
  REQUIRE(!ZSTD_isError(n));
  out.resize(n);
  return out;
}

void write_gzip(const std::string& path, const std::string& text) {
  gzFile gz = gzopen(path.c_str(), "wb");
  REQUIRE(gz != nullptr);
  REQUIRE(gzwrite(gz, text.data(), static_cast<unsigned>(text.size())) == static_cast<int>(text.size()));
  REQUIRE(gzclose(gz) == Z_OK);
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

std::string prepare_error(const dsrun::PrepareOptions& o) {
  return dsrun::test::error_of([&] { dsrun::prepare_corpus(o, nullptr); });
}

}  // namespace

TEST_CASE("prepare reads .zst and .gz files whose text is a multiple of zstd's 128 KiB block", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir);
  for (const size_t size : {size_t(128) << 10, size_t(256) << 10, size_t(1) << 20}) {
    INFO("text of " << size << " bytes");
    const std::string text = lines_of(size), sub = "s" + std::to_string(size) + "/";
    dir.write(sub + "t.txt", text);
    dir.write(sub + "t.txt.zst", zstd_bytes(text));
    write_gzip(dir.file(sub + "t.txt.gz"), text);
    for (const bool lines : {false, true}) {  // one document (read whole), or lines (decompressed as a stream)
      INFO((lines ? "a document per line" : "one document"));
      std::string plain;
      for (const char* ext : {"", ".zst", ".gz"}) {
        INFO("t.txt" << ext);
        dsrun::PrepareOptions o = prepare_options(tok, dir.file(sub + "out" + ext + (lines ? "-lines" : "")), {dir.file(sub + "t.txt" + ext)});
        o.line_documents = lines;
        const dsrun::PrepareSummary s = dsrun::prepare_corpus(o, nullptr);
        CHECK(s.input_bytes == static_cast<int64_t>(size));
        CHECK(s.tokens == static_cast<int64_t>(lines ? size : size + 1));  // each newline becomes an <eos>; one document gets one
        if (plain.empty()) plain = all_tokens(o.out);
        else CHECK(all_tokens(o.out) == plain);
      }
    }
  }
}

TEST_CASE("prepare with --line-documents: blank lines are no documents, and the summary and manifest count them", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir);
  const std::string path = dir.write("in/lines.txt", "first\n\n   \nsecond\n\r\n\t\nthird\n");
  dsrun::PrepareOptions o = prepare_options(tok, dir.file("out"), {path});
  o.line_documents = true;
  const dsrun::PrepareSummary s = dsrun::prepare_corpus(o, nullptr);
  CHECK(s.documents == 3);
  CHECK(s.blank_lines == 4);
  CHECK(s.skipped_lines == 0);
  CHECK(s.tokens == 5 + 6 + 5 + 3);  // bytes of the three lines, an <eos> after each
  CHECK(json::parse(dsrun::read_file(dir.file("out/manifest.json"))).at("blank_lines") == 4);
  // The command says so.
  const auto printed = dsrun::test::run_command(std::string(DSRUN_BINARY) + " prepare --line-documents --tokenizer " + quoted(tok) + " -o " + quoted(dir.file("cli")) + " " + quoted(path));
  CHECK(printed.code == 0);
  CHECK_THAT(printed.text, Catch::Contains("4 blank lines were not documents (--line-documents)"));
}

TEST_CASE("tokenize past a file-size limit says so and exits 1 (not killed by SIGXFSZ), and -o of blanks is named as such", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir);
  const std::string text = dir.write("in.txt", "some text\nmore text\n");
  const auto limited = dsrun::test::run_command("bash -c \"ulimit -f 0; exec '" DSRUN_BINARY "' tokenize --tokenizer " + quoted(tok) + " " + quoted(text) + " > " +
                                                quoted(dir.file("out.txt")) + "\"");
  INFO(limited.text);
  CHECK(limited.code == 1);  // 128 + SIGXFSZ (153) before
  CHECK_THAT(limited.text, Catch::Contains("cannot write the tokens: File too large"));
  const auto blank = dsrun::test::run_command(std::string(DSRUN_BINARY) + " prepare --tokenizer " + quoted(tok) + " -o ' ' " + quoted(text));
  CHECK(blank.code == 1);
  CHECK_THAT(blank.text, Catch::Contains("-o is only blanks"));
}

TEST_CASE("a second prepare into a directory being written is refused at once, naming the first's pid", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir), other = byte_tokenizer(dir, "other", "<end>");
  dir.write("in/a.txt", lines_of(200000));
  dir.write("in/b.txt", lines_of(100000));
  const std::string out = dir.file("out");
  // The first prepare (in this process) holds its lock while its progress callback waits.
  std::promise<void> started, release;
  std::shared_future<void> go = release.get_future().share();
  std::atomic<bool> first_call{true};
  std::exception_ptr failed;
  std::thread first([&] {
    try {
      dsrun::prepare_corpus(prepare_options(tok, out, {dir.file("in")}), [&](int, int, int64_t, int64_t) {
        if (!first_call.exchange(false)) return;
        started.set_value();
        go.wait();
      });
    } catch (...) {
      failed = std::current_exception();
      if (first_call.exchange(false)) started.set_value();
    }
  });
  started.get_future().wait();
  const auto t0 = std::chrono::steady_clock::now();
  const auto second = dsrun::test::run_command(std::string(DSRUN_BINARY) + " prepare --tokenizer " + quoted(other) + " -o " + quoted(out) + " " + quoted(dir.file("in")));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string reading = dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); });  // a rank, meanwhile
  release.set_value();
  first.join();
  REQUIRE(!failed);
  INFO(second.text);
  CHECK(second.code != 0);
  const std::string pid = std::to_string(::getpid());
  CHECK_THAT(second.text, Catch::Contains(out + ": another dsrun prepare (pid " + pid + ") is writing to this directory"));
  CHECK(seconds < 10);
  CHECK_THAT(reading, Catch::Contains("dsrun prepare (pid " + pid + ") is still writing this directory"));
  // One tokenizer: the manifest's, in every shard's record.
  const json manifest = json::parse(dsrun::read_file(out + "/manifest.json"));
  for (const std::string& record : dsrun::data_directory_files(out, ".json")) {
    if (record == out + "/manifest.json") continue;
    CHECK(json::parse(dsrun::read_file(record))["identity"]["tokenizer"] == manifest["tokenizer"]["checksum"]);
  }
  CHECK(manifest["tokens"] == 300002);  // 300,000 bytes and two <eos>
  // Once the first is done, the lock is free: the second prepare runs (and its tokenizer wins).
  const auto later = dsrun::test::run_command(std::string(DSRUN_BINARY) + " prepare --tokenizer " + quoted(other) + " -o " + quoted(out) + " " + quoted(dir.file("in")));
  CHECK(later.code == 0);
}

TEST_CASE("a prepare directory without its manifest is refused, and a smaller corpus prepared again leaves no stale shards", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir), out = dir.file("out");
  for (int k = 0; k < 3; ++k) dir.write("big/" + std::to_string(k) + ".txt", lines_of(1024));
  dsrun::PrepareOptions o = prepare_options(tok, out, {dir.file("big")});
  o.shard_bytes = 1024;  // a shard per file
  REQUIRE(dsrun::prepare_corpus(o, nullptr).shards == 3);
  REQUIRE_NOTHROW(TokenCorpus(options(out, 8)));
  // As a killed prepare leaves it: shards, their records and the lock file, no manifest.
  REQUIRE(::unlink((out + "/manifest.json").c_str()) == 0);
  std::string error = dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); });
  CHECK_THAT(error, Catch::Contains(out + ": data.path: holds dsrun prepare's shards but no manifest.json"));
  CHECK_THAT(error, Catch::Contains("run the same dsrun prepare command again"));
  REQUIRE(::unlink((out + "/" + dsrun::kPrepareLockName).c_str()) == 0);  // as an older prepare left it: records only
  CHECK_THAT(dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); }), Catch::Contains("holds dsrun prepare's shards but no manifest.json"));
  // Loose shards (no records) are still read as they are.
  std::vector<uint32_t> ids(100, 7);
  dir.write("loose/a.tokens", dsrun::token_shard_bytes(ids, 2));
  CHECK(TokenCorpus(options(dir.file("loose"), 8)).train_windows() == 12);

  // A smaller corpus into the same directory, beside a temporary file a killed write left.
  dir.write("out/shard-00002.tokens.tmp.4242", "partial");
  o.inputs = {dir.file("big/0.txt")};
  const dsrun::PrepareSummary s = dsrun::prepare_corpus(o, nullptr);
  CHECK(s.shards == 1);
  CHECK(s.shards_reused == 1);
  CHECK(s.stale_files_removed == 7);  // shards 1 and 2 (three files each) and the temporary file
  CHECK(dsrun::list_directory(out) == std::vector<std::string>{"manifest.json", "shard-00000.docs", "shard-00000.json", "shard-00000.tokens"});
  CHECK(TokenCorpus(options(out, 8)).train_windows() == (1025 - 1) / 8);  // 1024 bytes and an <eos>
}

TEST_CASE("prepare skips its own output directory inside an input directory, and says so", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir), out = dir.file("in/out");
  dir.write("in/a.txt", "the first document\n");
  dir.write("in/b.txt", "the second\n");
  REQUIRE(dsrun::prepare_corpus(prepare_options(tok, out, {dir.file("in")}), nullptr).documents == 2);
  const std::string manifest = dsrun::read_file(out + "/manifest.json");
  // Run again, as a process: the shards now inside the input are not read as text.
  const auto again = dsrun::test::run_command(std::string(DSRUN_BINARY) + " prepare --tokenizer " + quoted(tok) + " -o " + quoted(out) + " " + quoted(dir.file("in")));
  INFO(again.text);
  CHECK(again.code == 0);
  CHECK_THAT(again.text, Catch::Contains("skipped " + out + ": the output directory (-o), not read as input"));
  CHECK_THAT(again.text, Catch::Contains("prepared " + out + ": 2 documents"));
  CHECK(dsrun::read_file(out + "/manifest.json") == manifest);
  // Another prepare's output inside the input is skipped too; named as the input, either is refused.
  REQUIRE(dsrun::prepare_corpus(prepare_options(tok, dir.file("elsewhere"), {dir.file("in")}), nullptr).documents == 2);
  const dsrun::PrepareSummary s = dsrun::prepare_corpus(prepare_options(tok, dir.file("elsewhere"), {dir.file("in")}), nullptr);
  CHECK(s.documents == 2);
  CHECK(s.skipped_directories == std::vector<std::string>{out + ": the output of another dsrun prepare, not read as input"});
  CHECK_THAT(prepare_error(prepare_options(tok, out, {out})), Catch::Contains(out + ": the input is the output directory (-o): its shards are not text"));
  CHECK_THAT(prepare_error(prepare_options(tok, dir.file("third"), {out})), Catch::Contains("the input is the output of another dsrun prepare"));
}

TEST_CASE("a file rewritten while prepare reads it is an error naming it, not a corpus of old and new text", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir);
  const size_t size = 8 << 20;
  const std::string path = dir.write("in/big.txt", lines_of(size));
  const struct timespec past[2] = {{946684800, 0}, {946684800, 0}};  // so a rewrite in the same clock tick still shows
  REQUIRE(::utimensat(AT_FDCWD, path.c_str(), past, 0) == 0);
  dsrun::PrepareOptions o = prepare_options(tok, dir.file("out"), {path});
  o.line_documents = true;
  o.shard_bytes = 64 << 10;  // 128 chunks, read one after another by one thread
  o.threads = 1;
  bool rewritten = false;
  // At the first progress report (the first chunks in hand, most not yet read), the last line
  // changes in place: same size, new text.
  const std::string error = dsrun::test::error_of([&] {
    dsrun::prepare_corpus(o, [&](int, int, int64_t, int64_t) {
      if (rewritten) return;
      rewritten = true;
      const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd >= 0 && ::pwrite(fd, "Z", 1, static_cast<off_t>(size - 2)) == 1) ::close(fd);
    });
  });
  CHECK(rewritten);
  CHECK_THAT(error, Catch::Contains(path + ": was rewritten (same size, a new modification time) while dsrun prepare was reading it"));
  CHECK(!dsrun::file_exists(dir.file("out/manifest.json")));
}

TEST_CASE("a bad JSON line is reported by a short excerpt, not echoed whole", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir);
  // An unterminated string of 2 MB: the JSON parser's message quotes all of it.
  const std::string docs = dir.write("docs.jsonl", "{\"text\": \"" + std::string(2 << 20, 'x') + "\n{\"text\": \"fine\"}\n");
  const std::string command = std::string(DSRUN_BINARY) + " prepare --tokenizer " + quoted(tok) + " -o " + quoted(dir.file("out")) + " " + quoted(docs);
  const auto skipped = dsrun::test::run_command(command);
  CHECK(skipped.code == 0);
  CHECK(skipped.text.size() < 4000);
  CHECK_THAT(skipped.text, Catch::Contains("skipped 1 lines"));
  CHECK_THAT(skipped.text, Catch::Contains(docs + ":1: not JSON: [json.exception.parse_error"));
  CHECK_THAT(skipped.text, Catch::Contains("bytes in all)"));
  const auto strict = dsrun::test::run_command(command + " --strict");  // the same directory: the shard that skipped the line is not kept
  CHECK(strict.code != 0);
  CHECK(strict.text.size() < 4000);
  CHECK_THAT(strict.text, Catch::Contains(docs + ":1: not JSON"));
}

TEST_CASE("corpora from elsewhere: a manifest's files stay inside the corpus, a malformed one names itself, a .gz that is not gzip and a number past double's range are refused or skipped, -o '' is refused", "[data][prepare]") {
  TempDir dir;
  const std::string tok = byte_tokenizer(dir), out = dir.file("out");
  dir.write("in/a.txt", lines_of(512));
  REQUIRE(dsrun::prepare_corpus(prepare_options(tok, out, {dir.file("in/a.txt")}), nullptr).shards == 1);
  const std::string manifest_path = out + "/manifest.json";
  const json good = json::parse(dsrun::read_file(manifest_path));
  // A shard named by a path out of the corpus: refused, naming the manifest.
  for (const std::string& name : {"../a.tokens", "/etc/passwd", "sub/x.tokens", ".."}) {
    json bad = good;
    bad["shards"][0]["tokens_file"] = name;
    dir.write("out/manifest.json", bad.dump());
    const std::string e = dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); });
    CHECK_THAT(e, Catch::Contains(manifest_path));
    CHECK_THAT(e, Catch::Contains("plain names inside its directory"));
  }
  // Fields of the wrong type: the manifest and the field named, not the JSON library's words.
  dir.write("out/manifest.json", R"({"format": "dsrun-tokens", "version": 1, "shards": [{"tokens_file": 3}]})");
  std::string e = dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); });
  CHECK_THAT(e, Catch::Contains(manifest_path));
  CHECK_THAT(e, Catch::Contains("shard 0: tokens_file is not a file name"));
  CHECK_THAT(e, !Catch::Contains("json.exception"));
  dir.write("out/manifest.json", R"({"format": "dsrun-tokens", "version": 1, "tokenizer": 5, "shards": []})");
  CHECK_THAT(dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); }), Catch::Contains("tokenizer.vocab_size is not a count"));
  // A count of -1 tokens is no count (it read as "not given", and the shard trained).
  json negative = good;
  negative["shards"][0]["tokens"] = -1;
  dir.write("out/manifest.json", negative.dump());
  CHECK_THAT(dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); }), Catch::Contains("shard 0: tokens = -1 is not a count of tokens"));
  dir.write("out/manifest.json", good.dump());
  CHECK_NOTHROW(TokenCorpus(options(out, 8)));
  // A shard that is a link (here out of the corpus, to a copy elsewhere): refused, not followed.
  const std::string shard = out + "/" + good["shards"][0]["tokens_file"].get<std::string>();
  REQUIRE(::rename(shard.c_str(), dir.file("elsewhere.tokens").c_str()) == 0);
  REQUIRE(::symlink(dir.file("elsewhere.tokens").c_str(), shard.c_str()) == 0);
  CHECK_THAT(dsrun::test::error_of([&] { TokenCorpus corpus(options(out, 8)); }), Catch::Contains(shard + ": data.path: is a symbolic link"));
  REQUIRE(::unlink(shard.c_str()) == 0);
  REQUIRE(::rename(dir.file("elsewhere.tokens").c_str(), shard.c_str()) == 0);
  CHECK_NOTHROW(TokenCorpus(options(out, 8)));

  // A .gz of plain text or random bytes is not gzip: refused, naming the file (zlib would read it as text).
  dir.write("gz/plain.gz", "hello world\n");
  e = prepare_error(prepare_options(tok, dir.file("gz_out"), {dir.file("gz/plain.gz")}));
  CHECK_THAT(e, Catch::Contains(dir.file("gz/plain.gz")));
  CHECK_THAT(e, Catch::Contains("is not gzip data"));
  // One number out of double's range skips its line; the others are prepared.
  dir.write("j/docs.jsonl", "{\"text\": \"fine\", \"score\": 1e999}\n{\"text\": \"also fine\"}\n");
  const dsrun::PrepareSummary j = dsrun::prepare_corpus(prepare_options(tok, dir.file("j_out"), {dir.file("j/docs.jsonl")}), nullptr);
  CHECK(j.skipped_lines == 1);
  CHECK(j.documents == 1);
  // The same file named twice (and inside a named directory) is read once.
  const dsrun::PrepareSummary once = dsrun::prepare_corpus(prepare_options(tok, dir.file("once_out"), {dir.file("in/a.txt")}), nullptr);
  const dsrun::PrepareSummary twice = dsrun::prepare_corpus(prepare_options(tok, dir.file("twice_out"), {dir.file("in/a.txt"), dir.file("in/a.txt"), dir.file("in")}), nullptr);
  CHECK(twice.tokens == once.tokens);
  CHECK(twice.documents == once.documents);
  // A tokenizer.json number past double's range: an error naming the file.
  dir.write("badtok/tokenizer.json", R"({"version": "1.0", "model": {"type": "BPE", "dropout": 1e400}})");
  e = prepare_error(prepare_options(dir.file("badtok/tokenizer.json"), dir.file("bt_out"), {dir.file("in/a.txt")}));
  CHECK_THAT(e, Catch::Contains(dir.file("badtok/tokenizer.json")));
  CHECK_THAT(e, Catch::Contains("a number JSON cannot hold"));
  // A file name that is not UTF-8 is prepared like any other (its record keeps a readable form).
  dir.write(std::string("nonutf/bad\xff.txt"), lines_of(256));
  const dsrun::PrepareSummary named = dsrun::prepare_corpus(prepare_options(tok, dir.file("nu_out"), {dir.file("nonutf")}), nullptr);
  CHECK(named.documents == 1);
  CHECK_NOTHROW(TokenCorpus(options(dir.file("nu_out"), 8)));
  // An empty -o: refused before anything is written to the current directory.
  e = prepare_error(prepare_options(tok, "", {dir.file("in/a.txt")}));
  CHECK_THAT(e, Catch::Contains("-o is empty"));
}

TEST_CASE("index entries out of order or past the tokens are refused when a file is mapped, naming the entry", "[data][formats]") {
  TempDir dir;
  const auto put = [](std::string& s, auto v) { s.append(reinterpret_cast<const char*>(&v), sizeof v); };
  // Megatron-LM: sequences of 3, 4 and 5 uint16 tokens (bytes 0, 6, 14), one document each.
  const auto megatron = [&](const std::string& name, std::vector<int64_t> pointers) {
    std::string idx("MMIDIDX\0\0", 9), bin;
    put(idx, uint64_t(1));
    idx += char(8);  // uint16
    put(idx, uint64_t(3));
    put(idx, uint64_t(4));
    for (int32_t n : {3, 4, 5}) put(idx, n);
    for (int64_t p : pointers) put(idx, p);
    for (int64_t d : {0, 1, 2, 3}) put(idx, d);
    for (uint16_t t = 1; t <= 12; ++t) put(bin, t);
    dir.write(name + ".idx", idx);
    return dir.write(name + ".bin", bin);
  };
  const auto refusal = [&](const std::string& path) {
    try {
      TokenCorpus corpus(options(path, 2));
    } catch (const dsrun::Error& e) {
      return e;
    }
    FAIL("accepted " + path);
    return dsrun::Error("");
  };
  REQUIRE(TokenCorpus(options(megatron("good", {0, 6, 14}), 2)).train_windows() == (12 - 1) / 2);
  megatron("reversed", {14, 6, 0});
  dsrun::Error e = refusal(dir.file("reversed.bin"));
  CHECK(e.context().file == dir.file("reversed.idx"));
  CHECK_THAT(e.what(), Catch::Contains("sequence 1 of 3 (byte pointer 6, 4 tokens) starts before the end of sequence 0 (byte 20): pointers must ascend"));
  megatron("past", {0, 4000, 14});
  e = refusal(dir.file("past.bin"));
  CHECK(e.context().file == dir.file("past.idx"));
  CHECK_THAT(e.what(), Catch::Contains("sequence 1 of 3 (byte pointer 4000, 4 tokens) points past the end of " + dir.file("past.bin") + " (24 bytes)"));
  // dsrun's .docs: document ends that go back before the last.
  std::vector<uint32_t> ids(20, 3);
  dir.write("s.tokens", dsrun::token_shard_bytes(ids, 2));
  dir.write("s.docs", dsrun::document_index_bytes({5, 12, 9, 20}));
  e = refusal(dir.file("s.tokens"));
  CHECK(e.context().file == dir.file("s.docs"));
  CHECK_THAT(e.what(), Catch::Contains("document ends decrease at entry 2 of 4 (9 after 12)"));
}

TEST_CASE("a validation split far from data.val_fraction is warned about, saying where each file was cut", "[data][formats]") {
  TempDir dir;
  std::vector<uint32_t> ids(6000);
  for (size_t k = 0; k < ids.size(); ++k) ids[k] = static_cast<uint32_t>(k % 1000);
  const std::string two = dir.write("two.tokens", dsrun::token_shard_bytes(ids, 2));
  dir.write("two.docs", dsrun::document_index_bytes({40, 6000}));
  TokenCorpusOptions o = options(two, 8);
  o.val_fraction = 0.05;
  {
    TokenCorpus corpus(o);
    const std::string d = corpus.describe();
    CHECK_THAT(d, Catch::Contains("40 training tokens (4 sequences), 5960 validation tokens (whole documents at each file's end)"));
    CHECK_THAT(d, Catch::Contains("; warning: validation is 99.3% of the tokens (5960), not the 5% data.val_fraction asks (300): " + two +
                                  " is cut at token 40 of 6000, the last document end at or before its share's end, token 5700"));
    CHECK(corpus.warnings().size() == 1);
  }
  // One document longer than the training share: cut inside it, and not called whole documents.
  ids.resize(1000);
  o.paths = {dir.write("one.tokens", dsrun::token_shard_bytes(ids, 2))};
  dir.write("one.docs", dsrun::document_index_bytes({1000}));
  {
    TokenCorpus corpus(o);
    const std::string d = corpus.describe();
    CHECK_THAT(d, Catch::Contains("950 training tokens (118 sequences), 50 validation tokens (each file's end; cut inside a document"));
    CHECK_THAT(d, !Catch::Contains("whole documents"));
    CHECK(corpus.warnings().empty());
  }
}

TEST_CASE("a document whose tokenizer regex runs past its work budget is skipped and counted, or with --strict fails naming file and line", "[data][prepare]") {
  TempDir dir;
  // A hostile Split pattern: quadratic in the document (18.8 s for 320 KB before the budget).
  const json split = {{"type", "Split"}, {"pattern", {{"Regex", ".(?=.*$)"}}}, {"behavior", "Isolated"}, {"invert", false}};
  const std::string tok = byte_tokenizer(dir, "hostile", "<eos>", split);
  const std::string docs = dir.write("docs.jsonl", "{\"text\": \"short and fine\"}\n{\"text\": \"" + std::string(320 << 10, 'z') + "\"}\n{\"text\": \"fine too\"}\n");
  const std::string command = std::string(DSRUN_BINARY) + " prepare --tokenizer " + quoted(tok) + " -o " + quoted(dir.file("out")) + " " + quoted(docs);
  const auto skipped = dsrun::test::run_command(command);
  INFO(skipped.text);
  CHECK(skipped.code == 0);
  CHECK_THAT(skipped.text, Catch::Contains("skipped 1 lines"));
  CHECK_THAT(skipped.text, Catch::Contains(docs + ":2: tokenizer regex"));
  const auto strict = dsrun::test::run_command(command + " --strict");
  INFO(strict.text);
  CHECK(strict.code != 0);
  CHECK_THAT(strict.text, Catch::Contains(docs + ":2"));
  CHECK_THAT(strict.text, Catch::Contains("tokenizer regex"));
}

TEST_CASE("a mapped token file truncated under its reader: the SIGBUS names the file", "[data][reliability]") {
  TempDir dir;
  std::string bytes;
  for (int k = 0; k < 40000; ++k) {  // 80 KB: pages past the first 4 KiB vanish with the truncation
    const uint16_t t = static_cast<uint16_t>(1 + k % 250);
    bytes.append(reinterpret_cast<const char*>(&t), 2);
  }
  dir.write("nano.bin", bytes);
  const std::string path = dir.file("nano.bin");
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // the reader: maps, sees its file truncated, reads on
    ::close(fds[0]);
    try {
      dsrun::report_mapped_file_faults(fds[1], [](const std::string& message) { return "report: " + message + "\n"; });
      TokenCorpusOptions o = options(path, 32);
      o.format = dsrun::TokenFormat::Nanogpt;
      o.token_width = 2;
      TokenCorpus corpus(o);
      if (::truncate(path.c_str(), 4096) != 0) ::_exit(3);
      dsrun::Window w;
      for (int64_t g = 0; g < corpus.train_windows(); ++g) corpus.train_window(g, w);
    } catch (...) {
      ::_exit(4);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string said;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;) said.append(buffer, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  INFO(said);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGBUS);  // it still dies of the signal: the launcher records signal 7
  CHECK(contains(said, "report: SIGBUS reading the mapped file " + path + " (80000 bytes when mapped)"));
}

TEST_CASE("data identity: size, content and modification time, compared in order", "[data][resume]") {
  TempDir dir;
  dir.write("a.bin", std::string(100000, 'a'));
  dir.write("b.bin", std::string(5000, 'b'));
  const auto then = dsrun::identify_data_files({dir.file("a.bin"), dir.file("b.bin")});
  CHECK(dsrun::compare_with_disk(then).same());
  // One byte rewritten inside a sampled block, same size.
  std::string a(100000, 'a');
  a[0] = 'z';
  dir.write("a.bin", a);
  auto changes = dsrun::compare_with_disk(then);
  REQUIRE(changes.differ.size() == 1);
  CHECK(contains(changes.differ[0], "same size, different content"));
  // Truncated; and a file gone.
  ::truncate(dir.file("a.bin").c_str(), 4096);
  ::unlink(dir.file("b.bin").c_str());
  changes = dsrun::compare_with_disk(then);
  REQUIRE(changes.differ.size() == 2);
  CHECK(contains(changes.differ[0], "100000 bytes -> 4096 bytes"));
  CHECK(contains(changes.differ[1], "missing"));
  // The same files moved elsewhere are the same data; a touched file is said, not refused.
  dir.write("c.bin", std::string(5000, 'b'));
  auto moved = dsrun::identify_data_files({dir.file("c.bin")});
  CHECK(dsrun::compare_data_files({then[1]}, moved).same());
  moved[0].mtime_ns += 1;
  moved[0].path = then[1].path;
  changes = dsrun::compare_data_files({then[1]}, moved);
  CHECK(changes.same());
  CHECK(changes.touched.size() == 1);
  // An extra file is a change.
  CHECK(!dsrun::compare_data_files({then[1]}, {then[1], then[0]}).same());
  // The record survives the manifest's JSON.
  CHECK(dsrun::data_files_from_json(dsrun::data_files_to_json(then))[0].sample_hash == then[0].sample_hash);
}
