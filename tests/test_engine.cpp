// Engine pieces in one process (and the communicator across real processes): collectives against
// a reference, MoE routing and balance loss, data readers, ResNet, imported weights, documents.
#include "engine/checkpoint/export.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/data/dataset.hpp"
#include "engine/data/token_source.hpp"
#include "engine/dist/communicator.hpp"
#include "engine/model/fused_ops.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/recompute.hpp"
#include "engine/parallel/zero.hpp"
#include "engine/train/checkpointing.hpp"
#include "engine/train/optimizer.hpp"
#include "engine_util.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace dsrun;

using dsrun::test::in_processes;
using dsrun::test::one_rank_loss;
using dsrun::test::tiny_decoder;
using dsrun::test::tiny_moe_decoder;
using dsrun::test::token_batch;

TEST_CASE("Gloo collectives agree with a reference on 3 processes, uneven sizes included", "[engine][comm]") {
  CHECK(in_processes(3, [](int rank, Communicator& comm) {
    const int world = comm.world_size();
    // all-reduce: sum of (rank + 1) * [0, 1, ..., 6]
    torch::Tensor t = torch::arange(7, torch::kFloat32) * (rank + 1);
    comm.all_reduce_sum(t);
    bool ok = torch::allclose(t, torch::arange(7, torch::kFloat32) * 6);
    // reduce-scatter of 3 x 5 elements (Gloo has none: derived from all-reduce) in fp32 and bf16
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      torch::Tensor full = (torch::arange(15, torch::kFloat32) + 100 * rank).to(dtype);
      torch::Tensor shard = torch::empty({5}, dtype);
      comm.reduce_scatter_sum(full, shard);
      torch::Tensor expected = torch::zeros({15});
      for (int r = 0; r < world; ++r) expected += torch::arange(15, torch::kFloat32) + 100 * r;
      ok &= torch::allclose(shard.to(torch::kFloat32), expected.narrow(0, rank * 5, 5), 1e-2);
    }
    // all-gather and broadcast
    torch::Tensor mine = torch::full({4}, static_cast<float>(rank));
    torch::Tensor gathered = torch::empty({12});
    comm.all_gather(mine, gathered);
    for (int r = 0; r < world; ++r) ok &= gathered.narrow(0, r * 4, 4).eq(static_cast<float>(r)).all().item<bool>();
    torch::Tensor b = torch::full({3}, rank == 2 ? 42.0f : -1.0f);
    comm.broadcast(b, 2);
    ok &= b.eq(42.0f).all().item<bool>();
    comm.barrier();
    return ok;
  }));
}

TEST_CASE("MoE: top-k routing, balance loss near its uniform value, gradients to router and chosen experts", "[engine][moe]") {
  ModelSpec m = tiny_moe_decoder(8);
  m.moe.aux_loss_weight = 0.01;
  torch::manual_seed(3);
  auto model = build_model(m, 16, {3});
  UnitRunner plain;
  MicroBatchLoss out = one_rank_loss(*model, token_batch(4, 16, m.vocab, 4), plain);
  // With near-uniform router scores, Σ f_i P_i ≈ 1, so the loss is close to its weight.
  CHECK(out.aux_loss == Approx(0.01).epsilon(0.2));
  out.loss.backward();
  int router_grads = 0, expert_grads = 0, experts = 0;
  for (auto& p : model->module().named_parameters()) {
    const std::string& name = p.key();
    if (name.find("router") != std::string::npos) router_grads += p.value().grad().defined() && p.value().grad().abs().sum().item<double>() > 0;
    if (name.find(".expert") != std::string::npos && name.find("gate_up.weight") != std::string::npos) {
      ++experts;
      expert_grads += p.value().grad().defined();
    }
  }
  CHECK(router_grads == 1);                // one MoE layer (the first layer is dense)
  CHECK(experts == 8);
  CHECK(expert_grads >= 2);                // 64 tokens x top-2 reach several experts
}

TEST_CASE("token shards: written, read back, windows cut, bad shards refused", "[engine][data]") {
  char pattern[] = "/tmp/dsrun-data-XXXXXX";
  std::string dir = ::mkdtemp(pattern);
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 1000; ++i) tokens.push_back(i % 300);
  write_file_atomic(dir + "/a.tokens", token_shard_bytes(tokens, 2));
  DataOptions data;
  data.kind = DataKind::Tokens;
  data.path = dir;
  data.val_fraction = 0.1;
  data.shuffle = false;
  ModelSpec m = tiny_decoder();
  m.vocab = 300;
  auto set = open_dataset(data, m, 8, 1);
  Batch b = set->train_batch(0, 2);
  CHECK(b.inputs.sizes() == std::vector<int64_t>({2, 8}));
  CHECK(b.inputs[1][0].item<int64_t>() == 8);        // window 1 starts at token 8
  CHECK(b.targets[0][0].item<int64_t>() == 1);       // targets are the next tokens
  // Shuffled order is a permutation, the same for the same seed.
  data.shuffle = true;
  auto a1 = open_dataset(data, m, 8, 5), a2 = open_dataset(data, m, 8, 5);
  CHECK(torch::equal(a1->train_batch(3, 4).inputs, a2->train_batch(3, 4).inputs));
  // A token outside the vocabulary, and a truncated shard, are errors naming the file.
  m.vocab = 100;
  CHECK_THROWS_WITH(open_dataset(data, m, 8, 1)->train_batch(0, 4), Catch::Contains("outside the vocabulary"));  // checked per batch: shards are mapped
  std::string bytes = read_file(dir + "/a.tokens");
  write_file_atomic(dir + "/a.tokens", bytes.substr(0, bytes.size() - 3));
  m.vocab = 300;
  CHECK_THROWS_WITH(open_dataset(data, m, 8, 1), Catch::Contains("does not match its size"));
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST_CASE("CIFAR-10 binary batches are read as normalised images with labels", "[engine][data]") {
  char pattern[] = "/tmp/dsrun-cifar-XXXXXX";
  std::string dir = ::mkdtemp(pattern);
  for (const char* name : {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin", "test_batch.bin"}) {
    std::string records;
    for (int i = 0; i < 4; ++i) {
      records.push_back(static_cast<char>(i % 10));  // label
      records.append(3072, static_cast<char>(i * 40));
    }
    write_file_atomic(dir + "/" + name, records);
  }
  DataOptions data;
  data.kind = DataKind::Cifar10;
  data.path = dir;
  data.shuffle = false;
  ModelSpec m;
  m.arch = ModelArch::ResNet;
  auto set = open_dataset(data, m, 0, 1);
  Batch b = set->train_batch(0, 4);
  CHECK(b.inputs.sizes() == std::vector<int64_t>({4, 3, 32, 32}));
  CHECK(b.targets[3].item<int64_t>() == 3);
  CHECK(b.inputs[0][0][0][0].item<float>() == Approx((0.0 - 0.4914) / 0.2470).epsilon(1e-4));
  CHECK(set->val_batch(0, 2).targets.size(0) == 2);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST_CASE("ResNet-18 trains a step on synthetic images and counts correct predictions", "[engine][resnet]") {
  ModelSpec m;
  m.arch = ModelArch::ResNet;
  m.resnet.depth = 18;
  m.resnet.width = 8;
  m.resnet.image_size = 16;
  DataOptions data;
  auto set = open_dataset(data, m, 0, 1);
  torch::manual_seed(1);
  auto model = build_model(m, 0, {1});
  UnitRunner plain;
  Batch images = set->train_batch(0, 8);
  MicroBatchLoss out = one_rank_loss(*model, images, plain);
  CHECK(std::isfinite(out.task_loss));
  CHECK(out.correct >= 0);
  CHECK(out.correct <= 8);
  out.loss.backward();
  CHECK(model->parameter_units().size() == 1 + 8 + 1);  // stem, 8 basic blocks, head
}

// ---- CUDA: these run only where a GPU is visible; elsewhere they say they were skipped.

TEST_CASE("CUDA: NCCL collectives agree with a reference on 2 GPUs", "[engine][cuda]") {
  // Counted from the driver's /proc entries: initialising CUDA here would break it in the forked ranks.
  if (read_host_facts().cuda_devices < 2) {
    WARN("SKIPPED: needs 2 CUDA devices");
    return;
  }
  const int port = dsrun::test::free_port();
  std::vector<pid_t> children;
  for (int r = 0; r < 2; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      bool ok = false;
      try {
        RendezvousOptions o;
        o.master_port = port;
        o.rank = r;
        o.world_size = 2;
        o.use_nccl = true;
        o.cuda_device = r;
        o.timeout_s = 60;
        auto comm = connect_communicator(o);
        torch::Device dev(torch::kCUDA, static_cast<c10::DeviceIndex>(r));
        torch::Tensor full = torch::arange(10, torch::TensorOptions().dtype(torch::kFloat32).device(dev)) * (r + 1);
        torch::Tensor shard = torch::empty({5}, full.options());
        comm->reduce_scatter_sum(full, shard);
        ok = torch::allclose(shard.cpu(), (torch::arange(10, torch::kFloat32) * 3).narrow(0, r * 5, 5));
        torch::Tensor gathered = torch::empty({10}, full.options());
        comm->all_gather(shard, gathered);
        ok &= torch::allclose(gathered.cpu(), torch::arange(10, torch::kFloat32) * 3);
        torch::Tensor scalar = torch::tensor({1.0 + r}, torch::kFloat64);  // a CPU scalar goes through the GPU
        comm->all_reduce_sum(scalar);
        ok &= scalar.item<double>() == 3.0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      _exit(ok ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
}

TEST_CASE("weights written under Hugging Face names load back into the model exactly (MoE, GQA)", "[engine][import]") {
  ModelSpec m = tiny_moe_decoder(4);
  m.kv_heads = m.heads / 2;
  torch::manual_seed(11);
  auto source = build_model(m, 16, {11});
  torch::manual_seed(12);
  auto target = build_model(m, 16, {12});

  // Source's parameters as Hugging Face tensors (fused q/k/v and gate/up split by rows).
  std::vector<torch::Tensor> keep;
  SafetensorsWriter writer;
  dsrun::test::add_hf_weights(*source, m, writer, keep);
  dsrun::test::TempDir dir;
  writer.write_atomic(dir.file("model.safetensors"));
  load_pretrained_weights(*target, m, dir.path());
  auto want = source->module().named_parameters();
  for (const auto& p : target->module().named_parameters()) CHECK(torch::equal(p.value(), want[p.key()]));

  ModelSpec other = m;
  other.hidden = m.hidden * 2;
  torch::manual_seed(13);
  auto wrong = build_model(other, 16, {13});
  try {
    load_pretrained_weights(*wrong, other, dir.path());
    FAIL("a model of another width accepted the weights");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("model.embed_tokens.weight has shape") != std::string::npos);
    auto* error = dynamic_cast<const dsrun::Error*>(&e);
    REQUIRE(error != nullptr);
    CHECK(error->context().key == "model.init_from");
  }
}

TEST_CASE("separate documents: a packed row trains as its documents would alone", "[engine][data][documents]") {
  // Row = document A (5 tokens) then B (3). With positions restarting and attention kept inside
  // each document, the row's summed loss is A's alone plus B's alone; crossing, it is not.
  ModelSpec m = tiny_decoder();
  auto model = build_model(m, 8, {9});
  UnitRunner plain;
  torch::manual_seed(3);
  const torch::Tensor x = torch::randint(m.vocab, {1, 8}, torch::kInt64), y = torch::randint(m.vocab, {1, 8}, torch::kInt64);
  const auto loss = [&](const torch::Tensor& in, const torch::Tensor& target, bool separate) {
    Batch b;
    b.inputs = in;
    b.targets = target;
    b.items = in.numel();
    if (separate) {
      b.positions = torch::tensor({0, 1, 2, 3, 4, 0, 1, 2}, torch::kInt64).view({1, 8});
      b.documents = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1}, torch::kInt32).view({1, 8});
    }
    torch::NoGradGuard no_grad;
    return one_rank_loss(*model, b, plain).task_loss * static_cast<double>(in.numel());
  };
  const double alone = loss(x.narrow(1, 0, 5), y.narrow(1, 0, 5), false) + loss(x.narrow(1, 5, 3), y.narrow(1, 5, 3), false);
  CHECK(loss(x, y, true) == Approx(alone).epsilon(1e-5));
  CHECK(std::fabs(loss(x, y, false) - alone) > 1e-4);  // without separation, B sees A
}

TEST_CASE("separate documents: batches carry positions and document numbers from the corpus", "[engine][data][documents]") {
  char pattern[] = "/tmp/dsrun-docs-XXXXXX";
  std::string dir = ::mkdtemp(pattern);
  // nanoGPT layout: token 0 closes a document every 5 tokens.
  std::string bytes;
  for (uint16_t k = 0; k < 400; ++k) {
    const uint16_t t = k % 5 == 4 ? 0 : static_cast<uint16_t>(1 + k % 50);
    bytes.append(reinterpret_cast<const char*>(&t), 2);
  }
  write_file_atomic(dir + "/c.bin", bytes);
  DataOptions data;
  data.kind = DataKind::Tokens;
  data.path = dir + "/c.bin";
  data.format = TokenFormat::Nanogpt;
  data.token_width = 2;
  data.document_token = 0;
  data.separate_documents = true;
  data.shuffle = false;
  ModelSpec m = tiny_decoder();
  Batch b = open_dataset(data, m, 8, 1)->train_batch(1, 1);  // window 1: tokens 8..16
  // The document in progress counts from the window's start, as Megatron-LM's reset_position_ids.
  CHECK(b.positions[0].equal(torch::tensor({0, 1, 0, 1, 2, 3, 4, 0}, torch::kInt64)));
  CHECK(b.documents[0].to(torch::kInt64).equal(torch::tensor({0, 0, 1, 1, 1, 1, 1, 2})));
  std::system(("rm -rf '" + dir + "'").c_str());
}
