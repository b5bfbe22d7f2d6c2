// Engine tests' shared pieces: ranks as forked processes joined by Gloo (a communicator, or a
// device mesh), the tiny decoders and random token batches they train on.
#pragma once

#include "engine/checkpoint/export.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/dist/communicator.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/tensor_parallel.hpp"
#include "engine/train/loss.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace dsrun::test {

inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Runs `body(rank, port)` in `world` forked processes; true if every one returned true.
inline bool in_forked_ranks(int world, const std::function<bool(int rank, int port)>& body) {
  const int port = free_port();
  std::vector<pid_t> children;
  for (int r = 0; r < world; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      torch::set_num_threads(1);
      bool ok = false;
      try {
        ok = body(r, port);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      _exit(ok ? 0 : 1);
    }
    children.push_back(pid);
  }
  bool all = true;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    all &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return all;
}

inline RendezvousOptions local_rendezvous(int rank, int world, int port) {
  RendezvousOptions o;
  o.master_port = port;
  o.rank = rank;
  o.world_size = world;
  o.timeout_s = 30;
  return o;
}

// Runs `body(rank, comm)` in `world` processes joined by one Gloo group.
inline bool in_processes(int world, const std::function<bool(int, Communicator&)>& body) {
  return in_forked_ranks(world, [&](int rank, int port) {
    auto comm = connect_communicator(local_rendezvous(rank, world, port));
    return body(rank, *comm);
  });
}

// Runs `body(mesh)` on every rank of a mesh of `shape`.
inline bool in_mesh(const MeshShape& shape, const std::function<bool(DeviceMesh&)>& body) {
  return in_forked_ranks(shape.size(), [&](int rank, int port) {
    auto mesh = connect_mesh(local_rendezvous(rank, shape.size(), port), shape);
    return body(*mesh);
  });
}

inline ModelSpec tiny_decoder() {
  ModelSpec m;
  m.hidden = 32;
  m.layers = 2;
  m.heads = 4;
  m.kv_heads = 2;
  m.intermediate = 48;
  m.vocab = 64;
  m.max_seq_len = 16;
  return m;
}

// The tiny decoder with DeepSeek-MoE layers after the first: `experts` routed, top-2, one shared.
inline ModelSpec tiny_moe_decoder(int experts) {
  ModelSpec m = tiny_decoder();
  m.moe.routed_experts = experts;
  m.moe.shared_experts = 1;
  m.moe.top_k = 2;
  m.moe.intermediate = 16;
  m.moe.first_dense_layers = 1;
  return m;
}

// A tiny DeepSeek-V3: MLA with a query latent, YaRN, one dense block then MoE blocks of 8 experts
// in 4 groups (2 kept, top-2, sigmoid, normalised, scaled), one shared expert, a sequence-wise
// balance loss and one MTP module.
inline ModelSpec tiny_v3_decoder() {
  ModelSpec m = tiny_decoder();
  m.kv_heads = m.heads;
  m.attention = AttentionKind::Mla;
  m.mla.q_lora_rank = 16;
  m.mla.kv_lora_rank = 16;
  m.mla.qk_nope_head_dim = 8;
  m.mla.qk_rope_head_dim = 4;
  m.mla.v_head_dim = 8;
  m.rope_scaling.kind = RopeScalingKind::Yarn;
  m.rope_scaling.factor = 4;
  m.rope_scaling.original_max_position_embeddings = 8;
  m.rope_scaling.mscale = 1;
  m.rope_scaling.mscale_all_dim = 0.8;
  m.moe.routed_experts = 8;
  m.moe.shared_experts = 1;
  m.moe.top_k = 2;
  m.moe.intermediate = 16;
  m.moe.first_dense_layers = 1;
  m.moe.scoring = RouterScore::Sigmoid;
  m.moe.n_group = 4;
  m.moe.topk_group = 2;
  m.moe.norm_topk_prob = true;
  m.moe.routed_scaling_factor = 2.5;
  m.moe.balance = MoeBalance::Bias;
  m.moe.seq_aux_loss_weight = 0.01;
  m.mtp.depth = 1;
  m.mtp.loss_weight = 0.3;
  m.init_std = 0.1;  // routing decided by clear margins, not rounding
  return m;
}

inline Batch token_batch(int64_t b, int64_t s, int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  Batch batch;
  batch.inputs = torch::randint(vocab, {b, s}, torch::kInt64);
  batch.targets = torch::randint(vocab, {b, s}, torch::kInt64);
  batch.items = b * s;
  return batch;
}

// The model's parameters under their Hugging Face names (export.hpp's pieces), F32, added to
// `writer`; `keep` holds the rows the writer points at until it writes them.
inline void add_hf_weights(Model& model, const ModelSpec& m, SafetensorsWriter& writer, std::vector<torch::Tensor>& keep) {
  for (const auto& p : model.module().named_parameters())
    for (const auto& piece : hf_pieces(p.key(), p.value().sizes().vec(), m)) {
      keep.push_back(p.value().detach().narrow(0, piece.row_begin, piece.rows).contiguous());
      writer.add(piece.name, "F32", keep.back().sizes().vec(), keep.back().data_ptr());
    }
}

// One process's loss, and after its backward every parameter's gradient (by name) with its split
// and the gradients' global norm: what a parallel layout must reproduce.
struct Reference {
  double loss = 0, norm = 0;
  std::map<std::string, torch::Tensor> grads;
  std::map<std::string, TensorSplit> splits;
};

inline void collect_gradients(Model& model, Reference& r) {
  double sq = 0;
  for (auto& unit : model.parameter_units())
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const torch::Tensor& g = unit.params[i].grad();  // (an expert no token chose has none)
      r.grads[unit.names[i]] = g.defined() ? g.clone() : torch::zeros_like(unit.params[i]);
      r.splits[unit.names[i]] = unit.splits[i];
      sq += r.grads[unit.names[i]].pow(2).sum().item<double>();
    }
  r.norm = std::sqrt(sq);
}

// After one backward on a mesh: this rank's loss (`loss`, the mean over the data ranks), the
// global norm and, at ZeRO-0, every gradient it holds (divided by the data ranks it was summed
// over; cut to this rank's tensor slice) within 1e-5 of one process's. Differences go to stderr.
inline bool matches_reference(DeviceMesh& mesh, Model& model, double loss, double norm, const Reference& ref, int zero_stage) {
  bool ok = std::fabs(loss - ref.loss) <= 1e-5 * std::fabs(ref.loss);
  if (!ok) std::fprintf(stderr, "rank %d: loss %.8f vs %.8f\n", mesh.rank(), loss, ref.loss);
  if (std::fabs(norm - ref.norm) > 1e-5 * ref.norm) {
    std::fprintf(stderr, "rank %d: norm %.8f vs %.8f\n", mesh.rank(), norm, ref.norm);
    ok = false;
  }
  if (zero_stage > 0) return ok;  // sharded gradients: the norm covers them
  const int tp = mesh.shape().tensor, tp_rank = mesh.coordinates().tensor, dp = mesh.shape().data;
  for (auto& unit : model.parameter_units())
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const std::string& name = unit.names[i];
      torch::Tensor expected = tensor_slice(ref.grads.at(name), ref.splits.at(name), tp_rank, tp);
      torch::Tensor grad = unit.params[i].grad();  // ZeRO-0: summed over the data ranks (the optimizer divides)
      if (!grad.defined() || !torch::allclose(grad / dp, expected, 1e-5, 1e-6)) {
        std::fprintf(stderr, "rank %d: gradient of %s differs\n", mesh.rank(), name.c_str());
        ok = false;
      }
    }
  return ok;
}

// The loss of one forward on one rank (no tensor parallelism), as the trainer computes it.
inline MicroBatchLoss one_rank_loss(Model& model, const Batch& batch, UnitRunner& runner) {
  static std::unique_ptr<Communicator> single = single_process_communicator();
  static TensorParallel whole(*single);
  return micro_batch_loss(model.forward(batch, runner), batch, whole);
}

}  // namespace dsrun::test
