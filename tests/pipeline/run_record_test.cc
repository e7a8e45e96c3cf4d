// pipeline/run_record.h: metrics.csv rows and summary.json, both directions, and the
// errors a malformed record gives.
#include "pipeline/run_record.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Values that print exactly with 6 significant digits, so the CSV round trip is exact.
StepRow SampleRow(uint64_t step) {
  StepRow row;
  row.step = step;
  row.version = step + 1;
  row.wall_s = 12.5;
  row.mean_reward = 0.25;
  row.eval_accuracy = step % 2 ? 0.5 : -1;
  row.k3 = 0.00125;
  row.staleness_mean = 1.5;
  row.staleness_max = 2;
  row.delta_density = 0.03125;
  row.delta_bytes = 123456789;
  row.keyframe_bytes = step % 2 ? 0 : 987654;
  row.full_bytes = 4000000000ull;
  row.wan_bytes = 77;
  row.sync_ms = step > 1 ? 42.5 : -1;
  row.sync_version = step;
  row.samples = 64;
  row.samples_per_s = 3.75;
  row.dropped_stale = 3;
  row.loss = -0.5;
  row.grad_norm = 1.25;
  row.clip_fraction = 0.0625;
  return row;
}

TEST(StepRowTest, CsvRoundTrip) {
  for (uint64_t step : {1, 2, 3}) {
    const StepRow row = SampleRow(step);
    auto parsed = StepRow::FromCsv(row.Csv());
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(*parsed, row) << row.Csv();
  }
}

TEST(StepRowTest, CsvLeavesUnmeasuredColumnsEmpty) {
  StepRow row = SampleRow(2);  // not evaluated at this step
  row.sync_ms = -1;
  const std::string csv = row.Csv();
  // eval_accuracy (column 5) and sync_ms (column 13) print empty for "not measured".
  EXPECT_NE(csv.find("0.25,,0.00125"), std::string::npos) << csv;
  EXPECT_NE(csv.find("77,,2,"), std::string::npos) << csv;
}

TEST(StepRowTest, CsvHeaderMatchesColumnCount) {
  const std::string header = StepRow::CsvHeader();
  const std::string row = SampleRow(1).Csv();
  EXPECT_EQ(std::count(header.begin(), header.end(), ','), std::count(row.begin(), row.end(), ','));
  EXPECT_EQ(header.rfind("step,version,wall_s,mean_reward,eval_accuracy", 0), 0u);
  EXPECT_EQ(MetricsCsv({SampleRow(1), SampleRow(2)}),
            header + "\n" + SampleRow(1).Csv() + "\n" + SampleRow(2).Csv() + "\n");
}

TEST(StepRowTest, CsvWrongColumnCountIsRefused) {
  auto parsed = StepRow::FromCsv("1,2,3");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("columns"), std::string::npos);
}

TEST(StepRowTest, CsvFieldThatIsNotANumberNamesItsColumn) {
  std::string line = SampleRow(1).Csv();
  line.replace(line.find("12.5"), 4, "soon");
  auto parsed = StepRow::FromCsv(line);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("wall_s"), std::string::npos) << parsed.status().ToString();
}

TEST(StepRowTest, JsonRoundTrip) {
  const StepRow row = SampleRow(3);
  auto parsed = StepRow::FromJson(json::parse(row.ToJson().dump()));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, row);
}

TEST(StepRowTest, JsonMissingKeyKeepsDefault) {
  json value = SampleRow(3).ToJson();
  value.erase("keyframe_bytes");  // rows saved before the column existed
  value.erase("sync_ms");
  auto parsed = StepRow::FromJson(value);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->keyframe_bytes, 0u);
  EXPECT_EQ(parsed->sync_ms, -1);
}

TEST(StepRowTest, JsonWrongTypeNamesKey) {
  json value = SampleRow(3).ToJson();
  value["samples"] = "many";
  auto parsed = StepRow::FromJson(value);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption);
  EXPECT_NE(parsed.status().message().find("'samples'"), std::string::npos);
  EXPECT_FALSE(StepRow::FromJson(json::array()).ok());
}

TEST(RunSummaryTest, AddRowsAggregates) {
  std::vector<StepRow> rows = {SampleRow(1), SampleRow(2), SampleRow(3)};
  rows[1].sync_version = 7;
  rows[2].sync_version = 7;  // the same synced version repeated: counted once
  rows[2].sync_ms = 100;
  rows[2].staleness_max = 5;
  RunSummary summary;
  summary.AddRows(rows);
  EXPECT_EQ(summary.steps, 3u);
  EXPECT_EQ(summary.samples, 192u);
  EXPECT_EQ(summary.max_staleness_observed, 5u);
  EXPECT_DOUBLE_EQ(summary.mean_staleness, 1.5);
  EXPECT_DOUBLE_EQ(summary.mean_k3, 0.00125);
  EXPECT_DOUBLE_EQ(summary.delta_bytes_mean, 123456789);
  EXPECT_EQ(summary.full_bytes, 4000000000ull);
  EXPECT_EQ(summary.wan_bytes_total, 231u);
  EXPECT_DOUBLE_EQ(summary.sync_ms_mean, 42.5);  // version 7 first seen at 42.5 ms

  RunSummary empty;
  empty.AddRows({});
  EXPECT_EQ(empty.steps, 0u);
  EXPECT_EQ(empty.sync_ms_mean, -1);
  EXPECT_EQ(empty.full_bytes, 0u);
}

RunSummary SampleSummary() {
  RunSummary summary;
  summary.task = "sort-6";
  summary.algorithm = "grpo";
  summary.model = "tiny";
  summary.parameters = 123456;
  summary.initial_accuracy = 0.0;
  summary.warmup_accuracy = 0.25;
  summary.final_accuracy = 0.875;
  summary.target_accuracy = 0.8;
  summary.reached_target = true;
  summary.time_to_target_s = 61.5;
  summary.wall_seconds = 62;
  summary.versions = 4;
  summary.max_staleness_allowed = 2;
  summary.workers = 4;
  summary.regions = 2;
  summary.samples_dropped_stale = 9;
  summary.leases_expired = 1;
  summary.submissions_refused = 2;
  summary.resumed = true;
  summary.eval_score = 0.5;
  summary.grader = "python3 grade.py";
  summary.samples_graded = 90;
  summary.samples_ungraded = 6;
  summary.groups_zero_variance = 4;
  summary.groups_too_few_graded = 1;
  summary.grader_restarts = 2;
  summary.AddRows({SampleRow(1), SampleRow(2), SampleRow(3)});
  return summary;
}

TEST(RunSummaryTest, JsonRoundTripThroughAFile) {
  const fs::path dir = fs::temp_directory_path() / ("run_record_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const RunSummary summary = SampleSummary();
  std::ofstream(dir / "summary.json") << summary.ToJson().dump(2);
  auto read = ReadSummary(dir.string());
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, summary);
  // The keys other readers (scripts, the fleet test) look up by name.
  const json value = summary.ToJson();
  EXPECT_EQ(value["steps"], 3);
  EXPECT_EQ(value["versions"], 4);
  EXPECT_EQ(value["algorithm"], "grpo");
  fs::remove_all(dir);
}

TEST(RunSummaryTest, ASummaryWrittenBeforeGradingStillLoads) {
  json value = SampleSummary().ToJson();
  for (const char* key : {"eval_score", "grader", "samples_graded", "samples_ungraded",
                          "groups_zero_variance", "groups_too_few_graded", "grader_restarts"}) {
    value.erase(key);
  }
  auto read = RunSummary::FromJson(value, "old summary.json");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->eval_score, -1);
  EXPECT_EQ(read->samples_graded, 0u);
  value["samples_graded"] = "many";
  EXPECT_FALSE(RunSummary::FromJson(value, "bad").ok());  // present keys are still checked
}

TEST(RunSummaryTest, MissingFileIsNotFound) {
  auto read = ReadSummary((fs::temp_directory_path() / "no-such-run-record-dir").string());
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), StatusCode::kNotFound);
}

TEST(RunSummaryTest, TruncatedFileIsNotFound) {
  const fs::path dir = fs::temp_directory_path() / ("run_record_trunc_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string text = SampleSummary().ToJson().dump(2);
  std::ofstream(dir / "summary.json") << text.substr(0, text.size() / 2);
  auto read = ReadSummary(dir.string());
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), StatusCode::kNotFound);
  fs::remove_all(dir);
}

TEST(RunSummaryTest, MissingKeyIsCorruptionNamingIt) {
  json value = SampleSummary().ToJson();
  value.erase("wan_bytes_total");
  auto parsed = RunSummary::FromJson(value, "summary.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption);
  EXPECT_NE(parsed.status().message().find("summary.json: missing key 'wan_bytes_total'"),
            std::string::npos)
      << parsed.status().ToString();
}

TEST(RunSummaryTest, WrongTypeIsCorruptionNamingIt) {
  json value = SampleSummary().ToJson();
  value["reached_target"] = "yes";
  auto parsed = RunSummary::FromJson(value, "summary.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("'reached_target'"), std::string::npos);
  value = SampleSummary().ToJson();
  value["steps"] = -3;
  EXPECT_FALSE(RunSummary::FromJson(value, "summary.json").ok());
  EXPECT_FALSE(RunSummary::FromJson(json::array(), "summary.json").ok());
}

}  // namespace
}  // namespace flywheel::pipeline
