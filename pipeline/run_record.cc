#include "pipeline/run_record.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace flywheel::pipeline {
namespace {

using nlohmann::json;

// Reads `key` into `out` when present; a present key of the wrong JSON type fails.
// `required` makes a missing key fail too.
template <typename T>
Status ReadKey(const json& object, const char* key, T* out, bool required, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end()) {
    if (!required) return Status::Ok();
    return Status::Corruption(where + ": missing key '" + key + "'");
  }
  bool fits = false;
  if constexpr (std::is_same_v<T, bool>) {
    fits = it->is_boolean();
  } else if constexpr (std::is_same_v<T, std::string>) {
    fits = it->is_string();
  } else if constexpr (std::is_floating_point_v<T>) {
    fits = it->is_number();
  } else if constexpr (std::is_unsigned_v<T>) {
    fits = it->is_number_unsigned() || (it->is_number_integer() && it->template get<int64_t>() >= 0);
  } else {
    fits = it->is_number_integer();
  }
  if (!fits) {
    return Status::Corruption(where + ": key '" + key + "' has the wrong type (" +
                              std::string(it->type_name()) + ")");
  }
  *out = it->template get<T>();
  return Status::Ok();
}

// The CSV columns in header order: the one list both Csv() and FromCsv() follow.
// Optional columns print empty for a negative value and read back as -1.
struct Column {
  const char* name;
  double StepRow::*real = nullptr;
  uint64_t StepRow::*count = nullptr;
  bool optional = false;
};
constexpr Column kColumns[] = {
    {"step", nullptr, &StepRow::step},
    {"version", nullptr, &StepRow::version},
    {"wall_s", &StepRow::wall_s},
    {"mean_reward", &StepRow::mean_reward},
    {"eval_accuracy", &StepRow::eval_accuracy, nullptr, true},
    {"k3", &StepRow::k3},
    {"staleness_mean", &StepRow::staleness_mean},
    {"staleness_max", nullptr, &StepRow::staleness_max},
    {"delta_density", &StepRow::delta_density},
    {"delta_bytes", nullptr, &StepRow::delta_bytes},
    {"full_bytes", nullptr, &StepRow::full_bytes},
    {"wan_bytes", nullptr, &StepRow::wan_bytes},
    {"sync_ms", &StepRow::sync_ms, nullptr, true},
    {"sync_version", nullptr, &StepRow::sync_version},
    {"samples", nullptr, &StepRow::samples},
    {"samples_per_s", &StepRow::samples_per_s},
    {"dropped_stale", nullptr, &StepRow::dropped_stale},
    {"loss", &StepRow::loss},
    {"grad_norm", &StepRow::grad_norm},
    {"clip_fraction", &StepRow::clip_fraction},
    {"keyframe_bytes", nullptr, &StepRow::keyframe_bytes},
};

Status ParseColumn(const Column& column, std::string_view text, StepRow* row) {
  const std::string where = std::string("metrics.csv column '") + column.name + "'";
  if (column.optional && text.empty()) {
    row->*column.real = -1;
    return Status::Ok();
  }
  if (column.count) {
    uint64_t value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size()) {
      return Status::InvalidArgument(where + ": '" + std::string(text) + "' is not a count");
    }
    row->*column.count = value;
    return Status::Ok();
  }
  // strtod (not from_chars) for "inf"/"nan" and exponent forms as ostream prints them.
  const std::string copy(text);
  char* end = nullptr;
  const double value = std::strtod(copy.c_str(), &end);
  if (copy.empty() || end != copy.c_str() + copy.size()) {
    return Status::InvalidArgument(where + ": '" + copy + "' is not a number");
  }
  row->*column.real = value;
  return Status::Ok();
}

}  // namespace

const char* StepRow::CsvHeader() {
  return "step,version,wall_s,mean_reward,eval_accuracy,k3,staleness_mean,staleness_max,"
         "delta_density,delta_bytes,full_bytes,wan_bytes,sync_ms,sync_version,samples,"
         "samples_per_s,dropped_stale,loss,grad_norm,clip_fraction,keyframe_bytes";
}

std::string StepRow::Csv() const {
  std::ostringstream out;
  out.precision(6);
  bool first = true;
  for (const Column& column : kColumns) {
    if (!first) out << ',';
    first = false;
    if (column.count) {
      out << this->*column.count;
    } else if (!column.optional || this->*column.real >= 0) {
      out << this->*column.real;
    }
  }
  return out.str();
}

Result<StepRow> StepRow::FromCsv(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  StepRow row;
  size_t index = 0;
  size_t begin = 0;
  for (;;) {
    const size_t comma = line.find(',', begin);
    const std::string_view field =
        line.substr(begin, comma == std::string_view::npos ? std::string_view::npos : comma - begin);
    if (index >= std::size(kColumns)) break;
    FW_RETURN_IF_ERROR(ParseColumn(kColumns[index], field, &row));
    ++index;
    if (comma == std::string_view::npos) break;
    begin = comma + 1;
  }
  const size_t fields = static_cast<size_t>(std::count(line.begin(), line.end(), ',')) + 1;
  if (fields != std::size(kColumns)) {
    return Status::InvalidArgument("metrics.csv row has " + std::to_string(fields) +
                                   " columns, expected " + std::to_string(std::size(kColumns)));
  }
  return row;
}

json StepRow::ToJson() const {
  json out = json::object();
  for (const Column& column : kColumns) {
    if (column.count) {
      out[column.name] = this->*column.count;
    } else {
      out[column.name] = this->*column.real;
    }
  }
  return out;
}

Result<StepRow> StepRow::FromJson(const json& value) {
  if (!value.is_object()) return Status::Corruption("step row: not a JSON object");
  StepRow row;
  for (const Column& column : kColumns) {
    const std::string where = "step row";
    if (column.count) {
      FW_RETURN_IF_ERROR(ReadKey(value, column.name, &(row.*column.count), false, where));
    } else {
      FW_RETURN_IF_ERROR(ReadKey(value, column.name, &(row.*column.real), false, where));
    }
  }
  return row;
}

void RunSummary::AddRows(const std::vector<StepRow>& rows) {
  double k3_sum = 0, delta_sum = 0, sync_sum = 0, stale_sum = 0;
  uint64_t syncs = 0;
  std::set<uint64_t> sync_versions;
  samples = 0;
  wan_bytes_total = 0;
  max_staleness_observed = 0;
  for (const StepRow& row : rows) {
    k3_sum += row.k3;
    delta_sum += static_cast<double>(row.delta_bytes);
    stale_sum += row.staleness_mean;
    max_staleness_observed = std::max(max_staleness_observed, row.staleness_max);
    wan_bytes_total += row.wan_bytes;
    samples += row.samples;
    // Every step repeats the newest synced version until a newer one syncs: count each once.
    if (row.sync_ms >= 0 && sync_versions.insert(row.sync_version).second) {
      sync_sum += row.sync_ms;
      ++syncs;
    }
  }
  const double n = std::max<double>(1, static_cast<double>(rows.size()));
  steps = rows.size();
  mean_staleness = stale_sum / n;
  mean_k3 = k3_sum / n;
  delta_bytes_mean = delta_sum / n;
  full_bytes = rows.empty() ? 0 : rows.back().full_bytes;
  sync_ms_mean = syncs ? sync_sum / static_cast<double>(syncs) : -1.0;
}

// The summary's keys, spelled once for both directions.
#define FW_SUMMARY_FIELDS(X)                                                                  \
  X(task) X(algorithm) X(model) X(parameters) X(initial_accuracy) X(warmup_accuracy)          \
  X(final_accuracy) X(target_accuracy) X(reached_target) X(time_to_target_s) X(wall_seconds)  \
  X(steps) X(versions) X(samples) X(max_staleness_allowed) X(max_staleness_observed)          \
  X(mean_staleness) X(mean_k3) X(delta_bytes_mean) X(full_bytes) X(wan_bytes_total) X(workers) \
  X(regions) X(sync_ms_mean) X(samples_dropped_stale) X(leases_expired) X(submissions_refused) \
  X(resumed)
#define FW_SUMMARY_OPTIONAL_FIELDS(X)                                                   \
  X(eval_score) X(grader) X(samples_graded) X(samples_ungraded) X(groups_zero_variance) \
  X(groups_too_few_graded) X(grader_restarts) X(episodes) X(episode_turns) X(episode_env_tokens)

json RunSummary::ToJson() const {
  json out = json::object();
#define FW_WRITE_FIELD(name) out[#name] = name;
  FW_SUMMARY_FIELDS(FW_WRITE_FIELD)
  FW_SUMMARY_OPTIONAL_FIELDS(FW_WRITE_FIELD)
#undef FW_WRITE_FIELD
  return out;
}

Result<RunSummary> RunSummary::FromJson(const json& value, const std::string& where) {
  if (!value.is_object()) return Status::Corruption(where + ": not a JSON object");
  RunSummary summary;
#define FW_READ_FIELD(name) FW_RETURN_IF_ERROR(ReadKey(value, #name, &summary.name, true, where));
  FW_SUMMARY_FIELDS(FW_READ_FIELD)
#undef FW_READ_FIELD
#define FW_READ_OPTIONAL(name) FW_RETURN_IF_ERROR(ReadKey(value, #name, &summary.name, false, where));
  FW_SUMMARY_OPTIONAL_FIELDS(FW_READ_OPTIONAL)
#undef FW_READ_OPTIONAL
  return summary;
}

#undef FW_SUMMARY_FIELDS
#undef FW_SUMMARY_OPTIONAL_FIELDS

Result<RunSummary> ReadSummary(const std::string& report_dir) {
  const std::string path = (std::filesystem::path(report_dir) / "summary.json").string();
  std::ifstream in(path);
  if (!in) return Status::NotFound("no summary.json in " + report_dir);
  const json value = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return Status::NotFound("no readable summary.json in " + report_dir);
  return RunSummary::FromJson(value, path);
}

std::string MetricsCsv(const std::vector<StepRow>& rows) {
  std::string text = std::string(StepRow::CsvHeader()) + "\n";
  for (const StepRow& row : rows) text += row.Csv() + "\n";
  return text;
}

}  // namespace flywheel::pipeline
