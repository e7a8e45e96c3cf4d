// The one hex encoder and decoder (base/hex.h): every byte value both ways, the 64-bit
// form, and each way a text can fail to be hex.
#include "base/hex.h"

#include <gtest/gtest.h>

#include <string>

namespace flywheel {
namespace {

TEST(HexTest, EveryByteRoundTrips) {
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes.push_back(static_cast<char>(b));
  const std::string hex = HexEncode(bytes);
  ASSERT_EQ(hex.size(), 512u);
  EXPECT_EQ(hex.substr(0, 8), "00010203");
  EXPECT_EQ(hex.substr(504), "fcfdfeff");
  Result<std::string> back = HexDecode(hex, HexCase::kLower);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, bytes);
}

TEST(HexTest, TheThreeEncodersAgree) {
  const uint8_t raw[] = {0xde, 0xad, 0x00, 0x0f};
  EXPECT_EQ(HexEncode(std::span<const uint8_t>(raw)), "dead000f");
  EXPECT_EQ(HexEncode(std::as_bytes(std::span(raw))), "dead000f");
  EXPECT_EQ(HexEncode(std::string_view("\xde\xad\x00\x0f", 4)), "dead000f");
  EXPECT_EQ(HexEncode(std::string_view()), "");
}

TEST(HexTest, Hex64IsSixteenZeroPaddedDigits) {
  EXPECT_EQ(Hex64(0), "0000000000000000");
  EXPECT_EQ(Hex64(255), "00000000000000ff");
  EXPECT_EQ(Hex64(0x0123456789abcdefull), "0123456789abcdef");
  EXPECT_EQ(Hex64(~uint64_t{0}), "ffffffffffffffff");
}

TEST(HexTest, Decode64TakesOneToSixteenDigits) {
  EXPECT_EQ(*HexDecode64("f"), 15u);
  EXPECT_EQ(*HexDecode64("00000000000000ff"), 255u);
  EXPECT_EQ(*HexDecode64("FFFFFFFFFFFFFFFF"), ~uint64_t{0});
  EXPECT_EQ(*HexDecode64(Hex64(0x8000000000000001ull)), 0x8000000000000001ull);
  EXPECT_FALSE(HexDecode64("").ok());
  EXPECT_FALSE(HexDecode64(std::string(17, '0')).ok());
  Result<uint64_t> bad = HexDecode64("12x4");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'x' at offset 2"), std::string::npos)
      << bad.status().message();
}

TEST(HexTest, UppercaseIsRefusedWhereLowercaseIsRequired) {
  EXPECT_EQ(*HexDecode("AbCd"), "\xab\xcd");
  EXPECT_FALSE(HexDecode("AbCd", HexCase::kLower).ok());
  EXPECT_FALSE(HexDecode64("A", HexCase::kLower).ok());
  EXPECT_EQ(HexDigitValue('F'), 15);
  EXPECT_EQ(HexDigitValue('F', HexCase::kLower), -1);
  EXPECT_EQ(HexDigitValue('g'), -1);
}

TEST(HexTest, OddLengthAndNonDigitsAreRefused) {
  Result<std::string> odd = HexDecode("abc");
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("odd length (3)"), std::string::npos);
  Result<std::string> bad = HexDecode("00g0");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'g' at offset 2"), std::string::npos);
  EXPECT_EQ(*HexDecode(""), "");
}

TEST(HexTest, IsHexNeedsAtLeastOneDigit) {
  EXPECT_TRUE(IsHex("09af"));
  EXPECT_TRUE(IsHex("09AF"));
  EXPECT_FALSE(IsHex("09AF", HexCase::kLower));
  EXPECT_FALSE(IsHex(""));
  EXPECT_FALSE(IsHex("0x1"));
}

}  // namespace
}  // namespace flywheel
