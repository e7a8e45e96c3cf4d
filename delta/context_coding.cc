#include "delta/context_coding.h"

#include <algorithm>
#include <string>

#include "delta/entropy.h"
#include "delta/wire.h"

namespace flywheel::delta::internal {
namespace {

using kernels::BucketContext;
using kernels::kNumBuckets;

constexpr uint8_t kInvertedBit = 0x80;
constexpr uint8_t kRiceMask = 0x1f;

// The offset that puts the largest exponent field among the changed words in bucket
// kNumBuckets - 2: bucket kNumBuckets - 1 then holds only words above every changed one
// (which need no stream), and the small exponents, which change most, share bucket 0.
int ChooseOffset(const BucketContext& field, std::span<const uint64_t> base_words) {
  if (field.field_mask < static_cast<uint32_t>(kNumBuckets)) return 0;
  uint64_t largest = 0;
  for (uint64_t word : base_words) largest = std::max<uint64_t>(largest, (word >> field.shift) & field.field_mask);
  return std::max(0, static_cast<int>(largest) - (kNumBuckets - 2));
}

// Rice gaps of ascending ranks (the first from -1).
void RanksToGaps(std::span<const uint32_t> ranks, std::vector<uint32_t>* gaps) {
  gaps->resize(ranks.size());
  int64_t previous = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    (*gaps)[i] = static_cast<uint32_t>(ranks[i] - previous - 1);
    previous = ranks[i];
  }
}

// The ranks in [0, total) that are not in `changed` (ascending).
void Complement(std::span<const uint32_t> changed, uint64_t total, std::vector<uint32_t>* out) {
  out->clear();
  size_t c = 0;
  for (uint32_t r = 0; r < total; ++r) {
    if (c < changed.size() && changed[c] == r) {
      ++c;
      continue;
    }
    out->push_back(r);
  }
}

}  // namespace

std::optional<BucketContext> ExponentFieldOf(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return BucketContext{7, 0xff, 0};
    case DType::kF16: return BucketContext{10, 0x1f, 0};
    case DType::kF32: return BucketContext{23, 0xff, 0};
    case DType::kF64: return BucketContext{52, 0x7ff, 0};
    case DType::kF8_E4M3: return BucketContext{3, 0xf, 0};
    case DType::kF8_E5M2: return BucketContext{2, 0x1f, 0};
    default: return std::nullopt;
  }
}

void EncodeSparseContext(const BucketContext& field, const uint8_t* base, size_t n, int w,
                         std::span<const uint32_t> positions, std::span<const uint64_t> z,
                         std::span<const uint64_t> base_words, Scratch& s, ByteVec* raw) {
  const size_t m = positions.size();
  BucketContext context = field;
  context.offset = ChooseOffset(field, base_words);
  size_t changes_in[kNumBuckets] = {};
  for (uint64_t word : base_words) ++changes_in[kernels::BucketOf(word, context)];
  uint8_t buckets[kNumBuckets];
  uint32_t* ranks[kNumBuckets];
  size_t streams = 0;
  Grow(s.ranks, m);
  for (int b = 0, filled = 0; b < kNumBuckets; ++b) {
    if (changes_in[b] == 0) continue;
    buckets[streams] = static_cast<uint8_t>(b);
    ranks[streams++] = s.ranks.data() + filled;
    filled += static_cast<int>(changes_in[b]);
  }
  Grow(s.order, m);
  Grow(s.contexts, m);
  uint64_t words_in[kNumBuckets];
  kernels::RankBucketed(base, n, w, context, buckets, streams, positions.data(), m,
                        s.order.data(), s.contexts.data(), ranks, words_in);
  raw->clear();
  wire::PutU8(raw, static_cast<uint8_t>(context.offset));
  wire::PutU8(raw, static_cast<uint8_t>(streams));
  ByteVec coded;
  std::vector<uint32_t> complement;
  for (size_t j = 0; j < streams; ++j) {
    const size_t changed = changes_in[buckets[j]];
    const bool inverted = 2 * changed > words_in[j];
    std::span<const uint32_t> listed(ranks[j], changed);
    if (inverted) {
      Complement(listed, words_in[j], &complement);
      listed = complement;
    }
    RanksToGaps(listed, &s.gaps);
    const std::span<const uint32_t> gaps(s.gaps.data(), listed.size());
    const int k = entropy::ChooseRiceK(gaps);
    const size_t before = coded.size();
    entropy::RiceEncode(gaps, k, &coded);
    wire::PutU8(raw, buckets[j]);
    wire::PutU8(raw, static_cast<uint8_t>(k | (inverted ? kInvertedBit : 0)));
    wire::PutVarint(raw, listed.size());
    wire::PutVarint(raw, coded.size() - before);
  }
  wire::PutBytes(raw, coded);
  Grow(s.z2, m);
  for (size_t i = 0; i < m; ++i) s.z2[i] = z[s.order[i]];
  entropy::EncodeValuesContext({s.z2.data(), m}, {s.contexts.data(), m}, static_cast<int>(streams),
                               raw);
}

namespace {

Status Corrupt(const std::string& what) {
  return Status::Corruption("context-coded chunk: " + what);
}

struct StreamHeader {
  uint8_t bucket;
  uint8_t k;
  bool inverted;
  uint64_t coded;
  uint64_t bytes;
};

// The stream table after the offset byte; every field checked before anything is sized
// from it.
Status ReadStreamHeaders(wire::Reader& r, size_t n, StreamHeader* headers, size_t* streams) {
  const size_t count = r.U8();
  if (r.failed() || count < 1 || count > static_cast<size_t>(kNumBuckets)) {
    return Corrupt("bad stream count " + std::to_string(count));
  }
  int previous = -1;
  for (size_t j = 0; j < count; ++j) {
    StreamHeader& h = headers[j];
    h.bucket = r.U8();
    const uint8_t rice = r.U8();
    h.coded = r.Varint();
    h.bytes = r.Varint();
    if (r.failed()) return Corrupt("stream table truncated at stream " + std::to_string(j));
    if (h.bucket <= previous || h.bucket >= kNumBuckets) {
      return Corrupt("stream " + std::to_string(j) + " has bucket " + std::to_string(h.bucket) +
                     " (buckets must ascend, below 16)");
    }
    if ((rice & ~(kInvertedBit | kRiceMask)) != 0) {
      return Corrupt("stream " + std::to_string(j) + " has unknown flags " + std::to_string(rice));
    }
    h.k = rice & kRiceMask;
    h.inverted = (rice & kInvertedBit) != 0;
    // Every Rice code is at least one bit.
    if (h.coded > n || h.coded > 8 * h.bytes) {
      return Corrupt("stream " + std::to_string(j) + " lists " + std::to_string(h.coded) +
                     " words in " + std::to_string(h.bytes) + " bytes of a " + std::to_string(n) +
                     "-word chunk");
    }
    previous = h.bucket;
  }
  *streams = count;
  return Status::Ok();
}

}  // namespace

Status DecodeSparseContext(const BucketContext& field, std::span<const uint8_t> raw,
                           const uint8_t* base, size_t n, int w, size_t count, Scratch& s) {
  wire::Reader r(raw);
  BucketContext context = field;
  context.offset = r.U8();
  StreamHeader headers[kNumBuckets];
  size_t streams = 0;
  FW_RETURN_IF_ERROR(ReadStreamHeaders(r, n, headers, &streams));
  const size_t streams_begin = raw.size() - r.remaining();
  uint64_t total_coded = 0;
  for (size_t j = 0; j < streams; ++j) {
    if (headers[j].bytes > r.remaining()) return Corrupt("rank streams run past the chunk");
    r.Bytes(headers[j].bytes);
    total_coded += headers[j].coded;
  }
  Grow(s.ranks, total_coded);
  kernels::BucketStream table[kNumBuckets];
  for (size_t j = 0, filled = 0, at = streams_begin; j < streams; ++j) {
    const StreamHeader& h = headers[j];
    Status st = entropy::RiceDecodePositions(raw.subspan(at, h.bytes), h.k, h.coded, n,
                                             s.ranks.data() + filled);
    if (!st.ok()) return st.WithContext("context-coded chunk, bucket " + std::to_string(h.bucket));
    table[j] = {h.bucket, h.inverted, s.ranks.data() + filled, h.coded};
    filled += h.coded;
    at += h.bytes;
  }
  Grow(s.positions, count);
  Grow(s.contexts, count);
  Grow(s.z, count);
  uint64_t words_in[kNumBuckets];
  const size_t listed = kernels::SelectBucketed(base, n, w, context, table, streams,
                                                s.positions.data(), s.contexts.data(), count,
                                                words_in);
  if (listed == SIZE_MAX) return Corrupt("rank streams do not fit the base's buckets");
  if (listed != count) {
    return Corrupt("rank streams list " + std::to_string(listed) + " changes, the chunk declares " +
                   std::to_string(count));
  }
  return entropy::DecodeValuesContext(r.Rest(), count, {s.contexts.data(), count},
                                      static_cast<int>(streams), s.z.data());
}

}  // namespace flywheel::delta::internal
