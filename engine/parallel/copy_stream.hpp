// Host <-> GPU copies on a stream of their own, ordered against the compute stream by events.
// On CPU ranks (and CPU-only builds) nothing crosses a bus: every call runs inline, every event is complete.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>

namespace dsrun {

// A point in a stream's queued work. Default-constructed (or on the CPU): already complete.
class CopyEvent {
 public:
  CopyEvent();
  ~CopyEvent();
  CopyEvent(const CopyEvent&);
  CopyEvent& operator=(const CopyEvent&);
  // The calling thread's current stream waits for it (on the GPU; the CPU goes on).
  void block_current() const;
  // The calling thread waits for it.
  void synchronize() const;
  // What the calling thread's current stream on `device` has queued so far (on the CPU: complete).
  static CopyEvent on_current_stream(torch::Device device);

 private:
  friend class CopyStream;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// numel elements of dtype in page-locked host memory, pinned exactly (CUDA's caching pinned
// allocator rounds every block up to a power of two: a 27.6 GB block of a 7B model's states takes
// 32 GB). Without CUDA, ordinary host memory. Throws (naming the bytes) when it cannot be pinned.
torch::Tensor pinned_host_tensor(int64_t numel, torch::ScalarType dtype);

// A copy of t in host memory that arrives while the device goes on with what is queued after it
// (pinned, non-blocking on CUDA): read it after `arrived` is complete. On the CPU, a plain copy.
struct HostReadback {
  torch::Tensor host;
  CopyEvent arrived;
};
HostReadback read_back(const torch::Tensor& t);

// A CUDA device's PCI address ("0000:1b:00.0"), for the cores near it; "" on the CPU or when unknown.
std::string cuda_pci_bus_id(torch::Device device);

class CopyStream {
 public:
  explicit CopyStream(torch::Device device);  // a CUDA device gets a stream of its own; others are inert
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
  // This stream waits for what the calling thread's current stream has queued so far.
  void follow_current();
  // Runs fn with this stream as the current one: the copies and kernels it queues go here.
  void run(const std::function<void()>& fn);
  // The caching allocator keeps t's memory until this stream's queued work is done (tensors made
  // on the compute stream and read here).
  void keep_alive(const torch::Tensor& t);
  // Marks what is queued on this stream now.
  CopyEvent record();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsrun
