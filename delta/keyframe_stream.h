// Decoding a streamed (format-2) keyframe piecemeal, while its bytes still arrive: a
// joining worker allocates the target once from the prologue's declared tensor sizes
// (AllocateKeyframeStaging), writes each chunk record into it as soon as the record is
// whole (DecodeKeyframeChunk, on any thread: chunks never overlap), and checks each
// tensor against its TensorRecord's hash once all its chunks are in (TensorHash of the
// staged tensor). Nothing here trusts the partial container: the sizes come from a
// StreamReader that checked them against its DecodeLimits, and every chunk is checked
// (checksum, kind, sizes, bounds) before a byte of it is written.
#pragma once

#include <cstdint>
#include <span>

#include "base/status.h"
#include "checkpoint/tensor.h"
#include "delta/delta.h"

namespace flywheel::delta {

// A new checkpoint laid out as `prologue`'s tensors (names, dtypes, shapes; target order),
// its bytes zero. ResourceExhausted, allocating nothing, when the declared sizes add up to
// more than `max_bytes` (naming both), or when the allocation fails. InvalidArgument for a
// manifest that is not a keyframe's.
Result<OwnedCheckpoint> AllocateKeyframeStaging(const Manifest& prologue, uint64_t max_bytes);

// Decodes the one chunk of `chunk_view` (StreamReader::ChunkView of a keyframe's chunk
// record: one tensor, one chunk) into `tensor_data`, the staged bytes of that tensor.
// Corruption, writing nothing, when the chunk is not literal, its checksum or sizes are
// wrong, or its words fall outside `tensor_data`.
// REQUIRES: `chunk_view`'s container holds the chunk's whole payload.
Status DecodeKeyframeChunk(const DeltaView& chunk_view, std::span<std::byte> tensor_data);

}  // namespace flywheel::delta
