// Runs the libFuzzer entry points under GoogleTest with the regular compiler: every seed
// of tests/fuzz/corpus/, plus a bounded number of deterministic mutations of each (byte
// flips, truncations, splices of length fields). The clang/libFuzzer builds of the same
// targets (tests/fuzz/CMakeLists.txt) explore further with coverage guidance.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "delta/delta.h"
#include "tests/delta/test_checkpoints.h"

int FuzzSafetensors(const uint8_t* data, size_t size);
int FuzzDelta(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

std::vector<std::vector<uint8_t>> Seeds(const std::string& sub) {
  std::vector<std::vector<uint8_t>> seeds;
  fs::path dir = fs::path(FLYWHEEL_SOURCE_DIR) / "tests/fuzz/corpus" / sub;
  if (!fs::exists(dir)) return seeds;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    seeds.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  return seeds;
}

void RunMutations(int (*target)(const uint8_t*, size_t),
                  const std::vector<std::vector<uint8_t>>& seeds, int mutations_per_seed) {
  std::mt19937_64 rng(42);
  for (const auto& seed : seeds) {
    target(seed.data(), seed.size());
    for (int i = 0; i < mutations_per_seed && !seed.empty(); ++i) {
      std::vector<uint8_t> input = seed;
      switch (rng() % 4) {
        case 0:
          input[rng() % input.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        case 1:
          input.resize(rng() % input.size());
          break;
        case 2: {  // overwrite 8 bytes with an extreme value
          size_t at = rng() % input.size();
          uint64_t v = (rng() & 1) ? ~uint64_t{0} : (uint64_t{1} << (rng() % 64));
          for (int b = 0; b < 8 && at + b < input.size(); ++b)
            input[at + b] = static_cast<uint8_t>(v >> (8 * b));
          break;
        }
        default:
          input[rng() % input.size()] = static_cast<uint8_t>(rng());
          break;
      }
      target(input.data(), input.size());
    }
  }
}

TEST(FuzzCorpusTest, SafetensorsSeedsAndMutations) {
  auto seeds = Seeds("safetensors");
  ASSERT_FALSE(seeds.empty());
  RunMutations(FuzzSafetensors, seeds, 2000);
}

TEST(FuzzCorpusTest, DeltaSeedsAndMutations) {
  auto seeds = Seeds("delta");
  // Fresh seeds from the encoder too, so the test does not depend on committed files only.
  using namespace flywheel;
  auto base = flywheel::testing::RandomCheckpoint(
      {{"a", DType::kBF16, {700}}, {"b", DType::kF32, {33}}}, 5);
  auto target = flywheel::testing::Mutate(base, 0.05, 6);
  for (delta::Compressor c : {delta::Compressor::kZstd, delta::Compressor::kLz4}) {
    delta::EncodeOptions options;
    options.compressor = c;
    auto d = delta::Encode(base.view(), target.view(), options);
    auto k = delta::EncodeKeyframe(target.view(), options);
    ASSERT_TRUE(d.ok() && k.ok());
    for (auto* bytes : {&*d, &*k}) {
      auto* p = reinterpret_cast<const uint8_t*>(bytes->data());
      seeds.emplace_back(p, p + bytes->size());
    }
    // The streamed form (format 2) of the same delta and keyframe.
    struct Collect : delta::StreamSink {
      std::vector<uint8_t> out;
      Status Begin(uint64_t) override { return Status::Ok(); }
      Status Write(std::span<const std::byte> more) override {
        auto* p = reinterpret_cast<const uint8_t*>(more.data());
        out.insert(out.end(), p, p + more.size());
        return Status::Ok();
      }
    };
    Collect streamed_delta, streamed_keyframe;
    ASSERT_TRUE(delta::EncodeStreamed(base.view(), target.view(), options, streamed_delta).ok());
    ASSERT_TRUE(delta::EncodeKeyframeStreamed(target.view(), options, streamed_keyframe).ok());
    seeds.push_back(std::move(streamed_delta.out));
    seeds.push_back(std::move(streamed_keyframe.out));
  }
  RunMutations(FuzzDelta, seeds, 2000);
}

}  // namespace
