// What a delta or keyframe holds, from its manifest alone: the numbers behind
// `flywheel delta inspect`. Chunk payloads are not decoded (ApplyInPlace verifies them),
// so a summary says what the delta declares, checked only as far as DeltaView::Parse
// checks it. delta/delta_file.h's InspectDeltaFile does the same for a file.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "delta/delta.h"

namespace flywheel::delta {

// Chunks by kind (ChunkKind::kSparse and kSparseContext counted as sparse, kDenseXor,
// kLiteral).
struct ChunkKindCounts {
  uint64_t sparse = 0;
  uint64_t dense = 0;
  uint64_t literal = 0;
};

// TensorStats summed over every tensor of a delta.
struct DeltaTotals {
  uint64_t elements = 0;
  uint64_t words = 0;
  uint64_t changed_words = 0;
  uint64_t stored_bytes = 0;  // all chunk payloads
  ChunkKindCounts chunks;

  // changed_words / words; 0 when the delta has no words at all.
  double changed_fraction() const;
};

struct DeltaSummary {
  Manifest manifest;          // a copy: the summary outlives the container bytes
  uint64_t file_bytes = 0;    // the whole container
  uint64_t target_bytes = 0;  // tensor data of the target checkpoint (manifest.total_bytes())
  std::vector<TensorStats> tensors;  // index-aligned with manifest.tensors
  DeltaTotals total;
  // Chunks per compressor, by CompressorName. The manifest records one compressor per
  // chunk: "none" where compressing did not make the chunk smaller.
  std::map<std::string, uint64_t> compressor_chunks;
};

// Summarizes a parsed delta or keyframe. Never fails: DeltaView::Parse has already
// checked everything the summary reads.
DeltaSummary SummarizeDelta(const DeltaView& delta);

// Bits of stored delta per changed word: 8 * stored_bytes / changed_words. Negative when
// nothing changed (there is no such ratio).
double BitsPerChangedWord(uint64_t stored_bytes, uint64_t changed_words);

}  // namespace flywheel::delta
