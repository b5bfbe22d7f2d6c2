#include "engine/parallel/unit_worker.hpp"

#include "engine/common/error.hpp"

#include <chrono>

namespace dsrun {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

UnitWorker::~UnitWorker() {
  if (thread_.joinable()) thread_.join();
}

void UnitWorker::start(size_t units, std::function<void(size_t)> task) {
  DSRUN_ASSERT(!thread_.joinable(), "the previous host update was waited for");
  units_ = units;
  done_ = 0;
  error_ = nullptr;
  if (units == 0) return;
  thread_ = std::thread([this, units, task = std::move(task)] {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t k = 0; k < units; ++k) {
      std::exception_ptr failed;
      try {
        task(k);
      } catch (...) {  // handed to the waiting thread, which rethrows it
        failed = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed) {
        error_ = failed;
        done_ = units;
        progress_.notify_all();
        return;
      }
      done_ = k + 1;
      if (done_ == units) last_run_seconds_ = seconds_since(t0);
      progress_.notify_all();
    }
  });
}

void UnitWorker::wait(size_t unit) {
  if (!thread_.joinable()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  progress_.wait(lock, [&] { return done_ > unit || error_; });
  wait_seconds_ += seconds_since(t0);
  if (done_ < units_ && !error_) return;
  lock.unlock();
  thread_.join();  // every task has finished (or one failed): the thread is ending
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void UnitWorker::wait_all() {
  if (thread_.joinable()) wait(units_ == 0 ? 0 : units_ - 1);
}

bool UnitWorker::finished(size_t unit) {
  if (!thread_.joinable()) return true;
  std::lock_guard<std::mutex> lock(mutex_);
  return done_ > unit && !error_;
}

double UnitWorker::take_wait_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  double s = wait_seconds_;
  wait_seconds_ = 0;
  return s;
}

}  // namespace dsrun
