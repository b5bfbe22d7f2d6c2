// Checkpoint files without torch: safetensors against its specification, damaged files rejected
// with the file named, the manifest and marker protocol, retention, and slices for any world size.
#include "engine/checkpoint/checkpoint.hpp"
#include "engine/checkpoint/export.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <fcntl.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <thread>

using dsrun::test::contains;
using dsrun::test::error_of;

namespace {

std::string raw_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void put_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

}  // namespace

TEST_CASE("safetensors written here follow the format's specification", "[checkpoint][safetensors]") {
  dsrun::test::TempDir dir;
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, 7.0f};
  std::vector<int64_t> b = {42, -7, 1LL << 40};
  std::vector<uint16_t> c = {dsrun::float_to_bf16(1.0f), dsrun::float_to_bf16(-0.5f)};
  dsrun::SafetensorsWriter w;
  w.add("a", "F32", {2, 3}, a.data());
  w.add("b", "I64", {3}, b.data());
  w.add("c", "BF16", {2}, c.data());
  w.add("empty", "F32", {0}, nullptr);
  w.set_metadata("format", "pt");
  dsrun::WrittenFile written = w.write_atomic(dir.file("t.safetensors"));

  // Read back by hand, as the specification describes it, not through the reader under test.
  std::string bytes = raw_bytes(dir.file("t.safetensors"));
  REQUIRE(bytes.size() == written.bytes);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  CHECK((8 + n) % 8 == 0);  // data starts 8-byte aligned
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  CHECK(header["__metadata__"]["format"] == "pt");
  CHECK(header["a"]["dtype"] == "F32");
  CHECK(header["a"]["shape"] == nlohmann::json::array({2, 3}));
  CHECK(header["a"]["data_offsets"] == nlohmann::json::array({0, 24}));
  CHECK(header["b"]["data_offsets"] == nlohmann::json::array({24, 48}));
  CHECK(header["c"]["data_offsets"] == nlohmann::json::array({48, 52}));
  CHECK(header["empty"]["data_offsets"] == nlohmann::json::array({52, 52}));
  CHECK(bytes.size() == 8 + n + 52);
  float a_back[6];
  std::memcpy(a_back, bytes.data() + 8 + n, 24);
  CHECK(std::equal(a.begin(), a.end(), a_back));
  CHECK(written.checksum == dsrun::checksum_file(dir.file("t.safetensors")));
  CHECK_FALSE(dsrun::file_exists(dir.file("t.safetensors.tmp")));

  dsrun::SafetensorsFile f(dir.file("t.safetensors"));
  CHECK(f.entries().size() == 4);
  CHECK(f.read_f32(f.at("a"), 2, 3) == std::vector<float>{3.25f, 0.0f, 1e-3f});
  CHECK(f.read_f32(f.at("c"), 0, 2) == std::vector<float>{1.0f, -0.5f});
}

TEST_CASE("damaged safetensors are rejected, naming the file and the fault", "[checkpoint][safetensors]") {
  dsrun::test::TempDir dir;
  std::vector<float> a(16, 1.0f);
  dsrun::SafetensorsWriter w;
  w.add("a", "F32", {16}, a.data());
  const std::string path = dir.file("t.safetensors");
  w.write_atomic(path);
  const std::string good = raw_bytes(path);

  put_bytes(path, good.substr(0, good.size() - 4));  // truncated
  std::string e = error_of([&] { dsrun::SafetensorsFile f(path); });
  CHECK(contains(e, path));
  CHECK(contains(e, "outside the 60 data bytes"));

  put_bytes(path, good.substr(0, 5));  // shorter than the length field
  CHECK(contains(error_of([&] { dsrun::SafetensorsFile f(path); }), "shorter than the 8-byte header"));

  std::string huge = good;
  huge[6] = 0x7f;  // header length far beyond the file
  put_bytes(path, huge);
  CHECK(contains(error_of([&] { dsrun::SafetensorsFile f(path); }), "header length"));

  auto with_header = [&](const std::string& json) {
    std::string h = json;
    while ((8 + h.size()) % 8) h += ' ';
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
    put_bytes(path, out + h + std::string(64, '\0'));
    return error_of([&] { dsrun::SafetensorsFile f(path); });
  };
  CHECK(contains(with_header(R"({"a":{"dtype":"F32","shape":[16],"data_offsets":[0,60]}})"), "60 bytes for shape of 16 F32"));
  CHECK(contains(with_header(R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},"b":{"dtype":"F32","shape":[8],"data_offsets":[16,48]}})"), "hole or overlap"));
  CHECK(contains(with_header(R"({"a":{"dtype":"Q4","shape":[16],"data_offsets":[0,64]}})"), "unknown or missing dtype"));
  CHECK(contains(with_header(R"({"a":{"dtype":"F32","shape":[-16],"data_offsets":[0,64]}})"), "negative"));
  CHECK(contains(with_header(R"([1,2])"), "does not start with '{'"));
  CHECK(with_header(R"({"a":{"dtype":"F32","shape":[16],"data_offsets":[0,64]}})").empty());
}

TEST_CASE("bf16 conversion rounds to nearest even and keeps NaN", "[checkpoint][safetensors]") {
  CHECK(dsrun::bf16_to_float(dsrun::float_to_bf16(1.0f)) == 1.0f);
  CHECK(dsrun::bf16_to_float(dsrun::float_to_bf16(-3.5f)) == -3.5f);
  CHECK(dsrun::float_to_bf16(1.00390625f) == 0x3f80);  // halfway 1 + 2^-8: ties to even (down)
  CHECK(dsrun::float_to_bf16(1.01171875f) == 0x3f82);  // halfway 1 + 3*2^-8: ties to even (up)
  CHECK(std::isnan(dsrun::bf16_to_float(dsrun::float_to_bf16(std::nanf("")))));
  CHECK(dsrun::f16_to_float(0x3c00) == 1.0f);
  CHECK(dsrun::f16_to_float(0xc000) == -2.0f);
  CHECK(dsrun::f16_to_float(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
}

TEST_CASE("checkpoint slices cut every unit exactly, for any world size", "[checkpoint]") {
  for (int64_t numel : {1, 7, 12, 1000, 1001}) {
    for (int world : {1, 2, 3, 8}) {
      int64_t covered = 0, expect_begin = 0;
      for (int r = 0; r < world; ++r) {
        auto [b, e] = dsrun::checkpoint_slice(numel, world, r);
        CHECK(b == expect_begin);
        CHECK(e >= b);
        covered += e - b;
        expect_begin = e;
      }
      CHECK(covered == numel);
    }
  }
}

TEST_CASE("retention keeps the newest K and every Mth, and clears interrupted saves", "[checkpoint]") {
  std::vector<dsrun::CheckpointInfo> all;
  for (int step : {10, 20, 30, 40, 50, 60}) all.push_back({step, "s" + std::to_string(step), true});
  all.insert(all.begin() + 2, {25, "s25", false});  // an interrupted save, older than the newest complete one
  all.push_back({70, "s70", false});                // a save in progress: kept
  auto removed = dsrun::checkpoints_to_remove(all, 2, 20);
  std::sort(removed.begin(), removed.end());
  CHECK(removed == std::vector<std::string>{"s10", "s25", "s30"});  // 60, 50 newest; 40, 20 multiples of 20
  CHECK(dsrun::checkpoints_to_remove(all, 10, 0) == std::vector<std::string>{"s25"});
}

TEST_CASE("removing a step's directory survives a peer still writing into it, and takes hidden files", "[checkpoint][files]") {
  // Two ranks clean up one failed step at once: one rank's file may appear after the other listed
  // the directory, and rmdir then says "not empty". CI once saw that error stand in for "did not fit".
  dsrun::test::TempDir dir;
  const std::string step = dir.file("step_00000006");
  for (int round = 0; round < 20; ++round) {
    dsrun::make_directories(step + "/nested");
    dsrun::write_file_atomic(step + "/.hidden", "x");
    dsrun::write_file_atomic(step + "/nested/rank0.safetensors", "x");
    std::thread peer([&] {
      for (int i = 0; i < 200; ++i) {
        const int fd = ::open((step + "/rank1." + std::to_string(i)).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) break;  // the directory is gone: the peer's write fails as a rank's would
        ::close(fd);
      }
    });
    CHECK_NOTHROW(dsrun::remove_tree(step));
    peer.join();
    dsrun::remove_tree(step);  // what the peer made after the first removal (none if it ended first)
    CHECK_FALSE(dsrun::is_directory(step));
  }
}

TEST_CASE("a checkpoint exists only once its marker matches its manifest", "[checkpoint]") {
  dsrun::test::TempDir dir;
  const std::string step_dir = dir.file(dsrun::checkpoint_dir_name(5));
  dsrun::make_directories(step_dir);
  std::vector<float> master = {1, 2, 3, 4, 5};
  dsrun::SafetensorsWriter w;
  w.add(dsrun::slice_tensor_name("p", "master"), "F32", {5}, master.data());
  dsrun::WrittenFile written = w.write_atomic(step_dir + "/" + dsrun::rank_file_name(0));
  dsrun::CheckpointManifest m;
  m.run_id = "abc";
  m.step = 5;
  m.world_size = 1;
  dsrun::ParamSlice slice;
  slice.end = 5;
  slice.tensor = "p";
  m.params = {{"p", {5}, {slice}}};
  m.files = {{dsrun::rank_file_name(0), 0, written.bytes, written.checksum}};

  CHECK(contains(error_of([&] { dsrun::read_checkpoint(step_dir, true); }), "no completion marker"));
  CHECK_FALSE(dsrun::find_checkpoint(dir.path(), -1, false).has_value());
  dsrun::commit_checkpoint(step_dir, m);
  CHECK(dsrun::read_checkpoint(step_dir, true).step == 5);
  REQUIRE(dsrun::find_checkpoint(dir.path(), -1, false).has_value());
  CHECK_FALSE(dsrun::find_checkpoint(dir.path(), 4, false).has_value());

  dsrun::CheckpointReader reader(step_dir, m);
  std::vector<float> mid(2);
  reader.read(*reader.find("p"), "master", dsrun::TensorRegion{}, 1, 3, mid.data());
  CHECK(mid == std::vector<float>{2, 3});

  // A flipped byte: the checksum names the file and the step.
  std::string bytes = raw_bytes(step_dir + "/" + dsrun::rank_file_name(0));
  bytes[bytes.size() - 1] ^= 0x40;
  put_bytes(step_dir + "/" + dsrun::rank_file_name(0), bytes);
  std::string e = error_of([&] { dsrun::read_checkpoint(step_dir, true); });
  CHECK(contains(e, "rank00000.safetensors"));
  CHECK(contains(e, "step 5"));
  CHECK(contains(e, "checksum"));
  std::vector<std::string> skipped;
  CHECK_FALSE(dsrun::find_checkpoint(dir.path(), -1, true, &skipped).has_value());
  CHECK(skipped.size() == 1);

  // An edited manifest no longer matches its marker.
  dsrun::write_file_atomic(step_dir + "/manifest.json", dsrun::read_file(step_dir + "/manifest.json") + " ");
  CHECK(contains(error_of([&] { dsrun::read_checkpoint(step_dir, false); }), "does not match the checksum in its completion marker"));
}

TEST_CASE("Hugging Face names split fused q/k/v and gate/up by rows", "[checkpoint][export]") {
  dsrun::ModelSpec spec;
  spec.hidden = 64;
  spec.heads = 4;
  spec.kv_heads = 2;
  auto qkv = dsrun::hf_pieces("block3.attn.wqkv.weight", {128, 64}, spec);
  REQUIRE(qkv.size() == 3);
  CHECK(qkv[0].name == "model.layers.3.self_attn.q_proj.weight");
  CHECK((qkv[0].row_begin == 0 && qkv[0].rows == 64));
  CHECK((qkv[1].name == "model.layers.3.self_attn.k_proj.weight" && qkv[1].row_begin == 64 && qkv[1].rows == 32));
  CHECK((qkv[2].name == "model.layers.3.self_attn.v_proj.weight" && qkv[2].row_begin == 96 && qkv[2].rows == 32));
  auto expert = dsrun::hf_pieces("block1.moe.expert12.gate_up.weight", {40, 64}, spec);
  REQUIRE(expert.size() == 2);
  CHECK((expert[1].name == "model.layers.1.mlp.experts.12.up_proj.weight" && expert[1].row_begin == 20));
  CHECK(dsrun::hf_pieces("embedding.weight", {256, 64}, spec)[0].name == "model.embed_tokens.weight");
  CHECK(dsrun::hf_pieces("head.weight", {256, 64}, spec)[0].name == "lm_head.weight");
  CHECK(dsrun::hf_pieces("block0.moe.router.weight", {8, 64}, spec)[0].name == "model.layers.0.mlp.gate.weight");
  auto config = nlohmann::json::parse(dsrun::hf_config_json(spec, "float32"));
  CHECK(config["model_type"] == "llama");
  CHECK(config["num_key_value_heads"] == 2);
}

TEST_CASE("tensor regions map rank slices onto the whole parameter: column blocks, row blocks of fused parts", "[checkpoint][format]") {
  // A 4 x 6 parameter; columns 3-5 (tensor rank 1 of 2, split by columns).
  dsrun::TensorRegion columns{1, {{3, 3}}};
  CHECK(dsrun::region_shape({4, 6}, columns) == std::vector<int64_t>{4, 3});
  auto runs = dsrun::region_runs({4, 6}, columns);
  REQUIRE(runs.size() == 4);  // one run per row
  CHECK(runs[1].in_region == 3);
  CHECK(runs[1].in_whole == 9);
  CHECK(runs[1].count == 3);
  // Rows 1 and 3 of a fused q|k pair of 2 rows each (tensor rank 1 of 2, split by rows in parts).
  dsrun::TensorRegion rows{0, {{1, 1}, {3, 1}}};
  std::vector<float> whole(24);
  for (int i = 0; i < 24; ++i) whole[i] = static_cast<float>(i);
  std::vector<float> part(5);
  dsrun::copy_region_range(dsrun::region_runs({4, 6}, rows), 4, 9, part.data(), whole.data(), /*to_whole=*/false);
  CHECK(part == std::vector<float>{10, 11, 18, 19, 20});  // region elements 4-8: the end of row 1, the start of row 3
  CHECK_THROWS_WITH(dsrun::region_runs({4, 6}, dsrun::TensorRegion{1, {{4, 3}}}), Catch::Contains("outside dimension 1"));
}

TEST_CASE("the reader assembles any region of a parameter from slices of any other", "[checkpoint][format]") {
  // A 4 x 6 parameter written by tensor parallelism over columns (2 regions of 4 x 3), each region
  // cut in two by ZeRO: four slices in four rank files.
  dsrun::test::TempDir dir;
  const std::string step_dir = dir.file(dsrun::checkpoint_dir_name(1));
  dsrun::make_directories(step_dir);
  std::vector<float> whole(24);
  for (int i = 0; i < 24; ++i) whole[i] = static_cast<float>(i) + 0.5f;
  dsrun::CheckpointManifest m;
  m.step = 1;
  m.world_size = 4;
  dsrun::StoredParam p{"w", {4, 6}, {}};
  std::vector<std::vector<float>> data(4);
  for (int r = 0; r < 4; ++r) {
    dsrun::ParamSlice sl;
    sl.rank = r;
    sl.region = dsrun::TensorRegion{1, {{3 * (r / 2), 3}}};
    sl.begin = r % 2 == 0 ? 0 : 5;
    sl.end = r % 2 == 0 ? 5 : 12;
    sl.tensor = "w";
    std::vector<float> region(12);
    dsrun::copy_region_range(dsrun::region_runs(p.shape, sl.region), 0, 12, region.data(), whole.data(), false);
    data[r].assign(region.begin() + sl.begin, region.begin() + sl.end);
    dsrun::SafetensorsWriter w;
    w.add(dsrun::slice_tensor_name("w", "master"), "F32", {sl.end - sl.begin}, data[r].data());
    dsrun::WrittenFile f = w.write_atomic(step_dir + "/" + dsrun::rank_file_name(r));
    m.files.push_back({dsrun::rank_file_name(r), r, f.bytes, f.checksum});
    p.slices.push_back(sl);
  }
  m.params = {p};
  dsrun::commit_checkpoint(step_dir, m);
  const dsrun::CheckpointManifest back = dsrun::read_checkpoint(step_dir, true);  // through JSON
  REQUIRE(back.params.size() == 1);
  CHECK(back.params[0].slices[3].region == p.slices[3].region);
  dsrun::CheckpointReader reader(step_dir, back);
  const dsrun::StoredParam& stored = *reader.find("w");
  CHECK(reader.read_whole(stored) == whole);
  // The same region (ZeRO-resharded): straight from the slices.
  std::vector<float> out(7);
  reader.read(stored, "master", dsrun::TensorRegion{1, {{3, 3}}}, 2, 9, out.data());
  CHECK(out == std::vector<float>{5.5f, 9.5f, 10.5f, 11.5f, 15.5f, 16.5f, 17.5f});
  // Another tensor-parallel cut (rows), and no tensor parallelism at all.
  reader.read(stored, "master", dsrun::TensorRegion{0, {{2, 2}}}, 0, 7, out.data());
  CHECK(out == std::vector<float>{12.5f, 13.5f, 14.5f, 15.5f, 16.5f, 17.5f, 18.5f});
  reader.read(stored, "master", dsrun::TensorRegion{}, 17, 24, out.data());
  CHECK(out == std::vector<float>{17.5f, 18.5f, 19.5f, 20.5f, 21.5f, 22.5f, 23.5f});
  CHECK(reader.bytes_read() > 0);

  // A manifest whose slices leave part of a parameter out is refused when the part is read.
  dsrun::CheckpointManifest gap = back;
  gap.params[0].slices.pop_back();
  dsrun::CheckpointReader partial(step_dir, gap);
  CHECK_THROWS_WITH(partial.read_whole(*partial.find("w")), Catch::Contains("its slices hold 17 of its 24 elements"));
  // One that points outside the parameter is refused when read.
  nlohmann::json j = nlohmann::json::parse(dsrun::manifest_to_json(back));
  j["params"][0]["slices"][0]["ranges"][0][0] = 5;
  CHECK_THROWS_WITH(dsrun::manifest_from_json(j.dump(), "manifest.json"), Catch::Contains("a slice of parameter w"));
}
