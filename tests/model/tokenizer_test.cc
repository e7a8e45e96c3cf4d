#include "model/tokenizer.h"

#include <gtest/gtest.h>

namespace flywheel::model {
namespace {

TEST(TokenizerTest, BytesRoundTripAnyText) {
  ByteTokenizer t;
  const std::string text = "12+30=42\n\xc3\xa9\x00z";
  auto ids = t.Encode(text);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), text.size());
  std::vector<int32_t> with_specials = {t.bos()};
  with_specials.insert(with_specials.end(), ids->begin(), ids->end());
  with_specials.push_back(t.eos());
  auto back = t.Decode(with_specials);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, text);
  auto bad = t.Decode(std::vector<int32_t>{65, 258});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("token 258 at position 1"), std::string::npos);
}

TEST(TokenizerTest, CharactersOfAnAlphabet) {
  auto t = CharTokenizer::Create("0123456789+= ");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->vocab_size(), 15);
  auto ids = (*t)->Encode("12+30=42");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ((*ids)[0], 1);
  EXPECT_EQ((*ids)[2], 10);
  auto back = (*t)->Decode(*ids);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, "12+30=42");
  auto unknown = (*t)->Encode("1x");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("offset 1"), std::string::npos);
  EXPECT_FALSE(CharTokenizer::Create("00").ok());
  EXPECT_FALSE(CharTokenizer::Create("").ok());
}

}  // namespace
}  // namespace flywheel::model
