// Token corpora read in place: Megatron-LM, llm.c and nanoGPT files written by an independent
// writer (tests/formats/write_token_formats.cjs, in Node) read back token for token with their
// document boundaries; bad files refused naming the file; mixtures, shuffling and validation.
#include "engine/data/token_source.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>
#include <set>

using dsrun::TokenCorpus;
using dsrun::TokenCorpusOptions;
using dsrun::TokenFormat;
using dsrun::Window;
using dsrun::test::TempDir;
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
