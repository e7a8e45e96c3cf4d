// Little-endian byte writing and bounds-checked reading (internal to flywheel_delta).
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace flywheel::delta::wire {

inline void PutU8(std::vector<uint8_t>* out, uint8_t v) {
  out->push_back(v);
}
inline void PutFixed(std::vector<uint8_t>* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void PutVarint(std::vector<uint8_t>* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<uint8_t>(v));
}
inline void PutBytes(std::vector<uint8_t>* out, std::span<const uint8_t> bytes) {
  out->insert(out->end(), bytes.begin(), bytes.end());
}
inline void PutString(std::vector<uint8_t>* out, const std::string& s) {
  PutVarint(out, s.size());
  out->insert(out->end(), s.begin(), s.end());
}
inline uint64_t LoadFixed(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Reads from a span; any read past the end sets failed() and returns zeros, so parsers
// check once per record instead of after every field.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  uint8_t U8() {
    if (pos_ >= in_.size()) return Fail(), 0;
    return in_[pos_++];
  }
  uint64_t Fixed(int bytes) {
    if (in_.size() - pos_ < static_cast<size_t>(bytes)) return Fail(), 0;
    uint64_t v = LoadFixed(in_.data() + pos_, bytes);
    pos_ += bytes;
    return v;
  }
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= in_.size()) return Fail(), 0;
      uint8_t b = in_[pos_++];
      if (shift == 63 && b > 1) return Fail(), 0;  // more than 64 bits
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    return Fail(), 0;
  }
  // A span of `n` bytes, or an empty span and failed() if fewer remain.
  std::span<const uint8_t> Bytes(uint64_t n) {
    if (n > in_.size() - pos_) return Fail(), std::span<const uint8_t>{};
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::span<const uint8_t> Rest() { return Bytes(in_.size() - pos_); }
  size_t remaining() const { return in_.size() - pos_; }
  size_t position() const { return pos_; }
  bool failed() const { return failed_; }

 private:
  void Fail() {
    failed_ = true;
    pos_ = in_.size();
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  bool failed_ = false;
};

}  // namespace flywheel::delta::wire
