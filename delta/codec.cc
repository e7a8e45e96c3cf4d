// The delta codec: encoder, container parser, in-place apply with undo.
#include <lz4.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>
#include <type_traits>
#include <unordered_map>

#include "delta/delta.h"
#include "delta/entropy.h"
#include "delta/format.h"
#include "delta/parallel.h"
#include "delta/wire.h"
#include "kernels/kernels.h"

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

namespace {

using ByteVec = std::vector<uint8_t>;

std::string Quote(const std::string& name) {
  return "'" + name + "'";
}

uint64_t Checksum(std::span<const uint8_t> bytes) {
  return HashBytes64(std::as_bytes(bytes));
}

// Fuzzing builds (tests/fuzz/clang) skip checksum comparisons so that mutated inputs reach
// the manifest parser and the chunk decoders instead of stopping at the first checksum.
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
constexpr bool kVerifyChecksums = false;
#else
constexpr bool kVerifyChecksums = true;
#endif
bool ChecksumMismatch(uint64_t stored, std::span<const uint8_t> bytes) {
  return kVerifyChecksums && stored != Checksum(bytes);
}

const uint8_t* U8(std::span<const std::byte> s) {
  return reinterpret_cast<const uint8_t*>(s.data());
}
uint8_t* U8(std::span<std::byte> s) {
  return reinterpret_cast<uint8_t*>(s.data());
}

// ---- byte-plane shuffle -------------------------------------------------------------

void Shuffle(const uint8_t* src, size_t n, int w, uint8_t* dst) {
  if (w == 1) return void(std::memcpy(dst, src, n));
  for (int b = 0; b < w; ++b) {
    uint8_t* plane = dst + static_cast<size_t>(b) * n;
    for (size_t i = 0; i < n; ++i) plane[i] = src[i * w + b];
  }
}

// dst[i*w+b] = src[b*n+i], combined with the existing bytes by `op`.
template <typename Op>
void Unshuffle(const uint8_t* src, size_t n, int w, uint8_t* dst, Op op) {
  for (int b = 0; b < w; ++b) {
    const uint8_t* plane = src + static_cast<size_t>(b) * n;
    for (size_t i = 0; i < n; ++i) dst[i * w + b] = op(dst[i * w + b], plane[i]);
  }
}

// ---- compressors --------------------------------------------------------------------

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

// Compresses `raw` into `out`; returns false (and leaves `out` empty) when the result
// would not be smaller than the raw bytes.
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

// A zstd frame must declare exactly the manifest's raw size (checked before any buffer
// of that size is allocated).
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

// Decompresses exactly `raw_bytes` bytes into `dst`.
Status Decompress(Compressor compressor, std::span<const uint8_t> stored, uint64_t raw_bytes,
                  uint8_t* dst) {
  if (compressor == Compressor::kZstd) {
    FW_RETURN_IF_ERROR(CheckZstdFrameSize(stored, raw_bytes));
    ZSTD_DCtx* dctx = ThreadZstd().Decompressor();
    size_t n = ZSTD_decompressDCtx(dctx, dst, raw_bytes, stored.data(), stored.size());
    if (ZSTD_isError(n)) return Status::Corruption(std::string("zstd: ") + ZSTD_getErrorName(n));
    if (n != raw_bytes) return Status::Corruption("zstd frame decompressed to a different size");
    return Status::Ok();
  }
  if (compressor == Compressor::kLz4) {
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
  if (stored.size() != raw_bytes) return Status::Corruption("stored size differs from raw size");
  std::memcpy(dst, stored.data(), raw_bytes);
  return Status::Ok();
}

// ---- word arithmetic ----------------------------------------------------------------

// The unsigned and signed integer of a word of W bytes.
template <int W>
struct WordOf {
  using U = std::conditional_t<
      W == 1, uint8_t,
      std::conditional_t<W == 2, uint16_t, std::conditional_t<W == 4, uint32_t, uint64_t>>>;
  using S = std::make_signed_t<U>;
};

// Per-thread scratch reused across chunks.
struct Scratch {
  std::vector<uint32_t> positions;
  std::vector<uint32_t> gaps;
  std::vector<uint64_t> z;
  ByteVec words_a, words_b;
  ByteVec raw, raw2, packed, packed2;
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Scratch only grows (shrinking and growing again would zero-fill the difference).
template <typename V>
void Grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Pool threads live for the process: after an unusually large chunk, give its scratch
// back instead of holding the peak forever.
void TrimScratch(Scratch& s) {
  constexpr size_t kKeepBytes = 64 << 20;
  auto trim = [&](auto& v) {
    if (v.capacity() * sizeof(v[0]) > kKeepBytes) std::decay_t<decltype(v)>().swap(v);
  };
  trim(s.positions), trim(s.gaps), trim(s.z), trim(s.words_a), trim(s.words_b);
  trim(s.raw), trim(s.raw2), trim(s.packed), trim(s.packed2);
}

// ---- encoding -----------------------------------------------------------------------

struct ChunkTask {
  uint32_t tensor_index;
  uint64_t word_begin;
  uint64_t word_count;
};

struct EncodedChunk {
  ChunkEntry entry;
  ByteVec payload;
  bool present = false;
  Status error;  // ResourceExhausted when scratch could not be allocated
};

// For the changed words just found in one block: the gap to the previous change and the
// zigzagged difference, read while the block is in cache.
template <int W>
void GapsAndDiffs(const uint8_t* base, const uint8_t* target, const uint32_t* block_positions,
                  size_t found, uint32_t block_begin, uint32_t& next_free, uint32_t* gaps,
                  uint64_t* z) {
  using U = typename WordOf<W>::U;
  using S = typename WordOf<W>::S;
  for (size_t i = 0; i < found; ++i) {
    const uint32_t p = block_positions[i];
    U b, t;
    std::memcpy(&b, base + size_t{p} * W, W);
    std::memcpy(&t, target + size_t{p} * W, W);
    z[i] = entropy::ZigZag(static_cast<S>(static_cast<U>(t - b)));
    gaps[i] = block_begin + p - next_free;
    next_free = block_begin + p + 1;
  }
}

// Compares base and target in cache-sized blocks (feeding each block to the hashers first,
// when given) and, for the changed words, fills s.gaps and s.z while the block is still in
// cache. Returns the number of changed words.
size_t CompareAndGather(int w, const uint8_t* base, const uint8_t* target, size_t n, Scratch& s,
                        StreamingHash* base_hasher, StreamingHash* target_hasher) {
  constexpr size_t kBlockBytes = 64 << 10;
  const size_t block_words = kBlockBytes / w;
  Grow(s.positions, std::min(n, block_words));
  Grow(s.gaps, n);
  Grow(s.z, n);
  size_t m = 0;
  uint32_t next_free = 0;
  for (size_t begin = 0; begin < n; begin += block_words) {
    const size_t len = std::min(block_words, n - begin);
    const uint8_t* b = base + begin * w;
    const uint8_t* t = target + begin * w;
    if (base_hasher) base_hasher->Update(b, len * w);
    if (target_hasher) target_hasher->Update(t, len * w);
    const size_t found = kernels::CompareCompact(b, t, len, w, s.positions.data());
    if (found == 0) continue;
    const uint32_t block_begin = static_cast<uint32_t>(begin);
    uint32_t* gaps = s.gaps.data() + m;
    uint64_t* z = s.z.data() + m;
    switch (w) {
      case 1:
        GapsAndDiffs<1>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z);
        break;
      case 2:
        GapsAndDiffs<2>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z);
        break;
      case 4:
        GapsAndDiffs<4>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z);
        break;
      default:
        GapsAndDiffs<8>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z);
        break;
    }
    m += found;
  }
  return m;
}

// Builds the raw sparse chunk from s.gaps and s.z (m changed words).
void BuildSparseRaw(int w, size_t m, Scratch& s, ByteVec* raw) {
  const std::span<const uint32_t> gaps(s.gaps.data(), m);
  const std::span<const uint64_t> z(s.z.data(), m);
  int k = entropy::ChooseRiceK(gaps);
  ByteVec index;
  entropy::RiceEncode(gaps, k, &index);
  raw->clear();
  raw->push_back(static_cast<uint8_t>(k));
  ByteVec values;
  entropy::EncodeValues(z, &values);
  format::ValueCoding coding = format::ValueCoding::kRans;
  if (m < 256) {
    ByteVec gamma;
    entropy::EncodeValuesGamma(z, &gamma);
    if (gamma.size() < values.size()) values.swap(gamma), coding = format::ValueCoding::kGamma;
  }
  raw->push_back(static_cast<uint8_t>(coding));
  wire::PutVarint(raw, index.size());
  wire::PutBytes(raw, index);
  wire::PutBytes(raw, values);
}

EncodedChunk EncodeChunk(const ChunkTask& task, int w, const uint8_t* base, const uint8_t* target,
                         const EncodeOptions& options, bool keyframe,
                         StreamingHash* base_hasher = nullptr,
                         StreamingHash* target_hasher = nullptr) {
  Scratch& s = ThreadScratch();
  EncodedChunk out;
  ChunkEntry& e = out.entry;
  e.tensor_index = task.tensor_index;
  e.word_begin = task.word_begin;
  e.word_count = task.word_count;
  const size_t n = task.word_count;
  const uint8_t* t = target + task.word_begin * w;
  const uint8_t* b = base ? base + task.word_begin * w : nullptr;
  const uint64_t dense_bytes = n * w;

  // The chosen raw form lands in s.raw, its compressed form (if any) in s.packed.
  auto choose = [&](ChunkKind kind, ByteVec& raw, ByteVec& packed) {
    bool compressed = Compress(options.compressor, options.zstd_level, raw, &packed);
    uint64_t stored = compressed ? packed.size() : raw.size();
    bool better = !out.present || stored < out.entry.payload_bytes;
    if (!better) return;
    out.present = true;
    e.kind = kind;
    e.compressor = compressed ? options.compressor : Compressor::kNone;
    e.raw_bytes = raw.size();
    e.payload_bytes = stored;
    // Take the buffer instead of copying it; the scratch vector gets the old one back.
    out.payload.swap(compressed ? packed : raw);
  };

  if (keyframe) {
    if (target_hasher) target_hasher->Update(t, dense_bytes);
    s.raw.resize(dense_bytes);
    Shuffle(t, n, w, s.raw.data());
    e.changed_words = n;
    choose(ChunkKind::kLiteral, s.raw, s.packed);
  } else {
    size_t m = CompareAndGather(w, b, t, n, s, base_hasher, target_hasher);
    if (m == 0) return out;
    e.changed_words = m;
    BuildSparseRaw(w, m, s, &s.raw);
    choose(ChunkKind::kSparse, s.raw, s.packed);
    // Dense forms are tried only when the sparse one is not clearly small.
    if (out.entry.payload_bytes * 8 > dense_bytes) {
      s.raw2.resize(dense_bytes);
      s.words_a.resize(dense_bytes);
      for (size_t i = 0; i < dense_bytes; ++i) s.words_a[i] = t[i] ^ b[i];
      Shuffle(s.words_a.data(), n, w, s.raw2.data());
      choose(ChunkKind::kDenseXor, s.raw2, s.packed2);
      s.raw2.resize(dense_bytes);  // choose() may have swapped the buffer out
      Shuffle(t, n, w, s.raw2.data());
      choose(ChunkKind::kLiteral, s.raw2, s.packed2);
    }
  }
  e.checksum = Checksum(out.payload);
  TrimScratch(s);
  return out;
}

Status ValidateView(const TensorView& t, const char* role) {
  FW_ASSIGN_OR_RETURN(uint64_t bytes, TensorByteSize(t.dtype, t.shape));
  if (bytes != t.data.size()) {
    return Status::InvalidArgument(std::string(role) + " tensor " + Quote(t.name) + " has " +
                                   std::to_string(t.data.size()) +
                                   " bytes, its dtype and shape need " + std::to_string(bytes));
  }
  return Status::Ok();
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

void PutHash(ByteVec* out, const Hash128& h) {
  wire::PutFixed(out, h.low, 8);
  wire::PutFixed(out, h.high, 8);
}

Result<std::vector<std::byte>> EncodeImpl(const CheckpointView* base, const CheckpointView& target,
                                          const EncodeOptions& options) {
  const bool keyframe = base == nullptr;
  if (options.threads < 1 || options.threads > kMaxThreads) {
    return Status::InvalidArgument("threads must be in [1, " + std::to_string(kMaxThreads) +
                                   "], got " + std::to_string(options.threads));
  }
  if (options.chunk_bytes < 4096 || options.chunk_bytes > (64ull << 20)) {
    return Status::InvalidArgument("chunk size must be in [4 KiB, 64 MiB], got " +
                                   std::to_string(options.chunk_bytes));
  }
  // What the default DecodeLimits would refuse is refused here, so every delta this
  // encoder writes can be read back.
  const DecodeLimits limits;
  if (target.size() > limits.max_tensors) {
    return Status::InvalidArgument("checkpoint has " + std::to_string(target.size()) +
                                   " tensors, more than a delta can hold (" +
                                   std::to_string(limits.max_tensors) + ")");
  }
  uint64_t metadata_bytes = 0;
  for (const auto& [key, value] : options.metadata) metadata_bytes += key.size() + value.size();
  if (metadata_bytes > limits.max_metadata_bytes) {
    return Status::InvalidArgument("metadata of " + std::to_string(metadata_bytes) +
                                   " bytes exceeds " + std::to_string(limits.max_metadata_bytes));
  }
  for (const TensorView& t : target) {
    if (t.name.size() > limits.max_name_bytes || t.shape.size() > format::kMaxRank) {
      return Status::InvalidArgument("tensor " + Quote(t.name.substr(0, 64)) +
                                     " has a name over 64 KiB or a rank over 64");
    }
  }
  if (options.compressor == Compressor::kZstd &&
      (options.zstd_level < 1 || options.zstd_level > ZSTD_maxCLevel())) {
    return Status::InvalidArgument("zstd level must be in [1, " + std::to_string(ZSTD_maxCLevel()) +
                                   "], got " + std::to_string(options.zstd_level));
  }
  // Validate the target, and pair every target tensor with its base tensor by name.
  std::unordered_map<std::string, size_t> target_index;
  for (size_t i = 0; i < target.size(); ++i) {
    FW_RETURN_IF_ERROR(ValidateView(target[i], "target"));
    if (target[i].name.empty())
      return Status::InvalidArgument("target has a tensor with an empty name");
    if (!target_index.emplace(target[i].name, i).second) {
      return Status::InvalidArgument("target has two tensors named " + Quote(target[i].name));
    }
  }
  std::vector<size_t> base_of(target.size(), 0);
  CheckpointView base_aligned;  // base tensors in target order
  if (!keyframe) {
    if (base->size() != target.size()) {
      return Status::Mismatch("base has " + std::to_string(base->size()) + " tensors, target has " +
                              std::to_string(target.size()));
    }
    base_aligned.resize(target.size());
    std::vector<bool> seen(target.size(), false);
    for (const TensorView& bt : *base) {
      FW_RETURN_IF_ERROR(ValidateView(bt, "base"));
      auto it = target_index.find(bt.name);
      if (it == target_index.end()) {
        return Status::Mismatch("base tensor " + Quote(bt.name) + " is not in the target");
      }
      if (seen[it->second])
        return Status::InvalidArgument("base has two tensors named " + Quote(bt.name));
      seen[it->second] = true;
      const TensorView& tt = target[it->second];
      if (bt.dtype != tt.dtype || bt.shape != tt.shape) {
        return Status::Mismatch("tensor " + Quote(bt.name) + " differs in dtype or shape: base " +
                                DTypeName(bt.dtype) + ", target " + DTypeName(tt.dtype));
      }
      base_aligned[it->second] = bt;
    }
  }

  // Chunks: word ranges of every tensor.
  std::vector<ChunkTask> tasks;
  std::vector<size_t> first_task(target.size() + 1, 0);
  uint64_t total_bytes = 0, largest = 0;
  for (size_t i = 0; i < target.size(); ++i) {
    const int w = DTypeWordBytes(target[i].dtype);
    const uint64_t words = target[i].data.size() / w;
    const uint64_t chunk_words =
        std::min<uint64_t>(kMaxChunkWords, std::max<uint64_t>(1, options.chunk_bytes / w));
    first_task[i] = tasks.size();
    for (uint64_t begin = 0; begin < words; begin += chunk_words) {
      tasks.push_back({static_cast<uint32_t>(i), begin, std::min(chunk_words, words - begin)});
    }
    total_bytes += target[i].data.size();
    largest = std::max<uint64_t>(largest, target[i].data.size());
  }
  first_task[target.size()] = tasks.size();

  std::vector<EncodedChunk> encoded(tasks.size());
  std::vector<bool> skip(tasks.size(), false);
  std::atomic<uint64_t> done_bytes{0};
  auto encode_task = [&](size_t k, StreamingHash* base_hasher, StreamingHash* target_hasher) {
    const ChunkTask& task = tasks[k];
    const int w = DTypeWordBytes(target[task.tensor_index].dtype);
    const uint8_t* b = keyframe ? nullptr : U8(base_aligned[task.tensor_index].data);
    try {
      encoded[k] = EncodeChunk(task, w, b, U8(target[task.tensor_index].data), options, keyframe,
                               base_hasher, target_hasher);
    } catch (const std::bad_alloc&) {
      encoded[k] = EncodedChunk{};
      encoded[k].error = Status::ResourceExhausted("out of memory encoding tensor " +
                                                   Quote(target[task.tensor_index].name));
    }
    uint64_t done = done_bytes.fetch_add(task.word_count * w) + task.word_count * w;
    if (options.progress) options.progress(done, total_bytes);
  };

  std::vector<Hash128> target_hashes(target.size()), base_hashes(target.size());
  const bool hash_here =
      options.target_tensor_hashes.empty() && (keyframe || options.base_tensor_hashes.empty());
  // Hashing inside the compare pass reads every byte once instead of twice, but a
  // tensor's chunks must then run in order on one thread: only when no tensor is so large
  // that it would leave the other threads idle.
  const bool fused =
      hash_here && (options.threads == 1 || largest * options.threads <= total_bytes);
  if (fused) {
    std::vector<size_t> order(target.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t c) { return target[a].data.size() > target[c].data.size(); });
    ParallelFor(order.size(), options.threads, [&](size_t j) {
      const size_t i = order[j];
      StreamingHash base_hasher, target_hasher;
      for (size_t k = first_task[i]; k < first_task[i + 1]; ++k) {
        encode_task(k, keyframe ? nullptr : &base_hasher, &target_hasher);
      }
      target_hashes[i] = target_hasher.Finish();
      if (!keyframe) base_hashes[i] = base_hasher.Finish();
    });
  } else {
    // Hashes first (given or computed); base hashes are given index-aligned with `base`.
    FW_ASSIGN_OR_RETURN(target_hashes, HashesOrCompute(target, options.target_tensor_hashes,
                                                       options.threads, "target"));
    if (!keyframe) {
      FW_ASSIGN_OR_RETURN(
          std::vector<Hash128> given,
          HashesOrCompute(*base, options.base_tensor_hashes, options.threads, "base"));
      for (size_t i = 0; i < base->size(); ++i) {
        base_hashes[target_index[(*base)[i].name]] = given[i];
      }
      // Unchanged tensors (equal hashes and bytes) need no comparison at all.
      for (size_t i = 0; i < target.size(); ++i) {
        if (base_hashes[i] == target_hashes[i] &&
            std::ranges::equal(base_aligned[i].data, target[i].data)) {
          for (size_t k = first_task[i]; k < first_task[i + 1]; ++k) skip[k] = true;
          done_bytes += target[i].data.size();
        }
      }
    }
    ParallelFor(tasks.size(), options.threads, [&](size_t k) {
      if (!skip[k]) encode_task(k, nullptr, nullptr);
    });
  }
  Hash128 base_hash;
  if (!keyframe) {
    FW_ASSIGN_OR_RETURN(base_hash, CheckpointHashFromTensorHashes(base_aligned, base_hashes));
  }
  FW_ASSIGN_OR_RETURN(Hash128 target_hash, CheckpointHashFromTensorHashes(target, target_hashes));

  for (const EncodedChunk& c : encoded) FW_RETURN_IF_ERROR(c.error);

  // Manifest.
  std::vector<uint64_t> changed(target.size(), 0), chunk_count(target.size(), 0);
  uint64_t payload_bytes = 0, present_chunks = 0;
  for (const EncodedChunk& c : encoded) {
    if (!c.present) continue;
    changed[c.entry.tensor_index] += c.entry.changed_words;
    ++chunk_count[c.entry.tensor_index];
    payload_bytes += c.payload.size();
    ++present_chunks;
  }
  ByteVec manifest;
  manifest.reserve(256 + target.size() * 96 + present_chunks * 40);
  wire::PutVarint(&manifest, keyframe ? 0 : options.base_version);
  wire::PutVarint(&manifest, options.target_version);
  PutHash(&manifest, keyframe ? Hash128{} : base_hash);
  PutHash(&manifest, target_hash);
  wire::PutVarint(&manifest, options.metadata.size());
  for (const auto& [key, value] : options.metadata) {
    wire::PutString(&manifest, key);
    wire::PutString(&manifest, value);
  }
  wire::PutVarint(&manifest, target.size());
  for (size_t i = 0; i < target.size(); ++i) {
    const TensorView& t = target[i];
    wire::PutString(&manifest, t.name);
    wire::PutU8(&manifest, static_cast<uint8_t>(t.dtype));
    wire::PutVarint(&manifest, t.shape.size());
    for (int64_t d : t.shape) wire::PutVarint(&manifest, static_cast<uint64_t>(d));
    PutHash(&manifest, keyframe ? Hash128{} : base_hashes[i]);
    PutHash(&manifest, target_hashes[i]);
    wire::PutVarint(&manifest, keyframe ? t.data.size() / DTypeWordBytes(t.dtype) : changed[i]);
    wire::PutVarint(&manifest, chunk_count[i]);
  }
  wire::PutVarint(&manifest, present_chunks);
  for (const EncodedChunk& c : encoded) {
    if (!c.present) continue;
    const ChunkEntry& e = c.entry;
    wire::PutVarint(&manifest, e.word_begin);
    wire::PutVarint(&manifest, e.word_count);
    wire::PutU8(&manifest, static_cast<uint8_t>(e.kind));
    wire::PutU8(&manifest, static_cast<uint8_t>(e.compressor));
    wire::PutVarint(&manifest, e.changed_words);
    wire::PutVarint(&manifest, e.raw_bytes);
    wire::PutVarint(&manifest, e.payload_bytes);
    wire::PutFixed(&manifest, e.checksum, 8);
  }

  if (manifest.size() > limits.max_manifest_bytes) {
    return Status::InvalidArgument(
        "the delta's manifest would be " + std::to_string(manifest.size()) + " bytes, over the " +
        std::to_string(limits.max_manifest_bytes) + "-byte limit: use larger chunks");
  }
  ByteVec header;
  header.insert(header.end(), format::kMagic, format::kMagic + 8);
  wire::PutFixed(&header, format::kVersion, 2);
  wire::PutFixed(&header, keyframe ? format::kFlagKeyframe : 0, 2);
  wire::PutFixed(&header, 0, 4);
  wire::PutFixed(&header, manifest.size(), 8);
  wire::PutFixed(&header, payload_bytes, 8);
  wire::PutFixed(&header, Checksum(manifest), 8);
  wire::PutFixed(&header, Checksum(header), 8);

  std::vector<std::byte> out;
  try {
    out.resize(header.size() + manifest.size() + payload_bytes);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(out.size()) +
                                     " bytes for the delta");
  }
  uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
  std::memcpy(p, header.data(), header.size());
  p += header.size();
  std::memcpy(p, manifest.data(), manifest.size());
  p += manifest.size();
  for (const EncodedChunk& c : encoded) {
    if (!c.present) continue;
    std::memcpy(p, c.payload.data(), c.payload.size());
    p += c.payload.size();
  }
  return out;
}

}  // namespace

// ---- parsing ------------------------------------------------------------------------

Result<DeltaView> DeltaView::Parse(std::span<const std::byte> container,
                                   const DecodeLimits& limits) {
  const uint8_t* p = U8(container);
  const uint64_t size = container.size();
  if (size < format::kHeaderBytes) {
    return Status::Corruption("delta is " + std::to_string(size) +
                              " bytes, shorter than its 48-byte header");
  }
  if (std::memcmp(p, format::kMagic, 8) != 0) {
    return Status::Corruption("not a flywheel delta (bad magic at byte 0)");
  }
  if (ChecksumMismatch(wire::LoadFixed(p + 40, 8), {p, 40})) {
    return Status::Corruption("delta header checksum mismatch (bytes 0..47)");
  }
  const uint64_t version = wire::LoadFixed(p + 8, 2);
  const uint64_t flags = wire::LoadFixed(p + 10, 2);
  if (version != format::kVersion) {
    return Status::Corruption("delta format version " + std::to_string(version) +
                              " is not supported (this build reads version 1)");
  }
  if ((flags & ~uint64_t{format::kFlagKeyframe}) != 0) {
    return Status::Corruption("delta header has unknown flags " + std::to_string(flags));
  }
  if (wire::LoadFixed(p + 12, 4) != 0) {
    return Status::Corruption("delta header's reserved field is not zero");
  }
  const uint64_t manifest_bytes = wire::LoadFixed(p + 16, 8);
  const uint64_t payload_bytes = wire::LoadFixed(p + 24, 8);
  if (manifest_bytes > limits.max_manifest_bytes) {
    return Status::ResourceExhausted("delta manifest of " + std::to_string(manifest_bytes) +
                                     " bytes exceeds the limit of " +
                                     std::to_string(limits.max_manifest_bytes));
  }
  if (manifest_bytes > size - format::kHeaderBytes ||
      payload_bytes != size - format::kHeaderBytes - manifest_bytes) {
    return Status::Corruption("delta is " + std::to_string(size) + " bytes but its header says " +
                              std::to_string(format::kHeaderBytes) + " + " +
                              std::to_string(manifest_bytes) + " (manifest) + " +
                              std::to_string(payload_bytes) + " (payloads): truncated or padded");
  }
  std::span<const uint8_t> manifest_span(p + format::kHeaderBytes, manifest_bytes);
  if (ChecksumMismatch(wire::LoadFixed(p + 32, 8), manifest_span)) {
    return Status::Corruption("delta manifest checksum mismatch");
  }

  DeltaView view;
  view.bytes_ = container;
  view.payloads_ = container.subspan(format::kHeaderBytes + manifest_bytes);
  Manifest& m = view.manifest_;
  m.keyframe = flags & format::kFlagKeyframe;
  wire::Reader r(manifest_span);
  auto truncated = [&](const std::string& where) {
    return Status::Corruption("delta manifest truncated or malformed in " + where);
  };
  auto get_hash = [&] {
    Hash128 h;
    h.low = r.Fixed(8);
    h.high = r.Fixed(8);
    return h;
  };
  m.base_version = r.Varint();
  m.target_version = r.Varint();
  m.base_hash = get_hash();
  m.target_hash = get_hash();
  if (r.failed()) return truncated("the version fields");
  if (m.keyframe && m.base_hash != Hash128{})
    return Status::Corruption("keyframe names a base hash");
  uint64_t metadata_count = r.Varint();
  uint64_t metadata_bytes = 0;
  for (uint64_t i = 0; i < metadata_count && !r.failed(); ++i) {
    uint64_t key_len = r.Varint();
    auto key = r.Bytes(key_len);
    uint64_t value_len = r.Varint();
    auto value = r.Bytes(value_len);
    metadata_bytes += key_len + value_len;
    if (r.failed()) break;
    if (metadata_bytes > limits.max_metadata_bytes) {
      return Status::ResourceExhausted("delta metadata exceeds " +
                                       std::to_string(limits.max_metadata_bytes) + " bytes");
    }
    if (!m.metadata
             .emplace(std::string(key.begin(), key.end()), std::string(value.begin(), value.end()))
             .second) {
      return Status::Corruption("delta metadata has a duplicate key");
    }
  }
  if (r.failed()) return truncated("the metadata");

  uint64_t tensor_count = r.Varint();
  if (r.failed()) return truncated("the tensor count");
  if (tensor_count > limits.max_tensors) {
    return Status::ResourceExhausted("delta declares " + std::to_string(tensor_count) +
                                     " tensors, limit " + std::to_string(limits.max_tensors));
  }
  std::unordered_map<std::string, size_t> names;
  uint64_t declared_chunks = 0;
  uint64_t total_bytes = 0;
  for (uint64_t i = 0; i < tensor_count; ++i) {
    TensorEntry t;
    uint64_t name_len = r.Varint();
    if (name_len == 0 || name_len > limits.max_name_bytes) {
      return Status::Corruption("delta tensor " + std::to_string(i) + " has a name of " +
                                std::to_string(name_len) + " bytes");
    }
    auto name = r.Bytes(name_len);
    uint8_t dtype = r.U8();
    uint64_t rank = r.Varint();
    if (r.failed()) return truncated("tensor " + std::to_string(i));
    t.name.assign(name.begin(), name.end());
    if (dtype >= kNumDTypes) {
      return Status::Corruption("delta tensor " + Quote(t.name) + " has unknown dtype " +
                                std::to_string(dtype));
    }
    t.dtype = static_cast<DType>(dtype);
    if (rank > format::kMaxRank) {
      return Status::Corruption("delta tensor " + Quote(t.name) + " has rank " +
                                std::to_string(rank));
    }
    for (uint64_t d = 0; d < rank; ++d) {
      uint64_t dim = r.Varint();
      if (dim > (uint64_t{1} << 62))
        return Status::Corruption("delta tensor " + Quote(t.name) + " has a huge dimension");
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    t.base_hash = get_hash();
    t.target_hash = get_hash();
    t.changed_words = r.Varint();
    uint64_t chunks = r.Varint();
    if (r.failed()) return truncated("tensor " + Quote(t.name));
    auto bytes = TensorByteSize(t.dtype, t.shape);
    if (!bytes.ok())
      return Status::Corruption("delta tensor " + Quote(t.name) + ": " + bytes.status().message());
    t.byte_size = *bytes;
    if (t.byte_size > limits.max_total_bytes - total_bytes) {
      return Status::ResourceExhausted("delta tensors declare more than " +
                                       std::to_string(limits.max_total_bytes) +
                                       " bytes in all (at tensor " + Quote(t.name) + ")");
    }
    total_bytes += t.byte_size;
    const uint64_t words = t.byte_size / DTypeWordBytes(t.dtype);
    if (chunks > limits.max_chunks) {
      return Status::ResourceExhausted("delta tensor " + Quote(t.name) + " declares " +
                                       std::to_string(chunks) + " chunks, limit " +
                                       std::to_string(limits.max_chunks));
    }
    if (t.changed_words > words || chunks > words) {
      return Status::Corruption("delta tensor " + Quote(t.name) + " declares " +
                                std::to_string(t.changed_words) + " changed words in " +
                                std::to_string(chunks) + " chunks but has " +
                                std::to_string(words) + " words");
    }
    if (m.keyframe && t.base_hash != Hash128{}) {
      return Status::Corruption("keyframe tensor " + Quote(t.name) + " names a base hash");
    }
    if (!names.emplace(t.name, i).second)
      return Status::Corruption("delta names tensor " + Quote(t.name) + " twice");
    t.first_chunk = static_cast<uint32_t>(declared_chunks);
    t.chunk_count = static_cast<uint32_t>(chunks);
    declared_chunks += chunks;
    if (declared_chunks > limits.max_chunks) {
      return Status::ResourceExhausted("delta declares more than " +
                                       std::to_string(limits.max_chunks) + " chunks");
    }
    m.tensors.push_back(std::move(t));
  }
  uint64_t chunk_count = r.Varint();
  if (r.failed()) return truncated("the chunk count");
  if (chunk_count != declared_chunks) {
    return Status::Corruption("delta chunk table has " + std::to_string(chunk_count) +
                              " entries, tensors declare " + std::to_string(declared_chunks));
  }
  uint64_t payload_offset = 0;
  for (uint32_t ti = 0; ti < m.tensors.size(); ++ti) {
    TensorEntry& t = m.tensors[ti];
    const int w = DTypeWordBytes(t.dtype);
    const uint64_t words = t.byte_size / w;
    uint64_t next_free = 0, changed_sum = 0, covered = 0;
    for (uint32_t c = 0; c < t.chunk_count; ++c) {
      ChunkEntry e;
      e.tensor_index = ti;
      e.word_begin = r.Varint();
      e.word_count = r.Varint();
      uint8_t kind = r.U8();
      uint8_t compressor = r.U8();
      e.changed_words = r.Varint();
      e.raw_bytes = r.Varint();
      e.payload_bytes = r.Varint();
      e.checksum = r.Fixed(8);
      std::string where =
          "chunk " + std::to_string(m.chunks.size()) + " (tensor " + Quote(t.name) + ")";
      if (r.failed()) return truncated(where);
      if (kind > 2 || compressor > 2)
        return Status::Corruption(where + " has unknown kind or compressor");
      e.kind = static_cast<ChunkKind>(kind);
      e.compressor = static_cast<Compressor>(compressor);
      if (e.word_count == 0 || e.word_begin < next_free || e.word_begin > words ||
          e.word_count > words - e.word_begin) {
        return Status::Corruption(where + " covers words [" + std::to_string(e.word_begin) + ", +" +
                                  std::to_string(e.word_count) +
                                  ") outside or overlapping the tensor's " + std::to_string(words) +
                                  " words");
      }
      if (e.word_count > limits.max_chunk_words) {
        return Status::ResourceExhausted(where + " holds " + std::to_string(e.word_count) +
                                         " words, limit " + std::to_string(limits.max_chunk_words));
      }
      next_free = e.word_begin + e.word_count;
      covered += e.word_count;
      const uint64_t dense = e.word_count * w;
      if (e.changed_words > e.word_count ||
          (e.kind == ChunkKind::kSparse && e.changed_words == 0)) {
        return Status::Corruption(where + " declares " + std::to_string(e.changed_words) +
                                  " changed words of " + std::to_string(e.word_count));
      }
      if (e.kind != ChunkKind::kSparse && e.raw_bytes != dense) {
        return Status::Corruption(where + " is dense but its raw size " +
                                  std::to_string(e.raw_bytes) + " is not " + std::to_string(dense));
      }
      // A sparse chunk costs at least one bit per change (the shortest Rice code) and at
      // most 24 bytes per change (escaped gap + 64-bit value), plus its headers and table.
      if (e.kind == ChunkKind::kSparse && e.changed_words > 8 * e.raw_bytes) {
        return Status::Corruption(where + " declares " + std::to_string(e.changed_words) +
                                  " changes in only " + std::to_string(e.raw_bytes) + " bytes");
      }
      if (e.kind == ChunkKind::kSparse && e.raw_bytes > 64 + 24 * e.changed_words + 4 * 77) {
        return Status::Corruption(where + " declares an implausible raw size " +
                                  std::to_string(e.raw_bytes));
      }
      if (e.raw_bytes > limits.max_chunk_raw_bytes) {
        return Status::ResourceExhausted(where + " raw size " + std::to_string(e.raw_bytes) +
                                         " exceeds the limit");
      }
      if ((e.compressor == Compressor::kNone) != (e.payload_bytes == e.raw_bytes) &&
          e.compressor == Compressor::kNone) {
        return Status::Corruption(where + " is uncompressed but stored and raw sizes differ");
      }
      if (e.payload_bytes > payload_bytes - payload_offset) {
        return Status::Corruption(where + " payload runs past the end of the delta");
      }
      if (m.keyframe && e.kind != ChunkKind::kLiteral) {
        return Status::Corruption(where + " of a keyframe is not literal");
      }
      e.payload_offset = payload_offset;
      payload_offset += e.payload_bytes;
      changed_sum += e.changed_words;
      m.chunks.push_back(e);
    }
    if (changed_sum != t.changed_words) {
      return Status::Corruption("delta tensor " + Quote(t.name) + " declares " +
                                std::to_string(t.changed_words) + " changed words, its chunks " +
                                std::to_string(changed_sum));
    }
    if (m.keyframe && covered != words) {
      return Status::Corruption("keyframe does not cover every word of tensor " + Quote(t.name));
    }
    if (!m.keyframe && t.chunk_count == 0 && t.base_hash != t.target_hash) {
      return Status::Corruption("delta tensor " + Quote(t.name) +
                                " has no chunks but different base and target hashes");
    }
  }
  if (r.remaining() != 0) {
    return Status::Corruption("delta manifest has " + std::to_string(r.remaining()) +
                              " trailing bytes");
  }
  if (payload_offset != payload_bytes) {
    return Status::Corruption("delta chunks account for " + std::to_string(payload_offset) +
                              " payload bytes, header says " + std::to_string(payload_bytes));
  }
  return view;
}

Result<std::vector<std::byte>> Encode(const CheckpointView& base, const CheckpointView& target,
                                      const EncodeOptions& options) {
  return EncodeImpl(&base, target, options);
}

Result<std::vector<std::byte>> EncodeKeyframe(const CheckpointView& target,
                                              const EncodeOptions& options) {
  return EncodeImpl(nullptr, target, options);
}

// ---- apply --------------------------------------------------------------------------

namespace {

// What a chunk overwrote, to put it back if the apply as a whole fails.
struct UndoRecord {
  bool applied = false;
  std::vector<uint32_t> positions;  // sparse: positions (relative to word_begin)
  ByteVec old_bytes;                // sparse: old words at positions; dense: the old range
};

std::string ChunkName(const Manifest& m, size_t index) {
  const ChunkEntry& e = m.chunks[index];
  return "chunk " + std::to_string(index) + " (tensor " + Quote(m.tensors[e.tensor_index].name) +
         ", words " + std::to_string(e.word_begin) + ".." +
         std::to_string(e.word_begin + e.word_count) + ")";
}

Status ApplyChunkImpl(const DeltaView& delta, size_t index, std::span<std::byte> tensor_data,
                      bool keep_undo, bool keep_positions, UndoRecord* undo) {
  const Manifest& m = delta.manifest();
  const ChunkEntry& e = m.chunks[index];
  const int w = DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  auto stored = delta.payload(e);
  std::span<const uint8_t> stored_u8(U8(stored), stored.size());
  if (ChecksumMismatch(e.checksum, stored_u8)) {
    return Status::Corruption(ChunkName(m, index) + ": checksum mismatch");
  }
  Scratch& s = ThreadScratch();
  std::span<const uint8_t> raw = stored_u8;
  if (e.compressor != Compressor::kNone) {
    if (e.compressor == Compressor::kZstd) {
      Status st = CheckZstdFrameSize(stored_u8, e.raw_bytes);
      if (!st.ok()) return st.WithContext(ChunkName(m, index));
    }
    s.raw.resize(e.raw_bytes);
    Status st = Decompress(e.compressor, stored_u8, e.raw_bytes, s.raw.data());
    if (!st.ok()) return st.WithContext(ChunkName(m, index));
    raw = s.raw;
  } else if (raw.size() != e.raw_bytes) {
    return Status::Corruption(ChunkName(m, index) + ": stored size differs from raw size");
  }
  uint8_t* region = U8(tensor_data) + e.word_begin * w;
  const size_t n = e.word_count;

  if (e.kind == ChunkKind::kSparse) {
    wire::Reader r(raw);
    int k = r.U8();
    uint8_t coding = r.U8();
    uint64_t index_bytes = r.Varint();
    auto index_stream = r.Bytes(index_bytes);
    if (r.failed()) return Status::Corruption(ChunkName(m, index) + ": sparse header truncated");
    const size_t count = e.changed_words;
    // Every Rice code is at least one bit: refuse before sizing scratch from `count`.
    if (count > 8 * index_stream.size()) {
      return Status::Corruption(ChunkName(m, index) + ": index stream of " +
                                std::to_string(index_stream.size()) + " bytes cannot hold " +
                                std::to_string(count) + " changes");
    }
    Grow(s.positions, count);
    Grow(s.z, count);
    Status st = entropy::RiceDecodePositions(index_stream, k, count, n, s.positions.data());
    if (st.ok()) {
      if (coding == static_cast<uint8_t>(format::ValueCoding::kRans)) {
        st = entropy::DecodeValues(r.Rest(), count, s.z.data());
      } else if (coding == static_cast<uint8_t>(format::ValueCoding::kGamma)) {
        st = entropy::DecodeValuesGamma(r.Rest(), count, s.z.data());
      } else {
        st = Status::Corruption("unknown value coding " + std::to_string(coding));
      }
    }
    if (!st.ok()) return st.WithContext(ChunkName(m, index));
    // Everything decoded and in bounds: only now touch the state.
    void* old_values = nullptr;
    if (keep_undo || keep_positions) {
      undo->positions.assign(s.positions.begin(), s.positions.begin() + count);
    }
    if (keep_undo) {
      undo->old_bytes.resize(count * w);
      old_values = undo->old_bytes.data();
    }
    kernels::ScatterAddZigZag(region, w, s.positions.data(), s.z.data(), count, old_values);
  } else {
    if (keep_undo) undo->old_bytes.assign(region, region + n * w);
    if (e.kind == ChunkKind::kLiteral) {
      Unshuffle(raw.data(), n, w, region, [](uint8_t, uint8_t v) { return v; });
    } else {
      Unshuffle(raw.data(), n, w, region,
                [](uint8_t old, uint8_t v) { return static_cast<uint8_t>(old ^ v); });
    }
  }
  undo->applied = true;
  return Status::Ok();
}

// ApplyChunkImpl, with allocation failure reported as a status so that the caller's
// rollback runs (no exception leaves a pool thread).
Status ApplyChunk(const DeltaView& delta, size_t index, std::span<std::byte> tensor_data,
                  bool keep_undo, bool keep_positions, UndoRecord* undo) {
  try {
    Status st = ApplyChunkImpl(delta, index, tensor_data, keep_undo, keep_positions, undo);
    TrimScratch(ThreadScratch());
    return st;
  } catch (const std::bad_alloc&) {
    if (undo->applied) return Status::Internal("allocation failed after a chunk was applied");
    return Status::ResourceExhausted(ChunkName(delta.manifest(), index) +
                                     ": out of memory for decoding scratch");
  }
}

void Undo(const Manifest& m, size_t index, std::span<std::byte> tensor_data,
          const UndoRecord& undo) {
  if (!undo.applied) return;
  const ChunkEntry& e = m.chunks[index];
  const int w = DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  uint8_t* region = U8(tensor_data) + e.word_begin * w;
  if (e.kind == ChunkKind::kSparse) {
    kernels::ScatterApply(region, w, undo.positions.data(), undo.old_bytes.data(),
                          undo.positions.size());
  } else {
    std::memcpy(region, undo.old_bytes.data(), undo.old_bytes.size());
  }
}

}  // namespace

Result<ApplyStats> ApplyInPlace(MutableCheckpointView& state, const DeltaView& delta,
                                const ApplyOptions& options) {
  const Manifest& m = delta.manifest();
  if (options.threads < 1 || options.threads > kMaxThreads) {
    return Status::InvalidArgument("threads must be in [1, " + std::to_string(kMaxThreads) +
                                   "], got " + std::to_string(options.threads));
  }
  if (options.before_commit && !options.restore_on_failure) {
    return Status::InvalidArgument("before_commit needs restore_on_failure (a refusal restores the base)");
  }
  const int threads = options.threads;
  if (state.size() != m.tensors.size()) {
    return Status::Mismatch("state has " + std::to_string(state.size()) + " tensors, the delta " +
                            std::to_string(m.tensors.size()));
  }
  // state_of[i]: the state tensor that manifest tensor i patches.
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < state.size(); ++i) by_name.emplace(state[i].name, i);
  std::vector<size_t> state_of(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorEntry& t = m.tensors[i];
    auto it = by_name.find(t.name);
    if (it == by_name.end()) return Status::Mismatch("state has no tensor " + Quote(t.name));
    const MutableTensorView& st = state[it->second];
    if (st.dtype != t.dtype || st.shape != t.shape || st.data.size() != t.byte_size) {
      return Status::Mismatch("tensor " + Quote(t.name) +
                              " differs in dtype, shape or size from the delta's");
    }
    state_of[i] = it->second;
  }
  CheckpointView state_view;
  state_view.reserve(state.size());
  for (const MutableTensorView& t : state) state_view.push_back(t.view());

  std::vector<Hash128> hashes;
  if (!m.keyframe) {
    FW_ASSIGN_OR_RETURN(hashes,
                        HashesOrCompute(state_view, options.state_tensor_hashes, threads, "state"));
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      if (hashes[state_of[i]] != m.tensors[i].base_hash) {
        return Status::Mismatch("refusing to apply: this delta's base is version " +
                                std::to_string(m.base_version) + " (" + m.base_hash.ToHex() +
                                ") but tensor " + Quote(m.tensors[i].name) +
                                " of the state differs from it");
      }
    }
    FW_ASSIGN_OR_RETURN(Hash128 base_hash, CheckpointHashFromTensorHashes(state_view, hashes));
    if (base_hash != m.base_hash) {
      return Status::Mismatch("refusing to apply: state hash " + base_hash.ToHex() +
                              " is not the delta's base " + m.base_hash.ToHex());
    }
  } else {
    hashes.assign(state.size(), Hash128{});
  }

  // Decode and apply every chunk; stop early after a failure.
  // Undo records are recycled per calling thread (a worker applies delta after delta), so
  // their memory is mapped once rather than page-faulted in on every apply.
  thread_local std::vector<UndoRecord> recycled_undo;
  std::vector<UndoRecord> undo = std::move(recycled_undo);
  undo.resize(m.chunks.size());
  for (UndoRecord& u : undo) {
    u.applied = false;
    u.positions.clear();
    u.old_bytes.clear();
  }
  struct GiveBack {
    std::vector<UndoRecord>& records;
    ~GiveBack() {
      size_t bytes = 0;
      for (const UndoRecord& u : records)
        bytes += u.positions.capacity() * 4 + u.old_bytes.capacity();
      if (bytes <= (256u << 20)) recycled_undo = std::move(records);
    }
  } give_back{undo};
  std::vector<Status> errors(m.chunks.size());
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> done_bytes{0};
  uint64_t total_bytes = 0;  // progress counts the word ranges that chunks cover
  for (const ChunkEntry& e : m.chunks)
    total_bytes += e.word_count * DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  ParallelFor(m.chunks.size(), threads, [&](size_t c) {
    if (failed.load(std::memory_order_relaxed)) return;
    const ChunkEntry& e = m.chunks[c];
    errors[c] = ApplyChunk(delta, c, state[state_of[e.tensor_index]].data,
                           options.restore_on_failure, options.report_changes, &undo[c]);
    if (!errors[c].ok()) failed = true;
    const uint64_t bytes = e.word_count * DTypeWordBytes(m.tensors[e.tensor_index].dtype);
    uint64_t done = done_bytes.fetch_add(bytes) + bytes;
    if (options.progress) options.progress(done, total_bytes);
  });
  auto rollback = [&] {
    if (!options.restore_on_failure) return;
    for (size_t c = 0; c < m.chunks.size(); ++c) {
      Undo(m, c, state[state_of[m.chunks[c].tensor_index]].data, undo[c]);
    }
  };
  if (failed) {
    rollback();
    for (const Status& st : errors)
      if (!st.ok()) return st;
  }

  // Verify the target: every tensor that chunks touched is rehashed.
  std::vector<size_t> touched;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (m.tensors[i].chunk_count > 0)
      touched.push_back(i);
    else
      hashes[state_of[i]] = m.tensors[i].target_hash;
  }
  std::sort(touched.begin(), touched.end(),
            [&](size_t a, size_t b) { return m.tensors[a].byte_size > m.tensors[b].byte_size; });
  ParallelFor(touched.size(), threads, [&](size_t k) {
    size_t si = state_of[touched[k]];
    hashes[si] = TensorHash(state_view[si]);
  });
  for (size_t i : touched) {
    if (hashes[state_of[i]] != m.tensors[i].target_hash) {
      rollback();
      return Status::Corruption("tensor " + Quote(m.tensors[i].name) + " hashes to " +
                                hashes[state_of[i]].ToHex() + " after apply, the delta promises " +
                                m.tensors[i].target_hash.ToHex());
    }
  }
  FW_ASSIGN_OR_RETURN(Hash128 target_hash, CheckpointHashFromTensorHashes(state_view, hashes));
  if (target_hash != m.target_hash) {
    rollback();
    return Status::Corruption("checkpoint hashes to " + target_hash.ToHex() +
                              " after apply, the delta promises " + m.target_hash.ToHex());
  }
  ApplyStats stats;
  stats.changed_words = m.changed_words();
  stats.chunks = m.chunks.size();
  stats.tensor_hashes = std::move(hashes);
  if (options.report_changes) {
    stats.changes.reserve(m.chunks.size());
    for (size_t c = 0; c < m.chunks.size(); ++c) {
      const ChunkEntry& e = m.chunks[c];
      ChangedWords changed;
      changed.state_index = state_of[e.tensor_index];
      changed.word_begin = e.word_begin;
      changed.word_count = e.word_count;
      changed.all = e.kind != ChunkKind::kSparse;
      if (!changed.all) changed.positions = undo[c].positions;
      stats.changes.push_back(std::move(changed));
    }
  }
  if (options.before_commit) {
    Status accepted = options.before_commit(stats);
    if (!accepted.ok()) {
      rollback();
      return accepted;
    }
  }
  return stats;
}

namespace {

Result<OwnedCheckpoint> AllocateLike(const Manifest& m) {
  OwnedCheckpoint out;
  uint64_t total = m.total_bytes();
  if (total > (uint64_t{1} << 40)) {
    return Status::ResourceExhausted("delta target of " + std::to_string(total) +
                                     " bytes is too large to hold in memory");
  }
  try {
    out.tensors.reserve(m.tensors.size());
    for (const TensorEntry& t : m.tensors) {
      out.tensors.push_back({t.name, t.dtype, t.shape, std::vector<std::byte>(t.byte_size)});
    }
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(total) +
                                     " bytes for the target");
  }
  return out;
}

}  // namespace

Result<OwnedCheckpoint> DecodeKeyframe(const DeltaView& keyframe, int threads) {
  const Manifest& m = keyframe.manifest();
  if (!m.keyframe) return Status::InvalidArgument("not a keyframe (a delta needs a base)");
  if (threads < 1 || threads > kMaxThreads) {
    return Status::InvalidArgument("threads must be in [1, " + std::to_string(kMaxThreads) + "]");
  }
  // The target is allocated from declared sizes: first check what can be checked cheaply
  // (every chunk's checksum and zstd frame size), so a forged keyframe costs no memory.
  for (size_t c = 0; c < m.chunks.size(); ++c) {
    auto stored = keyframe.payload(m.chunks[c]);
    std::span<const uint8_t> bytes(U8(stored), stored.size());
    if (ChecksumMismatch(m.chunks[c].checksum, bytes)) {
      return Status::Corruption(ChunkName(m, c) + ": checksum mismatch");
    }
    if (m.chunks[c].compressor == Compressor::kZstd) {
      Status st = CheckZstdFrameSize(bytes, m.chunks[c].raw_bytes);
      if (!st.ok()) return st.WithContext(ChunkName(m, c));
    }
  }
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint out, AllocateLike(m));
  MutableCheckpointView view = out.mutable_view();
  ApplyOptions options;
  options.threads = threads;
  options.restore_on_failure = false;
  FW_RETURN_IF_ERROR(ApplyInPlace(view, keyframe, options).status());
  return out;
}

Result<OwnedCheckpoint> ApplyToCopy(const CheckpointView& base, const DeltaView& delta,
                                    const ApplyOptions& options) {
  const Manifest& m = delta.manifest();
  if (m.keyframe) return DecodeKeyframe(delta, options.threads);
  if (base.size() != m.tensors.size()) {
    return Status::Mismatch("base has " + std::to_string(base.size()) + " tensors, the delta " +
                            std::to_string(m.tensors.size()));
  }
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < base.size(); ++i) by_name.emplace(base[i].name, i);
  std::vector<size_t> base_of(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    auto it = by_name.find(m.tensors[i].name);
    if (it == by_name.end())
      return Status::Mismatch("base has no tensor " + Quote(m.tensors[i].name));
    const TensorView& b = base[it->second];
    if (b.dtype != m.tensors[i].dtype || b.shape != m.tensors[i].shape ||
        b.data.size() != m.tensors[i].byte_size) {
      return Status::Mismatch("tensor " + Quote(b.name) +
                              " differs in dtype, shape or size from the delta's");
    }
    base_of[i] = it->second;
  }
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint out, AllocateLike(m));
  ParallelFor(m.tensors.size(), options.threads, [&](size_t i) {
    const TensorView& b = base[base_of[i]];
    if (!b.data.empty()) std::memcpy(out.tensors[i].data.data(), b.data.data(), b.data.size());
  });
  MutableCheckpointView view = out.mutable_view();
  ApplyOptions inner = options;
  inner.restore_on_failure = false;
  if (!options.state_tensor_hashes.empty()) {
    if (options.state_tensor_hashes.size() != base.size()) {
      return Status::InvalidArgument("state tensor hashes do not match the base's tensor count");
    }
    inner.state_tensor_hashes.resize(m.tensors.size());
    for (size_t i = 0; i < m.tensors.size(); ++i)
      inner.state_tensor_hashes[i] = options.state_tensor_hashes[base_of[i]];
  }
  FW_RETURN_IF_ERROR(ApplyInPlace(view, delta, inner).status());
  return out;
}

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
      s.sparse_chunks += e.kind == ChunkKind::kSparse;
      s.dense_chunks += e.kind == ChunkKind::kDenseXor;
      s.literal_chunks += e.kind == ChunkKind::kLiteral;
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace flywheel::delta
