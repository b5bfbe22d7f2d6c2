// The device mesh: this rank's communicators along each named dimension (pipeline, data, tensor),
// the expert and context groups within data, and the world's, all made from the run's one
// rendezvous. Layout rules live in mesh_shape.hpp.
#pragma once

#include "engine/dist/communicator.hpp"
#include "engine/recipe/mesh_shape.hpp"

#include <memory>

namespace dsrun {

class DeviceMesh {
 public:
  DeviceMesh(const MeshShape& shape, int rank, std::unique_ptr<Communicator> world, std::array<std::unique_ptr<Communicator>, 3> groups,
             std::array<std::unique_ptr<Communicator>, 2> expert_groups, std::unique_ptr<Communicator> context_group)
      : shape_(shape), rank_(rank), coordinates_(shape.coordinates_of(rank)), world_(std::move(world)), groups_(std::move(groups)),
        expert_groups_(std::move(expert_groups)), context_group_(std::move(context_group)) {}

  const MeshShape& shape() const { return shape_; }
  const MeshCoordinates& coordinates() const { return coordinates_; }
  int rank() const { return rank_; }
  Communicator& world() { return *world_; }
  Communicator& along(MeshDim d) { return *groups_[static_cast<size_t>(d)]; }
  // Without expert parallelism: Shards is a group of one, Replicas the data group's ranks.
  Communicator& experts(ExpertGroup g) { return *expert_groups_[static_cast<size_t>(g)]; }
  // The ranks splitting this rank's sequences (a group of one without context parallelism).
  Communicator& context() { return *context_group_; }
  // The first pipeline stage reads the batch; the last computes the loss.
  bool first_stage() const { return coordinates_.pipeline == 0; }
  bool last_stage() const { return coordinates_.pipeline == shape_.pipeline - 1; }

 private:
  MeshShape shape_;
  int rank_;
  MeshCoordinates coordinates_;
  std::unique_ptr<Communicator> world_;
  std::array<std::unique_ptr<Communicator>, 3> groups_;  // indexed by MeshDim
  std::array<std::unique_ptr<Communicator>, 2> expert_groups_;  // indexed by ExpertGroup
  std::unique_ptr<Communicator> context_group_;
};

// Every rank builds the world's group, then its three groups, its two expert groups and its
// context group, in the same order (c10d needs every member of a group to create it).
// options.world_size must be shape.size().
std::unique_ptr<DeviceMesh> connect_mesh(const RendezvousOptions& options, const MeshShape& shape);

}  // namespace dsrun
