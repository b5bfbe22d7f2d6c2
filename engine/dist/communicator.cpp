#include "engine/dist/communicator.hpp"

#include "engine/common/error.hpp"
#include "engine/common/text.hpp"
#include "engine/common/torch_compat.hpp"

#ifdef DSRUN_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cstdlib>

namespace dsrun {

Exchange Communicator::exchange(const std::vector<PointToPoint>& operations) {
  std::vector<PendingCollective> sends;
  for (const PointToPoint& op : operations) {
    if (op.kind == PointToPoint::Send) {
      sends.push_back(send_async(op.tensor, op.peer, op.tag));
    } else {
      torch::Tensor into = op.tensor;  // shares op.tensor's storage
      recv(into, op.peer, op.tag);
    }
  }
  Exchange e;
  if (!sends.empty())
    e.sent = PendingCollective([sends]() mutable {
      for (PendingCollective& p : sends) p.wait();
    });
  return e;
}

namespace {

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  PendingCollective all_reduce_sum_async(torch::Tensor&) override { return {}; }
  PendingCollective reduce_scatter_sum_async(const torch::Tensor& full, torch::Tensor& shard) override {
    shard.copy_(full);
    return {};
  }
  void all_gather(const torch::Tensor& shard, torch::Tensor& full) override { full.copy_(shard); }
  void broadcast(torch::Tensor&, int) override {}
  void barrier() override {}
  PendingCollective all_to_all_async(const torch::Tensor& input, torch::Tensor& output, const std::vector<int64_t>&, const std::vector<int64_t>&) override {
    output.copy_(input);
    return {};
  }
  PendingCollective send_async(const torch::Tensor&, int, int) override {
    DSRUN_ASSERT(false, "send in a group of one");
    return {};
  }
  void recv(torch::Tensor&, int, int) override { DSRUN_ASSERT(false, "recv in a group of one"); }
};

// Collectives through a c10d process group. Gloo lacks reduce-scatter and bf16 on some versions:
// it reduces in fp32 and derives reduce-scatter from all-reduce (same result, twice the traffic).
class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<compat::CollectiveBackend> group, int rank, int world, bool nccl, int cuda_device)
      : group_(std::move(group)), rank_(rank), world_(world), nccl_(nccl), cuda_device_(cuda_device) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  // Collectives run on c10d's own stream (NCCL) or threads (Gloo); c10d keeps their tensors alive
  // until they finish, so callers may drop their references before wait().
  PendingCollective all_reduce_sum_async(torch::Tensor& tensor) override {
    torch::Tensor wire = on_wire(tensor);
    std::vector<torch::Tensor> tensors{wire};
    auto work = group_->allreduce(tensors);
    return PendingCollective([work, wire, tensor]() mutable {
      work->wait();
      if (!wire.is_same(tensor)) tensor.copy_(wire);
    });
  }

  PendingCollective reduce_scatter_sum_async(const torch::Tensor& full, torch::Tensor& shard) override {
    DSRUN_ASSERT(full.numel() == shard.numel() * world_, "reduce_scatter: full must be world_size x shard");
#ifdef DSRUN_WITH_NCCL
    if (nccl_) {  // flat buffers: NCCL's own reduce-scatter, no copies
      torch::Tensor in = full, out = shard;
      auto work = group_->_reduce_scatter_base(out, in);
      return PendingCollective([work]() { work->wait(); });
    }
#endif
    torch::Tensor reduced = on_wire(full).clone();
    std::vector<torch::Tensor> tensors{reduced};
    auto work = group_->allreduce(tensors);
    const int64_t begin = rank_ * shard.numel();
    return PendingCollective([work, reduced, shard, begin]() mutable {
      work->wait();
      shard.copy_(reduced.narrow(0, begin, shard.numel()));
    });
  }

  void all_gather(const torch::Tensor& shard, torch::Tensor& full) override {
    DSRUN_ASSERT(full.numel() == shard.numel() * world_, "all_gather: full must be world_size x shard");
#ifdef DSRUN_WITH_NCCL
    if (nccl_) {
      torch::Tensor in = shard.contiguous(), out = full;
      group_->_allgather_base(out, in)->wait();
      return;
    }
#endif
    torch::Tensor wire_full = on_wire(full);
    std::vector<torch::Tensor> inputs{on_wire(shard).contiguous()};
    std::vector<std::vector<torch::Tensor>> outputs(1);
    for (int r = 0; r < world_; ++r) outputs[0].push_back(wire_full.narrow(0, r * shard.numel(), shard.numel()));
    group_->allgather(outputs, inputs)->wait();
    if (!wire_full.is_same(full)) full.copy_(wire_full);
  }

  void broadcast(torch::Tensor& tensor, int root) override {
    torch::Tensor wire = on_wire(tensor);
    std::vector<torch::Tensor> tensors{wire};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    group_->broadcast(tensors, options)->wait();
    if (!wire.is_same(tensor)) tensor.copy_(wire);
  }

  void barrier() override { group_->barrier()->wait(); }

  PendingCollective all_to_all_async(const torch::Tensor& input, torch::Tensor& output, const std::vector<int64_t>& input_rows,
                                     const std::vector<int64_t>& output_rows) override {
    DSRUN_ASSERT(input_rows.size() == output_rows.size() && (input_rows.empty() || static_cast<int>(input_rows.size()) == world_), "all_to_all: one row count per rank");
    DSRUN_ASSERT(!input_rows.empty() || (input.numel() == output.numel() && input.size(0) % world_ == 0), "all_to_all: equal slices per rank");
    torch::Tensor in = on_wire(input).contiguous(), out = on_wire(output);
    if (!out.is_contiguous()) out = out.contiguous();
    std::vector<int64_t> in_rows = input_rows, out_rows = output_rows;  // (c10d takes them by reference)
    auto work = group_->alltoall_base(out, in, out_rows, in_rows);
    return PendingCollective([work, in, out, output]() mutable {
      work->wait();
      if (!out.is_same(output)) output.copy_(out);
    });
  }

  PendingCollective send_async(const torch::Tensor& tensor, int to, int tag) override {
    torch::Tensor wire = on_wire(tensor).contiguous();
    std::vector<torch::Tensor> tensors{wire};
    auto work = group_->send(tensors, to, tag);
    return PendingCollective([work, wire]() { work->wait(); });
  }

  void recv(torch::Tensor& tensor, int from, int tag) override {
    torch::Tensor wire = on_wire(tensor);
    if (!wire.is_contiguous()) wire = wire.contiguous();
    std::vector<torch::Tensor> tensors{wire};
    group_->recv(tensors, from, tag)->wait();
    if (!wire.is_same(tensor)) tensor.copy_(wire);
  }

  // NCCL: one group, done when all its operations are (NCCL ignores tags). The wait orders this
  // rank's stream after the group, sends included; the closure keeps every tensor alive until then.
  Exchange exchange(const std::vector<PointToPoint>& operations) override {
    if (!nccl_ || operations.empty()) return Communicator::exchange(operations);
    std::vector<torch::Tensor> wires;
    for (const PointToPoint& op : operations) {
      torch::Tensor wire = on_wire(op.tensor);
      wires.push_back(wire.is_contiguous() ? wire : wire.contiguous());
    }
    auto works = compat::coalesced(*group_, [&](std::vector<c10::intrusive_ptr<c10d::Work>>& started) {
      for (size_t i = 0; i < operations.size(); ++i) {
        std::vector<torch::Tensor> tensors{wires[i]};
        const PointToPoint& op = operations[i];
        started.push_back(op.kind == PointToPoint::Send ? group_->send(tensors, op.peer, op.tag) : group_->recv(tensors, op.peer, op.tag));
      }
    });
    Exchange e;
    e.received = PendingCollective([works, wires, operations]() mutable {
      for (auto& w : works) w->wait();
      for (size_t i = 0; i < operations.size(); ++i)
        if (operations[i].kind == PointToPoint::Receive && !wires[i].is_same(operations[i].tensor)) operations[i].tensor.copy_(wires[i]);
    });
    return e;
  }

 private:
  // Gloo reduces bf16 in fp32 (not every Gloo build has bf16 kernels); NCCL needs CUDA tensors,
  // so CPU scalars (metrics, norms) travel through this rank's GPU.
  torch::Tensor on_wire(const torch::Tensor& t) const {
    if (!nccl_ && t.scalar_type() == torch::kBFloat16) return t.to(torch::kFloat32);
    if (nccl_ && t.is_cpu()) return t.to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cuda_device_)));
    return t;
  }

  c10::intrusive_ptr<compat::CollectiveBackend> group_;
  int rank_, world_;
  bool nccl_;
  int cuda_device_;
};

}  // namespace

std::unique_ptr<Communicator> single_process_communicator() { return std::make_unique<SingleProcess>(); }

namespace {

class StoreRendezvous final : public Rendezvous {
 public:
  StoreRendezvous(c10::intrusive_ptr<c10d::Store> store, const RendezvousOptions& o) : store_(std::move(store)), o_(o) {}

  std::unique_ptr<Communicator> group(const std::string& name, int group_rank, int group_size) override {
    if (group_size == 1) return single_process_communicator();
    auto store = c10::make_intrusive<c10d::PrefixStore>(name, store_);
    auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000));
    if (o_.use_nccl) {
#ifdef DSRUN_WITH_NCCL
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = timeout;
      auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, group_rank, group_size, options);
      return std::make_unique<ProcessGroupCommunicator>(group, group_rank, group_size, true, o_.cuda_device);
#else
      ErrorContext c;
      c.rank = o_.rank;
      c.hint = "build dsrun against a CUDA libtorch with NCCL (README: A GPU machine)";
      throw Error("this dsrun was built without NCCL", c);
#endif
    }
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = timeout;
    // One machine: loopback. Several: the interface named by GLOO_SOCKET_IFNAME, else the host's name.
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (o_.master_addr == "127.0.0.1" || o_.master_addr == "localhost")
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, group_rank, group_size, options);
    return std::make_unique<ProcessGroupCommunicator>(group, group_rank, group_size, false, 0);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  RendezvousOptions o_;
};

// A world of one: every group is a group of one.
class SingleProcessRendezvous final : public Rendezvous {
 public:
  std::unique_ptr<Communicator> group(const std::string&, int, int group_size) override {
    DSRUN_ASSERT(group_size == 1, "a world of one has groups of one");
    return single_process_communicator();
  }
};

// Every rank posts its identity; rank 0 reads every other's, the others read rank 0's. Whoever
// finds a difference refuses to go on, naming it, so both nodes of a mismatch stop at once (the
// other side's wait ends with its own error, or with the launcher's when the run stops).
void agree_on_identity(c10d::Store& store, const RendezvousOptions& o) {
  auto as_bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  auto key = [](int rank) { return "dsrun/identity/" + std::to_string(rank); };
  store.set(key(o.rank), as_bytes(o.identity));
  auto refuse = [&](int other, const std::string& theirs) {
    ErrorContext c;
    c.rank = o.rank;
    c.hint = "start every node with the same recipe, the same --set overrides and the same dsrun build";
    throw Error("rank " + std::to_string(other) + " runs other settings than this rank (" + std::to_string(o.rank) +
                    "), so the run cannot start: " + join(settings_differences(o.identity, theirs), "; "),
                c);
  };
  for (int other = o.rank == 0 ? 1 : 0; other < (o.rank == 0 ? o.world_size : 1); ++other) {
    const std::vector<uint8_t> bytes = store.get(key(other));
    const std::string theirs(bytes.begin(), bytes.end());
    if (theirs != o.identity) refuse(other, theirs);
  }
}

}  // namespace

std::unique_ptr<Rendezvous> open_rendezvous(const RendezvousOptions& o) {
  if (o.world_size == 1) return std::make_unique<SingleProcessRendezvous>();
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(o.master_port);
  store_options.isServer = o.rank == 0;
  store_options.numWorkers = o.world_size;
  store_options.waitWorkers = true;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, store_options);
  } catch (const std::exception& e) {
    ErrorContext c;
    c.rank = o.rank;
    c.hint = "check MASTER_ADDR/MASTER_PORT and that every rank started";
    throw Error("rendezvous at " + o.master_addr + ":" + std::to_string(o.master_port) + " failed: " + e.what(), c);
  }
  if (!o.identity.empty()) agree_on_identity(*store, o);
  return std::make_unique<StoreRendezvous>(store, o);
}

std::unique_ptr<Communicator> connect_communicator(const RendezvousOptions& o) {
  return open_rendezvous(o)->group("world", o.rank, o.world_size);
}

}  // namespace dsrun
