// The delta container's byte layout (format version 1). docs/DELTA_FORMAT.md says the
// same in prose. All fixed-width integers are little-endian; "varint" is unsigned LEB128
// (7 bits per byte, low groups first, at most 10 bytes).
//
// Container := Header | Manifest | Payloads        (file size == 48 + M + P exactly)
//
// Header (48 bytes)
//   0   8  magic "FWDELTA\0"
//   8   2  u16 format version (1)
//   10  2  u16 flags: bit 0 = keyframe; other bits must be 0
//   12  4  u32 reserved, 0
//   16  8  u64 M = manifest bytes
//   24  8  u64 P = payload bytes
//   32  8  u64 XXH3-64 of the manifest
//   40  8  u64 XXH3-64 of header bytes [0, 40)
//
// Manifest (M bytes)
//   varint base_version, varint target_version
//   16 bytes base checkpoint hash, 16 bytes target checkpoint hash (XXH3-128 of the
//       canonical record of checkpoint/hash.h; low u64 then high u64; base is zero in a keyframe)
//   varint metadata_count, then per entry: varint key length, key, varint value length, value
//   varint tensor_count, then per tensor (target order):
//     varint name length (>= 1), name (UTF-8; unique)
//     u8 dtype (DType value, checkpoint/tensor.h)
//     varint rank (<= 64), rank x varint dim
//     16 bytes base tensor hash (zero in a keyframe), 16 bytes target tensor hash
//     varint changed_words, varint chunk_count
//   varint total chunk count (== sum of the tensors' chunk_count), then per chunk, grouped
//   by tensor in tensor order, word ranges ascending and disjoint within a tensor:
//     varint word_begin, varint word_count (>= 1)   (words of the dtype's word size)
//     u8 kind (0 sparse, 1 dense xor, 2 literal, 3 sparse context-coded),
//     u8 compressor (0 none, 1 zstd, 2 lz4)
//     varint changed_words, varint raw_bytes, varint payload_bytes
//     u64 XXH3-64 of the stored payload
//   The manifest ends exactly there. Word ranges without a chunk are unchanged.
//
// Payloads: each chunk's stored bytes, back to back in chunk order. Stored bytes are the
// raw chunk compressed with the chunk's compressor (a zstd frame with its content size,
// or an LZ4 block), or the raw chunk itself for compressor 0.
//
// Raw chunk, by kind (w = word size in bytes, n = word_count):
//   literal:   n*w bytes, the target words byte-plane shuffled: byte b of word i at b*n + i
//   dense xor: n*w bytes, (target XOR base) words, byte-plane shuffled the same way
//   sparse:    u8 Rice parameter k (0..31)
//              u8 value coding: 0 = rANS, 1 = Elias-gamma
//              varint index stream bytes, index stream
//              value stream (the rest)
//     index stream: for each changed word, the gap g = position - previous position - 1
//       (previous starts at -1) as a Rice code: g >> k zero bits, a one bit, the k low bits
//       of g; when g >> k >= 31: 31 zero bits, a one bit, 6 bits L = bit length of g, then
//       the L low bits of g. Bits are packed LSB-first.
//     values: d = target - base as a signed w-byte integer (wrapping), zigzag mapped to
//       z = (d << 1) ^ (d >> 63) >= 1. Symbol s = z - 1 for z <= 16, else 16 + L - 5 with
//       L = bit length of z, followed by the L - 1 low bits of z as extra bits.
//     rANS value stream: u8 S (used symbols, 1..76), S x (u8 symbol ascending, varint
//       frequency >= 1) summing to 4096; varint R, R bytes of rANS data: two interleaved
//       rANS coders (value i uses coder i & 1; 32-bit states, lower bound 2^23, 12-bit
//       frequencies, byte-wise renormalisation), their final encoder states as u32 LE
//       (coder 0 first), then the renormalisation bytes in decoding order; decoding must
//       end with both states at 2^23 having read all R bytes. Then the extra bits of all
//       values in order, LSB-first.
//     Elias-gamma value stream: per value, L - 1 zero bits, a one bit, the L - 1 low bits
//       of z, LSB-first.
//   sparse context-coded (kind 3; dtypes with an exponent field, delta/context_coding.h):
//     every word has the bucket clamp(e - offset, 0, 15) of its BASE word's exponent
//     field e (bf16 bits 7..14, f16 10..14, f32 23..30, f64 52..62, FP8 e4m3 3..6, e5m2
//     2..6); a word's rank is the number of words of its bucket before it in the chunk.
//     u8 offset
//     u8 S (streams, 1..16), S x (u8 bucket (ascending, < 16),
//                                 u8 Rice k (bits 0..4) | inverted (bit 7), bits 5..6 zero,
//                                 varint listed, varint stream bytes)
//     the S rank streams: the ascending ranks of the bucket's changed words (inverted: of
//       its unchanged words), `listed` of them, as Rice gaps like the index stream above
//     values: S frequency tables as in the rANS value stream (one per stream), varint R,
//       R bytes of rANS data as above with value i decoded by the table of its stream,
//       then the extra bits. Values are in the order changes are listed: stripe by stripe
//       (4096 words), within a stripe stream by stream, within a stream by position.
//
// ---- Format version 2: the streamed container ----------------------------------------
// Written front to back while the encoder runs, so that a reader can use every chunk as
// soon as its bytes are in, before the encoder has finished: the tensor table comes first
// without target hashes, each chunk is a self-describing record (in the order the
// encoder finished them), and what is known only at the end (target hashes, changed
// counts) is in a closing record.
//
// Container := Header2 | Prologue | ChunkRecord* | EndRecord     (the file ends there)
//
// Header2 (40 bytes)
//   0   8  magic "FWDELTA\0"
//   8   2  u16 format version (2)
//   10  2  u16 flags: bit 0 = keyframe; other bits must be 0
//   12  4  u32 reserved, 0
//   16  8  u64 M = prologue bytes
//   24  8  u64 XXH3-64 of the prologue
//   32  8  u64 XXH3-64 of header bytes [0, 32)
//
// Prologue (M bytes)
//   varint base_version, varint target_version
//   16 bytes base checkpoint hash (zero in a keyframe)
//   metadata as in version 1
//   varint tensor_count, then per tensor (target order):
//     varint name length (>= 1), name; u8 dtype; varint rank, rank x varint dim
//     16 bytes base tensor hash (zero in a keyframe)
//   varint max_chunks: no more chunk records follow than this (the encoder's plan)
//
// ChunkRecord
//   u8 tag 1
//   varint tensor index, varint word_begin, varint word_count (>= 1)
//   u8 kind, u8 compressor, varint changed_words, varint raw_bytes, varint payload_bytes
//   u64 XXH3-64 of the stored payload
//   u64 XXH3-64 of this record's bytes from the tag up to here
//   payload_bytes bytes of stored payload (as in version 1)
//
// TensorRecord (one per tensor, after all of that tensor's chunk records)
//   u8 tag 3
//   varint tensor index, 16 bytes target tensor hash, varint changed_words
//   u64 XXH3-64 of this record's bytes from the tag up to here
//   A reader may verify the tensor once its record is in; no chunk record of the tensor
//   may follow it.
//
// EndRecord
//   u8 tag 2
//   varint chunk record count
//   16 bytes target checkpoint hash
//   per tensor (prologue order): 16 bytes target tensor hash, varint changed_words (equal
//       to the tensor's TensorRecord, which every tensor must have)
//   u64 XXH3-64 of this record's bytes from the tag up to here
//
// Chunks of one tensor may come in any order but must not overlap; the same per-chunk
// rules as in version 1 apply.
#pragma once

#include <cstdint>

namespace flywheel::delta::format {

inline constexpr char kMagic[8] = {'F', 'W', 'D', 'E', 'L', 'T', 'A', '\0'};
inline constexpr uint16_t kVersion = 1;
inline constexpr uint16_t kStreamedVersion = 2;
inline constexpr uint64_t kStreamedHeaderBytes = 40;
inline constexpr uint8_t kTagChunk = 1;
inline constexpr uint8_t kTagEnd = 2;
inline constexpr uint8_t kTagTensor = 3;
inline constexpr uint16_t kFlagKeyframe = 1;
inline constexpr uint64_t kHeaderBytes = 48;
inline constexpr uint64_t kMaxRank = 64;

enum class ValueCoding : uint8_t { kRans = 0, kGamma = 1 };

}  // namespace flywheel::delta::format
