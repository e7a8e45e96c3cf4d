#include "pipeline/run_config.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <toml++/toml.h>
#include <variant>

namespace flywheel::pipeline {
namespace {

using FieldRef = std::variant<int64_t*, int*, double*, bool*, std::string*,
                              std::vector<std::string>*>;

// Every key of the file, in order: (section, key, the field it sets).
template <class Config, class F>
void ForEachField(Config& c, F&& f) {
  f("run", "seed", FieldRef(&c.run.seed));
  f("run", "max_steps", FieldRef(&c.run.max_steps));
  f("run", "time_limit_s", FieldRef(&c.run.time_limit_s));
  f("run", "target_accuracy", FieldRef(&c.run.target_accuracy));
  f("run", "eval_every", FieldRef(&c.run.eval_every));
  f("run", "eval_prompts", FieldRef(&c.run.eval_prompts));
  f("run", "threads", FieldRef(&c.run.threads));
  f("run", "state_every", FieldRef(&c.run.state_every));
  f("run", "check_memory", FieldRef(&c.run.check_memory));
  f("model", "preset", FieldRef(&c.model.preset));
  f("model", "config", FieldRef(&c.model.config));
  f("model", "dir", FieldRef(&c.model.dir));
  f("model", "routing_replay", FieldRef(&c.model.routing_replay));
  f("model", "serving", FieldRef(&c.model.serving));
  f("model", "fp8_qat", FieldRef(&c.model.fp8_qat));
  f("task", "name", FieldRef(&c.task.name));
  f("task", "digits", FieldRef(&c.task.digits));
  f("task", "dataset", FieldRef(&c.task.dataset));
  f("task", "eval_dataset", FieldRef(&c.task.eval_dataset));
  f("task", "eval_fraction", FieldRef(&c.task.eval_fraction));
  f("algorithm", "name", FieldRef(&c.algorithm.name));
  f("algorithm", "group_size", FieldRef(&c.algorithm.group_size));
  f("algorithm", "groups_per_step", FieldRef(&c.algorithm.groups_per_step));
  f("algorithm", "lr", FieldRef(&c.algorithm.lr));
  f("algorithm", "temperature", FieldRef(&c.algorithm.temperature));
  f("algorithm", "clip_low", FieldRef(&c.algorithm.clip_low));
  f("algorithm", "clip_high", FieldRef(&c.algorithm.clip_high));
  f("algorithm", "tis_cap", FieldRef(&c.algorithm.tis_cap));
  f("algorithm", "weight_decay", FieldRef(&c.algorithm.weight_decay));
  f("algorithm", "grad_clip", FieldRef(&c.algorithm.grad_clip));
  f("algorithm", "max_tokens", FieldRef(&c.algorithm.max_tokens));
  f("algorithm", "zero_variance_filter", FieldRef(&c.algorithm.zero_variance_filter));
  f("algorithm", "kl_coef", FieldRef(&c.algorithm.kl_coef));
  f("grading", "command", FieldRef(&c.grading.command));
  f("grading", "url", FieldRef(&c.grading.url));
  f("grading", "timeout_s", FieldRef(&c.grading.timeout_s));
  f("grading", "max_failures", FieldRef(&c.grading.max_failures));
  f("grading", "max_in_flight", FieldRef(&c.grading.max_in_flight));
  f("grading", "max_turns", FieldRef(&c.grading.max_turns));
  f("grading", "max_episode_tokens", FieldRef(&c.grading.max_episode_tokens));
  f("sft", "dataset", FieldRef(&c.sft.dataset));
  f("sft", "steps", FieldRef(&c.sft.steps));
  f("sft", "batch_size", FieldRef(&c.sft.batch_size));
  f("sft", "lr", FieldRef(&c.sft.lr));
  f("dpo", "dataset", FieldRef(&c.dpo.dataset));
  f("dpo", "steps", FieldRef(&c.dpo.steps));
  f("dpo", "batch_size", FieldRef(&c.dpo.batch_size));
  f("dpo", "lr", FieldRef(&c.dpo.lr));
  f("dpo", "beta", FieldRef(&c.dpo.beta));
  f("pipeline", "max_staleness", FieldRef(&c.pipeline.max_staleness));
  f("pipeline", "lease_s", FieldRef(&c.pipeline.lease_s));
  f("fleet", "regions", FieldRef(&c.fleet.regions));
  f("fleet", "workers_per_region", FieldRef(&c.fleet.workers_per_region));
  f("fleet", "wan_rate_mbit", FieldRef(&c.fleet.wan_rate_mbit));
  f("fleet", "wan_latency_ms", FieldRef(&c.fleet.wan_latency_ms));
  f("fleet", "keyframe_every", FieldRef(&c.fleet.keyframe_every));
  f("fleet", "worker_max_batch", FieldRef(&c.fleet.worker_max_batch));
  f("shape", "name", FieldRef(&c.shape.name));
  f("shape", "max_context", FieldRef(&c.shape.max_context));
  f("shape", "kv_cache_mib", FieldRef(&c.shape.kv_cache_mib));
}

// Sets `field` from `node`; the error names `key` and what it wanted.
Status Assign(const std::string& key, const toml::node& node, const FieldRef& field) {
  const auto wrong = [&](const char* wanted) {
    return Status::InvalidArgument(key + " must be " + wanted);
  };
  if (auto* p = std::get_if<int64_t*>(&field)) {
    if (!node.is_integer()) return wrong("an integer");
    **p = node.as_integer()->get();
  } else if (auto* p = std::get_if<int*>(&field)) {
    if (!node.is_integer()) return wrong("an integer");
    const int64_t value = node.as_integer()->get();
    if (value < INT32_MIN || value > INT32_MAX) return wrong("a 32-bit integer");
    **p = static_cast<int>(value);
  } else if (auto* p = std::get_if<double*>(&field)) {
    if (node.is_integer()) {
      **p = static_cast<double>(node.as_integer()->get());
    } else if (node.is_floating_point()) {
      **p = node.as_floating_point()->get();
    } else {
      return wrong("a number");
    }
  } else if (auto* p = std::get_if<bool*>(&field)) {
    if (!node.is_boolean()) return wrong("true or false");
    **p = node.as_boolean()->get();
  } else if (auto* p = std::get_if<std::string*>(&field)) {
    if (!node.is_string()) return wrong("a string");
    **p = node.as_string()->get();
  } else if (auto* p = std::get_if<std::vector<std::string>*>(&field)) {
    const toml::array* array = node.as_array();
    if (array == nullptr) return wrong("an array of strings");
    std::vector<std::string> values;
    for (const toml::node& element : *array) {
      if (!element.is_string()) return wrong("an array of strings");
      values.push_back(element.as_string()->get());
    }
    **p = std::move(values);
  }
  return Status::Ok();
}

// A TOML value as JSON (scalars, arrays and tables; dates are refused).
Result<nlohmann::json> ToJson(const toml::node& node, const std::string& key) {
  if (node.is_string()) return nlohmann::json(node.as_string()->get());
  if (node.is_integer()) return nlohmann::json(node.as_integer()->get());
  if (node.is_floating_point()) return nlohmann::json(node.as_floating_point()->get());
  if (node.is_boolean()) return nlohmann::json(node.as_boolean()->get());
  if (const toml::array* array = node.as_array()) {
    nlohmann::json out = nlohmann::json::array();
    for (const toml::node& element : *array) {
      FW_ASSIGN_OR_RETURN(nlohmann::json value, ToJson(element, key));
      out.push_back(std::move(value));
    }
    return out;
  }
  if (const toml::table* table = node.as_table()) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [name, value] : *table) {
      FW_ASSIGN_OR_RETURN(out[std::string(name.str())], ToJson(value, key + "." + std::string(name.str())));
    }
    return out;
  }
  return Status::InvalidArgument(key + ": dates and times are not grader parameters");
}

// [[grader]] tables: checked now (LoadBuiltinGraders), so a bad one stops before anything runs.
Status ApplyGraders(const toml::node& node, RunConfig& config, const std::string& source) {
  const toml::array* array = node.as_array();
  if (array == nullptr || !array->is_array_of_tables()) {
    return Status::InvalidArgument(source + ": grader must be a list of tables ([[grader]])");
  }
  FW_ASSIGN_OR_RETURN(nlohmann::json list, ToJson(node, "grader"));
  Result<std::vector<grading::GraderSpec>> specs = grading::GraderSpecsFromJson(list);
  if (!specs.ok()) return Status::InvalidArgument(source + ": [[grader]]: " + specs.status().message());
  config.graders = std::move(*specs);
  return Status::Ok();
}

// Applies every key of `root` onto `config`; unknown sections and keys are errors.
Status Apply(const toml::table& root, RunConfig& config, const std::string& source) {
  std::set<std::string> sections;
  ForEachField(config, [&](const char* section, const char*, const FieldRef&) {
    sections.insert(section);
  });
  for (const auto& [name, node] : root) {
    const std::string section(name.str());
    if (section == "grader") {
      FW_RETURN_IF_ERROR(ApplyGraders(node, config, source));
      continue;
    }
    if (!sections.count(section)) {
      return Status::InvalidArgument(source + ": unknown section [" + section + "]");
    }
    const toml::table* table = node.as_table();
    if (table == nullptr) {
      return Status::InvalidArgument(source + ": " + section + " must be a table ([" + section +
                                     "])");
    }
    for (const auto& [key_name, value] : *table) {
      const std::string key(key_name.str());
      Status status = Status::InvalidArgument(source + ": unknown key " + section + "." + key);
      ForEachField(config, [&](const char* s, const char* k, const FieldRef& field) {
        if (section == s && key == k) {
          Status assigned = Assign(section + "." + key, value, field);
          status = assigned.ok() ? assigned : Status::InvalidArgument(source + ": " + assigned.message());
        }
      });
      if (!status.ok()) return status;
    }
  }
  return Status::Ok();
}

Result<toml::table> Parse(const std::string& text, const std::string& source) {
  try {
    return toml::parse(text, std::string_view(source));
  } catch (const toml::parse_error& error) {
    std::ostringstream message;
    message << source << ":" << error.source().begin.line << ":" << error.source().begin.column
            << ": " << error.description();
    return Status::InvalidArgument(message.str());
  }
}

// One "key = value: why" error.
template <class T>
Status BadKey(const std::string& key, const T& value, const std::string& why) {
  std::ostringstream message;
  message << key << " = " << value << ": " << why;
  return Status::InvalidArgument(message.str());
}

// The managed-RL keys: [algorithm] kl_coef and max_tokens, [grading], [[grader]].
Status ValidateGrading(const RunConfig& config) {
  const auto& algorithm = config.algorithm;
  const auto& grading = config.grading;
  const auto& graders = config.graders;
  const auto bad = [](const std::string& key, const auto& value, const std::string& why) {
    return BadKey(key, value, why);
  };
  if (!(algorithm.kl_coef >= 0 && algorithm.kl_coef <= 100))
    return bad("algorithm.kl_coef", algorithm.kl_coef, "must be in [0, 100]");
  if (algorithm.max_tokens < 0 || algorithm.max_tokens > 65536)
    return bad("algorithm.max_tokens", algorithm.max_tokens, "must be in 0..65536 (0: the longest answer + 1)");
  if (!grading.command.empty() && !grading.url.empty())
    return bad("grading.url", grading.url, "and grading.command are exclusive");
  if ((!grading.command.empty() || !grading.url.empty()) && !graders.empty())
    return bad("grading", grading.command.empty() ? grading.url : grading.command,
               "an external grader and [[grader]] tables are exclusive");
  if (!(grading.timeout_s > 0 && grading.timeout_s <= 3600))
    return bad("grading.timeout_s", grading.timeout_s, "must be in (0, 3600]");
  if (grading.max_failures < 1) return bad("grading.max_failures", grading.max_failures, "must be at least 1");
  if (grading.max_in_flight < 1 || grading.max_in_flight > 65536)
    return bad("grading.max_in_flight", grading.max_in_flight, "must be in 1..65536");
  if (grading.max_turns < 1 || grading.max_turns > 64)
    return bad("grading.max_turns", grading.max_turns, "must be in 1..64");
  if (grading.max_turns > 1 && grading.command.empty() && grading.url.empty())
    return bad("grading.max_turns", grading.max_turns, "needs an external environment (grading.command or url)");
  if (grading.max_episode_tokens < 2 || grading.max_episode_tokens > 1 << 20)
    return bad("grading.max_episode_tokens", grading.max_episode_tokens, "must be in 2..1048576");
  if (!graders.empty()) {
    Result<std::shared_ptr<const grading::Grader>> loaded = grading::LoadBuiltinGraders(graders);
    if (!loaded.ok()) return Status::InvalidArgument("[[grader]]: " + loaded.status().message());
  }
  return Status::Ok();
}

}  // namespace

Status RunConfig::Validate() const {
  const auto bad = [](const std::string& key, const auto& value, const std::string& why) {
    std::ostringstream message;
    message << key << " = " << value << ": " << why;
    return Status::InvalidArgument(message.str());
  };
  if (run.max_steps < 1) return bad("run.max_steps", run.max_steps, "must be at least 1");
  if (!(run.time_limit_s > 0)) return bad("run.time_limit_s", run.time_limit_s, "must be > 0");
  if (!(run.target_accuracy >= 0 && run.target_accuracy <= 1))
    return bad("run.target_accuracy", run.target_accuracy, "must be in [0, 1]");
  if (run.eval_every < 1) return bad("run.eval_every", run.eval_every, "must be at least 1");
  if (run.eval_prompts < 1 || run.eval_prompts > 100000)
    return bad("run.eval_prompts", run.eval_prompts, "must be in 1..100000");
  if (run.threads < 1 || run.threads > 256) return bad("run.threads", run.threads, "must be in 1..256");
  if (run.state_every < 1) return bad("run.state_every", run.state_every, "must be at least 1");
  if (model.config.empty() && model.preset != "tiny" && model.preset != "tiny-moe")
    return bad("model.preset", model.preset, "unknown (tiny, tiny-moe; or set model.config)");
  if (!model.dir.empty() && !model.config.empty())
    return bad("model.dir", model.dir, "and model.config are exclusive (the directory holds config.json)");
  if (!(task.eval_fraction > 0 && task.eval_fraction < 1))
    return bad("task.eval_fraction", task.eval_fraction, "must be in (0, 1)");
  if (!task.eval_dataset.empty() && task.dataset.empty())
    return bad("task.eval_dataset", task.eval_dataset, "needs task.dataset");
  if (model.serving != "bf16" && model.serving != "fp8")
    return bad("model.serving", model.serving, "unknown (bf16, fp8)");
  if (model.fp8_qat && model.serving != "fp8")
    return bad("model.fp8_qat", "true", "needs model.serving = \"fp8\"");
  FW_RETURN_IF_ERROR(Task::Create(task).status());
  const std::set<std::string> algorithms = {"grpo", "dapo", "gspo", "cispo"};
  if (!algorithms.count(algorithm.name))
    return bad("algorithm.name", algorithm.name, "unknown (grpo, dapo, gspo, cispo)");
  if (algorithm.group_size < 2 || algorithm.group_size > 256)
    return bad("algorithm.group_size", algorithm.group_size, "must be in 2..256");
  if (algorithm.groups_per_step < 1 || algorithm.groups_per_step > 4096)
    return bad("algorithm.groups_per_step", algorithm.groups_per_step, "must be in 1..4096");
  if (!(algorithm.lr > 0 && algorithm.lr < 1)) return bad("algorithm.lr", algorithm.lr, "must be in (0, 1)");
  if (!(algorithm.temperature > 0 && algorithm.temperature <= 10))
    return bad("algorithm.temperature", algorithm.temperature, "must be in (0, 10]");
  if (!(algorithm.clip_low >= 0 && algorithm.clip_low < 1))
    return bad("algorithm.clip_low", algorithm.clip_low, "must be in [0, 1)");
  if (!(algorithm.clip_high >= 0)) return bad("algorithm.clip_high", algorithm.clip_high, "must be >= 0");
  if (!(algorithm.tis_cap == 0 || algorithm.tis_cap >= 1))
    return bad("algorithm.tis_cap", algorithm.tis_cap, "must be 0 (off) or >= 1");
  if (!(algorithm.weight_decay >= 0)) return bad("algorithm.weight_decay", algorithm.weight_decay, "must be >= 0");
  if (!(algorithm.grad_clip >= 0)) return bad("algorithm.grad_clip", algorithm.grad_clip, "must be >= 0");
  FW_RETURN_IF_ERROR(ValidateGrading(*this));
  if (sft.steps < 0) return bad("sft.steps", sft.steps, "must be >= 0");
  if (sft.batch_size < 1) return bad("sft.batch_size", sft.batch_size, "must be at least 1");
  if (!(sft.lr > 0 && sft.lr < 1)) return bad("sft.lr", sft.lr, "must be in (0, 1)");
  if (dpo.steps < 0) return bad("dpo.steps", dpo.steps, "must be >= 0");
  if (dpo.batch_size < 1) return bad("dpo.batch_size", dpo.batch_size, "must be at least 1");
  if (!(dpo.lr > 0 && dpo.lr < 1)) return bad("dpo.lr", dpo.lr, "must be in (0, 1)");
  if (!(dpo.beta > 0)) return bad("dpo.beta", dpo.beta, "must be > 0");
  if (pipeline.max_staleness < 0 || pipeline.max_staleness > 1000)
    return bad("pipeline.max_staleness", pipeline.max_staleness, "must be in 0..1000 (0: synchronous)");
  if (!(pipeline.lease_s >= 1)) return bad("pipeline.lease_s", pipeline.lease_s, "must be >= 1");
  if (fleet.regions.empty() || fleet.regions.size() > 16)
    return bad("fleet.regions", fleet.regions.size(), "must list 1..16 region names");
  std::set<std::string> regions;
  for (const std::string& region : fleet.regions) {
    if (region.empty() || region == "home" || !regions.insert(region).second)
      return bad("fleet.regions", "'" + region + "'", "names must be distinct, non-empty and not 'home'");
  }
  if (fleet.workers_per_region < 1 || fleet.workers_per_region > 64)
    return bad("fleet.workers_per_region", fleet.workers_per_region, "must be in 1..64");
  if (!(fleet.wan_rate_mbit >= 0)) return bad("fleet.wan_rate_mbit", fleet.wan_rate_mbit, "must be >= 0 (0: unshaped)");
  if (!(fleet.wan_latency_ms >= 0 && fleet.wan_latency_ms <= 10000))
    return bad("fleet.wan_latency_ms", fleet.wan_latency_ms, "must be in 0..10000");
  if (fleet.keyframe_every < 1) return bad("fleet.keyframe_every", fleet.keyframe_every, "must be at least 1");
  if (fleet.worker_max_batch < 1 || fleet.worker_max_batch > 4096)
    return bad("fleet.worker_max_batch", fleet.worker_max_batch, "must be in 1..4096");
  if (shape.max_context < 0) return bad("shape.max_context", shape.max_context, "must be >= 0");
  if (shape.kv_cache_mib < 0) return bad("shape.kv_cache_mib", shape.kv_cache_mib, "must be >= 0");
  return Status::Ok();
}

Result<RunConfig> RunConfig::FromToml(const std::string& text, const std::string& source) {
  FW_ASSIGN_OR_RETURN(toml::table root, Parse(text, source));
  RunConfig config;
  // DAPO's clip-higher is its default unless the file sets clip_high.
  const toml::node* name = root.at_path("algorithm.name").node();
  if (name != nullptr && name->is_string() && name->as_string()->get() == "dapo") {
    config.algorithm.clip_high = 0.28;
  }
  FW_RETURN_IF_ERROR(Apply(root, config, source));
  Status valid = config.Validate();
  if (!valid.ok()) return Status::InvalidArgument(source + ": " + valid.message());
  return config;
}

Result<RunConfig> RunConfig::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read run config " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return FromToml(text.str(), path);
}

Status RunConfig::Set(const std::string& assignment) {
  const size_t eq = assignment.find('=');
  const size_t dot = assignment.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) {
    return Status::InvalidArgument("--set '" + assignment + "' is not section.key=value");
  }
  const std::string key = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  Result<toml::table> parsed = Parse(key + " = " + value, "--set " + key);
  if (!parsed.ok()) {  // a bare word: take it as a string
    std::ostringstream quoted;
    quoted << toml::value<std::string>(value);
    parsed = Parse(key + " = " + quoted.str(), "--set " + key);
    if (!parsed.ok()) return parsed.status();
  }
  RunConfig copy = *this;
  FW_RETURN_IF_ERROR(Apply(*parsed, copy, "--set"));
  FW_RETURN_IF_ERROR(copy.Validate());
  *this = std::move(copy);
  return Status::Ok();
}

std::string RunConfig::ToToml() const {
  std::ostringstream out;
  std::string current;
  RunConfig copy = *this;
  ForEachField(copy, [&](const char* section, const char* key, const FieldRef& field) {
    if (current != section) {
      out << (current.empty() ? "" : "\n") << "[" << section << "]\n";
      current = section;
    }
    out << key << " = ";
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            toml::array array;
            for (const std::string& s : *p) array.push_back(s);
            out << array;
          } else if constexpr (std::is_same_v<T, std::string>) {
            out << toml::value<std::string>(*p);
          } else if constexpr (std::is_same_v<T, bool>) {
            out << (*p ? "true" : "false");
          } else if constexpr (std::is_same_v<T, double>) {
            std::ostringstream number;
            number.precision(17);
            number << *p;
            std::string text = number.str();
            if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
            out << text;
          } else {
            out << *p;
          }
        },
        field);
    out << "\n";
  });
  for (const grading::GraderSpec& spec : graders) {
    out << "\n[[grader]]\n";
    out << "type = " << toml::value<std::string>(spec.type) << "\n";
    if (!spec.name.empty()) out << "name = " << toml::value<std::string>(spec.name) << "\n";
    std::ostringstream weight;
    weight.precision(17);
    weight << spec.weight;
    out << "weight = " << weight.str() << (weight.str().find_first_of(".eEn") == std::string::npos ? ".0" : "")
        << "\n";
    // JSON scalars and arrays of them are TOML values as written, but for strings' escapes.
    for (const auto& [key, value] : spec.params.items()) {
      out << key << " = ";
      if (value.is_string()) {
        out << toml::value<std::string>(value.get<std::string>());
      } else {
        out << value.dump();
      }
      out << "\n";
    }
  }
  return out.str();
}

}  // namespace flywheel::pipeline
