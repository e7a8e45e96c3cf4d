// safetensors reading, validation and writing. Inputs for the reader are built by hand
// (header JSON as text, raw bytes) so that the reader is never checked against the writer
// alone.
#include "checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint/tensor.h"

int FuzzSafetensors(const uint8_t* data, size_t size);

namespace flywheel {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSource = "model.safetensors";

// ---------------------------------------------------------------------------------------
// The hand-made writer: u64 LE length, header text as given (no padding unless asked),
// then the data bytes.

std::string LittleEndian64(uint64_t value) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(value >> (8 * i));
  return out;
}

std::string HandMadeFile(const std::string& header, const std::string& data,
                         bool pad_to_8 = false) {
  std::string json = header;
  if (pad_to_8) json.append((8 - json.size() % 8) % 8, ' ');
  return LittleEndian64(json.size()) + json + data;
}

std::vector<std::byte> Bytes(const std::string& text) {
  std::vector<std::byte> out(text.size());
  if (!text.empty()) std::memcpy(out.data(), text.data(), text.size());
  return out;
}

std::string Text(std::span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

Result<SafetensorsImage> ParseText(const std::string& file) {
  // Copy into an exactly sized buffer so that any read past the end is caught by ASan.
  static std::vector<std::byte> buffer;
  buffer = Bytes(file);
  return ParseSafetensors(buffer, kSource);
}

Result<SafetensorsImage> ParseHeader(const std::string& header, const std::string& data) {
  return ParseText(HandMadeFile(header, data));
}

std::string Entry(const std::string& dtype, const std::string& shape, uint64_t begin,
                  uint64_t end) {
  return "{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

void WriteFile(const fs::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Asserts a Corruption whose message names the file and every string in `mentions`.
#define EXPECT_CORRUPTION(result, ...)                                            \
  do {                                                                            \
    const auto& fw_result = (result);                                             \
    ASSERT_FALSE(fw_result.ok()) << "expected a corruption error";                \
    EXPECT_EQ(fw_result.status().code(), StatusCode::kCorruption)                 \
        << fw_result.status().ToString();                                         \
    EXPECT_NE(fw_result.status().message().find(kSource), std::string::npos)      \
        << fw_result.status().message();                                          \
    for (const std::string& fw_mention : std::vector<std::string>{__VA_ARGS__}) { \
      EXPECT_NE(fw_result.status().message().find(fw_mention), std::string::npos) \
          << "'" << fw_mention << "' not in: " << fw_result.status().message();   \
    }                                                                             \
  } while (0)

OwnedTensor MakeTensor(std::string name, DType dtype, std::vector<int64_t> shape, uint8_t seed) {
  OwnedTensor tensor{std::move(name), dtype, std::move(shape), {}};
  const uint64_t size = TensorByteSize(tensor.dtype, tensor.shape).value();
  tensor.data.resize(size);
  for (uint64_t i = 0; i < size; ++i) {
    tensor.data[i] = static_cast<std::byte>(seed + i * 7);
  }
  return tensor;
}

// One tensor of every dtype, plus a 0-rank and two empty tensors.
OwnedCheckpoint EveryDtypeCheckpoint() {
  OwnedCheckpoint checkpoint;
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto dtype = static_cast<DType>(i);
    // 12 elements fill whole bytes for every dtype (F4: 6 bytes, F6: 9 bytes).
    checkpoint.tensors.push_back(
        MakeTensor(std::string("t.") + DTypeName(dtype), dtype, {3, 4}, uint8_t(i)));
  }
  checkpoint.tensors.push_back(MakeTensor("scalar", DType::kF32, {}, 100));
  checkpoint.tensors.push_back(MakeTensor("empty.bf16", DType::kBF16, {0, 3}, 0));
  checkpoint.tensors.push_back(MakeTensor("empty.f4", DType::kF4, {5, 0}, 0));
  checkpoint.tensors.push_back(MakeTensor("after.empty", DType::kI8, {2}, 9));
  return checkpoint;
}

void ExpectSameTensors(const CheckpointView& actual, const CheckpointView& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    SCOPED_TRACE(expected[i].name);
    EXPECT_EQ(actual[i].name, expected[i].name);
    EXPECT_EQ(actual[i].dtype, expected[i].dtype);
    EXPECT_EQ(actual[i].shape, expected[i].shape);
    EXPECT_EQ(Text(actual[i].data), Text(expected[i].data));
  }
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "safetensors_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // Every entry of the test directory (temporary files included).
  std::vector<std::string> DirEntries(const fs::path& dir) const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path dir_;
};

// ---------------------------------------------------------------------------------------
// DType table and sizes.

TEST(SafetensorsDType, NamesRoundTripAndSizes) {
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto dtype = static_cast<DType>(i);
    ASSERT_NE(DTypeName(dtype), nullptr) << i;
    EXPECT_EQ(ParseDType(DTypeName(dtype)), dtype);
  }
  EXPECT_EQ(DTypeName(static_cast<DType>(kNumDTypes)), nullptr);
  EXPECT_FALSE(ParseDType("F128").has_value());
  EXPECT_FALSE(ParseDType("bf16").has_value());
  EXPECT_EQ(DTypeBits(DType::kBool), 8);
  EXPECT_EQ(DTypeBits(DType::kF8_E8M0), 8);
  EXPECT_EQ(DTypeBits(DType::kBF16), 16);
  EXPECT_EQ(DTypeBits(DType::kC64), 64);
  EXPECT_EQ(DTypeBits(DType::kF4), 4);
  EXPECT_EQ(DTypeBits(DType::kF6_E2M3), 6);
  EXPECT_EQ(DTypeBits(DType::kF6_E3M2), 6);
  EXPECT_EQ(DTypeWordBytes(DType::kF4), 1);
  EXPECT_EQ(DTypeWordBytes(DType::kF6_E3M2), 1);
  EXPECT_EQ(DTypeWordBytes(DType::kF16), 2);
  EXPECT_EQ(DTypeWordBytes(DType::kU32), 4);
  EXPECT_EQ(DTypeWordBytes(DType::kC64), 8);
}

TEST(SafetensorsDType, ElementCountAndByteSize) {
  EXPECT_EQ(ElementCount(std::vector<int64_t>{}).value(), 1u);
  EXPECT_EQ(ElementCount(std::vector<int64_t>{3, 0, 5}).value(), 0u);
  EXPECT_FALSE(ElementCount(std::vector<int64_t>{3, -1}).ok());
  EXPECT_FALSE(ElementCount(std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32}).ok());
  EXPECT_EQ(TensorByteSize(DType::kBF16, std::vector<int64_t>{2, 2}).value(), 8u);
  EXPECT_EQ(TensorByteSize(DType::kF64, std::vector<int64_t>{}).value(), 8u);
  EXPECT_EQ(TensorByteSize(DType::kF4, std::vector<int64_t>{6}).value(), 3u);
  EXPECT_EQ(TensorByteSize(DType::kF6_E2M3, std::vector<int64_t>{8}).value(), 6u);
  EXPECT_EQ(TensorByteSize(DType::kF4, std::vector<int64_t>{0}).value(), 0u);
  EXPECT_FALSE(TensorByteSize(DType::kF4, std::vector<int64_t>{3}).ok());
  EXPECT_FALSE(TensorByteSize(DType::kF6_E3M2, std::vector<int64_t>{2}).ok());
  // 2^62 elements fit in 64 bits, their F32 bytes do not.
  EXPECT_FALSE(TensorByteSize(DType::kF32, std::vector<int64_t>{int64_t{1} << 62}).ok());
  // The byte count of a sub-byte dtype is computed without forming count * bits.
  EXPECT_EQ(TensorByteSize(DType::kF4, std::vector<int64_t>{int64_t{1} << 62}).value(),
            uint64_t{1} << 61);
}

// ---------------------------------------------------------------------------------------
// Round trips and the written layout.

TEST_F(SafetensorsTest, RoundTripEveryDtypeWithScalarEmptyAndMetadata) {
  const OwnedCheckpoint checkpoint = EveryDtypeCheckpoint();
  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {"note", "gr\u00fc\u00df"}};
  const fs::path path = dir_ / "every.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, checkpoint.view(), metadata).ok());

  Result<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ExpectSameTensors(file->tensors(), checkpoint.view());
  EXPECT_EQ(file->metadata(), metadata);
  EXPECT_EQ(file->path(), path.string());

  Result<std::vector<std::byte>> serialized = SerializeSafetensors(checkpoint.view(), metadata);
  ASSERT_TRUE(serialized.ok()) << serialized.status().ToString();
  EXPECT_EQ(Text(*serialized), ReadFile(path));
  Result<SafetensorsImage> image = ParseSafetensors(*serialized, kSource);
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  ExpectSameTensors(image->tensors, checkpoint.view());
  EXPECT_EQ(image->metadata, metadata);

  Result<std::vector<std::byte>> header = SafetensorsHeader(checkpoint.view(), metadata);
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->size(), 8 + image->header_bytes);
  EXPECT_EQ(Text(*header), Text(*serialized).substr(0, header->size()));

  // Every view points into the image at 8 + N + begin (zero copy).
  const std::byte* data_start = serialized->data() + 8 + image->header_bytes;
  uint64_t offset = 0;
  for (const TensorView& tensor : image->tensors) {
    EXPECT_EQ(tensor.data.data(), data_start + offset) << tensor.name;
    offset += tensor.data.size();
  }
}

TEST(SafetensorsFormat, HeaderIsCompactJsonMetadataFirstPaddedWithSpaces) {
  OwnedCheckpoint checkpoint;
  checkpoint.tensors.push_back(MakeTensor("z", DType::kF32, {1}, 1));
  checkpoint.tensors.push_back(MakeTensor("a", DType::kU8, {2}, 2));
  Result<std::vector<std::byte>> bytes = SerializeSafetensors(checkpoint.view(), {{"k", "v"}});
  ASSERT_TRUE(bytes.ok());
  const std::string json =
      "{\"__metadata__\":{\"k\":\"v\"},"
      "\"z\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}";
  ASSERT_EQ(json.size() % 8, 3u);  // so the writer must add 5 spaces
  const std::string expected =
      LittleEndian64(json.size() + 5) + json + "     " + "\x01\x08\x0f\x16" + "\x02\x09";
  EXPECT_EQ(Text(*bytes), expected);
}

TEST(SafetensorsFormat, EmptyCheckpointIsPaddedBraces) {
  Result<std::vector<std::byte>> bytes = SerializeSafetensors({}, {});
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(Text(*bytes), LittleEndian64(8) + "{}      ");
  Result<SafetensorsImage> image = ParseSafetensors(*bytes, kSource);
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  EXPECT_TRUE(image->tensors.empty());
  EXPECT_TRUE(image->metadata.empty());
}

TEST(SafetensorsFormat, ReadsUnpaddedHeaderInAnyKeyOrder) {
  // Header length 3 + ... deliberately not a multiple of 8; tensors listed out of
  // offset order; metadata last.
  const std::string header = "{\"b\":" + Entry("I16", "[2]", 2, 6) +
                             ",\"a\":" + Entry("U8", "[2]", 0, 2) +
                             ",\"__metadata__\":{\"format\":\"np\"}}";
  ASSERT_NE(header.size() % 8, 0u);
  Result<SafetensorsImage> image = ParseHeader(header, std::string("\x01\x02\x03\x04\x05\x06", 6));
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  ASSERT_EQ(image->tensors.size(), 2u);
  EXPECT_EQ(image->tensors[0].name, "a");  // offset order
  EXPECT_EQ(Text(image->tensors[0].data), "\x01\x02");
  EXPECT_EQ(image->tensors[1].name, "b");
  EXPECT_EQ(image->tensors[1].dtype, DType::kI16);
  EXPECT_EQ(Text(image->tensors[1].data), "\x03\x04\x05\x06");
  EXPECT_EQ(image->metadata.at("format"), "np");
  EXPECT_EQ(image->header_bytes, header.size());
}

TEST(SafetensorsFormat, ScalarAndEmptyTensorsHandMade) {
  const std::string header = "{\"s\":" + Entry("F64", "[]", 0, 8) +
                             ",\"e\":" + Entry("F32", "[4,0,2]", 8, 8) +
                             ",\"e2\":" + Entry("F6_E2M3", "[0]", 8, 8) + "}";
  Result<SafetensorsImage> image = ParseText(HandMadeFile(header, "12345678", true));
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  ASSERT_EQ(image->tensors.size(), 3u);
  EXPECT_TRUE(image->tensors[0].shape.empty());
  EXPECT_EQ(image->tensors[0].data.size(), 8u);
  // Empty tensors at one offset keep header order.
  EXPECT_EQ(image->tensors[1].name, "e");
  EXPECT_EQ((std::vector<int64_t>{4, 0, 2}), image->tensors[1].shape);
  EXPECT_TRUE(image->tensors[1].data.empty());
  EXPECT_EQ(image->tensors[2].name, "e2");
}

TEST(SafetensorsFormat, NullMetadataIsNoMetadata) {
  Result<SafetensorsImage> image = ParseHeader("{\"__metadata__\":null}", "");
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  EXPECT_TRUE(image->metadata.empty());
}

// ---------------------------------------------------------------------------------------
// Validation, one rule per test.

TEST(SafetensorsValidation, FileShorterThan8Bytes) {
  EXPECT_CORRUPTION(ParseText(""), "0 bytes");
  EXPECT_CORRUPTION(ParseText(std::string("\x02\0\0\0\0", 5)), "5 bytes");
}

TEST(SafetensorsValidation, HeaderTooLarge) {
  EXPECT_CORRUPTION(ParseText(LittleEndian64(kMaxSafetensorsHeaderBytes + 1) + "{}"), "100000001",
                    "limit");
  EXPECT_CORRUPTION(ParseText(LittleEndian64(~uint64_t{0}) + "{}"), "limit");
}

TEST(SafetensorsValidation, HeaderLengthBeyondFile) {
  EXPECT_CORRUPTION(ParseText(LittleEndian64(100) + "{}"), "header length 100", "beyond the file");
  EXPECT_CORRUPTION(ParseText(LittleEndian64(1)), "beyond the file");
}

TEST(SafetensorsValidation, HeaderNotJson) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\": ", ""), "not valid JSON");
  EXPECT_CORRUPTION(ParseHeader("", ""), "not valid JSON");
  EXPECT_CORRUPTION(ParseHeader(std::string("{}\0\0", 4), ""), "not valid JSON");
  EXPECT_CORRUPTION(ParseHeader("{\"w\":{\"dtype\":\"\xff\"}}", ""), "not valid JSON");
}

TEST(SafetensorsValidation, HeaderNotObject) {
  EXPECT_CORRUPTION(ParseHeader("[1, 2]", ""), "not an object");
  EXPECT_CORRUPTION(ParseHeader("\"w\"", ""), "not an object");
  EXPECT_CORRUPTION(ParseHeader("7", ""), "not an object");
}

TEST(SafetensorsValidation, HeaderWithLeadingWhitespace) {
  EXPECT_CORRUPTION(ParseHeader("  {}", ""), "does not start with '{'");
}

TEST(SafetensorsValidation, EntryNotObject) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":[1]}", ""), "tensor 'w'", "not an object");
}

TEST(SafetensorsValidation, MissingField) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":{\"dtype\":\"U8\",\"shape\":[1]}}", "x"), "tensor 'w'",
                    "missing field 'data_offsets'");
}

TEST(SafetensorsValidation, UnknownField) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],"
                                "\"extra\":1}}",
                                "x"),
                    "tensor 'w'", "unknown field 'extra'");
}

TEST(SafetensorsValidation, UnknownDtype) {
  EXPECT_CORRUPTION(
      ParseHeader("{\"w\":" + Entry("F128", "[1]", 0, 16) + "}", std::string(16, 'x')),
      "tensor 'w'", "unknown dtype 'F128'");
  EXPECT_CORRUPTION(ParseHeader("{\"w\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,1]}}", "x"),
                    "tensor 'w'", "dtype");
}

TEST(SafetensorsValidation, NegativeDim) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[2,-1]", 0, 0) + "}", ""), "tensor 'w'",
                    "negative dimension -1");
}

TEST(SafetensorsValidation, NonIntegerDim) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[2.0]", 0, 2) + "}", "xx"), "tensor 'w'",
                    "2.0");
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[\"2\"]", 0, 2) + "}", "xx"), "tensor 'w'",
                    "not a non-negative integer");
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "{}", 0, 2) + "}", "xx"), "tensor 'w'",
                    "shape is a JSON object");
}

TEST(SafetensorsValidation, DimensionAboveInt64) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[9223372036854775808]", 0, 0) + "}", ""),
                    "tensor 'w'", "9223372036854775808");
}

TEST(SafetensorsValidation, OffsetsNotTwoNonNegativeIntegers) {
  for (const std::string offsets : {"[0]", "[0,1,2]", "[-1,0]", "[0,1.5]", "\"0,1\"", "[0,null]"}) {
    SCOPED_TRACE(offsets);
    EXPECT_CORRUPTION(
        ParseHeader("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":" + offsets + "}}",
                    "x"),
        "tensor 'w'", "not two non-negative integers");
  }
}

TEST(SafetensorsValidation, OffsetsEndBeforeBegin) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[0]", 4, 2) + "}", "xxxx"), "tensor 'w'",
                    "[4, 2]");
}

TEST(SafetensorsValidation, OffsetsGap) {
  const std::string header =
      "{\"a\":" + Entry("U8", "[2]", 0, 2) + ",\"b\":" + Entry("U8", "[2]", 3, 5) + "}";
  EXPECT_CORRUPTION(ParseHeader(header, "xxxxx"), "tensor 'b'", "[3, 5]", "gap", "tensor 'a'");
}

TEST(SafetensorsValidation, OffsetsOverlap) {
  const std::string header =
      "{\"a\":" + Entry("U8", "[4]", 0, 4) + ",\"b\":" + Entry("U8", "[4]", 2, 6) + "}";
  EXPECT_CORRUPTION(ParseHeader(header, "xxxxxx"), "tensor 'b'", "[2, 6]", "overlap", "tensor 'a'");
  // Two tensors sharing the same bytes.
  const std::string same =
      "{\"a\":" + Entry("U8", "[4]", 0, 4) + ",\"b\":" + Entry("U8", "[4]", 0, 4) + "}";
  EXPECT_CORRUPTION(ParseHeader(same, "xxxx"), "[0, 4]", "overlap");
}

TEST(SafetensorsValidation, OffsetsNotFromZero) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[2]", 2, 4) + "}", "xxxx"), "tensor 'w'",
                    "[2, 4]", "do not start at 0");
}

TEST(SafetensorsValidation, DataBeyondEndOfFile) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("F32", "[2]", 0, 8) + "}", "xxxx"), "tensor 'w'",
                    "[0, 8]", "beyond the end of the file");
  // Offsets near 2^64 must not wrap around.
  EXPECT_CORRUPTION(
      ParseHeader(
          "{\"w\":" + Entry("U8", "[0]", 18446744073709551615u, 18446744073709551615u) + "}", ""),
      "tensor 'w'", "beyond the end of the file");
}

TEST(SafetensorsValidation, TrailingBytesAfterData) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[2]", 0, 2) + "}", "xxxxx"),
                    "3 trailing bytes", "tensor 'w'");
  EXPECT_CORRUPTION(ParseHeader("{}", "xx"), "lists no tensors");
}

TEST(SafetensorsValidation, SizeMismatchForDtypeAndShape) {
  Result<SafetensorsImage> result =
      ParseHeader("{\"w\":" + Entry("BF16", "[2,2]", 0, 6) + "}", "xxxxxx");
  EXPECT_CORRUPTION(result, "tensor 'w'");
  EXPECT_EQ(result.status().message(),
            "model.safetensors: tensor 'w': data_offsets [0, 6] span 6 bytes but BF16 [2, 2] "
            "needs 8");
}

TEST(SafetensorsValidation, ElementCountOverflow) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", "[4294967296,4294967296]", 0, 0) + "}", ""),
                    "tensor 'w'", "overflows");
  // The count fits, the F32 byte size does not.
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("F32", "[4611686018427387904]", 0, 0) + "}", ""),
                    "tensor 'w'", "overflows");
}

TEST(SafetensorsValidation, DuplicateTensorName) {
  const std::string header =
      "{\"w\":" + Entry("U8", "[2]", 0, 2) + ",\"w\":" + Entry("U8", "[2]", 2, 4) + "}";
  EXPECT_CORRUPTION(ParseHeader(header, "xxxx"), "'w' twice");
}

TEST(SafetensorsValidation, DuplicateFieldInsideEntry) {
  EXPECT_CORRUPTION(ParseHeader("{\"w\":{\"dtype\":\"U8\",\"dtype\":\"I8\",\"shape\":[1],"
                                "\"data_offsets\":[0,1]}}",
                                "x"),
                    "duplicate key 'dtype'", "'w'");
}

TEST(SafetensorsValidation, MetadataValueNotString) {
  EXPECT_CORRUPTION(ParseHeader("{\"__metadata__\":{\"format\":\"pt\",\"step\":3}}", ""),
                    "__metadata__", "'step'", "not a string");
}

TEST(SafetensorsValidation, MetadataNotObject) {
  EXPECT_CORRUPTION(ParseHeader("{\"__metadata__\":[\"pt\"]}", ""), "__metadata__",
                    "not an object");
}

TEST(SafetensorsValidation, SubByteTensorNotWholeBytes) {
  // 3 F4 elements are 12 bits; 2 F6 elements are 12 bits.
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("F4", "[3]", 0, 2) + "}", "xx"), "tensor 'w'",
                    "whole bytes");
  EXPECT_CORRUPTION(ParseHeader("{\"v\":" + Entry("F6_E3M2", "[1,2]", 0, 2) + "}", "xx"),
                    "tensor 'v'", "whole bytes");
  // 4 F6 elements are exactly 3 bytes.
  EXPECT_TRUE(ParseHeader("{\"v\":" + Entry("F6_E3M2", "[4]", 0, 3) + "}", "xxx").ok());
}

TEST(SafetensorsValidation, DeepNestingRejected) {
  // serde_json (the reference reader) stops at 128 levels; deeper input must not recurse.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_CORRUPTION(ParseHeader("{\"w\":" + Entry("U8", deep, 0, 0) + "}", ""), "nesting");
  EXPECT_CORRUPTION(ParseHeader(deep, ""), "nesting");
  // Brackets inside strings do not count.
  const std::string quoted = "\"" + std::string(1000, '[') + "\\\"\"";
  Result<SafetensorsImage> image = ParseHeader("{\"__metadata__\":{\"k\":" + quoted + "}}", "");
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  EXPECT_EQ(image->metadata.at("k"), std::string(1000, '[') + "\"");
}

TEST(SafetensorsValidation, EveryTruncationIsRejected) {
  OwnedCheckpoint checkpoint = EveryDtypeCheckpoint();
  const std::string file = Text(SerializeSafetensors(checkpoint.view(), {{"a", "b"}}).value());
  for (size_t length = 0; length < file.size(); ++length) {
    EXPECT_FALSE(ParseText(file.substr(0, length)).ok()) << length;
  }
  EXPECT_TRUE(ParseText(file).ok());
}

TEST(SafetensorsValidation, SingleByteCorruptionNeverCrashes) {
  const std::string header =
      "{\"__metadata__\":{\"k\":\"v\"},\"a\":" + Entry("F16", "[2,1]", 0, 4) +
      ",\"b\":" + Entry("F4", "[4]", 4, 6) + "}";
  const std::string file = HandMadeFile(header, "abcdef", true);
  for (size_t i = 0; i < file.size(); ++i) {
    for (const uint8_t value : {0x00, 0x20, 0x22, 0x2c, 0x5b, 0x7b, 0x7d, 0x80, 0xff}) {
      std::string corrupt = file;
      corrupt[i] = static_cast<char>(value);
      Result<SafetensorsImage> image = ParseText(corrupt);
      if (image.ok()) {
        for (const TensorView& tensor : image->tensors) {
          EXPECT_EQ(tensor.data.size(), TensorByteSize(tensor.dtype, tensor.shape).value());
        }
      } else {
        EXPECT_EQ(image.status().code(), StatusCode::kCorruption);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Files and sharded checkpoints.

TEST_F(SafetensorsTest, OpenMissingFileIsNotFound) {
  Result<SafetensorsFile> file = SafetensorsFile::Open(dir_ / "absent.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find("absent.safetensors"), std::string::npos);
  EXPECT_EQ(Checkpoint::Open(dir_ / "absent").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Checkpoint::Open(dir_).status().code(), StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, OpenZeroByteFileIsCorruption) {
  WriteFile(dir_ / "zero.safetensors", "");
  Result<SafetensorsFile> file = SafetensorsFile::Open(dir_ / "zero.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kCorruption);
  EXPECT_NE(file.status().message().find("zero.safetensors"), std::string::npos);
}

TEST_F(SafetensorsTest, CheckpointOpensSingleFileAndDirectory) {
  const std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"},\"w\":" + Entry("U8", "[3]", 0, 3) + "}";
  WriteFile(dir_ / "model.safetensors", HandMadeFile(header, "abc", true));
  for (const fs::path& path : {dir_ / "model.safetensors", dir_}) {
    Result<Checkpoint> checkpoint = Checkpoint::Open(path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    EXPECT_FALSE(checkpoint->sharded());
    ASSERT_EQ(checkpoint->tensors().size(), 1u);
    EXPECT_EQ(Text(checkpoint->tensors()[0].data), "abc");
    EXPECT_EQ(checkpoint->metadata().at("format"), "pt");
  }
}

class SafetensorsShardedTest : public SafetensorsTest {
 protected:
  // Two hand-made shards: shard 1 holds a, b; shard 2 holds c.
  void WriteShards() {
    WriteFile(
        dir_ / "model-00001-of-00002.safetensors",
        HandMadeFile("{\"__metadata__\":{\"format\":\"pt\"},\"a\":" + Entry("U8", "[2]", 0, 2) +
                         ",\"b\":" + Entry("I16", "[1]", 2, 4) + "}",
                     "abcd", true));
    WriteFile(dir_ / "model-00002-of-00002.safetensors",
              HandMadeFile("{\"c\":" + Entry("F32", "[]", 0, 4) + "}", "wxyz", true));
  }
  void WriteIndex(const std::string& weight_map) {
    WriteFile(dir_ / "model.safetensors.index.json",
              "{\"metadata\": {\"total_size\": 8}, \"weight_map\": " + weight_map + "}");
  }
  const std::string kGoodMap =
      "{\"a\": \"model-00001-of-00002.safetensors\", \"b\": \"model-00001-of-00002.safetensors\", "
      "\"c\": \"model-00002-of-00002.safetensors\"}";

  Status OpenStatus() { return Checkpoint::Open(dir_).status(); }
};

TEST_F(SafetensorsShardedTest, ReadsHandWrittenIndexAndShards) {
  WriteShards();
  WriteIndex(kGoodMap);
  for (const fs::path& path : {dir_, dir_ / "model.safetensors.index.json"}) {
    Result<Checkpoint> checkpoint = Checkpoint::Open(path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    EXPECT_TRUE(checkpoint->sharded());
    ASSERT_EQ(checkpoint->tensors().size(), 3u);
    EXPECT_EQ(checkpoint->tensors()[0].name, "a");
    EXPECT_EQ(Text(checkpoint->tensors()[0].data), "ab");
    EXPECT_EQ(checkpoint->tensors()[1].name, "b");
    EXPECT_EQ(checkpoint->tensors()[2].name, "c");
    EXPECT_EQ(Text(checkpoint->tensors()[2].data), "wxyz");
    EXPECT_EQ(checkpoint->weight_map().at("c"), "model-00002-of-00002.safetensors");
    EXPECT_EQ(checkpoint->metadata().at("format"), "pt");
  }
}

TEST_F(SafetensorsShardedTest, ShardNameWithPathSeparatorRejected) {
  WriteShards();
  for (const std::string shard : {"../model-00002-of-00002.safetensors", "sub/x.safetensors",
                                  "sub\\\\x.safetensors", "..", ""}) {
    SCOPED_TRACE(shard);
    WriteIndex(
        "{\"a\": \"model-00001-of-00002.safetensors\", \"b\": "
        "\"model-00001-of-00002.safetensors\", \"c\": \"" +
        shard + "\"}");
    const Status status = OpenStatus();
    EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
    EXPECT_NE(status.message().find("tensor 'c'"), std::string::npos) << status.message();
  }
}

TEST_F(SafetensorsShardedTest, TensorMissingFromItsShardRejected) {
  WriteShards();
  WriteIndex(
      "{\"a\": \"model-00001-of-00002.safetensors\", \"b\": "
      "\"model-00001-of-00002.safetensors\", \"c\": \"model-00002-of-00002.safetensors\", "
      "\"d\": \"model-00002-of-00002.safetensors\"}");
  const Status status = OpenStatus();
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  EXPECT_NE(status.message().find("tensor 'd'"), std::string::npos) << status.message();
}

TEST_F(SafetensorsShardedTest, ShardTensorNotInWeightMapRejected) {
  WriteShards();
  WriteIndex(
      "{\"a\": \"model-00001-of-00002.safetensors\", \"c\": "
      "\"model-00002-of-00002.safetensors\"}");
  const Status status = OpenStatus();
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  EXPECT_NE(status.message().find("tensor 'b'"), std::string::npos) << status.message();
}

TEST_F(SafetensorsShardedTest, TensorInTwoShardsRejected) {
  WriteShards();
  WriteFile(dir_ / "model-00002-of-00002.safetensors",
            HandMadeFile(
                "{\"c\":" + Entry("F32", "[]", 0, 4) + ",\"a\":" + Entry("U8", "[2]", 4, 6) + "}",
                "wxyzab", true));
  WriteIndex(kGoodMap);
  const Status status = OpenStatus();
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  EXPECT_NE(status.message().find("tensor 'a'"), std::string::npos) << status.message();
}

TEST_F(SafetensorsShardedTest, MissingShardFileIsNotFound) {
  WriteShards();
  fs::remove(dir_ / "model-00002-of-00002.safetensors");
  WriteIndex(kGoodMap);
  const Status status = OpenStatus();
  EXPECT_EQ(status.code(), StatusCode::kNotFound) << status.ToString();
  EXPECT_NE(status.message().find("model-00002-of-00002.safetensors"), std::string::npos);
}

TEST_F(SafetensorsShardedTest, CorruptShardNamesShardAndTensor) {
  WriteShards();
  WriteFile(dir_ / "model-00002-of-00002.safetensors",
            HandMadeFile("{\"c\":" + Entry("F32", "[]", 0, 3) + "}", "wxy", true));
  WriteIndex(kGoodMap);
  const Status status = OpenStatus();
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  EXPECT_NE(status.message().find("model-00002-of-00002.safetensors: tensor 'c'"),
            std::string::npos)
      << status.message();
}

TEST_F(SafetensorsShardedTest, IndexNotValid) {
  WriteShards();
  WriteFile(dir_ / "model.safetensors.index.json", "{\"weight_map\": [1]}");
  EXPECT_EQ(OpenStatus().code(), StatusCode::kCorruption);
  WriteFile(dir_ / "model.safetensors.index.json", "{\"weight_map\": {\"a\": 1}}");
  EXPECT_EQ(OpenStatus().code(), StatusCode::kCorruption);
  WriteFile(dir_ / "model.safetensors.index.json", "not json");
  EXPECT_EQ(OpenStatus().code(), StatusCode::kCorruption);
  WriteFile(dir_ / "model.safetensors.index.json",
            "{\"weight_map\": {\"a\": \"x\", \"a\": \"y\"}}");
  EXPECT_EQ(OpenStatus().code(), StatusCode::kCorruption);
}

TEST_F(SafetensorsTest, WriteShardedCheckpointRoundTrip) {
  const OwnedCheckpoint checkpoint = EveryDtypeCheckpoint();
  std::map<std::string, std::string> weight_map;
  uint64_t total_size = 0;
  for (size_t i = 0; i < checkpoint.tensors.size(); ++i) {
    weight_map[checkpoint.tensors[i].name] =
        "model-0000" + std::to_string(1 + i % 3) + "-of-00003.safetensors";
    total_size += checkpoint.tensors[i].data.size();
  }
  const fs::path out = dir_ / "sharded";
  ASSERT_TRUE(WriteShardedCheckpoint(out, checkpoint.view(), weight_map, {{"format", "pt"}}).ok());
  EXPECT_EQ(DirEntries(out),
            (std::vector<std::string>{
                "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  const std::string index = ReadFile(out / "model.safetensors.index.json");
  EXPECT_NE(index.find("\"total_size\": " + std::to_string(total_size)), std::string::npos)
      << index;

  Result<Checkpoint> read = Checkpoint::Open(out);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->weight_map(), weight_map);
  EXPECT_EQ(read->metadata().at("format"), "pt");
  // Shards are read in name order; within a shard, tensors keep their written order.
  CheckpointView expected;
  for (int shard = 1; shard <= 3; ++shard) {
    for (size_t i = shard - 1; i < checkpoint.tensors.size(); i += 3) {
      expected.push_back(checkpoint.view()[i]);
    }
  }
  ExpectSameTensors(read->tensors(), expected);
}

TEST_F(SafetensorsTest, WriteShardedCheckpointRejectsBadWeightMap) {
  const OwnedCheckpoint checkpoint = EveryDtypeCheckpoint();
  std::map<std::string, std::string> weight_map;
  for (const OwnedTensor& tensor : checkpoint.tensors) weight_map[tensor.name] = "s.safetensors";
  weight_map.erase("scalar");
  EXPECT_EQ(WriteShardedCheckpoint(dir_ / "a", checkpoint.view(), weight_map, {}).code(),
            StatusCode::kInvalidArgument);
  weight_map["scalar"] = "../escape.safetensors";
  EXPECT_EQ(WriteShardedCheckpoint(dir_ / "b", checkpoint.view(), weight_map, {}).code(),
            StatusCode::kInvalidArgument);
  weight_map["scalar"] = "s.safetensors";
  weight_map["ghost"] = "s.safetensors";
  EXPECT_EQ(WriteShardedCheckpoint(dir_ / "c", checkpoint.view(), weight_map, {}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir_ / "escape.safetensors"));
}

// ---------------------------------------------------------------------------------------
// Writing.

TEST_F(SafetensorsTest, WriteSafetensorsReplacesExistingFile) {
  const fs::path path = dir_ / "model.safetensors";
  WriteFile(path, "old contents that are not safetensors");
  OwnedCheckpoint checkpoint;
  checkpoint.tensors.push_back(MakeTensor("w", DType::kF16, {3}, 5));
  ASSERT_TRUE(WriteSafetensors(path, checkpoint.view(), {}).ok());
  Result<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ExpectSameTensors(file->tensors(), checkpoint.view());
  // No temporary file is left beside it.
  EXPECT_EQ(DirEntries(dir_), std::vector<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsTest, WriteSafetensorsRejectsBadInputWithoutTouchingPath) {
  const fs::path path = dir_ / "model.safetensors";
  OwnedCheckpoint checkpoint;
  checkpoint.tensors.push_back(MakeTensor("w", DType::kF16, {3}, 5));
  checkpoint.tensors[0].data.pop_back();
  const Status size_mismatch = WriteSafetensors(path, checkpoint.view(), {});
  EXPECT_EQ(size_mismatch.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(size_mismatch.message().find("tensor 'w'"), std::string::npos);

  OwnedCheckpoint duplicate;
  duplicate.tensors.push_back(MakeTensor("w", DType::kU8, {1}, 1));
  duplicate.tensors.push_back(MakeTensor("w", DType::kU8, {1}, 2));
  EXPECT_EQ(WriteSafetensors(path, duplicate.view(), {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SerializeSafetensors(duplicate.view(), {}).status().code(),
            StatusCode::kInvalidArgument);

  OwnedCheckpoint reserved;
  reserved.tensors.push_back(MakeTensor("__metadata__", DType::kU8, {1}, 1));
  EXPECT_EQ(SerializeSafetensors(reserved.view(), {}).status().code(),
            StatusCode::kInvalidArgument);

  OwnedCheckpoint not_utf8;
  not_utf8.tensors.push_back(MakeTensor("bad\xff", DType::kU8, {1}, 1));
  EXPECT_EQ(SerializeSafetensors(not_utf8.view(), {}).status().code(),
            StatusCode::kInvalidArgument);

  OwnedCheckpoint odd;
  odd.tensors.push_back({"f4", DType::kF4, {3}, {}});
  EXPECT_EQ(SafetensorsHeader(odd.view(), {}).status().code(), StatusCode::kInvalidArgument);

  EXPECT_TRUE(DirEntries(dir_).empty());
  EXPECT_EQ(WriteSafetensors(dir_ / "no-such-dir" / "x.safetensors", {}, {}).code(),
            StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, WriterCommitProducesValidFile) {
  const OwnedCheckpoint checkpoint = EveryDtypeCheckpoint();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  const fs::path path = dir_ / "out.safetensors";
  Result<SafetensorsWriter> writer = SafetensorsWriter::Create(path, checkpoint.view(), metadata);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_FALSE(fs::exists(path));  // nothing visible before Commit
  ASSERT_EQ(writer->tensors().size(), checkpoint.tensors.size());
  for (size_t i = 0; i < checkpoint.tensors.size(); ++i) {
    MutableTensorView& view = writer->tensors()[i];
    EXPECT_EQ(view.name, checkpoint.tensors[i].name);
    ASSERT_EQ(view.data.size(), checkpoint.tensors[i].data.size());
    std::copy(checkpoint.tensors[i].data.begin(), checkpoint.tensors[i].data.end(),
              view.data.begin());
  }
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_TRUE(writer->tensors().empty());
  EXPECT_EQ(ReadFile(path), Text(SerializeSafetensors(checkpoint.view(), metadata).value()));
  EXPECT_EQ(DirEntries(dir_), std::vector<std::string>{"out.safetensors"});
  EXPECT_EQ(writer->Commit().code(), StatusCode::kInvalidArgument);  // only once
}

TEST_F(SafetensorsTest, WriterEmptyLayoutCommits) {
  const fs::path path = dir_ / "empty.safetensors";
  Result<SafetensorsWriter> writer = SafetensorsWriter::Create(path, {}, {});
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_EQ(ReadFile(path), LittleEndian64(8) + "{}      ");
}

TEST_F(SafetensorsTest, AbandonedWriterLeavesNoFile) {
  const fs::path path = dir_ / "out.safetensors";
  {
    Result<SafetensorsWriter> writer =
        SafetensorsWriter::Create(path, EveryDtypeCheckpoint().view(), {});
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    EXPECT_EQ(DirEntries(dir_).size(), 1u);  // the temporary file
    EXPECT_EQ(DirEntries(dir_)[0].rfind(".out.safetensors.tmp-", 0), 0u) << DirEntries(dir_)[0];
    std::fill(writer->tensors()[0].data.begin(), writer->tensors()[0].data.end(), std::byte{0x5a});
  }
  EXPECT_TRUE(DirEntries(dir_).empty());
}

TEST_F(SafetensorsTest, AbandonedWriterKeepsExistingFile) {
  const fs::path path = dir_ / "model.safetensors";
  const std::string existing = HandMadeFile("{\"w\":" + Entry("U8", "[1]", 0, 1) + "}", "k");
  WriteFile(path, existing);
  {
    Result<SafetensorsWriter> writer =
        SafetensorsWriter::Create(path, EveryDtypeCheckpoint().view(), {});
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    EXPECT_EQ(ReadFile(path), existing);
  }
  EXPECT_EQ(ReadFile(path), existing);
  EXPECT_EQ(DirEntries(dir_), std::vector<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsTest, MoveAssignAbandonsTheOverwrittenWriter) {
  const OwnedCheckpoint checkpoint = EveryDtypeCheckpoint();
  Result<SafetensorsWriter> first = SafetensorsWriter::Create(dir_ / "a", checkpoint.view(), {});
  Result<SafetensorsWriter> second = SafetensorsWriter::Create(dir_ / "b", checkpoint.view(), {});
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(DirEntries(dir_).size(), 2u);
  *first = std::move(*second);
  EXPECT_EQ(DirEntries(dir_).size(), 1u);
  SafetensorsWriter moved(std::move(*first));
  ASSERT_TRUE(moved.Commit().ok());
  EXPECT_EQ(DirEntries(dir_), std::vector<std::string>{"b"});
  EXPECT_TRUE(SafetensorsFile::Open(dir_ / "b").ok());
}

// ---------------------------------------------------------------------------------------
// The fuzz target on its seed corpus (it aborts on any broken invariant).

TEST(SafetensorsFuzz, SeedCorpusRunsClean) {
  const fs::path corpus =
      fs::path(__FILE__).parent_path().parent_path() / "fuzz" / "corpus" / "safetensors";
  if (!fs::is_directory(corpus)) GTEST_SKIP() << "no corpus at " << corpus;
  int seeds = 0;
  for (const auto& entry : fs::directory_iterator(corpus)) {
    const std::string bytes = ReadFile(entry.path());
    EXPECT_EQ(FuzzSafetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0)
        << entry.path();
    // Seeds named broken_* must be rejected, all others must parse.
    const bool broken = entry.path().filename().string().starts_with("broken_");
    EXPECT_EQ(ParseText(bytes).ok(), !broken) << entry.path();
    ++seeds;
  }
  EXPECT_GE(seeds, 6);
}

TEST(SafetensorsFuzz, TargetAcceptsValidAndInvalidInputs) {
  const std::string valid =
      Text(SerializeSafetensors(EveryDtypeCheckpoint().view(), {{"format", "pt"}}).value());
  EXPECT_EQ(FuzzSafetensors(reinterpret_cast<const uint8_t*>(valid.data()), valid.size()), 0);
  EXPECT_EQ(FuzzSafetensors(nullptr, 0), 0);
  for (size_t length : {1, 8, 9, 64}) {
    EXPECT_EQ(FuzzSafetensors(reinterpret_cast<const uint8_t*>(valid.data()), length), 0);
  }
}

}  // namespace
}  // namespace flywheel
