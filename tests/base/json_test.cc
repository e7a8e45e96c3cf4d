// The one parser for JSON from the network (base/json.h): depth and size limits, and that a
// refused document never reaches code that recurses on it.
#include "base/json.h"

#include <gtest/gtest.h>

#include <string>

namespace flywheel {
namespace {

std::string Nested(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST(JsonTest, ParsesOrdinaryDocuments) {
  auto parsed = ParseJson(R"({"prompt": "hi", "stop": ["a", "b"], "n": 2})", "the body");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ((*parsed)["n"], 2);
  auto ordered = ParseJson<nlohmann::ordered_json>(R"({"b": 1, "a": 2})", "the body");
  ASSERT_TRUE(ordered.ok());
  EXPECT_EQ(ordered->begin().key(), "b");
}

TEST(JsonTest, NestingAtTheLimitParses) {
  auto parsed = ParseJson(Nested(64), "the body");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->dump(), Nested(64));
}

TEST(JsonTest, NestingOneBeyondTheLimitIsRefusedNamingTheByte) {
  auto parsed = ParseJson(Nested(65), "the body");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("the body: JSON nested deeper than 64 levels at byte 64"),
            std::string::npos)
      << parsed.status().message();
}

// The request that killed a worker: 100,000 nested arrays in a 200 KB body (and a million in
// 2 MB). Refused without recursing: this test would overflow the stack otherwise.
TEST(JsonTest, HundredThousandNestedArraysAreRefusedWithoutRecursing) {
  for (int depth : {100000, 1000000}) {
    const std::string body = R"({"prompt": "hi", "temperature": )" + Nested(depth) + "}";
    auto parsed = ParseJson<nlohmann::ordered_json>(body, "the body");
    ASSERT_FALSE(parsed.ok()) << depth;
    EXPECT_NE(parsed.status().message().find("nested deeper than 64 levels at byte 95"),
              std::string::npos)
        << parsed.status().message();
  }
  // Objects count as well as arrays; brackets inside strings do not.
  std::string objects;
  for (int i = 0; i < 100; ++i) objects += R"({"a":)";
  objects += "1" + std::string(100, '}');
  EXPECT_FALSE(ParseJson(objects, "").ok());
  EXPECT_TRUE(ParseJson("[\"" + std::string(1000, '[') + "\"]", "").ok());
}

TEST(JsonTest, LimitsAreTheCallersToSet) {
  JsonLimits limits;
  limits.max_depth = 2;
  limits.max_bytes = 10;
  EXPECT_TRUE(ParseJson("[[1]]", "", limits).ok());
  EXPECT_FALSE(ParseJson("[[[1]]]", "", limits).ok());
  auto long_text = ParseJson("[1,2,3,4,5,6]", "upload metadata", limits);
  ASSERT_FALSE(long_text.ok());
  EXPECT_NE(long_text.status().message().find("upload metadata is 13 bytes, over the limit of 10"),
            std::string::npos)
      << long_text.status().message();
}

TEST(JsonTest, InvalidJsonNamesWhatAndWhere) {
  for (const char* text : {"not json", "{\"a\": 1", "{\"a\": 1} trailing", ""}) {
    auto parsed = ParseJson(text, "claim");
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_NE(parsed.status().message().find("claim: not valid JSON"), std::string::npos)
        << parsed.status().message();
  }
}

}  // namespace
}  // namespace flywheel
