// Entropy coders of the sparse chunk encoding (internal to flywheel_delta; the byte
// layout they produce is specified in delta/format.h).
//
//  * Rice codes with escape for the gaps between changed positions: a gap g is
//    q = g >> k zero bits, a one bit, then the k low bits of g; a gap with q >= 31 is
//    written as 31 zero bits, a one bit, 6 bits holding L = bit length of g, then the
//    L low bits of g. Bits are packed LSB-first into bytes.
//  * A static rANS coder (32-bit state, byte-wise renormalisation, 12-bit frequencies)
//    for value symbols, with a per-chunk frequency table.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "base/status.h"

namespace flywheel::delta::entropy {

// ---- bits -------------------------------------------------------------------------

class BitWriter {
 public:
  // Appends to `out`, which is grown once to hold `max_bits` more bits (an upper bound
  // the caller computes); Flush() trims it to what was written.
  BitWriter(std::vector<uint8_t>* out, uint64_t max_bits) : out_(out), start_(out->size()) {
    out->resize(start_ + (max_bits + 7) / 8 + 8);
    next_ = out->data() + start_;
    limit_ = out->data() + out->size();
  }
  // REQUIRES: count <= 32, value < 2^count, at most max_bits in all.
  // Without a branch: the accumulator (under 8 bits pending, then up to 32 more) is stored
  // whole every time and the pointer moves by its complete bytes (the vector has 8 bytes
  // of room past max_bits for that store).
  void Put(uint64_t value, int count) {
    acc_ |= value << filled_;
    filled_ += count;
    assert(next_ + 8 <= limit_);
    std::memcpy(next_, &acc_, 8);
    next_ += filled_ >> 3;
    acc_ >>= filled_ & ~7;  // filled_ <= 7 + 32 here
    filled_ &= 7;
  }
  // REQUIRES: count <= 64, value < 2^count.
  void PutWide(uint64_t value, int count) {
    if (count > 32) {
      Put(value & 0xffffffffu, 32);
      Put(value >> 32, count - 32);
    } else {
      Put(value, count);
    }
  }
  // Writes the partial last bytes (zero padded) and trims the vector.
  void Flush() {
    while (filled_ > 0) {
      *next_++ = static_cast<uint8_t>(acc_);
      acc_ >>= 8;
      filled_ -= 8;
    }
    acc_ = 0;
    filled_ = 0;
    out_->resize(static_cast<size_t>(next_ - out_->data()));
  }

 private:
  std::vector<uint8_t>* out_;
  size_t start_;
  uint8_t* next_;
  uint8_t* limit_;
  uint64_t acc_ = 0;
  int filled_ = 0;
};

// Reads LSB-first bits; past the end it reads zeros, and overrun() tells that more bits
// were consumed than the input holds.
class BitReader {
 public:
  explicit BitReader(std::span<const uint8_t> in) : in_(in) { Refill(); }
  // At least 56 upcoming bits, lowest first.
  uint64_t Peek() const { return acc_; }
  // REQUIRES: count <= 56.
  void Skip(int count) {
    acc_ >>= count;
    avail_ -= count;
    consumed_ += static_cast<uint64_t>(count);
    if (avail_ < 56) Refill();
  }
  // REQUIRES: count <= 56.
  uint64_t Get(int count) {
    uint64_t v = count == 0 ? 0 : acc_ & ((~uint64_t{0}) >> (64 - count));
    Skip(count);
    return v;
  }
  uint64_t GetWide(int count) {  // count <= 64
    if (count > 32) {
      uint64_t low = Get(32);
      return low | (Get(count - 32) << 32);
    }
    return Get(count);
  }
  bool overrun() const { return consumed_ > 8 * static_cast<uint64_t>(in_.size()); }
  // True when every byte was used: fewer than 8 bits are left and they are zero (the
  // writer's padding), so trailing garbage is detected.
  bool AtEnd() const {
    const uint64_t total = 8 * static_cast<uint64_t>(in_.size());
    if (consumed_ > total || total - consumed_ >= 8) return false;
    const int left = static_cast<int>(total - consumed_);
    return left == 0 || (acc_ & ((uint64_t{1} << left) - 1)) == 0;
  }

 private:
  void Refill() {
    if (pos_ + 8 <= in_.size()) {
      uint64_t word;
      std::memcpy(&word, in_.data() + pos_, 8);
      acc_ |= word << avail_;
      pos_ += static_cast<size_t>((63 - avail_) >> 3);
      avail_ |= 56;
      return;
    }
    while (avail_ <= 56) {
      uint64_t byte = pos_ < in_.size() ? in_[pos_] : 0;
      ++pos_;
      acc_ |= byte << avail_;
      avail_ += 8;
    }
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  int avail_ = 0;
  uint64_t consumed_ = 0;
};

// ---- Rice gaps --------------------------------------------------------------------

inline constexpr int kRiceEscapeQuotient = 31;
inline constexpr int kMaxRiceK = 31;

// Bits needed to code `gaps` with parameter k.
uint64_t RiceCost(std::span<const uint32_t> gaps, int k);
// The k in [0, kMaxRiceK] that minimises RiceCost (searched around the mean gap).
int ChooseRiceK(std::span<const uint32_t> gaps);
void RiceEncode(std::span<const uint32_t> gaps, int k, std::vector<uint8_t>* out);
// Decodes `count` changed positions (gap coded, first gap from -1) into `positions`,
// each < `limit`. Corruption on a malformed stream, an overrun, or a position >= limit.
Status RiceDecodePositions(std::span<const uint8_t> in, int k, size_t count, uint64_t limit,
                           uint32_t* positions);

// ---- the plain sparse chunk, decoded and applied in one pass --------------------------

// What DecodeApplySparse patches: `region` holds the chunk's words (w bytes each,
// little-endian); positions_out[i] and old_out[i] (w bytes) receive each change's word
// index and its previous word (the undo record).
// Which compiled loop DecodeApplySparse runs: the BMI2 one where the CPU has BMI2 (kAuto)
// or the one for any x86-64 (kBaseline; tests run both).
enum class FusedLoopIsa { kAuto, kBaseline };

struct SparseTarget {
  FusedLoopIsa isa = FusedLoopIsa::kAuto;
  uint8_t* region = nullptr;
  int w = 2;  // 1, 2, 4 or 8
  uint32_t* positions_out = nullptr;  // room for `count`
  uint8_t* old_out = nullptr;         // room for count * w bytes
};

// True when DecodeApplySparse takes chunks of Rice parameter k (larger k, rare, take the
// three-pass reference).
inline bool FusedRiceK(int k) {
  return k >= 0 && k <= 24;
}

// The sparse apply of a plain (kind 2, rANS-valued) chunk in one pass over its changes:
// each change's Rice gap (`index`, parameter k, each position < limit), its rANS-coded
// value (`values`, EncodeValues's layout) and its extra bits are decoded and the
// difference added to its word at once, so the decoders' dependency chains overlap and
// no per-change array is written but the undo record. The reference is
// RiceDecodePositions + DecodeValues + kernels::ScatterAddZigZagScalar; the two agree bit
// for bit, and on the same inputs both succeed or both return Corruption.
// On Corruption every word written is put back: the region is as before the call.
// REQUIRES: FusedRiceK(k); target as SparseTarget says.
Status DecodeApplySparse(std::span<const uint8_t> index, int k, std::span<const uint8_t> values,
                         size_t count, uint64_t limit, const SparseTarget& target);

// ---- value symbols ------------------------------------------------------------------
// A changed word's difference d = target - base (mod 2^(8w), as a signed integer) is
// zigzag mapped to z >= 1. z <= 16 is symbol z - 1; larger z is symbol 16 + (L - 5)
// with L = bit length of z (5..64), followed by the L - 1 low bits of z as extra bits.

inline constexpr int kNumValueSymbols = 76;
inline constexpr int kRansScaleBits = 12;
inline constexpr uint32_t kRansScale = 1u << kRansScaleBits;
inline constexpr uint32_t kRansLow = 1u << 23;

inline uint64_t ZigZag(int64_t d) {
  return (static_cast<uint64_t>(d) << 1) ^ static_cast<uint64_t>(d >> 63);
}
inline int64_t UnZigZag(uint64_t z) {
  return static_cast<int64_t>((z >> 1) ^ (~(z & 1) + 1));
}
inline int BitLength(uint64_t z) {
  return 64 - __builtin_clzll(z);
}  // REQUIRES z > 0
inline int ValueSymbol(uint64_t z) {
  return z <= 16 ? static_cast<int>(z - 1) : 16 + BitLength(z) - 5;
}

// Normalises symbol counts to frequencies summing to kRansScale, every used symbol >= 1.
std::vector<uint32_t> NormalizeFrequencies(std::span<const uint64_t> counts);

// Encodes zigzag values `z` (each >= 1): writes the frequency table, the rANS stream and
// the extra-bits stream (layout in delta/format.h) to `out`.
void EncodeValues(std::span<const uint64_t> z, std::vector<uint8_t>* out);
// Elias-gamma alternative for very few values (no table).
void EncodeValuesGamma(std::span<const uint64_t> z, std::vector<uint8_t>* out);
// Bytes EncodeValues / EncodeValuesGamma would produce (exact for gamma, close for rANS).
uint64_t EstimateValuesBytes(std::span<const uint64_t> z);

// Decode `count` values into `z` (each >= 1). Corruption on any malformed input.
Status DecodeValues(std::span<const uint8_t> in, size_t count, uint64_t* z);
Status DecodeValuesGamma(std::span<const uint8_t> in, size_t count, uint64_t* z);

// Values coded with one frequency table per context (the context-modelled sparse chunk):
// value i uses table context_of[i] (< contexts). Layout: `contexts` frequency tables as
// EncodeValues writes its one, then the rANS stream and the extra bits as there.
inline constexpr int kMaxValueContexts = 16;
void EncodeValuesContext(std::span<const uint64_t> z, std::span<const uint8_t> context_of,
                         int contexts, std::vector<uint8_t>* out);
// REQUIRES: context_of holds `count` entries, each < contexts.
Status DecodeValuesContext(std::span<const uint8_t> in, size_t count,
                           std::span<const uint8_t> context_of, int contexts, uint64_t* z);

}  // namespace flywheel::delta::entropy
