// Inspection: per-tensor statistics (Inspect) and the whole-delta summary behind
// `flywheel delta inspect` (SummarizeDelta), from the manifest alone. No file I/O here:
// InspectDeltaFile is in delta_file.cc, so the fuzz build links this without it.
#include "delta/inspect.h"

#include <utility>

#include "delta/delta.h"

namespace flywheel::delta {

std::vector<TensorStats> Inspect(const DeltaView& delta) {
  const Manifest& m = delta.manifest();
  std::vector<TensorStats> out;
  out.reserve(m.tensors.size());
  for (const TensorEntry& t : m.tensors) {
    TensorStats s;
    s.name = t.name;
    s.dtype = t.dtype;
    s.elements = ElementCount(t.shape).ok() ? *ElementCount(t.shape) : 0;
    s.words = t.byte_size / DTypeWordBytes(t.dtype);
    s.changed_words = t.changed_words;
    for (uint32_t c = t.first_chunk; c < t.first_chunk + t.chunk_count; ++c) {
      const ChunkEntry& e = m.chunks[c];
      s.stored_bytes += e.payload_bytes;
      s.sparse_chunks += e.kind == ChunkKind::kSparse || e.kind == ChunkKind::kSparseContext;
      s.dense_chunks += e.kind == ChunkKind::kDenseXor;
      s.literal_chunks += e.kind == ChunkKind::kLiteral;
    }
    out.push_back(std::move(s));
  }
  return out;
}

double DeltaTotals::changed_fraction() const {
  return words == 0 ? 0.0 : static_cast<double>(changed_words) / static_cast<double>(words);
}

DeltaSummary SummarizeDelta(const DeltaView& delta) {
  DeltaSummary summary;
  summary.manifest = delta.manifest();
  summary.file_bytes = delta.bytes().size();
  summary.target_bytes = summary.manifest.total_bytes();
  summary.tensors = Inspect(delta);
  for (const ChunkEntry& chunk : summary.manifest.chunks) {
    ++summary.compressor_chunks[CompressorName(chunk.compressor)];
  }
  DeltaTotals& total = summary.total;
  for (const TensorStats& tensor : summary.tensors) {
    total.elements += tensor.elements;
    total.words += tensor.words;
    total.changed_words += tensor.changed_words;
    total.stored_bytes += tensor.stored_bytes;
    total.chunks.sparse += tensor.sparse_chunks;
    total.chunks.dense += tensor.dense_chunks;
    total.chunks.literal += tensor.literal_chunks;
  }
  return summary;
}

double BitsPerChangedWord(uint64_t stored_bytes, uint64_t changed_words) {
  return changed_words == 0
             ? -1.0
             : 8.0 * static_cast<double>(stored_bytes) / static_cast<double>(changed_words);
}

}  // namespace flywheel::delta
