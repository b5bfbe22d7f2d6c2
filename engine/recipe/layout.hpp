// The layout: one torch-free value for how a run is laid out (degrees, schedule, ZeRO, micro batch,
// recomputation, offload) and the one place its rules live (read by the recipe, the search, the plan).
#pragma once

#include "engine/recipe/mesh_shape.hpp"
#include "engine/recipe/load.hpp"
#include "engine/recipe/recipe.hpp"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

// Degrees multiply to the world: pipeline × data × context × tensor; expert is carved out of data.
// `data` counts the batch's replicas; each replica's sequences are split over `context` ranks.
struct Layout {
  int pipeline = 1, data = 1, tensor = 1, expert = 1, context = 1;
  PipelineScheduleKind schedule = PipelineScheduleKind::OneFOneB;
  int virtual_stages = 1;
  bool sequence_parallel = false;
  int zero_stage = 0;
  int64_t micro = 1;
  bool recomputation = false;  // full activation checkpointing
  Offload offload = Offload::None;
  bool delayed_update = false;

  int world() const { return pipeline * data * context * tensor; }
  int ranks_per_replica() const { return pipeline * context * tensor; }
  // The ranks holding the same parameters, over which ZeRO shards and gradients are reduced: the
  // replicas and their context ranks (the mesh's data dimension).
  int data_ranks() const { return data * context; }
  MeshShape mesh_shape() const;
  // The keys that pin this layout in a rank's config (or as --set overrides): the rank reads these
  // and nothing else, so it runs the layout the plan chose.
  std::vector<std::pair<std::string, Value>> to_config_keys() const;
  std::string describe() const;  // "tensor 2 × pipeline 4 (interleaved × 2) × data 2 (expert 2), sequence-parallel"
  bool operator==(const Layout& o) const;
  bool operator!=(const Layout& o) const { return !(*this == o); }
};

// Which fields of a Layout are decided. The recipe's own check knows only what it fixes; the
// search decides the degrees; the planner decides ZeRO stage, micro batch and recomputation.
struct LayoutDecided {
  bool tensor = true, pipeline = true, data = true, expert = true, context = true, schedule = true, virtual_stages = true, sequence_parallel = true;
  bool zero_stage = true, micro = true, offload = true;
};

// A rule the layout breaks, on the key to change, with a fix (the recipe's errors print these
// with the key's file:line:col; the search prints the message).
struct LayoutProblem {
  std::string key;
  std::string message;
  std::string fix;
  std::vector<std::string> related;  // keys that take part (the error points at the one the user wrote last)
};

// Every rule of every layout, in one place: the model divides by the degrees, the degrees fit the
// hardware, tensor groups stay inside a node, the batch splits, the schedule can be built, ZeRO
// and offload agree. Reads only the recipe's model, hardware, batch and parallel options.
std::vector<LayoutProblem> layout_problems(const Recipe& recipe, const Layout& layout, const LayoutDecided& decided = {});
// With the ZeRO stage left to the planner: none when some stage 0-3 can run the layout, else the
// first rule each stage breaks, ZeRO-3's first (the stage offloading parameters needs).
std::vector<LayoutProblem> problems_at_every_stage(const Recipe& recipe, const Layout& layout, const LayoutDecided& decided);

// The recipe's fixed values as a Layout (searched keys hold their placeholders), and which are decided.
Layout layout_of_recipe(const Recipe& recipe, LayoutDecided* decided = nullptr);
// The recipe with every layout key taken from `layout` (nothing left to search).
Recipe with_layout(const Recipe& recipe, const Layout& layout);
// Only the degrees, schedule and sequence parallelism: the ZeRO stage, micro batch and
// recomputation stay as the recipe says (the planner chooses them when "auto").
Recipe with_degrees(const Recipe& recipe, const Layout& layout);

// Where the ranks of a layout sit: rank r on node r / ranks_per_node (the launcher's placement).
struct Placement {
  int nodes = 1, ranks_per_node = 1;
  int node_of(int rank) const { return rank / ranks_per_node; }
  // Nodes the ranks start, start + stride, ... (count of them) span: a mesh dimension's group.
  // Computed, not listed: a data group of a 100,000-node cluster has hundreds of millions of ranks.
  int nodes_spanned(int64_t start, int64_t stride, int64_t count) const;
};
Placement placement_of(const HardwareSpec& hardware, const Layout& layout);

}  // namespace dsrun
