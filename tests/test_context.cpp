// Context parallelism on real Gloo processes: the zigzag split of a sequence, and attention over
// it by all-gathered keys and values against one process's causal attention, forward and gradients.
#include "engine/common/torch_compat.hpp"
#include "engine/parallel/context_parallel.hpp"
#include "engine_util.hpp"

#include <catch2/catch.hpp>

using namespace dsrun;
using dsrun::test::in_mesh;

TEST_CASE("the zigzag split gives every place of the sequence to one rank and every rank the same share of causal attention", "[engine][context]") {
  for (int ranks : {1, 2, 4}) {
    const ZigzagSplit split{ranks, 8 * ranks};
    std::vector<int> owners(static_cast<size_t>(split.seq_len), 0);
    std::vector<int64_t> pairs;  // (query, key) pairs each rank computes under the causal mask
    for (int r = 0; r < ranks; ++r) {
      const torch::Tensor places = split.positions(r);
      REQUIRE(places.size(0) == split.seq_len / ranks);
      int64_t seen = 0;
      for (int64_t i = 0; i < places.size(0); ++i) {
        ++owners[static_cast<size_t>(places[i].item<int64_t>())];
        seen += places[i].item<int64_t>() + 1;
      }
      pairs.push_back(seen);
      // take() cuts the same places out of a tensor whose values are their places.
      const torch::Tensor whole = torch::arange(split.seq_len, torch::kInt64).view({1, -1});
      CHECK(torch::equal(split.take(whole, r).view({-1}), places));
    }
    CHECK(std::count(owners.begin(), owners.end(), 1) == split.seq_len);
    CHECK(std::adjacent_find(pairs.begin(), pairs.end(), std::not_equal_to<>()) == pairs.end());
  }
}

TEST_CASE("context ranks sit in the data dimension: consecutive data ranks of one replica, tensor ranks apart", "[engine][context][mesh]") {
  // data 2 replicas x context 2 x tensor 2: mesh data 4, rank = data · 2 + tensor.
  MeshShape s;
  s.data = 4, s.tensor = 2, s.context = 2;
  CHECK(s.size() == 8);
  CHECK(s.context_group_of(0) == std::vector<int>{0, 2});
  CHECK(s.context_group_of(5) == std::vector<int>{5, 7});  // data 2 = replica 1, context rank 0
  CHECK(s.replica(5) == 1);
  CHECK(s.context_rank(7) == 1);
  CHECK(s.group_of(5, MeshDim::Data) == std::vector<int>{1, 3, 5, 7});  // ZeRO's group: every replica's context ranks
  CHECK(s.context_group_name(7) == s.context_group_name(5));
  // Without context parallelism every rank is its own context group and its own replica.
  MeshShape plain;
  plain.data = 4;
  CHECK(plain.context_group_of(2) == std::vector<int>{2});
  CHECK(plain.replica(2) == 2);
}

namespace {

// One process's causal attention of q [b, s, heads, d] over k, v [b, s, kv_heads, d]: [b, s, heads, d].
torch::Tensor whole_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t group = q.size(2) / k.size(2);
  return compat::causal_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1), v.transpose(1, 2).repeat_interleave(group, 1))
      .transpose(1, 2);
}

bool matches_one_process(int ranks) {
  return in_mesh({1, ranks, 1}, [ranks](DeviceMesh& mesh) {
    Communicator& group = mesh.along(MeshDim::Data);
    const ZigzagSplit split{ranks, 4 * ranks};
    // The same inputs on every rank (one seed). The keys come in another order than one process's,
    // and libtorch 1.13's math attention takes its softmax in fp32: equal to about 1e-7, where a
    // wrong mask or a lost gradient is off by about 1.
    torch::manual_seed(11);
    const auto o = torch::TensorOptions().dtype(torch::kFloat64);
    const torch::Tensor q = torch::randn({2, split.seq_len, 4, 8}, o), k = torch::randn({2, split.seq_len, 2, 8}, o),
                        v = torch::randn({2, split.seq_len, 2, 8}, o), w = torch::randn({2, split.seq_len, 4, 8}, o);
    torch::Tensor q1 = q.clone().requires_grad_(), k1 = k.clone().requires_grad_(), v1 = v.clone().requires_grad_();
    const torch::Tensor whole = whole_attention(q1, k1, v1);
    (whole * w).sum().backward();
    // This rank's tokens; its share of the same loss. The sum over ranks of these losses is the
    // one above, so each rank's gradients of its own tokens must be the one process's.
    const int rank = group.rank();
    torch::Tensor qr = split.take(q, rank).requires_grad_(), kr = split.take(k, rank).requires_grad_(), vr = split.take(v, rank).requires_grad_();
    const torch::Tensor mine = context_parallel_attention(qr, kr, vr, split, group);
    (mine * split.take(w, rank)).sum().backward();
    const double tolerance = 1e-5;
    bool ok = torch::allclose(mine, split.take(whole, rank).detach(), tolerance, tolerance);
    ok &= torch::allclose(qr.grad(), split.take(q1.grad(), rank), tolerance, tolerance);
    ok &= torch::allclose(kr.grad(), split.take(k1.grad(), rank), tolerance, tolerance);
    ok &= torch::allclose(vr.grad(), split.take(v1.grad(), rank), tolerance, tolerance);
    return ok;
  });
}

}  // namespace

TEST_CASE("context parallelism on 2 and 4 ranks: attention over the zigzag split gives one process's output and gradients (GQA)", "[engine][context]") {
  CHECK(matches_one_process(2));
  CHECK(matches_one_process(4));
}
