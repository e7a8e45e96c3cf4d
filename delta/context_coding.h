// The context-modelled sparse chunk (chunk kind 3, delta/format.h): the changed words of a
// chunk coded conditioned on their BASE words, which the decoder holds. A float word
// changes when the update crosses half its ulp, and the ulp follows the exponent, so the
// change probability and the size of the difference depend strongly on the base word's
// exponent field: words are put in buckets by that field (kernels::BucketContext), the
// positions of each bucket's changes are a separate Rice-coded stream of ranks within the
// bucket, and the values use one rANS table per bucket. The only side information is the
// per-chunk bucket offset, per-bucket Rice parameters and counts, and the tables, all of
// which count in the chunk's bytes.
//
// Private to the codec (encode.cc, apply.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "base/status.h"
#include "checkpoint/tensor.h"
#include "delta/codec_internal.h"
#include "kernels/kernels.h"

namespace flywheel::delta::internal {

// The exponent field of `dtype`'s words (offset 0), or nullopt for dtypes without one
// (integers, booleans, E8M0 scales, packed sub-byte floats): those keep the plain sparse
// coding. bf16, f16, f32, f64 and both FP8 formats have one.
std::optional<kernels::BucketContext> ExponentFieldOf(DType dtype);

// Writes the raw kind-3 chunk of the m changed words at `positions` (chunk-relative,
// ascending) with zigzagged differences z and base words `base_words`, into `raw`.
// REQUIRES: m >= 1; base holds n words of w bytes; `field` from ExponentFieldOf.
void EncodeSparseContext(const kernels::BucketContext& field, const uint8_t* base, size_t n, int w,
                         std::span<const uint32_t> positions, std::span<const uint64_t> z,
                         std::span<const uint64_t> base_words, Scratch& s, ByteVec* raw);

// Decodes a raw kind-3 chunk against the base words `base` (n words of w bytes) into
// s.positions and s.z (`count` changes, in the chunk's coding order, not ascending).
// Corruption, naming the stream, on any malformed input or one inconsistent with the base.
Status DecodeSparseContext(const kernels::BucketContext& field, std::span<const uint8_t> raw,
                           const uint8_t* base, size_t n, int w, size_t count, Scratch& s);

}  // namespace flywheel::delta::internal
