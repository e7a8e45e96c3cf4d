// The rollout protocol's typed messages: each renders to the JSON the other side parses back
// unchanged, and a body that is malformed is refused naming the field that was wrong.
#include "pipeline/rollout_protocol.h"

#include <gtest/gtest.h>

#include <string>

namespace flywheel::pipeline {
namespace {

void ExpectRefused(const Status& status, const std::string& names) {
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find(names), std::string::npos)
      << "\"" << status.message() << "\" does not name " << names;
}

RolloutSample MoeSample() {
  return {.prompt_tokens = {13, 1, 2},
          .tokens = {5, 14},
          .logprobs = {-0.25f, -1.5f},
          .versions = {7, 8},
          .routing = {0, 3, 1, 2, 3, 0, 2, 1},
          .routing_shape = {4, 1, 2},
          .reward = 1};
}

TEST(RolloutProtocolTest, ClaimRequestRoundTrips) {
  const ClaimRequest request{.worker = "w-1",
                             .incarnation = "123-456",
                             .version = 42,
                             .serving_since_unix_us = 1700000000000000,
                             .max_groups = 8};
  Result<ClaimRequest> parsed = ParseClaimRequest(ToJson(request));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->worker, "w-1");
  EXPECT_EQ(parsed->incarnation, "123-456");
  EXPECT_EQ(parsed->version, 42u);
  EXPECT_EQ(parsed->serving_since_unix_us, 1700000000000000);
  EXPECT_EQ(parsed->max_groups, 8);
}

TEST(RolloutProtocolTest, ClaimRequestOptionalFieldsKeepTheirDefaults) {
  Result<ClaimRequest> parsed = ParseClaimRequest(R"({"worker": "w", "version": 0})");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->incarnation, "");
  EXPECT_EQ(parsed->serving_since_unix_us, 0);
  EXPECT_EQ(parsed->max_groups, 1);
}

TEST(RolloutProtocolTest, MalformedClaimRequestsNameWhatWasWrong) {
  ExpectRefused(ParseClaimRequest("{not json").status(), "not valid JSON");
  ExpectRefused(ParseClaimRequest("[1, 2]").status(), "not a JSON object");
  ExpectRefused(ParseClaimRequest(R"({"version": 1})").status(), "missing \"worker\"");
  ExpectRefused(ParseClaimRequest(R"({"worker": 7, "version": 1})").status(), "\"worker\"");
  ExpectRefused(ParseClaimRequest(R"({"worker": "w", "version": -1})").status(), "\"version\"");
  ExpectRefused(ParseClaimRequest(R"({"worker": "w", "version": 1.5})").status(), "\"version\"");
  ExpectRefused(ParseClaimRequest(R"({"worker": "", "version": 1})").status(), "worker must be named");
  ExpectRefused(ParseClaimRequest(R"({"worker": "w", "version": 1, "max_groups": 0})").status(),
                "max_groups >= 1");
}

// A worker's body nested 100,000 deep (the request that killed a worker on the serving
// side) is refused by every parser of the coordinator's protocol, which never recurses on it.
TEST(RolloutProtocolTest, DeeplyNestedBodiesAreRefusedByEveryParser) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string claim = R"({"worker": "w", "version": 1, "max_groups": )" + deep + "}";
  const std::string submit = R"({"worker": "w", "claim": 1, "version": 1, "samples": )" + deep + "}";
  ExpectRefused(ParseClaimRequest(claim).status(), "nested deeper than 64 levels");
  ExpectRefused(ParseSubmitRequest(submit).status(), "nested deeper than 64 levels");
  ExpectRefused(ParseSubmitHeader(submit).status(), "nested deeper than 64 levels");
}

TEST(RolloutProtocolTest, ClaimAnswersOfEveryKindRoundTrip) {
  ClaimAnswer ok = ClaimAnswer::Ok();
  ok.trainer_version = 9;
  ok.groups = {{(uint64_t{1} << 53) - 1, "3142>", "1234"}, {5, "1+1=", "2"}};
  ok.group_size = 4;
  ok.temperature = 0.75;
  ok.max_tokens = 12;
  Result<ClaimAnswer> parsed = ParseClaimAnswer(ToJson(ok));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->kind, ClaimAnswer::Kind::kOk);
  EXPECT_EQ(parsed->trainer_version, 9u);
  ASSERT_EQ(parsed->groups.size(), 2u);
  EXPECT_EQ(parsed->groups[0].claim, (uint64_t{1} << 53) - 1);  // exact
  EXPECT_EQ(parsed->groups[0].prompt, "3142>");
  EXPECT_EQ(parsed->groups[1].answer, "2");
  EXPECT_EQ(parsed->group_size, 4);
  EXPECT_DOUBLE_EQ(parsed->temperature, 0.75);
  EXPECT_EQ(parsed->max_tokens, 12);

  Result<ClaimAnswer> wait = ParseClaimAnswer(ToJson(ClaimAnswer::Wait(20, "pacing")));
  ASSERT_TRUE(wait.ok());
  EXPECT_EQ(wait->kind, ClaimAnswer::Kind::kWait);
  EXPECT_EQ(wait->retry_ms, 20);
  EXPECT_EQ(wait->reason, "pacing");
  Result<ClaimAnswer> done = ParseClaimAnswer(ToJson(ClaimAnswer::Done()));
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->kind, ClaimAnswer::Kind::kDone);
  // Errors are HTTP errors in the one shape (transport/api.h), not a claim answer.
  ExpectRefused(ParseClaimAnswer(R"({"status": "error", "reason": "bad claim request"})").status(),
                "unknown status \"error\"");
}

TEST(RolloutProtocolTest, MalformedClaimAnswersNameWhatWasWrong) {
  ExpectRefused(ParseClaimAnswer(R"({"status": "maybe"})").status(), "unknown status \"maybe\"");
  ExpectRefused(ParseClaimAnswer(R"({})").status(), "missing \"status\"");
  ExpectRefused(ParseClaimAnswer(R"({"status": "ok"})").status(), "\"groups\" must be an array");
  ExpectRefused(ParseClaimAnswer(R"({"status": "ok", "groups": [{"claim": 1, "prompt": "p"}]})")
                    .status(),
                "group 0: missing \"answer\"");
  ExpectRefused(ParseClaimAnswer(R"({"status": "ok", "groups": [], "group_size": 0})").status(),
                "group_size");
}

TEST(RolloutProtocolTest, SubmitRequestRoundTripsWithRouting) {
  RolloutSample dense = MoeSample();
  dense.routing.clear();
  dense.routing_shape.clear();
  const SubmitRequest request{.worker = "w", .incarnation = "i", .claim = 77,
                              .samples = {MoeSample(), dense}};
  Result<SubmitRequest> parsed = ParseSubmitRequest(ToJson(request));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->claim, 77u);
  ASSERT_EQ(parsed->samples.size(), 2u);
  const RolloutSample& s = parsed->samples[0];
  EXPECT_EQ(s.prompt_tokens, MoeSample().prompt_tokens);
  EXPECT_EQ(s.tokens, MoeSample().tokens);
  EXPECT_EQ(s.logprobs, MoeSample().logprobs);  // exact: float -> JSON -> float
  EXPECT_EQ(s.versions, MoeSample().versions);
  EXPECT_EQ(s.routing, MoeSample().routing);
  EXPECT_EQ(s.routing_shape, MoeSample().routing_shape);
  EXPECT_EQ(s.reward, 1);
  EXPECT_TRUE(parsed->samples[1].routing.empty());
  EXPECT_TRUE(parsed->samples[1].routing_shape.empty());
}

TEST(RolloutProtocolTest, MalformedSubmissionsNameWhatWasWrongAndKeepTheirHeader) {
  const std::string header = R"("worker": "w", "incarnation": "i", "claim": 5)";
  const auto body = [&](const std::string& sample) {
    return "{" + header + R"(, "samples": [)" + sample + "]}";
  };
  const std::string good =
      R"({"prompt_tokens": [1], "tokens": [2], "logprobs": [-0.5], "versions": [1], "reward": 0})";
  ASSERT_TRUE(ParseSubmitRequest(body(good)).ok());
  ExpectRefused(ParseSubmitRequest(R"({"worker": "w"})").status(), "missing \"claim\"");
  ExpectRefused(ParseSubmitRequest(R"({"worker": "w", "claim": "x"})").status(), "\"claim\"");
  ExpectRefused(ParseSubmitRequest("{" + header + "}").status(), "\"samples\" must be an array");
  struct Case {
    std::string sample;
    std::string names;
  } cases[] = {
      {"3", "sample 0: not an object"},
      {R"({"tokens": [2], "logprobs": [-0.5], "versions": [1], "reward": 0})",
       "sample 0: missing \"prompt_tokens\""},
      {R"({"prompt_tokens": [1], "tokens": [2.5], "logprobs": [-0.5], "versions": [1], "reward": 0})",
       "\"tokens\" must be an array of int32"},
      {R"({"prompt_tokens": [1], "tokens": [4294967298], "logprobs": [-0.5], "versions": [1], "reward": 0})",
       "\"tokens\" must be an array of int32"},
      {R"({"prompt_tokens": [1], "tokens": [2], "logprobs": ["x"], "versions": [1], "reward": 0})",
       "\"logprobs\" must be an array of numbers"},
      {R"({"prompt_tokens": [1], "tokens": [2], "logprobs": [-0.5], "versions": [-1], "reward": 0})",
       "\"versions\" must be an array of non-negative integers"},
      {R"({"prompt_tokens": [1], "tokens": [2], "logprobs": [-0.5], "versions": [1], "reward": "1"})",
       "\"reward\" must be a number"},
      {R"({"prompt_tokens": [1], "tokens": [2], "logprobs": [-0.5], "versions": [1], "reward": 0,
           "routing": [0, 1]})",
       "routing needs routing_shape"},
  };
  for (const Case& c : cases) {
    ExpectRefused(ParseSubmitRequest(body(c.sample)).status(), c.names);
    // The header still parses, so the receiver can close the claim.
    Result<SubmitRequest> head = ParseSubmitHeader(body(c.sample));
    ASSERT_TRUE(head.ok()) << head.status().ToString();
    EXPECT_EQ(head->claim, 5u);
    EXPECT_EQ(head->worker, "w");
    EXPECT_EQ(head->incarnation, "i");
  }
}

TEST(RolloutProtocolTest, SubmitAnswersRoundTrip) {
  Result<SubmitAnswer> yes = ParseSubmitAnswer(ToJson(SubmitAnswer::Accepted()));
  ASSERT_TRUE(yes.ok());
  EXPECT_TRUE(yes->accepted);
  Result<SubmitAnswer> no = ParseSubmitAnswer(ToJson(SubmitAnswer::Refused("claim 5 is not out")));
  ASSERT_TRUE(no.ok());
  EXPECT_FALSE(no->accepted);
  EXPECT_EQ(no->reason, "claim 5 is not out");
  ExpectRefused(ParseSubmitAnswer(R"({"accepted": "yes"})").status(), "\"accepted\"");
}

}  // namespace
}  // namespace flywheel::pipeline
