// Rendezvous (one c10d TCPStore per run) and a group's collectives over flat tensors: all-reduce, reduce-scatter,
// all-gather, all-to-all, broadcast, barrier, send/recv (alone or in groups). Gloo for CPU tensors, NCCL for CUDA.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dsrun {

struct RendezvousOptions {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world_size = 1;
  double timeout_s = 300;   // for rendezvous and for every collective
  bool use_nccl = false;    // CUDA tensors; needs a libtorch built with NCCL
  int cuda_device = 0;      // with NCCL: this rank's GPU (LOCAL_RANK)
  // What every rank must agree on (the run's settings and this build), as "key = value" lines under
  // [section] headers; checked against rank 0's as the rendezvous opens, before any group forms,
  // and refused on both sides naming what differs. Empty: not checked.
  std::string identity;
};

// A collective started but not waited for. wait() makes its result usable by what follows: on
// GPUs it orders the current CUDA stream after NCCL's (the CPU goes on), on CPU ranks it blocks;
// then it runs whatever must follow (a copy back from the wire format). Waiting twice is harmless.
class PendingCollective {
 public:
  PendingCollective() = default;
  explicit PendingCollective(std::function<void()> finish) : finish_(std::move(finish)) {}
  void wait() {
    if (!finish_) return;
    auto f = std::move(finish_);
    finish_ = nullptr;
    // Finishing is no step of autograd's graph, wherever it is waited for: a copy back from the
    // wire format recorded in place would turn the result of an autograd function (expert
    // parallelism's started exchange) into a copy whose gradient to that function is zero.
    torch::NoGradGuard not_recorded;
    f();
  }

 private:
  std::function<void()> finish_;
};

// One operation of a group of sends and receives issued together (Communicator::exchange).
struct PointToPoint {
  enum Kind { Send, Receive };
  Kind kind = Send;
  torch::Tensor tensor;  // a receive's is filled in place (it has the sender's shape and dtype)
  int peer = 0;
  int tag = 0;
};
// What finishes an exchange: `received` before the received tensors are read, `sent` before a sent
// tensor may change or go (the pipeline waits for its sends at the end of its step).
struct Exchange {
  PendingCollective received, sent;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // In place: every rank ends with the elementwise sum.
  void all_reduce_sum(torch::Tensor& tensor) { all_reduce_sum_async(tensor).wait(); }
  // full has world_size × shard.numel() elements; this rank's shard receives the sum of its slice.
  void reduce_scatter_sum(const torch::Tensor& full, torch::Tensor& shard) { reduce_scatter_sum_async(full, shard).wait(); }
  // The same, started now and finished by wait(): gradients are reduced while backward goes on.
  // Every rank must start the same collectives in the same order.
  virtual PendingCollective all_reduce_sum_async(torch::Tensor& tensor) = 0;
  virtual PendingCollective reduce_scatter_sum_async(const torch::Tensor& full, torch::Tensor& shard) = 0;
  // full has world_size × shard.numel() elements; slice r receives rank r's shard.
  virtual void all_gather(const torch::Tensor& shard, torch::Tensor& full) = 0;
  virtual void broadcast(torch::Tensor& tensor, int root) = 0;
  virtual void barrier() = 0;
  // Slice r of input (along dim 0) goes to rank r, slice r of output comes from rank r. Empty
  // row counts: world_size equal slices; otherwise input_rows[r] and output_rows[r] rows each (the
  // receiver must know them: expert parallelism sends its counts first).
  void all_to_all(const torch::Tensor& input, torch::Tensor& output, const std::vector<int64_t>& input_rows = {}, const std::vector<int64_t>& output_rows = {}) {
    all_to_all_async(input, output, input_rows, output_rows).wait();
  }
  // The same, started now: output is filled once wait() returns (expert parallelism computes the
  // shared experts while the routed rows travel).
  virtual PendingCollective all_to_all_async(const torch::Tensor& input, torch::Tensor& output, const std::vector<int64_t>& input_rows = {},
                                             const std::vector<int64_t>& output_rows = {}) = 0;
  // Point to point within the group (ranks are group ranks); the receiver's tensor has the
  // sender's shape and dtype. `tag` tells apart streams of messages between the same two ranks
  // (Gloo matches by it; NCCL delivers in order). A send is done once wait() returns; recv blocks.
  virtual PendingCollective send_async(const torch::Tensor& tensor, int to, int tag = 0) = 0;
  virtual void recv(torch::Tensor& tensor, int from, int tag = 0) = 0;
  void send(const torch::Tensor& tensor, int to, int tag = 0) { send_async(tensor, to, tag).wait(); }
  // Sends and receives issued as one group. Over NCCL, one ncclGroupStart/End (c10d's coalescing,
  // as torch.distributed.batch_isend_irecv): NCCL matches a pair's messages in order and a large
  // send waits for its receive, so two ranks that each send to the other before receiving would
  // stall if the operations went one by one. Elsewhere (Gloo queues sends) send_async and recv in
  // list order: the receives are done on return.
  virtual Exchange exchange(const std::vector<PointToPoint>& operations);
};

// The run's one rendezvous (rank 0 hosts the TCPStore); every group is made from it under a name
// of its own, so that one port serves the world and each dimension of the device mesh.
class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // A group of the ranks that call this with the same name: this rank is group_rank of group_size.
  // Every member must call it (in the same order as the other groups it belongs to).
  virtual std::unique_ptr<Communicator> group(const std::string& name, int group_rank, int group_size) = 0;
};
std::unique_ptr<Rendezvous> open_rendezvous(const RendezvousOptions& options);

// Connects to the TCPStore at master_addr:master_port (rank 0 hosts it) and builds the world's group.
std::unique_ptr<Communicator> connect_communicator(const RendezvousOptions& options);

// A group of one: every collective is the identity. Used when world_size == 1.
std::unique_ptr<Communicator> single_process_communicator();

}  // namespace dsrun
