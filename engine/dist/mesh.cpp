#include "engine/dist/mesh.hpp"

#include "engine/common/error.hpp"

#include <algorithm>

namespace dsrun {

std::unique_ptr<DeviceMesh> connect_mesh(const RendezvousOptions& o, const MeshShape& shape) {
  DSRUN_ASSERT(shape.size() == o.world_size, "the mesh's size is the world size (checked by the recipe)");
  std::unique_ptr<Rendezvous> rendezvous = open_rendezvous(o);
  std::unique_ptr<Communicator> world = rendezvous->group("world", o.rank, o.world_size);
  std::array<std::unique_ptr<Communicator>, 3> groups;
  for (const auto& entry : kMeshDims) {
    const MeshDim dim = entry.first;
    groups[static_cast<size_t>(dim)] = rendezvous->group(shape.group_name(o.rank, dim), shape.coordinates_of(o.rank)[dim], shape[dim]);
  }
  std::array<std::unique_ptr<Communicator>, 2> expert_groups;
  for (ExpertGroup g : {ExpertGroup::Shards, ExpertGroup::Replicas}) {
    const std::vector<int> members = shape.expert_group_of(o.rank, g);
    const int me = static_cast<int>(std::find(members.begin(), members.end(), o.rank) - members.begin());
    expert_groups[static_cast<size_t>(g)] = rendezvous->group(shape.expert_group_name(o.rank, g), me, static_cast<int>(members.size()));
  }
  const std::vector<int> context_members = shape.context_group_of(o.rank);
  std::unique_ptr<Communicator> context = rendezvous->group(shape.context_group_name(o.rank), shape.context_rank(o.rank), static_cast<int>(context_members.size()));
  return std::make_unique<DeviceMesh>(shape, o.rank, std::move(world), std::move(groups), std::move(expert_groups), std::move(context));
}

}  // namespace dsrun
