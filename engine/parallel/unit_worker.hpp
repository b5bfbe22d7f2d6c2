// A background thread that runs one task per parameter unit, in unit order, and says which are done:
// the offloaded optimizer step runs while the next forward starts, which waits for each unit alone.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace dsrun {

class UnitWorker {
 public:
  UnitWorker() = default;
  ~UnitWorker();  // waits for the tasks under way (their errors are dropped: the run is ending)
  UnitWorker(const UnitWorker&) = delete;
  UnitWorker& operator=(const UnitWorker&) = delete;

  // Runs task(0), task(1), ... task(units-1) on the worker thread. The previous run must be waited for.
  void start(size_t units, std::function<void(size_t)> task);
  // Returns once task(unit) has finished; rethrows the error of any task up to it (later units never run).
  void wait(size_t unit);
  void wait_all();
  // Whether task(unit) has finished, without waiting (false once a task failed: wait() reports it).
  bool finished(size_t unit);
  bool running() const { return thread_.joinable(); }
  // Seconds the last finished run took on the worker, and seconds callers spent waiting since the last call.
  double last_run_seconds() const { return last_run_seconds_; }
  double take_wait_seconds();

 private:
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable progress_;
  size_t units_ = 0, done_ = 0;
  std::exception_ptr error_;
  double last_run_seconds_ = 0, wait_seconds_ = 0;
};

}  // namespace dsrun
