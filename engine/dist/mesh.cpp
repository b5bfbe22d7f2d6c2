#include "engine/dist/mesh.hpp"

#include "engine/common/error.hpp"

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
  return std::make_unique<DeviceMesh>(shape, o.rank, std::move(world), std::move(groups));
}

}  // namespace dsrun
