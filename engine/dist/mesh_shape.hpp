// Where each rank sits in the run's grid of parallel dimensions: pipeline × data × tensor, with
// tensor innermost (consecutive ranks, so a tensor-parallel group stays inside a node). Torch-free.
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

struct MeshShape {
  int pipeline = 1, data = 1, tensor = 1;
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
  std::string describe() const {
    return "pipeline " + std::to_string(pipeline) + " × data " + std::to_string(data) + " × tensor " + std::to_string(tensor);
  }
};

}  // namespace dsrun
