// Where each rank sits in the run's grid of parallel dimensions: pipeline × data × tensor, with
// tensor innermost (consecutive ranks, so a tensor-parallel group stays inside a node), and the
// context and expert groups folded into data (ranks that hold the same parameters). Torch-free.
#pragma once

#include <array>
#include <string>
#include <vector>

namespace dsrun {

enum class MeshDim { Pipeline, Data, Tensor };

// One table for the dimensions' names (group names, messages, docs), outermost first.
inline constexpr std::array<std::pair<MeshDim, const char*>, 3> kMeshDims{{{MeshDim::Pipeline, "pipeline"}, {MeshDim::Data, "data"}, {MeshDim::Tensor, "tensor"}}};

inline const char* to_string(MeshDim d) {
  for (const auto& [dim, name] : kMeshDims)
    if (dim == d) return name;
  return "?";
}

struct MeshCoordinates {
  int pipeline = 0, data = 0, tensor = 0;
  int operator[](MeshDim d) const { return d == MeshDim::Pipeline ? pipeline : d == MeshDim::Data ? data : tensor; }
  int& operator[](MeshDim d) { return d == MeshDim::Pipeline ? pipeline : d == MeshDim::Data ? data : tensor; }
};

// Expert parallelism is carved out of the data dimension (as Megatron-LM and torchtitan fold it):
// data coordinate d holds expert shard d % expert of replica d / expert. The `expert` data ranks
// of one replica (consecutive, so inside a node) hold one shard of the routed experts each and
// exchange tokens by all-to-all; the data ranks with the same shard (d % expert equal) hold the
// same experts and reduce their gradients together.
enum class ExpertGroup { Shards, Replicas };

// Context parallelism also lives in the data dimension (Megatron-Core reduces gradients over
// data × context as one group): the mesh's data ranks are the batch's replicas × context, and the
// `context` consecutive data ranks of one replica split each of its sequences between them
// (engine/parallel/context_parallel.hpp). Every data rank holds the same parameters, so ZeRO and
// the gradients' reduction span them all; only the batch a rank reads and the attention's keys
// tell replicas and context ranks apart.
struct MeshShape {
  int pipeline = 1, data = 1, tensor = 1;
  int expert = 1;   // divides data
  int context = 1;  // divides data: data / context replicas of the batch
  int size() const { return pipeline * data * tensor; }
  int operator[](MeshDim d) const { return d == MeshDim::Pipeline ? pipeline : d == MeshDim::Data ? data : tensor; }

  // rank = (pipeline · data + data) · tensor + tensor
  int rank_of(const MeshCoordinates& c) const { return (c.pipeline * data + c.data) * tensor + c.tensor; }
  MeshCoordinates coordinates_of(int rank) const {
    MeshCoordinates c;
    c.tensor = rank % tensor;
    c.data = rank / tensor % data;
    c.pipeline = rank / (tensor * data);
    return c;
  }
  // The ranks of `rank`'s group along `d`, in group-rank order (member i has coordinate i along d).
  std::vector<int> group_of(int rank, MeshDim d) const {
    std::vector<int> ranks;
    MeshCoordinates c = coordinates_of(rank);
    for (int i = 0; i < (*this)[d]; ++i) {
      c[d] = i;
      ranks.push_back(rank_of(c));
    }
    return ranks;
  }
  // The group's name, the same on every member: the dimension and the other two coordinates.
  std::string group_name(int rank, MeshDim d) const {
    MeshCoordinates c = coordinates_of(rank);
    c[d] = 0;
    return std::string(to_string(d)) + "/" + std::to_string(rank_of(c));
  }
  // Shards: the ranks of `rank`'s expert-parallel group (shard i is member i); Replicas: the data
  // ranks holding the same expert shard as `rank` (replica i is member i).
  std::vector<int> expert_group_of(int rank, ExpertGroup g) const {
    std::vector<int> ranks;
    MeshCoordinates c = coordinates_of(rank);
    const int shard = c.data % expert, replica = c.data / expert;
    for (int i = 0; i < (g == ExpertGroup::Shards ? expert : data / expert); ++i) {
      c.data = g == ExpertGroup::Shards ? replica * expert + i : i * expert + shard;
      ranks.push_back(rank_of(c));
    }
    return ranks;
  }
  int expert_shard(int rank) const { return coordinates_of(rank).data % expert; }
  // The batch's replica `rank` reads, and its place in that replica's context group.
  int replica(int rank) const { return coordinates_of(rank).data / context; }
  int context_rank(int rank) const { return coordinates_of(rank).data % context; }
  // The ranks splitting `rank`'s sequences (context rank i is member i), and the group's name.
  std::vector<int> context_group_of(int rank) const {
    std::vector<int> ranks;
    MeshCoordinates c = coordinates_of(rank);
    const int first = c.data / context * context;
    for (int i = 0; i < context; ++i) {
      c.data = first + i;
      ranks.push_back(rank_of(c));
    }
    return ranks;
  }
  std::string context_group_name(int rank) const { return "context/" + std::to_string(context_group_of(rank).front()); }
  int expert_replica(int rank) const { return coordinates_of(rank).data / expert; }
  // The group's name, the same on every member: its kind and its first member.
  std::string expert_group_name(int rank, ExpertGroup g) const {
    return std::string(g == ExpertGroup::Shards ? "expert" : "expert-replicas") + "/" + std::to_string(expert_group_of(rank, g).front());
  }
  std::string describe() const {
    return "pipeline " + std::to_string(pipeline) + " × data " + std::to_string(data) + " × tensor " + std::to_string(tensor) +
           (context > 1 ? " (context " + std::to_string(context) + " within data)" : "") + (expert > 1 ? " (expert " + std::to_string(expert) + " within data)" : "");
  }
};

}  // namespace dsrun
