#include "delta/entropy.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "delta/wire.h"
#include "kernels/kernels.h"

namespace flywheel::delta::entropy {
namespace {

Status Corrupt(const std::string& what) {
  return Status::Corruption(what);
}

}  // namespace

// ---- Rice gaps --------------------------------------------------------------------

uint64_t RiceCost(std::span<const uint32_t> gaps, int k) {
  uint64_t bits = 0;
  for (uint32_t g : gaps) {
    uint64_t q = g >> k;
    bits += q < kRiceEscapeQuotient ? q + 1 + k
                                    : kRiceEscapeQuotient + 1 + 6 + BitLength(uint64_t{g} | 1);
  }
  return bits;
}

int ChooseRiceK(std::span<const uint32_t> gaps) {
  if (gaps.empty()) return 0;
  // Estimate every k from a histogram of gap bit lengths (a gap of length L is about
  // 1.5 * 2^(L-1)), robust to a few huge gaps; a sample of 4096 gaps is plenty.
  uint64_t by_length[33] = {};
  const size_t stride = std::max<size_t>(1, gaps.size() / 4096);
  for (size_t i = 0; i < gaps.size(); i += stride) {
    ++by_length[gaps[i] ? BitLength(gaps[i]) : 0];
  }
  int guess = 0;
  double guess_cost = 1e300;
  for (int k = 0; k <= kMaxRiceK; ++k) {
    double cost = 0;
    for (int length = 0; length <= 32; ++length) {
      if (!by_length[length]) continue;
      double q = length == 0 ? 0 : std::ldexp(1.5, length - 1 - k);
      double bits =
          q < kRiceEscapeQuotient ? std::floor(q) + 1 + k : kRiceEscapeQuotient + 1 + 6 + length;
      cost += bits * static_cast<double>(by_length[length]);
    }
    if (cost < guess_cost) guess_cost = cost, guess = k;
  }
  // Exact prices of three neighbours: first as if nothing were escaped (a loop the
  // compiler vectorises), then corrected for the rare escaped gaps.
  const int k0 = std::clamp(guess - 1, 0, kMaxRiceK - 2);
  uint64_t sum[3] = {0, 0, 0};
  for (uint32_t g : gaps) {
    sum[0] += g >> k0;
    sum[1] += g >> (k0 + 1);
    sum[2] += g >> (k0 + 2);
  }
  int64_t cost[3];
  for (int j = 0; j < 3; ++j) {
    cost[j] = static_cast<int64_t>(sum[j] + gaps.size() * static_cast<uint64_t>(1 + k0 + j));
  }
  const uint64_t escape_from = uint64_t{kRiceEscapeQuotient} << k0;
  for (uint32_t g : gaps) {
    if (g < escape_from) continue;
    for (int j = 0; j < 3; ++j) {
      const uint64_t q = g >> (k0 + j);
      if (q >= kRiceEscapeQuotient) {
        cost[j] += static_cast<int64_t>(kRiceEscapeQuotient + 1 + 6 + BitLength(uint64_t{g})) -
                   static_cast<int64_t>(q + 1 + k0 + j);
      }
    }
  }
  return k0 + static_cast<int>(std::min_element(cost, cost + 3) - cost);
}

void RiceEncode(std::span<const uint32_t> gaps, int k, std::vector<uint8_t>* out) {
  // At most 31 + 1 + 6 + 32 bits per gap (an escaped one).
  BitWriter w(out, 70 * static_cast<uint64_t>(gaps.size()));
  const uint64_t low_mask = (uint64_t{1} << k) - 1;
  for (uint32_t g : gaps) {
    uint64_t q = g >> k;
    if (q < kRiceEscapeQuotient) {
      // q zeros, a one, then the k low bits.
      if (q + 1 + k <= 32) {
        w.Put((uint64_t{1} << q) | ((g & low_mask) << (q + 1)), static_cast<int>(q) + 1 + k);
      } else {
        w.Put(uint64_t{1} << q, static_cast<int>(q) + 1);
        w.Put(g & low_mask, k);
      }
    } else {
      int length = BitLength(uint64_t{g});
      w.Put(uint64_t{1} << kRiceEscapeQuotient, kRiceEscapeQuotient + 1);
      w.Put(static_cast<uint64_t>(length), 6);
      w.Put(g, length);
    }
  }
  w.Flush();
}

namespace {

// Where a Rice decode stands: changes decoded, the bit position, the last change's word.
struct RiceCursor {
  size_t i = 0;
  uint64_t bit = 0;
  int64_t position = -1;
};

Status PastLimit(size_t i, int64_t position, uint64_t limit) {
  return Corrupt("index stream: change " + std::to_string(i) + " at word " +
                 std::to_string(position) + " is past the chunk's " + std::to_string(limit) +
                 " words");
}

// Fast loop: while 8 bytes can be loaded at the current bit position, decode plain
// (unescaped) codes straight from an unaligned load, keeping all state in registers. Stops
// at the first escape, near the end or at malformed input, which RiceDecodeCareful takes.
// REQUIRES: k <= 24.
inline Status RiceDecodeFast(std::span<const uint8_t> in, int k, size_t count, uint64_t limit,
                             uint32_t* positions, RiceCursor* cursor) {
  const uint64_t low_mask = (uint64_t{1} << k) - 1;
  size_t i = 0;
  uint64_t bit = 0;
  int64_t position = -1;
  const uint8_t* data = in.data();
  const uint64_t fast_end = in.size() >= 8 ? (in.size() - 8) * 8 : 0;
  while (i < count && bit < fast_end) {
    uint64_t bits;
    std::memcpy(&bits, data + (bit >> 3), 8);
    bits >>= bit & 7;
    const int valid = 64 - static_cast<int>(bit & 7);  // >= 57
    int used = 0;
    bool careful = false;
    // Decode every code that lies wholly inside this window.
    while (i < count) {
      const int q = bits ? __builtin_ctzll(bits) : 64;
      const int length = q + 1 + k;
      if (length > valid - used) {
        careful = used == 0;  // not even a fresh window holds it: escape or corruption
        break;
      }
      if (q >= kRiceEscapeQuotient) {
        careful = true;
        break;
      }
      const uint64_t gap = (static_cast<uint64_t>(q) << k) | ((bits >> (q + 1)) & low_mask);
      bits >>= length;
      used += length;
      position += static_cast<int64_t>(gap) + 1;
      if (static_cast<uint64_t>(position) >= limit) return PastLimit(i, position, limit);
      positions[i++] = static_cast<uint32_t>(position);
    }
    bit += static_cast<uint64_t>(used);
    if (careful) break;
  }
  *cursor = {i, bit, position};
  return Status::Ok();
}

// Careful loop from `cursor` to the end: escapes, the last bytes, malformed input; then the
// stream must end exactly.
Status RiceDecodeCareful(std::span<const uint8_t> in, int k, size_t count, uint64_t limit,
                         uint32_t* positions, RiceCursor cursor) {
  const uint64_t low_mask = (uint64_t{1} << k) - 1;
  int64_t position = cursor.position;
  BitReader r(in);
  for (uint64_t skip = cursor.bit; skip > 0;) {
    const int step = static_cast<int>(std::min<uint64_t>(skip, 48));
    r.Skip(step);
    skip -= step;
  }
  for (size_t i = cursor.i; i < count; ++i) {
    uint64_t bits = r.Peek();
    int q = bits ? __builtin_ctzll(bits) : 64;
    uint64_t gap;
    if (q < kRiceEscapeQuotient && q + 1 + k <= 56) {
      gap = (static_cast<uint64_t>(q) << k) | ((bits >> (q + 1)) & low_mask);
      r.Skip(q + 1 + k);
    } else if (q < kRiceEscapeQuotient) {
      r.Skip(q + 1);
      gap = (static_cast<uint64_t>(q) << k) | r.Get(k);
    } else if (q == kRiceEscapeQuotient) {
      r.Skip(kRiceEscapeQuotient + 1);
      int length = static_cast<int>(r.Get(6));
      if (length < 1 || length > 32) {
        return Corrupt("index stream: escaped gap of " + std::to_string(length) + " bits");
      }
      gap = r.Get(length);
    } else {
      return Corrupt("index stream: run of more than 31 zero bits at change " + std::to_string(i));
    }
    position += static_cast<int64_t>(gap) + 1;
    if (static_cast<uint64_t>(position) >= limit) return PastLimit(i, position, limit);
    positions[i] = static_cast<uint32_t>(position);
  }
  if (r.overrun()) return Corrupt("index stream is truncated");
  if (!r.AtEnd()) return Corrupt("index stream has bytes after its last change");
  return Status::Ok();
}

}  // namespace

Status RiceDecodePositions(std::span<const uint8_t> in, int k, size_t count, uint64_t limit,
                           uint32_t* positions) {
  if (k < 0 || k > kMaxRiceK) return Corrupt("Rice parameter " + std::to_string(k) + " > 31");
  RiceCursor cursor;
  if (k <= 24) FW_RETURN_IF_ERROR(RiceDecodeFast(in, k, count, limit, positions, &cursor));
  return RiceDecodeCareful(in, k, count, limit, positions, cursor);
}

// ---- value symbols ------------------------------------------------------------------

std::vector<uint32_t> NormalizeFrequencies(std::span<const uint64_t> counts) {
  uint64_t total = 0;
  for (uint64_t c : counts) total += c;
  std::vector<uint32_t> freq(counts.size(), 0);
  if (total == 0) return freq;
  int64_t sum = 0;
  size_t largest = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    if (counts[s] == 0) continue;
    uint64_t f = (counts[s] * kRansScale + total / 2) / total;
    freq[s] = static_cast<uint32_t>(std::max<uint64_t>(f, 1));
    sum += freq[s];
    if (counts[s] > counts[largest] || counts[largest] == 0) largest = s;
  }
  // Move the rounding error onto the largest symbols, keeping every used one >= 1.
  while (sum > static_cast<int64_t>(kRansScale)) {
    size_t s_max = largest;
    for (size_t s = 0; s < freq.size(); ++s)
      if (freq[s] > freq[s_max]) s_max = s;
    uint32_t take = static_cast<uint32_t>(
        std::min<int64_t>(sum - kRansScale, static_cast<int64_t>(freq[s_max]) - 1));
    freq[s_max] -= take;
    sum -= take;
  }
  if (sum < static_cast<int64_t>(kRansScale)) freq[largest] += kRansScale - sum;
  return freq;
}

namespace {

void PutExtraBits(BitWriter& extra, uint64_t z) {
  if (z <= 16) return;
  int length = BitLength(z);
  extra.PutWide(z & ((~uint64_t{0}) >> (65 - length)), length - 1);
}

// Per symbol: start, frequency, and a reciprocal so that x / freq is a multiply:
// floor(x / f) == (x * ceil(2^43 / f)) >> 43 for every x < 2^31 and f <= 2^12.
struct EncSymbol {
  uint32_t freq = 0;
  uint32_t start = 0;
  uint64_t reciprocal = 0;
  uint32_t x_max = 0;
};

// The symbol of each value into `symbols` and their histogram into `counts`, in one pass;
// returns the OR of all symbols (>= 16: some value carries extra bits). Four partial
// histograms: runs of the same symbol (mostly +-1 ulp) would otherwise serialise on one
// counter.
uint8_t ValueSymbols(std::span<const uint64_t> z, uint8_t* symbols, uint64_t* counts) {
  uint32_t partial[4][kNumValueSymbols] = {};
  uint8_t symbol_or = 0;
  size_t i = 0;
  for (; i + 4 <= z.size(); i += 4) {
    for (int lane = 0; lane < 4; ++lane) {
      const uint8_t sym = static_cast<uint8_t>(ValueSymbol(z[i + lane]));
      symbols[i + lane] = sym;
      ++partial[lane][sym];
      symbol_or |= sym;
    }
  }
  for (; i < z.size(); ++i) {
    const uint8_t sym = static_cast<uint8_t>(ValueSymbol(z[i]));
    symbols[i] = sym;
    ++partial[0][sym];
    symbol_or |= sym;
  }
  for (int sym = 0; sym < kNumValueSymbols; ++sym) {
    counts[sym] = uint64_t{partial[0][sym]} + partial[1][sym] + partial[2][sym] + partial[3][sym];
  }
  return symbol_or;
}

// The frequency table into `out` (the number of symbols used, then each one's symbol and
// frequency), and the encoder's constants of each symbol into `enc`.
void PutFrequencyTable(const std::vector<uint32_t>& freq, EncSymbol* enc,
                       std::vector<uint8_t>* out) {
  uint32_t start = 0;
  int used = 0;
  for (int sym = 0; sym < kNumValueSymbols; ++sym) {
    if (freq[sym]) {
      enc[sym] = {freq[sym], start, ((uint64_t{1} << 43) + freq[sym] - 1) / freq[sym],
                  ((kRansLow >> kRansScaleBits) << 8) * freq[sym]};
    }
    start += freq[sym];
    used += freq[sym] > 0;
  }
  wire::PutU8(out, static_cast<uint8_t>(used));
  for (int sym = 0; sym < kNumValueSymbols; ++sym) {
    if (freq[sym] == 0) continue;
    wire::PutU8(out, static_cast<uint8_t>(sym));
    wire::PutVarint(out, freq[sym]);
  }
}

// The rANS stream of `symbols`: its length, the two final states, then its bytes. Two
// interleaved states (value i uses state i & 1). rANS runs backwards: bytes come out in
// reverse decoding order and are flipped at the end.
// `enc_of(i)` is the table of value i (one table for the whole stream, or one per context).
template <typename EncOf>
void PutRansT(std::span<const uint8_t> symbols, EncOf enc_of, std::vector<uint8_t>* out) {
  // A step emits at most two bytes (x < 2^31, x_max >= 2^19), written backwards.
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(2 * symbols.size() + 16);
  uint8_t* const buffer_end = buffer.data() + buffer.size();
  uint8_t* ptr = buffer_end;
  uint32_t x0 = kRansLow, x1 = kRansLow;
  // The renormalisation without a branch: it emits n = (x >= x_max) + (x >> 8 >= x_max)
  // bytes, low byte first, so both are stored and the pointer moves by n (the buffer has
  // room below for the two stores).
  auto put = [&](uint32_t& state, size_t i) {
    const EncSymbol& e = enc_of(i)[symbols[i]];
    const uint32_t n = static_cast<uint32_t>(state >= e.x_max) + ((state >> 8) >= e.x_max);
    ptr[-1] = static_cast<uint8_t>(state);
    ptr[-2] = static_cast<uint8_t>(state >> 8);
    ptr -= n;
    state >>= 8 * n;
    const uint32_t q =
        static_cast<uint32_t>((static_cast<unsigned __int128>(state) * e.reciprocal) >> 43);
    state = (q << kRansScaleBits) + (state - q * e.freq) + e.start;
  };
  size_t i = symbols.size();
  if (i & 1) --i, put(x0, i);
  while (i > 0) {
    put(x1, i - 1);
    put(x0, i - 2);
    i -= 2;
  }
  wire::PutVarint(out, static_cast<uint64_t>(buffer_end - ptr) + 8);
  wire::PutFixed(out, x0, 4);
  wire::PutFixed(out, x1, 4);
  out->insert(out->end(), ptr, buffer_end);
}

}  // namespace

void EncodeValues(std::span<const uint64_t> z, std::vector<uint8_t>* out) {
  thread_local std::vector<uint8_t> symbols;
  thread_local std::vector<uint32_t> with_extra;
  symbols.resize(z.size());
  uint64_t counts[kNumValueSymbols];
  const uint8_t symbol_or = ValueSymbols(z, symbols.data(), counts);
  const bool any_extra = symbol_or >= 16;
  std::vector<uint32_t> freq = NormalizeFrequencies(counts);
  EncSymbol enc[kNumValueSymbols];
  PutFrequencyTable(freq, enc, out);
  PutRansT({symbols.data(), z.size()}, [&](size_t) { return enc; }, out);
  if (any_extra) {
    // The values with extra bits listed first without a branch (which value has some is
    // unpredictable), then only those written, in order.
    with_extra.resize(z.size());
    size_t listed = 0;
    for (size_t i = 0; i < z.size(); ++i) {
      with_extra[listed] = static_cast<uint32_t>(i);
      listed += z[i] > 16;
    }
    BitWriter extra(out, 63 * static_cast<uint64_t>(listed));
    for (size_t j = 0; j < listed; ++j) PutExtraBits(extra, z[with_extra[j]]);
    extra.Flush();
  }
}

void EncodeValuesGamma(std::span<const uint64_t> z, std::vector<uint8_t>* out) {
  BitWriter w(out, 127 * static_cast<uint64_t>(z.size()));
  for (uint64_t v : z) {
    int length = BitLength(v);
    // length - 1 zeros, a one, then the length - 1 low bits.
    w.PutWide(uint64_t{1} << (length - 1), length);
    if (length > 1) w.PutWide(v & ((~uint64_t{0}) >> (65 - length)), length - 1);
  }
  w.Flush();
}

uint64_t EstimateValuesBytes(std::span<const uint64_t> z) {
  uint64_t counts[kNumValueSymbols] = {};
  uint64_t extra_bits = 0, gamma_bits = 0;
  for (uint64_t v : z) {
    ++counts[ValueSymbol(v)];
    int length = BitLength(v);
    if (v > 16) extra_bits += length - 1;
    gamma_bits += 2 * length - 1;
  }
  double bits = 0;
  int used = 0;
  for (uint64_t c : counts) {
    if (!c) continue;
    ++used;
    bits -= static_cast<double>(c) * std::log2(static_cast<double>(c) / z.size());
  }
  uint64_t rans = static_cast<uint64_t>(bits / 8) + 3 * used + 12 + (extra_bits + 7) / 8;
  return std::min(rans, (gamma_bits + 7) / 8);
}

namespace {

// One table entry per rANS slot, so a decoding step is a single load:
// x' = freq * (x >> 12) + (slot - start).
struct Slot {
  uint16_t freq;
  uint16_t bias;
  uint8_t symbol;
};

// The frequency table at `r` into `slots` (kRansScale of them).
Status ReadFrequencyTable(wire::Reader& r, Slot* slots) {
  int used = r.U8();
  if (r.failed() || used < 1 || used > kNumValueSymbols) {
    return Corrupt("value stream: bad symbol count " + std::to_string(used));
  }
  uint32_t start = 0;
  int previous = -1;
  for (int i = 0; i < used; ++i) {
    int sym = r.U8();
    uint64_t f = r.Varint();
    if (r.failed()) return Corrupt("value stream: truncated frequency table");
    if (sym <= previous || sym >= kNumValueSymbols || f == 0 || f > kRansScale - start) {
      return Corrupt("value stream: malformed frequency table entry " + std::to_string(i));
    }
    for (uint32_t k = 0; k < f; ++k) {
      slots[start + k] = {static_cast<uint16_t>(f), static_cast<uint16_t>(k),
                          static_cast<uint8_t>(sym)};
    }
    start += static_cast<uint32_t>(f);
    previous = sym;
  }
  if (start != kRansScale) return Corrupt("value stream: frequencies do not sum to 4096");
  return Status::Ok();
}

// The `count` symbols of the rANS stream `rans` (its two initial states first), each plus
// one into z; the OR of all symbols into *symbol_or.
// `table_of(i)` is the table of value i.
template <typename TableOf>
Status RansDecodeT(std::span<const uint8_t> rans, TableOf table_of, size_t count, uint64_t* z,
                   uint8_t* symbol_or_out) {
  uint32_t x0 = static_cast<uint32_t>(wire::LoadFixed(rans.data(), 4));
  uint32_t x1 = static_cast<uint32_t>(wire::LoadFixed(rans.data() + 4, 4));
  const uint8_t* p = rans.data() + 8;
  const uint8_t* const end = rans.data() + rans.size();
  bool malformed = false;
  uint8_t symbol_or = 0;
  // One decoding step; a valid state needs at most two renormalisation bytes
  // (x >= 2^23 gives freq * (x >> 12) >= 2^11).
  auto step = [&](uint32_t& state, size_t value) -> uint8_t {
    const Slot e = table_of(value)[state & (kRansScale - 1)];
    state = e.freq * (state >> kRansScaleBits) + e.bias;
    if (state < kRansLow) {
      if (end - p >= 2 && state >= (kRansLow >> 16)) {
        state = (state << 8) | *p++;
        if (state < kRansLow) state = (state << 8) | *p++;
      } else {
        while (state < kRansLow && p < end) state = (state << 8) | *p++;
        malformed |= state < kRansLow;
      }
    }
    return e.symbol;
  };
  size_t i = 0;
  for (; i + 2 <= count; i += 2) {
    const uint8_t s0 = step(x0, i);
    const uint8_t s1 = step(x1, i + 1);
    z[i] = s0 + 1u;
    z[i + 1] = s1 + 1u;
    symbol_or |= s0 | s1;
  }
  if (i < count) {
    const uint8_t s0 = step(x0, i);
    z[i] = s0 + 1u;
    symbol_or |= s0;
  }
  if (malformed) return Corrupt("value stream: rANS data truncated");
  if (x0 != kRansLow || x1 != kRansLow || p != end) {
    return Corrupt("value stream: rANS final state does not check out");
  }
  *symbol_or_out = symbol_or;
  return Status::Ok();
}

// Symbols >= 16 carry L - 1 extra bits: rebuilds their values from the extra stream, which
// must hold exactly those bits (and be empty when no symbol needs any).
Status ReadExtraBits(std::span<const uint8_t> extra_bytes, bool any_extra, size_t count,
                     uint64_t* z) {
  if (!any_extra) {
    if (!extra_bytes.empty()) {
      return Corrupt("value stream: extra bits present but no value needs them");
    }
    return Status::Ok();
  }
  BitReader extra(extra_bytes);
  for (size_t i = 0; i < count; ++i) {
    if (z[i] <= 16) continue;
    const int length = static_cast<int>(z[i]) - 1 - 16 + 5;
    z[i] = (uint64_t{1} << (length - 1)) | extra.GetWide(length - 1);
  }
  if (extra.overrun()) return Corrupt("value stream: extra bits truncated");
  if (!extra.AtEnd()) return Corrupt("value stream: bytes after the extra bits");
  return Status::Ok();
}

}  // namespace

Status DecodeValues(std::span<const uint8_t> in, size_t count, uint64_t* z) {
  wire::Reader r(in);
  thread_local Slot slots[kRansScale];
  FW_RETURN_IF_ERROR(ReadFrequencyTable(r, slots));
  uint64_t rans_bytes = r.Varint();
  if (r.failed() || rans_bytes < 8 || rans_bytes > r.remaining()) {
    return Corrupt("value stream: rANS length out of bounds");
  }
  std::span<const uint8_t> rans = r.Bytes(rans_bytes);
  std::span<const uint8_t> extra_bytes = r.Rest();
  uint8_t symbol_or = 0;
  const Slot* table = slots;
  FW_RETURN_IF_ERROR(
      RansDecodeT(rans, [table](size_t) { return table; }, count, z, &symbol_or));
  return ReadExtraBits(extra_bytes, symbol_or >= 16, count, z);
}

Status DecodeValuesGamma(std::span<const uint8_t> in, size_t count, uint64_t* z) {
  BitReader r(in);
  for (size_t i = 0; i < count; ++i) {
    uint64_t bits = r.Peek();
    int zeros = bits ? __builtin_ctzll(bits) : 64;
    if (zeros < 32) {
      r.Skip(zeros + 1);
    } else {
      r.Skip(32);
      uint64_t rest = r.Peek();
      int more = rest ? __builtin_ctzll(rest) : 64;
      if (more > 31) return Corrupt("value stream: gamma code longer than 64 bits");
      zeros = 32 + more;
      r.Skip(more + 1);
    }
    z[i] = (uint64_t{1} << zeros) | r.GetWide(zeros);
    if (r.overrun()) return Corrupt("value stream: gamma codes truncated");
  }
  if (!r.AtEnd()) return Corrupt("value stream: bytes after the last gamma code");
  return Status::Ok();
}

// ---- the plain sparse chunk, decoded and applied in one pass --------------------------

namespace {

// LSB-first bits for the fused loop: Refill() before every code keeps at least 56 bits in
// the accumulator, without a branch while 8 bytes can be loaded; zeros past the end, as
// BitReader reads them, and the same overrun / AtEnd tests. The bits consumed are
// 8 * pos_ - avail_ (both refills keep that so).
class RefillingBits {
 public:
  explicit RefillingBits(std::span<const uint8_t> in) : data_(in.data()), size_(in.size()) {
    Refill();
  }
  [[gnu::always_inline]] void Refill() {
    if (pos_ + 8 <= size_) [[likely]] {
      uint64_t word;
      std::memcpy(&word, data_ + pos_, 8);
      acc_ |= word << avail_;
      pos_ += static_cast<size_t>((63 - avail_) >> 3);
      avail_ |= 56;
      return;
    }
    while (avail_ <= 55) {
      const uint64_t byte = pos_ < size_ ? data_[pos_] : 0;
      ++pos_;
      acc_ |= byte << avail_;
      avail_ += 8;
    }
  }
  uint64_t Peek() const { return acc_; }
  // REQUIRES: count <= the bits available (56 after a Refill).
  [[gnu::always_inline]] void Consume(int count) {
    acc_ >>= count;
    avail_ -= count;
  }
  uint64_t consumed() const { return 8 * static_cast<uint64_t>(pos_) - avail_; }
  bool overrun() const { return consumed() > 8 * static_cast<uint64_t>(size_); }
  bool AtEnd() const {
    const uint64_t total = 8 * static_cast<uint64_t>(size_);
    if (consumed() > total || total - consumed() >= 8) return false;
    const int left = static_cast<int>(total - consumed());
    return left == 0 || (acc_ & ((uint64_t{1} << left) - 1)) == 0;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  int avail_ = 0;
};

// The gap of an escaped code (q >= 31 zero bits first), as RiceDecodeCareful reads it;
// false on a malformed one.
[[gnu::always_inline]] inline bool RiceEscapedGap(RefillingBits& bits, int q, uint64_t* gap) {
  if (q != kRiceEscapeQuotient) return false;
  bits.Consume(kRiceEscapeQuotient + 1);
  bits.Refill();
  const int length = static_cast<int>(bits.Peek() & 63);
  bits.Consume(6);
  if (length < 1 || length > 32) return false;
  bits.Refill();
  *gap = bits.Peek() & ((~uint64_t{0}) >> (64 - length));
  bits.Consume(length);
  return true;
}

// A rANS slot packed into one word: freq (13 bits), bias (12 bits), symbol (7 bits).
constexpr uint32_t PackSlot(const Slot& s) {
  return uint32_t{s.freq} | (uint32_t{s.bias} << 13) | (uint32_t{s.symbol} << 25);
}

// The two rANS states and their byte stream, stepped as RansDecodeT steps them.
struct RansStates {
  uint32_t x0, x1;
  const uint8_t* p;
  const uint8_t* end;
  bool malformed = false;

  // Decodes one symbol with `state`. While two bytes are left the renormalisation takes
  // no branch: a state >= 2^23 before the step is >= 2^11 after it, so it needs
  // (x < 2^23) + (x < 2^15) bytes, the same ones RansDecodeT reads.
  [[gnu::always_inline]] uint32_t Step(const uint32_t* table, uint32_t& state) {
    const uint32_t e = table[state & (kRansScale - 1)];
    uint32_t x = (e & 0x1fff) * (state >> kRansScaleBits) + ((e >> 13) & 0xfff);
    if (end - p >= 2) [[likely]] {
      const uint32_t n = static_cast<uint32_t>(x < kRansLow) + (x < (kRansLow >> 8));
      const uint32_t two = (uint32_t{p[0]} << 8) | p[1];
      x = (x << (8 * n)) | (two >> (16 - 8 * n));
      p += n;
    } else {
      while (x < kRansLow && p < end) x = (x << 8) | *p++;
      malformed |= x < kRansLow;
    }
    state = x;
    return e >> 25;
  }
};

// Puts back the first `applied` words DecodeApplySparse wrote.
template <typename U>
void RestoreWords(const SparseTarget& t, size_t applied) {
  for (size_t i = 0; i < applied; ++i) {
    std::memcpy(t.region + size_t{t.positions_out[i]} * sizeof(U), t.old_out + i * sizeof(U),
                sizeof(U));
  }
}

// How far ahead of the change being applied the fused loop prefetches the words.
constexpr size_t kPrefetchBytes = 4096;

// Where the fused loop stands: the decoders, and how it ended.
struct FusedState {
  RefillingBits rice;
  RansStates rans;
  BitReader extra;
  bool any_extra = false;
  size_t applied = 0;     // words written (all, or those before a malformed index code)
  int failed_code = -1;   // change at which the index stream went wrong, or -1
  int64_t position = -1;  // the last change's word
};

// The fused loop over `count` changes, two at a time (change i uses rANS state i & 1, and
// both states stay in registers). The Rice and rANS decoders are copied into locals and
// back: the words written through byte pointers could otherwise alias them.
template <typename U>
[[gnu::always_inline]] inline void FusedLoopBody(FusedState& state, int k, uint64_t limit,
                                                 const uint32_t* table, size_t count,
                                                 const SparseTarget& target) {
  RefillingBits rice = state.rice;
  RansStates rans = state.rans;
  BitReader& extra = state.extra;  // rarely read: stays in memory, out of the registers
  uint8_t* const region = target.region;
  uint8_t* const old_out = target.old_out;
  uint32_t* const positions_out = target.positions_out;
  const uint64_t low_mask = (uint64_t{1} << k) - 1;
  int64_t position = -1;
  // One change; false when its index code is malformed or its position past the limit.
  auto change = [&](size_t i, uint32_t& x) __attribute__((always_inline)) {
    rice.Refill();
    const uint64_t bits = rice.Peek();
    const int q = __builtin_ctzll(bits | (uint64_t{1} << 63));
    uint64_t gap;
    if (q < kRiceEscapeQuotient) [[likely]] {
      gap = (static_cast<uint64_t>(q) << k) | ((bits >> (q + 1)) & low_mask);
      rice.Consume(q + 1 + k);
    } else if (!RiceEscapedGap(rice, q, &gap)) {
      return false;
    }
    position += static_cast<int64_t>(gap) + 1;
    if (static_cast<uint64_t>(position) >= limit) [[unlikely]] return false;
    const uint32_t symbol = rans.Step(table, x);
    uint64_t z = symbol + 1;
    if (symbol >= 16) [[unlikely]] {
      state.any_extra = true;
      const int length = static_cast<int>(symbol) - 16 + 5;
      z = (uint64_t{1} << (length - 1)) | extra.GetWide(length - 1);
    }
    const uint64_t d = (z >> 1) ^ (0 - (z & 1));
    uint8_t* word = region + static_cast<size_t>(position) * sizeof(U);
    // The words a few dozen changes on: at low density nearly every change is on a line
    // of its own, and the loop would wait on each one (a prefetch never faults, so past
    // the region's end it is harmless).
    __builtin_prefetch(word + kPrefetchBytes, 1);
    U old;
    std::memcpy(&old, word, sizeof(U));
    std::memcpy(old_out + i * sizeof(U), &old, sizeof(U));
    const U updated = static_cast<U>(old + static_cast<U>(d));
    std::memcpy(word, &updated, sizeof(U));
    positions_out[i] = static_cast<uint32_t>(position);
    return true;
  };
  size_t i = 0;
  bool ok = true;
  for (; i + 2 <= count; i += 2) {
    if (!change(i, rans.x0)) {
      ok = false;
      break;
    }
    if (!change(i + 1, rans.x1)) {
      ok = false;
      ++i;
      break;
    }
  }
  if (ok && i < count) ok = change(i, rans.x0);
  state.applied = ok ? count : i;
  state.failed_code = ok ? -1 : static_cast<int>(std::min<size_t>(i, INT32_MAX));
  state.position = position;
  state.rice = rice;
  state.rans = rans;
}

// The loop compiled twice: with BMI2's shifts (shlx/shrx take any register) where the
// CPU has them, and for any x86-64.
template <typename U>
__attribute__((target("bmi,bmi2"))) void FusedLoopBmi2(FusedState& state, int k, uint64_t limit,
                                                        const uint32_t* table, size_t count,
                                                        const SparseTarget& target) {
  FusedLoopBody<U>(state, k, limit, table, count, target);
}
template <typename U>
void FusedLoopPlain(FusedState& state, int k, uint64_t limit, const uint32_t* table,
                    size_t count, const SparseTarget& target) {
  FusedLoopBody<U>(state, k, limit, table, count, target);
}

// The checks the reference makes once every change is decoded, in its order.
Status FusedEndChecks(const FusedState& f, std::span<const uint8_t> extra_bytes) {
  if (f.rice.overrun()) return Corrupt("index stream is truncated");
  if (!f.rice.AtEnd()) return Corrupt("index stream has bytes after its last change");
  if (f.rans.malformed) return Corrupt("value stream: rANS data truncated");
  if (f.rans.x0 != kRansLow || f.rans.x1 != kRansLow || f.rans.p != f.rans.end) {
    return Corrupt("value stream: rANS final state does not check out");
  }
  if (!f.any_extra) {
    if (!extra_bytes.empty()) {
      return Corrupt("value stream: extra bits present but no value needs them");
    }
    return Status::Ok();
  }
  if (f.extra.overrun()) return Corrupt("value stream: extra bits truncated");
  if (!f.extra.AtEnd()) return Corrupt("value stream: bytes after the extra bits");
  return Status::Ok();
}

bool HaveBmi2() {
  static const bool have = __builtin_cpu_supports("bmi2");
  return have;
}

template <typename U>
Status DecodeApplySparseT(std::span<const uint8_t> index, int k, const uint32_t* table,
                          std::span<const uint8_t> rans_bytes,
                          std::span<const uint8_t> extra_bytes, size_t count, uint64_t limit,
                          const SparseTarget& t) {
  FusedState f{RefillingBits(index),
               RansStates{static_cast<uint32_t>(wire::LoadFixed(rans_bytes.data(), 4)),
                          static_cast<uint32_t>(wire::LoadFixed(rans_bytes.data() + 4, 4)),
                          rans_bytes.data() + 8, rans_bytes.data() + rans_bytes.size()},
               BitReader(extra_bytes)};
  if (t.isa == FusedLoopIsa::kAuto && HaveBmi2()) {
    FusedLoopBmi2<U>(f, k, limit, table, count, t);
  } else {
    FusedLoopPlain<U>(f, k, limit, table, count, t);
  }
  Status st;
  if (f.failed_code >= 0) {
    st = static_cast<uint64_t>(f.position) >= limit && f.position >= 0
             ? PastLimit(f.applied, f.position, limit)
             : Corrupt("index stream: malformed code at change " + std::to_string(f.applied));
  } else {
    st = FusedEndChecks(f, extra_bytes);
  }
  if (!st.ok()) RestoreWords<U>(t, f.applied);
  return st;
}

// The three-pass reference of DecodeApplySparse.
Status DecodeApplySparseReference(std::span<const uint8_t> index, int k,
                                  std::span<const uint8_t> values, size_t count, uint64_t limit,
                                  const SparseTarget& t) {
  thread_local std::vector<uint64_t> z;
  if (z.size() < count) z.resize(count);
  FW_RETURN_IF_ERROR(RiceDecodePositions(index, k, count, limit, t.positions_out));
  FW_RETURN_IF_ERROR(DecodeValues(values, count, z.data()));
  kernels::ScatterAddZigZagScalar(t.region, t.w, t.positions_out, z.data(), count, t.old_out);
  return Status::Ok();
}

}  // namespace

Status DecodeApplySparse(std::span<const uint8_t> index, int k, std::span<const uint8_t> values,
                         size_t count, uint64_t limit, const SparseTarget& target) {
  wire::Reader r(values);
  thread_local Slot slots[kRansScale];
  thread_local uint32_t packed[kRansScale];
  FW_RETURN_IF_ERROR(ReadFrequencyTable(r, slots));
  const uint64_t rans_length = r.Varint();
  if (r.failed() || rans_length < 8 || rans_length > r.remaining()) {
    return Corrupt("value stream: rANS length out of bounds");
  }
  std::span<const uint8_t> rans = r.Bytes(rans_length);
  std::span<const uint8_t> extra_bytes = r.Rest();
  const uint32_t x0 = static_cast<uint32_t>(wire::LoadFixed(rans.data(), 4));
  const uint32_t x1 = static_cast<uint32_t>(wire::LoadFixed(rans.data() + 4, 4));
  // Initial states below 2^23 (never written by the encoder) break the branchless
  // renormalisation's premise: the reference decodes those.
  if (x0 < kRansLow || x1 < kRansLow || !FusedRiceK(k)) {
    return DecodeApplySparseReference(index, k, values, count, limit, target);
  }
  for (uint32_t s = 0; s < kRansScale; ++s) packed[s] = PackSlot(slots[s]);
  switch (target.w) {
    case 1:
      return DecodeApplySparseT<uint8_t>(index, k, packed, rans, extra_bytes, count, limit, target);
    case 2:
      return DecodeApplySparseT<uint16_t>(index, k, packed, rans, extra_bytes, count, limit, target);
    case 4:
      return DecodeApplySparseT<uint32_t>(index, k, packed, rans, extra_bytes, count, limit, target);
    default:
      return DecodeApplySparseT<uint64_t>(index, k, packed, rans, extra_bytes, count, limit, target);
  }
}

// ---- values with a table per context ------------------------------------------------

void EncodeValuesContext(std::span<const uint64_t> z, std::span<const uint8_t> context_of,
                         int contexts, std::vector<uint8_t>* out) {
  thread_local std::vector<uint8_t> symbols;
  symbols.resize(z.size());
  std::vector<uint64_t> counts(static_cast<size_t>(contexts) * kNumValueSymbols, 0);
  uint8_t symbol_or = 0;
  for (size_t i = 0; i < z.size(); ++i) {
    const uint8_t sym = static_cast<uint8_t>(ValueSymbol(z[i]));
    symbols[i] = sym;
    symbol_or |= sym;
    ++counts[size_t{context_of[i]} * kNumValueSymbols + sym];
  }
  std::vector<EncSymbol> enc(static_cast<size_t>(contexts) * kNumValueSymbols);
  for (int c = 0; c < contexts; ++c) {
    std::span<const uint64_t> of_context(counts.data() + size_t(c) * kNumValueSymbols,
                                         kNumValueSymbols);
    uint64_t total = 0;
    for (uint64_t n : of_context) total += n;
    std::vector<uint32_t> freq = NormalizeFrequencies(of_context);
    if (total == 0) freq[0] = kRansScale;  // an unused context still needs a valid table
    PutFrequencyTable(freq, enc.data() + size_t(c) * kNumValueSymbols, out);
  }
  const EncSymbol* tables = enc.data();
  PutRansT({symbols.data(), z.size()},
           [&](size_t i) { return tables + size_t{context_of[i]} * kNumValueSymbols; }, out);
  if (symbol_or >= 16) {
    BitWriter extra(out, 63 * static_cast<uint64_t>(z.size()));
    for (uint64_t v : z) PutExtraBits(extra, v);
    extra.Flush();
  }
}

Status DecodeValuesContext(std::span<const uint8_t> in, size_t count,
                           std::span<const uint8_t> context_of, int contexts, uint64_t* z) {
  if (contexts < 1 || contexts > kMaxValueContexts) {
    return Corrupt("value stream: " + std::to_string(contexts) + " contexts");
  }
  wire::Reader r(in);
  thread_local std::vector<Slot> slots;
  slots.resize(static_cast<size_t>(contexts) * kRansScale);
  for (int c = 0; c < contexts; ++c) {
    Status st = ReadFrequencyTable(r, slots.data() + size_t(c) * kRansScale);
    if (!st.ok()) return st.WithContext("table of context " + std::to_string(c));
  }
  uint64_t rans_bytes = r.Varint();
  if (r.failed() || rans_bytes < 8 || rans_bytes > r.remaining()) {
    return Corrupt("value stream: rANS length out of bounds");
  }
  std::span<const uint8_t> rans = r.Bytes(rans_bytes);
  std::span<const uint8_t> extra_bytes = r.Rest();
  uint8_t symbol_or = 0;
  const Slot* tables = slots.data();
  const uint8_t* of = context_of.data();
  FW_RETURN_IF_ERROR(RansDecodeT(
      rans, [tables, of](size_t i) { return tables + size_t{of[i]} * kRansScale; }, count, z,
      &symbol_or));
  return ReadExtraBits(extra_bytes, symbol_or >= 16, count, z);
}

}  // namespace flywheel::delta::entropy
