// The chunks over every thread: a producer splits, workers tokenize units in order, one writer per
// shard; memory bounded by the units in flight.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/chunks.hpp"
#include "engine/data/prepare/decompressor.hpp"
#include "engine/data/prepare/preparer.hpp"
#include "engine/data/prepare/range_reader.hpp"
#include "engine/data/prepare/shard_builder.hpp"
#include "engine/data/prepare/splitter.hpp"

namespace dsrun::prepare_detail {

// Thrown in the producer when a worker has failed: its error is the one reported.
struct Stopped {};

// One producer walks the inputs in order, cuts each chunk's text into units (decompressing as it
// goes) and numbers the shards; every thread tokenizes units, whichever shard they belong to, and
// appends them to their shard, which the thread that appends its last unit finishes. At most
// 2 x threads + 2 units are out at once (queued, being tokenized, or waiting for the units ahead of
// them), so memory is bounded by units, not by the size of any file or document.
class Pipeline {
 public:
  Pipeline(const PrepareOptions& o, Preparer& preparer, int threads, int64_t total_bytes, const PrepareProgress& progress)
      : o_(o), preparer_(preparer), threads_(threads), total_bytes_(total_bytes), progress_(progress),
        max_out_(2 * static_cast<size_t>(threads) + 2) {}

  std::vector<ShardResult> run(const std::vector<PlannedChunk>& planned) {
    std::thread producer([&] { produce(planned); });
    std::vector<std::thread> pool;
    for (int t = 0; t < threads_; ++t) pool.emplace_back([this] { work(); });
    for (;;) {
      int done, known;
      int64_t bytes;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (failed_ || (produced_all_ && done_ == known_)) break;
        done = done_;
        known = known_;
        bytes = bytes_done_;
      }
      if (progress_) progress_(done, known, bytes, total_bytes_);
      std::unique_lock<std::mutex> lock(mutex_);  // a report every 200 ms, and none waited for once all is done
      changed_.wait_for(lock, std::chrono::milliseconds(200), [&] { return failed_ || (produced_all_ && done_ == known_); });
    }
    producer.join();
    for (auto& t : pool) t.join();
    queue_.clear();
    builder_.reset();  // an unfinished shard's temporary file goes with its last owner
    if (error_) std::rethrow_exception(error_);
    std::vector<ShardResult> out;
    for (auto& [k, r] : results_) out.push_back(std::move(r));
    return out;
  }

 private:
  void fail_with(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = e;
    failed_ = true;
    changed_.notify_all();
  }

  void shard_done(size_t k, ShardResult r) {
    std::lock_guard<std::mutex> lock(mutex_);
    results_[k] = std::move(r);
    ++done_;
    changed_.notify_all();
  }

  // A new shard k is under way (or kept from an earlier prepare).
  void announce_shard() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++known_;
  }

  void add_progress(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_done_ += bytes;
  }

  // To the queue, as unit `next_index_` of the current shard; waits while max_out_ units are out.
  void emit(Unit&& u) {
    u.shard = builder_;
    u.index = next_index_++;
    u.piece = piece_;
    u.progress = pending_progress_;
    pending_progress_ = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return out_ < max_out_ || failed_; });
    if (failed_) throw Stopped{};
    queue_.push_back(std::move(u));
    ++out_;
    changed_.notify_all();
  }

  void start_shard(size_t k, const Chunk& chunk) {
    builder_ = std::make_shared<ShardBuilder>(o_.out, k, chunk, preparer_.token_bytes_, preparer_.tokenizer_->vocab_size());
    next_index_ = 0;
    text_bytes_ = 0;
  }

  void close_shard(size_t k, int64_t end) {
    std::shared_ptr<ShardBuilder> builder = std::move(builder_);
    add_progress(pending_progress_);
    pending_progress_ = 0;
    if (builder->close(next_index_, end, text_bytes_)) shard_done(k, builder->finish(preparer_.identity(builder->chunk())));
  }

  // Text for the current shard's splitter.
  void feed(Splitter& splitter, std::string_view text) {
    text_bytes_ += static_cast<int64_t>(text.size());
    splitter.feed(text);
  }

  void produce(const std::vector<PlannedChunk>& planned) {
    try {
      size_t k = 0;
      for (const PlannedChunk& p : planned) {
        if (p.stream_file < 0) produce_chunk(k++, p.chunk);
        else produce_stream(static_cast<size_t>(p.stream_file), k);
      }
    } catch (const Stopped&) {
      // A worker failed; its error is reported.
    } catch (const std::bad_alloc&) {
      fail_with(std::make_exception_ptr(input_error(reading_, 0, "out of memory while reading this file", "prepare with fewer --threads, or on a machine with more memory")));
    } catch (...) {
      fail_with(std::current_exception());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    produced_all_ = true;
    changed_.notify_all();
  }

  // A chunk whose pieces are known before reading: byte ranges of plain files, whole compressed files.
  void produce_chunk(size_t k, const Chunk& chunk) {
    announce_shard();
    if (const auto done = preparer_.finished_record(k, preparer_.identity(chunk))) {
      add_progress(chunk.bytes);
      shard_done(k, Preparer::reused(*done));
      return;
    }
    start_shard(k, chunk);
    for (piece_ = 0; piece_ < chunk.pieces.size(); ++piece_) {
      const Piece& p = chunk.pieces[piece_];
      const InputFile& f = preparer_.files_[p.file];
      reading_ = f.path;
      Splitter splitter(preparer_.mode_of(f), *preparer_.tokenizer_, static_cast<size_t>(o_.max_document_bytes), [this](Unit&& u) { emit(std::move(u)); });
      std::string block;
      if (f.compression == Compression::none) {
        RangeReader reader(f, p.begin, p.end);
        while (!splitter.skipping_document() && reader.read(block)) {
          pending_progress_ += static_cast<int64_t>(block.size());
          feed(splitter, block);
        }
      } else {  // a compressed text read as one document, streamed
        Decompressor d(f);
        int64_t consumed = 0;
        for (bool more = true; more && !splitter.skipping_document();) {
          block.clear();
          more = d.read(block);
          const int64_t now = more ? d.consumed() : f.size;
          pending_progress_ += now - consumed;
          consumed = now;
          feed(splitter, block);
        }
        pending_progress_ += f.size - consumed;  // the rest of a skipped document, not read
      }
      splitter.finish();
    }
    close_shard(k, chunk.pieces.back().end);
  }

  // A compressed file of lines, cut into chunks as it is decompressed: a chunk ends at the first
  // line end at or after --shard-mb of text (as plain files are cut), so its end is known only once
  // read. A chunk an earlier prepare finished (its record names this start) is read past and kept.
  void produce_stream(size_t i, size_t& k) {
    const InputFile& f = preparer_.files_[i];
    reading_ = f.path;
    Decompressor d(f);
    std::string block;
    size_t at = 0;
    bool more = true;
    int64_t consumed = 0;
    // The unread text in block[at..], read on when it is all used; false at the end of the file.
    const auto fill = [&] {
      while (at == block.size() && more) {
        block.clear();
        at = 0;
        more = d.read(block);
        const int64_t now = more ? d.consumed() : f.size;
        pending_progress_ += now - consumed;
        consumed = now;
      }
      return at < block.size();
    };
    int64_t begin = 0;
    int line = 1;
    while (fill()) {
      Chunk chunk{{{i, begin, begin, line}}, 0};
      announce_shard();
      const int64_t recorded = preparer_.recorded_end(k, chunk);
      std::unique_ptr<Splitter> splitter;
      piece_ = 0;
      if (recorded < 0) {
        start_shard(k, chunk);
        splitter = std::make_unique<Splitter>(preparer_.mode_of(f), *preparer_.tokenizer_, static_cast<size_t>(o_.max_document_bytes), [this](Unit&& u) { emit(std::move(u)); });
      }
      int64_t taken = 0;
      int lines = 0;
      while (fill()) {
        std::string_view rest(block.data() + at, block.size() - at);
        size_t n = rest.size();
        bool chunk_ends = false;
        if (taken + static_cast<int64_t>(n) > o_.shard_bytes) {
          const size_t from = static_cast<size_t>(std::max<int64_t>(0, o_.shard_bytes - taken));
          const size_t newline = rest.find('\n', from);
          if (newline != std::string_view::npos) {
            n = newline + 1;
            chunk_ends = true;
          }
        }
        const std::string_view part = rest.substr(0, n);
        lines += static_cast<int>(std::count(part.begin(), part.end(), '\n'));
        if (splitter) feed(*splitter, part);
        taken += static_cast<int64_t>(n);
        at += n;
        if (chunk_ends) break;
      }
      const int64_t end = begin + taken;
      if (splitter) {
        splitter->finish();
        close_shard(k, end);
      } else {
        chunk.pieces[0].end = end;
        const auto done = recorded == end ? preparer_.finished_record(k, preparer_.identity(chunk)) : std::nullopt;
        if (!done) {  // the record named another end: the text changed after all; read the chunk again
          start_shard(k, chunk);
          Splitter again(preparer_.mode_of(f), *preparer_.tokenizer_, static_cast<size_t>(o_.max_document_bytes), [this](Unit&& u) { emit(std::move(u)); });
          reread(f, begin, taken, again);
          again.finish();
          close_shard(k, end);
        } else {
          add_progress(pending_progress_);
          pending_progress_ = 0;
          shard_done(k, Preparer::reused(*done));
        }
      }
      begin = end;
      line += lines;
      ++k;
    }
  }

  // Text [begin, begin + size) of a compressed file, decompressed from its start again, to `splitter`.
  void reread(const InputFile& f, int64_t begin, int64_t size, Splitter& splitter) {
    Decompressor d(f);
    std::string block;
    int64_t at = 0;
    for (bool more = true; more && at < begin + size;) {
      block.clear();
      more = d.read(block);
      const int64_t from = std::max<int64_t>(at, begin), to = std::min<int64_t>(at + static_cast<int64_t>(block.size()), begin + size);
      if (to > from) feed(splitter, std::string_view(block).substr(static_cast<size_t>(from - at), static_cast<size_t>(to - from)));
      at += static_cast<int64_t>(block.size());
    }
  }

  void work() {
    for (;;) {
      Unit u;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return !queue_.empty() || produced_all_ || failed_; });
        if (failed_ || queue_.empty()) return;
        u = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        UnitIds ids;
        try {
          ids = preparer_.tokenize(u);
        } catch (const std::bad_alloc&) {
          const std::string& path = preparer_.files_[u.shard->piece(u.piece).file].path;
          throw input_error(path, u.shard->absolute_line(u.piece, u.line, path), "out of memory tokenizing " + std::to_string(u.text.size()) + " bytes of text from this line",
                            "prepare with fewer --threads, or on a machine with more memory");
        }
        const auto [appended, complete] = u.shard->deliver(u.index, std::move(ids));
        {
          std::lock_guard<std::mutex> lock(mutex_);
          out_ -= appended;
          bytes_done_ += u.progress;
          changed_.notify_all();
        }
        if (complete) {
          shard_done(u.shard->number(), u.shard->finish(preparer_.identity(u.shard->chunk())));
        }
      } catch (const std::bad_alloc&) {
        fail_with(std::make_exception_ptr(input_error(o_.out, 0, "out of memory writing a shard", "prepare with fewer --threads, or on a machine with more memory")));
        return;
      } catch (...) {
        fail_with(std::current_exception());
        return;
      }
    }
  }

  const PrepareOptions& o_;
  Preparer& preparer_;
  const int threads_;
  const int64_t total_bytes_;
  const PrepareProgress& progress_;
  const size_t max_out_;

  std::mutex mutex_;  // everything below it, but the producer's own state
  std::condition_variable changed_;
  std::deque<Unit> queue_;
  size_t out_ = 0;  // units queued, being tokenized, or waiting for the units ahead of them
  bool produced_all_ = false, failed_ = false;
  std::exception_ptr error_;
  std::map<size_t, ShardResult> results_;
  int done_ = 0, known_ = 0;
  int64_t bytes_done_ = 0;

  // The producer's
  std::shared_ptr<ShardBuilder> builder_;  // of the shard being cut
  size_t next_index_ = 0, piece_ = 0;
  int64_t pending_progress_ = 0;  // input bytes read since the last unit went out
  int64_t text_bytes_ = 0;        // text of the shard being cut
  std::string reading_;           // the file being read, for an out-of-memory error
};

}  // namespace dsrun::prepare_detail
