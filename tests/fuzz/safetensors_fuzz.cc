// libFuzzer target for the safetensors reader. Any input must either be rejected with a
// Corruption status or parse into views that lie inside the input, match their dtype and
// shape, and survive a serialise / re-parse round trip unchanged. A broken invariant
// aborts. Seeds: tests/fuzz/corpus/safetensors/.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/tensor.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "safetensors fuzz invariant broken: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

// Reads every byte of every view so that a view outside the input is caught by ASan.
uint64_t TouchAll(const flywheel::CheckpointView& tensors) {
  uint64_t hash = 1469598103934665603ull;
  for (const flywheel::TensorView& tensor : tensors) {
    for (const std::byte byte : tensor.data) {
      hash = (hash ^ std::to_integer<uint64_t>(byte)) * 1099511628211ull;
    }
  }
  return hash;
}

bool SameTensor(const flywheel::TensorView& left, const flywheel::TensorView& right) {
  return left.name == right.name && left.dtype == right.dtype && left.shape == right.shape &&
         left.data.size() == right.data.size() &&
         std::equal(left.data.begin(), left.data.end(), right.data.begin());
}

}  // namespace

int FuzzSafetensors(const uint8_t* data, size_t size) {
  // Copy so that the parser sees an exactly sized heap buffer (a null `data` with size 0
  // is a legal input too).
  const std::vector<std::byte> input(reinterpret_cast<const std::byte*>(data),
                                     reinterpret_cast<const std::byte*>(data) + size);
  flywheel::Result<flywheel::SafetensorsImage> image =
      flywheel::ParseSafetensors(input, "fuzz.safetensors");
  if (!image.ok()) {
    Check(image.status().code() == flywheel::StatusCode::kCorruption, "error is not Corruption");
    return 0;
  }

  const std::byte* const begin = input.data();
  const std::byte* const end = begin + input.size();
  for (const flywheel::TensorView& tensor : image->tensors) {
    Check(tensor.data.empty() ||
              (tensor.data.data() >= begin && tensor.data.data() + tensor.data.size() <= end),
          "view outside the input");
    const flywheel::Result<uint64_t> bytes = flywheel::TensorByteSize(tensor.dtype, tensor.shape);
    Check(bytes.ok() && *bytes == tensor.data.size(), "view size differs from dtype x shape");
  }
  const uint64_t hash = TouchAll(image->tensors);

  flywheel::Result<std::vector<std::byte>> serialized =
      flywheel::SerializeSafetensors(image->tensors, image->metadata);
  Check(serialized.ok(), "a parsed image does not serialise");
  flywheel::Result<flywheel::SafetensorsImage> reparsed =
      flywheel::ParseSafetensors(*serialized, "fuzz-reserialised.safetensors");
  Check(reparsed.ok(), "a re-serialised image does not parse");
  Check(reparsed->header_bytes % 8 == 0, "re-serialised header is not padded to 8");
  Check(reparsed->metadata == image->metadata, "metadata changed in the round trip");
  Check(reparsed->tensors.size() == image->tensors.size(), "tensor count changed");
  for (size_t i = 0; i < image->tensors.size(); ++i) {
    Check(SameTensor(reparsed->tensors[i], image->tensors[i]), "tensor changed");
  }
  Check(TouchAll(reparsed->tensors) == hash, "tensor bytes changed");
  return 0;
}

#ifndef FLYWHEEL_FUZZ_NO_MAIN
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return FuzzSafetensors(data, size);
}
#endif
