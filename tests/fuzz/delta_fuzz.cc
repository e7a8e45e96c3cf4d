// libFuzzer target for the delta decoder: read any bytes as a streamed container while they
// arrive (format 2), parse them as a container; when the
// manifest parses, decode every chunk against a zero state of the declared layout (a
// keyframe) or apply it to such a state (a delta; the base check then fails unless the
// fuzzer forged every hash), and check the apply either fully succeeds or restores.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "delta/delta.h"

int FuzzDelta(const uint8_t* data, size_t size) {
  using namespace flywheel;
  using namespace flywheel::delta;
  DecodeLimits limits;
  limits.max_chunk_raw_bytes = 1 << 24;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  // A streamed container read while it arrives, in three slices: whatever it reads must
  // lie inside the bytes it was given.
  if (StreamReader::IsStreamed(bytes)) {
    StreamReader reader(limits);
    for (size_t have : {size / 3, 2 * size / 3, size}) {
      if (!reader.Advance(bytes.first(have)).ok()) break;
      for (const ChunkEntry& e : reader.manifest().chunks) {
        if (e.payload_offset + e.payload_bytes > have) __builtin_trap();
      }
    }
  }
  auto view = DeltaView::Parse(bytes, limits);
  if (!view.ok()) return 0;
  const Manifest& m = view->manifest();
  if (m.total_bytes() > (64u << 20)) return 0;  // keep fuzzing iterations small
  (void)Inspect(*view);
  OwnedCheckpoint state;
  for (const TensorEntry& t : m.tensors)
    state.tensors.push_back({t.name, t.dtype, t.shape, std::vector<std::byte>(t.byte_size)});
  OwnedCheckpoint before = state;
  auto mv = state.mutable_view();
  ApplyOptions options;
  // Claim the state is the base so chunk decoding is exercised even for deltas.
  for (const TensorEntry& t : m.tensors) options.state_tensor_hashes.push_back(t.base_hash);
  auto result = ApplyInPlace(mv, *view, options);
  if (!result.ok()) {
    for (size_t i = 0; i < state.tensors.size(); ++i) {
      if (state.tensors[i].data != before.tensors[i].data) __builtin_trap();  // not restored
    }
  }
  return 0;
}

#ifndef FLYWHEEL_FUZZ_NO_MAIN
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return FuzzDelta(data, size);
}
#endif
