// What the encoder (encode.cc) and the decoder (container_parse.cc, apply.cc) share:
// enum names, manifest totals, checksums, the byte-plane shuffle, the chunk compressors,
// per-thread scratch and tensor hashing.
#include <lz4.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>

#include "delta/codec_internal.h"
#include "delta/delta.h"
#include "checkpoint/parallel.h"

namespace flywheel::delta {

const char* CompressorName(Compressor compressor) {
  switch (compressor) {
    case Compressor::kNone:
      return "none";
    case Compressor::kZstd:
      return "zstd";
    case Compressor::kLz4:
      return "lz4";
  }
  return "?";
}

Result<Compressor> ParseCompressor(std::string_view name) {
  if (name == "zstd") return Compressor::kZstd;
  if (name == "lz4") return Compressor::kLz4;
  if (name == "none") return Compressor::kNone;
  return Status::InvalidArgument("unknown codec '" + std::string(name) +
                                 "' (expected zstd, lz4 or none)");
}

const char* ChunkKindName(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kSparse:
      return "sparse";
    case ChunkKind::kDenseXor:
      return "dense-xor";
    case ChunkKind::kLiteral:
      return "literal";
    case ChunkKind::kSparseContext:
      return "sparse-context";
  }
  return "?";
}

uint64_t Manifest::total_bytes() const {
  uint64_t total = 0;
  for (const TensorEntry& t : tensors) total += t.byte_size;
  return total;
}
uint64_t Manifest::changed_words() const {
  uint64_t total = 0;
  for (const TensorEntry& t : tensors) total += t.changed_words;
  return total;
}
uint64_t Manifest::total_words() const {
  uint64_t total = 0;
  for (const TensorEntry& t : tensors) total += t.byte_size / DTypeWordBytes(t.dtype);
  return total;
}

namespace internal {

std::string Quote(const std::string& name) {
  return "'" + name + "'";
}

uint64_t Checksum(std::span<const uint8_t> bytes) {
  return HashBytes64(std::as_bytes(bytes));
}

#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
constexpr bool kVerifyChecksums = false;
#else
constexpr bool kVerifyChecksums = true;
#endif
bool ChecksumMismatch(uint64_t stored, std::span<const uint8_t> bytes) {
  return kVerifyChecksums && stored != Checksum(bytes);
}

void Shuffle(const uint8_t* src, size_t n, int w, uint8_t* dst) {
  if (w == 1) return void(std::memcpy(dst, src, n));
  for (int b = 0; b < w; ++b) {
    uint8_t* plane = dst + static_cast<size_t>(b) * n;
    for (size_t i = 0; i < n; ++i) plane[i] = src[i * w + b];
  }
}

namespace {

// zstd contexts are reused per thread (pool threads live for the process).
class ZstdContexts {
 public:
  ~ZstdContexts() {
    ZSTD_freeCCtx(cctx_);
    ZSTD_freeDCtx(dctx_);
  }
  ZSTD_CCtx* Compressor() { return cctx_ ? cctx_ : (cctx_ = ZSTD_createCCtx()); }
  ZSTD_DCtx* Decompressor() { return dctx_ ? dctx_ : (dctx_ = ZSTD_createDCtx()); }

 private:
  ZSTD_CCtx* cctx_ = nullptr;
  ZSTD_DCtx* dctx_ = nullptr;
};
ZstdContexts& ThreadZstd() {
  thread_local ZstdContexts contexts;
  return contexts;
}

Status DecompressZstd(std::span<const uint8_t> stored, uint64_t raw_bytes, uint8_t* dst) {
  FW_RETURN_IF_ERROR(CheckZstdFrameSize(stored, raw_bytes));
  ZSTD_DCtx* dctx = ThreadZstd().Decompressor();
  size_t n = ZSTD_decompressDCtx(dctx, dst, raw_bytes, stored.data(), stored.size());
  if (ZSTD_isError(n)) return Status::Corruption(std::string("zstd: ") + ZSTD_getErrorName(n));
  if (n != raw_bytes) return Status::Corruption("zstd frame decompressed to a different size");
  return Status::Ok();
}

Status DecompressLz4(std::span<const uint8_t> stored, uint64_t raw_bytes, uint8_t* dst) {
  if (raw_bytes > static_cast<uint64_t>(LZ4_MAX_INPUT_SIZE) ||
      stored.size() > static_cast<size_t>(INT32_MAX)) {
    return Status::Corruption("lz4 block too large");
  }
  int n = LZ4_decompress_safe(reinterpret_cast<const char*>(stored.data()),
                              reinterpret_cast<char*>(dst), static_cast<int>(stored.size()),
                              static_cast<int>(raw_bytes));
  if (n < 0 || static_cast<uint64_t>(n) != raw_bytes) {
    return Status::Corruption("lz4 block does not decompress to the manifest's size");
  }
  return Status::Ok();
}

}  // namespace

bool Compress(Compressor compressor, int zstd_level, const ByteVec& raw, ByteVec* out) {
  out->clear();
  if (compressor == Compressor::kNone || raw.empty()) return false;
  if (compressor == Compressor::kZstd) {
    ZSTD_CCtx* cctx = ThreadZstd().Compressor();
    out->resize(ZSTD_compressBound(raw.size()));
    size_t n =
        ZSTD_compressCCtx(cctx, out->data(), out->size(), raw.data(), raw.size(), zstd_level);
    if (ZSTD_isError(n) || n >= raw.size()) return out->clear(), false;
    out->resize(n);
    return true;
  }
  if (raw.size() > static_cast<size_t>(LZ4_MAX_INPUT_SIZE)) return false;
  out->resize(LZ4_compressBound(static_cast<int>(raw.size())));
  int n = LZ4_compress_default(reinterpret_cast<const char*>(raw.data()),
                               reinterpret_cast<char*>(out->data()), static_cast<int>(raw.size()),
                               static_cast<int>(out->size()));
  if (n <= 0 || static_cast<size_t>(n) >= raw.size()) return out->clear(), false;
  out->resize(n);
  return true;
}

Status CheckZstdFrameSize(std::span<const uint8_t> stored, uint64_t raw_bytes) {
  unsigned long long declared = ZSTD_getFrameContentSize(stored.data(), stored.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR) return Status::Corruption("not a valid zstd frame");
  if (declared == ZSTD_CONTENTSIZE_UNKNOWN) {
    return Status::Corruption("zstd frame does not record its content size");
  }
  if (declared != raw_bytes) {
    return Status::Corruption("zstd frame declares " + std::to_string(declared) +
                              " bytes, the manifest " + std::to_string(raw_bytes));
  }
  return Status::Ok();
}

Status Decompress(Compressor compressor, std::span<const uint8_t> stored, uint64_t raw_bytes,
                  uint8_t* dst) {
  if (compressor == Compressor::kZstd) return DecompressZstd(stored, raw_bytes, dst);
  if (compressor == Compressor::kLz4) return DecompressLz4(stored, raw_bytes, dst);
  if (stored.size() != raw_bytes) return Status::Corruption("stored size differs from raw size");
  std::memcpy(dst, stored.data(), raw_bytes);
  return Status::Ok();
}

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

void TrimScratch(Scratch& s) {
  constexpr size_t kKeepBytes = 64 << 20;
  auto trim = [&](auto& v) {
    if (v.capacity() * sizeof(v[0]) > kKeepBytes) std::decay_t<decltype(v)>().swap(v);
  };
  trim(s.positions), trim(s.gaps), trim(s.z), trim(s.words_a), trim(s.words_b);
  trim(s.raw), trim(s.raw2), trim(s.packed), trim(s.packed2);
  trim(s.ranks), trim(s.order), trim(s.contexts), trim(s.z2), trim(s.base_words);
}

Result<std::vector<Hash128>> HashesOrCompute(const CheckpointView& view,
                                             const std::vector<Hash128>& given, int threads,
                                             const char* role) {
  if (!given.empty()) {
    if (given.size() != view.size()) {
      return Status::InvalidArgument(std::string(role) +
                                     " tensor hashes: " + std::to_string(given.size()) +
                                     " given for " + std::to_string(view.size()) + " tensors");
    }
    return given;
  }
  std::vector<Hash128> hashes(view.size());
  std::vector<size_t> order(view.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t c) { return view[a].data.size() > view[c].data.size(); });
  ParallelFor(order.size(), threads,
              [&](size_t k) { hashes[order[k]] = TensorHash(view[order[k]]); });
  return hashes;
}

Status CheckThreads(int threads) {
  if (threads < 1 || threads > kMaxThreads) {
    return Status::InvalidArgument("threads must be in [1, " + std::to_string(kMaxThreads) +
                                   "], got " + std::to_string(threads));
  }
  return Status::Ok();
}

}  // namespace internal
}  // namespace flywheel::delta
