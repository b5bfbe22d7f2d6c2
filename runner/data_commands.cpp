// `dsrun tokenize` (see data_commands.hpp). Lines are split on \n only, so a CRLF line keeps
// its \r, as a tokenizer given the text would. Blocks of lines go to threads; output keeps order.
// A long line is encoded a piece at a time at the tokenizer's safe cuts (same ids).
#include "runner/data_commands.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/data/prepare.hpp"
#include "engine/tokenizer/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <charconv>
#include <chrono>
#include <csignal>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <thread>
#include <unistd.h>
#include <vector>

namespace dsrun {
namespace {

std::string read_input(const std::string& file) {
  if (file == "-") return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  return read_file(file);
}

std::vector<std::string_view> split_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

void append_ids(std::string& out, const std::vector<uint32_t>& ids) {
  out += '[';
  char number[16];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ',';
    const auto end = std::to_chars(number, number + sizeof number, ids[i]).ptr;
    out.append(number, end);
  }
  out += "]\n";
}

std::vector<uint32_t> parse_ids(std::string_view line, const std::string& file, size_t line_number) {
  ErrorContext c;
  c.file = file;
  c.line = static_cast<int>(line_number);
  c.hint = "each line must be a JSON array of token ids, as `dsrun tokenize` prints";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(std::string("not JSON: ") + e.what(), c);
  }
  if (!j.is_array()) throw Error("not an array of ids", c);
  std::vector<uint32_t> ids;
  for (const auto& v : j) {
    if (!v.is_number_unsigned() || v.get<uint64_t>() > UINT32_MAX) throw Error("an id is not a non-negative 32-bit integer", c);
    ids.push_back(v.get<uint32_t>());
  }
  return ids;
}

}  // namespace

int command_tokenize(const TokenizeArgs& args) {
  const auto loaded = std::chrono::steady_clock::now();
  const std::unique_ptr<Tokenizer> tokenizer = open_tokenizer(args.tokenizer);
  const std::string input = read_input(args.file);
  const std::vector<std::string_view> lines = split_lines(input);
  const std::string input_name = args.file == "-" ? "standard input" : args.file;

  const int threads = std::max(1, args.threads > 0 ? args.threads : static_cast<int>(std::thread::hardware_concurrency()));
  constexpr size_t kBlock = 1024;  // lines per task
  const size_t blocks = (lines.size() + kBlock - 1) / kBlock;
  std::vector<std::string> outputs(blocks);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  size_t token_count = 0;
  std::vector<size_t> tokens_per_thread(static_cast<size_t>(threads));
  const auto started = std::chrono::steady_clock::now();
  const auto work = [&](int t) {
    try {
      std::vector<uint32_t> ids;
      for (size_t b = static_cast<size_t>(t); b < blocks; b += static_cast<size_t>(threads)) {
        std::string& out = outputs[b];
        for (size_t i = b * kBlock; i < std::min(lines.size(), (b + 1) * kBlock); ++i) {
          if (args.decode) {
            out += tokenizer->decode(parse_ids(lines[i], input_name, i + 1), args.skip_special);
            out += '\n';
          } else {
            ids.clear();
            tokenizer->encode_in_pieces(lines[i], args.special, ids);  // a line of megabytes costs a piece's working memory
            tokens_per_thread[static_cast<size_t>(t)] += ids.size();
            append_ids(out, ids);
          }
        }
      }
    } catch (...) {
      errors[static_cast<size_t>(t)] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  for (const auto& e : errors) if (e) std::rethrow_exception(e);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (const std::string& out : outputs) std::fwrite(out.data(), 1, out.size(), stdout);
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    ErrorContext c;
    c.file = "standard output";
    c.system_errno = errno;
    c.hint = "make room for the output (a full disk, or a file-size limit: ulimit -f), or write it elsewhere";
    throw Error(std::string("cannot write the tokens: ") + std::strerror(errno), c);
  }
  for (size_t n : tokens_per_thread) token_count += n;
  if (args.stats) {
    const double load = std::chrono::duration<double>(started - loaded).count();
    std::fprintf(stderr, "tokenize: %s; %zu lines, %zu bytes, %zu tokens in %.3f s on %d threads: %.2f MB/s (load %.2f s)\n",
                 tokenizer->describe().c_str(), lines.size(), input.size(), token_count, seconds, threads,
                 seconds > 0 ? input.size() / seconds / 1e6 : 0.0, load);
  }
  return 0;
}

int command_prepare(const PrepareOptions& options) {
  // Past a file size limit (ulimit -f) a write fails with EFBIG, which prepare reports naming the
  // file, instead of the kernel's SIGXFSZ killing the process silently.
  std::signal(SIGXFSZ, SIG_IGN);
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  const auto started = std::chrono::steady_clock::now();
  auto last_print = started - std::chrono::seconds(10);
  const auto progress = [&](int done, int shards, int64_t bytes, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    const bool finished = done == shards;
    if (!finished && now - last_print < std::chrono::seconds(tty ? 1 : 10)) return;
    last_print = now;
    const double s = std::chrono::duration<double>(now - started).count();
    const double rate = s > 0 ? static_cast<double>(bytes) / s : 0;
    const double eta = rate > 0 ? static_cast<double>(total - bytes) / rate : 0;
    std::fprintf(stderr, "%sprepare: %d/%d shards, %.1f of %.1f MB, %.1f MB/s, ETA %.0f s%s", tty ? "\r" : "", done, shards, bytes / 1e6,
                 total / 1e6, rate / 1e6, eta, tty && !finished ? "   " : "\n");
    std::fflush(stderr);
  };
  const PrepareSummary s = prepare_corpus(options, progress);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (const auto& d : s.skipped_directories) std::printf("skipped %s\n", d.c_str());
  std::printf("prepared %s: %lld documents, %lld tokens (%d bytes each) from %lld bytes, %.4f tokens per byte; %d shards (%d kept from an earlier run) in %.1f s\n",
              options.out.c_str(), static_cast<long long>(s.documents), static_cast<long long>(s.tokens), s.token_bytes,
              static_cast<long long>(s.input_bytes), s.input_bytes > 0 ? static_cast<double>(s.tokens) / static_cast<double>(s.input_bytes) : 0.0,
              s.shards, s.shards_reused, seconds);
  if (s.cut_documents > 0)
    std::printf("%lld documents longer than a piece were cut into %lld pieces at safe cuts and tokenized on %d threads\n",
                static_cast<long long>(s.cut_documents), static_cast<long long>(s.cut_pieces), s.threads);
  if (s.stale_files_removed > 0)
    std::printf("removed %d stale files of an earlier prepare (shards beyond these %d, or left half-written)\n", s.stale_files_removed, s.shards);
  if (s.blank_lines > 0) std::printf("%lld blank lines were not documents (--line-documents)\n", static_cast<long long>(s.blank_lines));
  if (s.skipped_lines > 0) {
    std::printf("skipped %lld lines (not JSON, without the field, too long to hold, or refused by the tokenizer; --strict makes them fatal)%s\n",
                static_cast<long long>(s.skipped_lines),
                s.skipped_examples.empty() ? "" : ", for example:");
    for (const auto& e : s.skipped_examples) std::printf("  %s\n", e.c_str());
  }
  return 0;
}

}  // namespace dsrun
