// The external grader process under the protocol and its faults: batches answered out of
// order, a crash (restarted, its requests re-sent once), a hang past the timeout, garbage,
// NaN, unknown ids, a grader that always fails (its stderr in the error), a command that
// does not start. Every script records its process id; each test checks they all ended.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <thread>

#include "grading/grader.h"
#include "tests/grading/grading_test_util.h"

namespace flywheel::grading {
namespace {

using std::chrono::milliseconds;
using testing::Await;
using testing::MakeSample;
using testing::TempDir;
using testing::WriteGrader;

// Reads what has arrived (waiting 50 ms for more), cuts it into batches of 4 and answers
// each batch in reverse order: reward = the completion's length, metrics.batch = the batch's size.
constexpr char kBatchReverse[] = R"py(
import select
fd, pending = sys.stdin.fileno(), b""
while True:
    chunk = os.read(fd, 65536)
    if not chunk:
        break
    pending += chunk
    while select.select([fd], [], [], 0.05)[0]:
        more = os.read(fd, 65536)
        if not more:
            break
        pending += more
    *lines, pending = pending.split(b"\n")
    requests = [json.loads(line) for line in lines if line]
    for start in range(0, len(requests), 4):
        batch = requests[start:start + 4]
        for request in reversed(batch):
            print(json.dumps({"id": request["id"], "reward": len(request["completion"]),
                              "metrics": {"batch": len(batch), "text": "ignored"}}), flush=True)
)py";

ExternalGraderOptions Fast() {
  ExternalGraderOptions options;
  options.timeout = milliseconds(3000);
  options.stop_grace = milliseconds(500);
  return options;
}

TEST(ProcessGraderTest, BatchesAnsweredOutOfOrderReachTheirSamples) {
  TempDir dir;
  auto grader = StartProcessGrader(WriteGrader(dir, "batch.py", kBatchReverse), Fast());
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  std::vector<std::future<Outcome>> futures;
  for (int i = 0; i < 12; ++i) {
    futures.push_back((*grader)->Submit(MakeSample("s" + std::to_string(i), std::string(i, 'x'))));
  }
  double largest_batch = 0;
  for (int i = 0; i < 12; ++i) {
    Outcome outcome = Await(futures[i]);
    ASSERT_EQ(outcome.kind, OutcomeKind::kReward) << outcome.reason;
    EXPECT_EQ(outcome.reward, i);
    EXPECT_EQ(outcome.metrics.count("text"), 0u);  // a non-number metric is left out
    largest_batch = std::max(largest_batch, outcome.metrics.at("batch"));
  }
  EXPECT_GT(largest_batch, 1.0);  // several requests were in flight at once
  GraderCounters counters = (*grader)->counters();
  EXPECT_EQ(counters.submitted, 12u);
  EXPECT_EQ(counters.rewarded, 12u);
  EXPECT_EQ(counters.restarts, 0u);
  grader->reset();
  EXPECT_TRUE(testing::AllEnded(dir));
}

TEST(ProcessGraderTest, MaxInFlightBoundsWhatTheGraderHolds) {
  TempDir dir;
  ExternalGraderOptions options = Fast();
  options.max_in_flight = 2;
  auto grader = StartProcessGrader(WriteGrader(dir, "batch.py", kBatchReverse), options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  std::vector<std::future<Outcome>> futures;
  for (int i = 0; i < 6; ++i)
    futures.push_back((*grader)->Submit(MakeSample("s" + std::to_string(i), "ab")));
  for (auto& future : futures) {
    Outcome outcome = Await(future);
    ASSERT_EQ(outcome.kind, OutcomeKind::kReward) << outcome.reason;
    EXPECT_LE(outcome.metrics.at("batch"), 2.0);
  }
}

// Crashes (exit 1) on "crash" the first time, and on "always" every time.
constexpr char kCrashing[] = R"(
marker = os.path.join(DIR, 'crashed')
for line in sys.stdin:
    request = json.loads(line)
    if request["completion"] == "always" or (request["completion"] == "crash" and not os.path.exists(marker)):
        open(marker, 'w').close()
        sys.stderr.write("crashing on " + request["id"] + "\n")
        sys.stderr.flush()
        os._exit(1)
    print(json.dumps({"id": request["id"], "reward": 1.0}), flush=True)
)";

TEST(ProcessGraderTest, ACrashRestartsTheGraderAndResendsItsRequestsOnce) {
  TempDir dir;
  auto grader = StartProcessGrader(WriteGrader(dir, "crash.py", kCrashing), Fast());
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  auto before = (*grader)->Submit(MakeSample("before", "fine"));
  EXPECT_EQ(Await(before).kind, OutcomeKind::kReward);
  auto crash = (*grader)->Submit(MakeSample("crash", "crash"));
  auto after = (*grader)->Submit(MakeSample("after", "fine"));
  Outcome crashed = Await(crash);
  EXPECT_EQ(crashed.kind, OutcomeKind::kReward) << crashed.reason;  // re-sent to the new process
  EXPECT_EQ(Await(after).kind, OutcomeKind::kReward);
  auto always = (*grader)->Submit(MakeSample("always", "always"));
  Outcome lost = Await(always);
  EXPECT_EQ(lost.kind, OutcomeKind::kUngraded);
  EXPECT_NE(lost.reason.find("twice"), std::string::npos) << lost.reason;
  auto last = (*grader)->Submit(MakeSample("last", "fine"));
  EXPECT_EQ(Await(last).kind, OutcomeKind::kReward);  // the run goes on
  GraderCounters counters = (*grader)->counters();
  EXPECT_EQ(counters.restarts, 3u);
  EXPECT_GE(counters.resent, 2u);
  EXPECT_EQ(counters.ungraded_crash, 1u);
  EXPECT_TRUE((*grader)->status().ok());
  grader->reset();
  EXPECT_EQ(testing::RecordedPids(dir).size(), 4u);
  EXPECT_TRUE(testing::AllEnded(dir));
}

// Blocks for an hour on "hang" (a grader stuck in a call), answers anything else.
constexpr char kHanging[] = R"(
for line in sys.stdin:
    request = json.loads(line)
    if request["completion"] == "hang":
        time.sleep(3600)
    print(json.dumps({"id": request["id"], "reward": 0.5}), flush=True)
)";

TEST(ProcessGraderTest, AHangPastTheTimeoutIsUngradedAndTheGraderReplaced) {
  TempDir dir;
  ExternalGraderOptions options = Fast();
  options.timeout = milliseconds(1500);
  auto grader = StartProcessGrader(WriteGrader(dir, "hang.py", kHanging), options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  auto hang = (*grader)->Submit(MakeSample("hang", "hang"));
  Outcome timed_out = Await(hang);
  EXPECT_EQ(timed_out.kind, OutcomeKind::kUngraded);
  EXPECT_NE(timed_out.reason.find("no answer within 1500 ms"), std::string::npos)
      << timed_out.reason;
  auto next = (*grader)->Submit(MakeSample("next", "fine"));
  Outcome answered = Await(next);
  EXPECT_EQ(answered.kind, OutcomeKind::kReward) << answered.reason;
  GraderCounters counters = (*grader)->counters();
  EXPECT_EQ(counters.ungraded_timeout, 1u);
  EXPECT_EQ(counters.restarts, 1u);  // the silent process was killed and replaced
  grader->reset();
  EXPECT_TRUE(testing::AllEnded(dir));
}

// Answers by the completion: garbage, NaN, a string reward, an unknown id, debug prints.
constexpr char kFaulty[] = R"(
for line in sys.stdin:
    request = json.loads(line)
    rid, text = request["id"], request["completion"]
    if text == "garbage":
        print("Traceback (most recent call last): oops", flush=True)
    elif text == "nan":
        print(json.dumps({"id": rid, "reward": float("nan")}), flush=True)
    elif text == "inf":
        print(json.dumps({"id": rid, "reward": float("inf")}), flush=True)
    elif text == "string":
        print(json.dumps({"id": rid, "reward": "0.5"}), flush=True)
    elif text == "neither":
        print(json.dumps({"id": rid, "score": 1}), flush=True)
    elif text == "stranger":
        print(json.dumps({"id": "nobody", "reward": 1}), flush=True)
        print(json.dumps({"id": rid, "reward": 1}), flush=True)
    else:
        print(json.dumps({"id": rid, "reward": 1, "metrics": {"n": 2}}), flush=True)
)";

TEST(ProcessGraderTest, GarbageNanAndBadAnswersAreUngradedAndCounted) {
  TempDir dir;
  ExternalGraderOptions options = Fast();
  options.timeout = milliseconds(2000);
  auto grader = StartProcessGrader(WriteGrader(dir, "faulty.py", kFaulty), options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  const std::vector<std::string> texts = {"garbage", "nan",      "inf", "string",
                                          "neither", "stranger", "ok"};
  std::vector<std::future<Outcome>> futures;
  for (const std::string& text : texts)
    futures.push_back((*grader)->Submit(MakeSample(text, text)));
  std::map<std::string, Outcome> outcomes;
  for (size_t i = 0; i < texts.size(); ++i) outcomes[texts[i]] = Await(futures[i]);
  EXPECT_NE(outcomes["garbage"].reason.find("no answer within"), std::string::npos);  // missing
  EXPECT_NE(outcomes["nan"].reason.find("not JSON"), std::string::npos) << outcomes["nan"].reason;
  EXPECT_NE(outcomes["inf"].reason.find("not JSON"), std::string::npos);
  EXPECT_NE(outcomes["string"].reason.find("\"reward\" is string"), std::string::npos)
      << outcomes["string"].reason;
  EXPECT_NE(outcomes["neither"].reason.find("neither"), std::string::npos);
  for (const char* ungraded : {"garbage", "nan", "inf", "string", "neither"}) {
    EXPECT_EQ(outcomes[ungraded].kind, OutcomeKind::kUngraded) << ungraded;
  }
  EXPECT_EQ(outcomes["stranger"].kind, OutcomeKind::kReward);
  EXPECT_EQ(outcomes["ok"].kind, OutcomeKind::kReward);
  EXPECT_EQ(outcomes["ok"].metrics.at("n"), 2.0);
  GraderCounters counters = (*grader)->counters();
  EXPECT_EQ(counters.ungraded, 5u);
  EXPECT_EQ(counters.ungraded_bad_answer, 4u);
  EXPECT_EQ(counters.ungraded_timeout, 1u);
  EXPECT_EQ(counters.garbage_lines, 1u);
  EXPECT_EQ(counters.unknown_ids, 1u);
  EXPECT_TRUE((*grader)->status().ok());  // 5 in a row is under max_grader_failures (20)
  grader->reset();
  EXPECT_TRUE(testing::AllEnded(dir));
}

TEST(ProcessGraderTest, AGraderThatAlwaysFailsStopsWithItsStderr) {
  TempDir dir;
  ExternalGraderOptions options = Fast();
  options.max_grader_failures = 3;
  const std::string command = WriteGrader(dir, "broken.py", R"(
sys.stderr.write("fatal: cannot load the reference solutions\n")
sys.exit(3)
)");
  auto grader = StartProcessGrader(command, options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();  // it starts, then exits
  auto first = (*grader)->Submit(MakeSample("a", "x"));
  Outcome outcome = Await(first);
  EXPECT_NE(outcome.kind, OutcomeKind::kReward);
  std::future_status failed = std::future_status::timeout;
  for (int i = 0; i < 300 && (*grader)->status().ok(); ++i)
    std::this_thread::sleep_for(milliseconds(50));
  failed = (*grader)->status().ok() ? std::future_status::timeout : std::future_status::ready;
  ASSERT_EQ(failed, std::future_status::ready) << "the grader did not fail";
  const std::string message = (*grader)->status().message();
  EXPECT_NE(message.find(command), std::string::npos) << message;
  EXPECT_NE(message.find("fatal: cannot load the reference solutions"), std::string::npos)
      << message;
  EXPECT_NE(message.find("exited with status 3"), std::string::npos) << message;
  auto later = (*grader)->Submit(MakeSample("b", "x"));
  Outcome refused = Await(later);
  EXPECT_EQ(refused.kind, OutcomeKind::kFailed);
  EXPECT_EQ(refused.reason, message);
  grader->reset();
  EXPECT_TRUE(testing::AllEnded(dir));
}

TEST(ProcessGraderTest, AGraderThatCannotBeRestartedFails) {
  TempDir dir;
  const std::string script = dir.File("vanishing.sh");
  testing::WriteText(
      script, "#!/bin/sh\necho $$ >> " + dir.File("pids") + "\nrm \"$0\"\necho gone >&2\nexit 1\n");
  ASSERT_EQ(::chmod(script.c_str(), 0700), 0);
  ExternalGraderOptions options = Fast();
  options.max_grader_failures = 2;
  auto grader = StartProcessGrader(script, options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  for (int i = 0; i < 300 && (*grader)->status().ok(); ++i)
    std::this_thread::sleep_for(milliseconds(50));
  ASSERT_FALSE((*grader)->status().ok());
  EXPECT_NE((*grader)->status().message().find("could not be restarted"), std::string::npos)
      << (*grader)->status().message();
  auto refused = (*grader)->Submit(MakeSample("a", "x"));
  EXPECT_EQ(Await(refused).kind, OutcomeKind::kFailed);
  grader->reset();
  EXPECT_EQ(testing::RecordedPids(dir).size(), 1u);
  EXPECT_TRUE(testing::AllEnded(dir));
}

TEST(ProcessGraderTest, BadAnswersInARowFailTheGrader) {
  TempDir dir;
  ExternalGraderOptions options = Fast();
  options.max_grader_failures = 4;
  auto grader = StartProcessGrader(WriteGrader(dir, "string.py", R"(
for line in sys.stdin:
    sys.stderr.write("no reference for " + json.loads(line)["id"] + "\n")
    sys.stderr.flush()
    print(json.dumps({"id": json.loads(line)["id"], "reward": None}), flush=True)
)"),
                                   options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  std::vector<std::future<Outcome>> futures;
  for (int i = 0; i < 8; ++i)
    futures.push_back((*grader)->Submit(MakeSample(std::to_string(i), "x")));
  int failed = 0;
  for (auto& future : futures) failed += Await(future).kind == OutcomeKind::kFailed;
  EXPECT_GE(failed, 1);
  EXPECT_FALSE((*grader)->status().ok());
  EXPECT_NE((*grader)->status().message().find("no reference for"), std::string::npos)
      << (*grader)->status().message();
  grader->reset();
  EXPECT_TRUE(testing::AllEnded(dir));
}

TEST(ProcessGraderTest, ACommandThatDoesNotStartIsRefusedNamingIt) {
  auto missing = StartProcessGrader("no-such-grader-binary --flag");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(
                "grader command 'no-such-grader-binary --flag' does not start"),
            std::string::npos)
      << missing.status().message();
  auto quoted = StartProcessGrader("python3 'grade.py");
  ASSERT_FALSE(quoted.ok());
  EXPECT_NE(quoted.status().message().find("unterminated quote"), std::string::npos);
  EXPECT_FALSE(StartProcessGrader("   ").ok());
}

TEST(ProcessGraderTest, QuotedArgumentsReachTheGrader) {
  TempDir dir;
  const std::string command = WriteGrader(dir, "args.py", R"(
for line in sys.stdin:
    print(json.dumps({"id": json.loads(line)["id"], "reward": len(sys.argv[1])}), flush=True)
)") + " 'two words'";
  auto grader = StartProcessGrader(command, Fast());
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  auto future = (*grader)->Submit(MakeSample("a", "x"));
  EXPECT_EQ(Await(future).reward, 9.0);
}

TEST(ProcessGraderTest, StoppingCompletesWhatIsOutstanding) {
  TempDir dir;
  auto grader = StartProcessGrader(WriteGrader(dir, "hang.py", kHanging), Fast());
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  auto hang = (*grader)->Submit(MakeSample("hang", "hang"));
  auto queued = (*grader)->Submit(MakeSample("queued", "fine"));
  std::this_thread::sleep_for(milliseconds(100));
  grader->reset();  // stdin closed, then SIGTERM after the grace
  EXPECT_EQ(Await(hang).reason, "grader stopped");
  EXPECT_EQ(Await(queued).kind, OutcomeKind::kUngraded);
  EXPECT_TRUE(testing::AllEnded(dir));
}

}  // namespace
}  // namespace flywheel::grading
