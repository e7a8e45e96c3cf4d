#include "pipeline/shapes.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <toml++/toml.h>

#include "ops/process.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;

// Reads `table[key]` as T into `out` (absent: left as is unless `required`).
template <class T>
Status Read(const toml::table& table, const std::string& section, const std::string& key, bool required,
            const std::string& source, T& out) {
  const toml::node* node = table.get(key);
  const std::string where = source + ":" + (section.empty() ? key : section + "." + key);
  if (node == nullptr) {
    return required ? Status::InvalidArgument(where + " is missing") : Status::Ok();
  }
  std::optional<T> value = node->value<T>();
  if (!value) return Status::InvalidArgument(where + " has the wrong type");
  out = *value;
  return Status::Ok();
}

const toml::table* Section(const toml::table& root, const std::string& name) {
  const toml::node* node = root.get(name);
  return node ? node->as_table() : nullptr;
}

Status CheckKeys(const toml::table& table, const std::string& section, const std::set<std::string>& known,
                 const std::string& source) {
  for (const auto& [key, value] : table) {
    const std::string name(key.str());
    if (known.count(name) == 0) {
      return Status::InvalidArgument(source + ":" + (section.empty() ? name : section + "." + name) +
                                     " is not a shape key");
    }
  }
  return Status::Ok();
}

Status ReadSections(const toml::table& root, const std::string& source, Shape& s) {
  static const std::map<std::string, std::set<std::string>> kKeys = {
      {"model", {"max_context", "mode", "lora_rank"}},
      {"trainer", {"threads", "data_parallel_ranks"}},
      {"workers", {"max_batch", "kv_cache_mib"}},
      {"serving", {"dtype"}}};
  for (const auto& [section, keys] : kKeys) {
    const toml::table* table = Section(root, section);
    if (table == nullptr) {
      if (section == "model") return Status::InvalidArgument(source + ":model.max_context is missing");
      continue;
    }
    FW_RETURN_IF_ERROR(CheckKeys(*table, section, keys, source));
  }
  const toml::table& model = *Section(root, "model");
  FW_RETURN_IF_ERROR(Read(model, "model", "max_context", true, source, s.max_context));
  FW_RETURN_IF_ERROR(Read(model, "model", "mode", false, source, s.mode));
  if (const toml::array* ranks = model.get_as<toml::array>("lora_rank")) {
    if (ranks->size() != 2 || !ranks->get(0)->value<int64_t>() || !ranks->get(1)->value<int64_t>()) {
      return Status::InvalidArgument(source + ":model.lora_rank must be [min, max]");
    }
    s.lora_rank_min = *ranks->get(0)->value<int64_t>();
    s.lora_rank_max = *ranks->get(1)->value<int64_t>();
  }
  if (const toml::table* t = Section(root, "trainer")) {
    FW_RETURN_IF_ERROR(Read(*t, "trainer", "threads", false, source, s.trainer_threads));
    FW_RETURN_IF_ERROR(Read(*t, "trainer", "data_parallel_ranks", false, source, s.data_parallel_ranks));
  }
  if (const toml::table* t = Section(root, "workers")) {
    FW_RETURN_IF_ERROR(Read(*t, "workers", "max_batch", false, source, s.worker_max_batch));
    FW_RETURN_IF_ERROR(Read(*t, "workers", "kv_cache_mib", false, source, s.kv_cache_mib));
  }
  if (const toml::table* t = Section(root, "serving")) {
    FW_RETURN_IF_ERROR(Read(*t, "serving", "dtype", false, source, s.serving));
  }
  return Status::Ok();
}

Status Validate(const Shape& s, const std::string& source) {
  auto bad = [&](const std::string& key, const std::string& why) {
    return Status::InvalidArgument(source + ":" + key + " " + why);
  };
  if (s.name.empty()) return bad("name", "must not be empty");
  if (s.max_context < 1) return bad("model.max_context", "must be at least 1");
  if (s.mode != "full" && s.mode != "lora") return bad("model.mode", "must be \"full\" or \"lora\"");
  if (s.mode == "lora" && (s.lora_rank_min < 1 || s.lora_rank_max < s.lora_rank_min)) {
    return bad("model.lora_rank", "must be [min, max] with 1 <= min <= max for a LoRA shape");
  }
  if (s.trainer_threads < 1 || s.trainer_threads > 1024) return bad("trainer.threads", "must be in 1..1024");
  if (s.data_parallel_ranks < 1) return bad("trainer.data_parallel_ranks", "must be at least 1");
  if (s.worker_max_batch < 1 || s.worker_max_batch > 4096) return bad("workers.max_batch", "must be in 1..4096");
  if (s.kv_cache_mib < 0) return bad("workers.kv_cache_mib", "must be >= 0");
  if (s.serving != "bf16" && s.serving != "fp8") return bad("serving.dtype", "must be \"bf16\" or \"fp8\"");
  return Status::Ok();
}

std::string Names(const std::vector<Shape>& shapes) {
  std::string out;
  for (const Shape& s : shapes) out += (out.empty() ? "" : ", ") + s.name;
  return out;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> Shape::Owned() const {
  return {{"run.threads", std::to_string(trainer_threads)},
          {"fleet.worker_max_batch", std::to_string(worker_max_batch)},
          {"model.serving", serving},
          {"shape.name", name},
          {"shape.max_context", std::to_string(max_context)},
          {"shape.kv_cache_mib", std::to_string(kv_cache_mib)}};
}

Result<Shape> Shape::FromToml(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    return Status::InvalidArgument(source + ":" + std::to_string(e.source().begin.line) + ": " +
                                   std::string(e.description()));
  }
  FW_RETURN_IF_ERROR(CheckKeys(root, "", {"name", "description", "model", "trainer", "workers", "serving"}, source));
  Shape shape;
  shape.source = source;
  FW_RETURN_IF_ERROR(Read(root, "", "name", true, source, shape.name));
  FW_RETURN_IF_ERROR(Read(root, "", "description", false, source, shape.description));
  FW_RETURN_IF_ERROR(ReadSections(root, source, shape));
  FW_RETURN_IF_ERROR(Validate(shape, source));
  return shape;
}

Result<std::vector<Shape>> LoadShapes(const std::string& user_dir) {
  std::vector<Shape> shapes;
  for (const auto& [file, text] : ShippedShapeFiles()) {
    FW_ASSIGN_OR_RETURN(Shape shape, Shape::FromToml(text, "shapes/" + file));
    shape.source = "shipped";
    shapes.push_back(std::move(shape));
  }
  if (user_dir.empty()) return shapes;
  if (!fs::is_directory(user_dir)) return Status::NotFound("--shapes-dir " + user_dir + " is not a directory");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(user_dir)) {
    if (entry.path().extension() == ".toml") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  for (const fs::path& file : files) {
    FW_ASSIGN_OR_RETURN(std::string text, ops::ReadWholeFile(file.string()));
    FW_ASSIGN_OR_RETURN(Shape shape, Shape::FromToml(text, file.string()));
    auto same = std::find_if(shapes.begin(), shapes.end(), [&](const Shape& s) { return s.name == shape.name; });
    if (same != shapes.end() && same->source != "shipped") {
      return Status::InvalidArgument("shape '" + shape.name + "' is defined twice: " + same->source + " and " +
                                     file.string());
    }
    if (same != shapes.end()) {
      *same = std::move(shape);
    } else {
      shapes.push_back(std::move(shape));
    }
  }
  return shapes;
}

Result<Shape> FindShape(const std::string& name, const std::string& user_dir) {
  FW_ASSIGN_OR_RETURN(std::vector<Shape> shapes, LoadShapes(user_dir));
  for (const Shape& shape : shapes) {
    if (shape.name == name) return shape;
  }
  return Status::NotFound("no shape '" + name + "' (shapes: " + Names(shapes) + "; see `flywheel shapes`)");
}

Status ApplyShape(const Shape& shape, const std::vector<std::string>& user_keys, const std::string& command,
                  RunConfig& config) {
  if (shape.mode == "lora") {
    return Status::InvalidArgument("shape '" + shape.name + "' trains LoRA adapters (rank " +
                                   std::to_string(shape.lora_rank_min) + ".." + std::to_string(shape.lora_rank_max) +
                                   "); flywheel " + command + " trains full weights: choose a full shape");
  }
  if (shape.data_parallel_ranks != 1) {
    return Status::InvalidArgument("shape '" + shape.name + "' has " + std::to_string(shape.data_parallel_ranks) +
                                   " data-parallel trainer ranks; flywheel " + command +
                                   " runs one: choose a shape with data_parallel_ranks = 1");
  }
  for (const auto& [key, value] : shape.Owned()) {
    if (std::find(user_keys.begin(), user_keys.end(), key) != user_keys.end()) {
      return Status::InvalidArgument(key + " is set by shape '" + shape.name + "' (" + key + " = " + value +
                                     "): drop the override, or choose another shape (`flywheel shapes`)");
    }
    FW_RETURN_IF_ERROR(config.Set(key + "=" + value));
  }
  return config.Validate();
}

Result<std::vector<std::string>> RunTomlKeys(const std::string& path) {
  FW_ASSIGN_OR_RETURN(std::string text, ops::ReadWholeFile(path));
  toml::table root;
  try {
    root = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    return Status::InvalidArgument(path + ": " + std::string(e.description()));
  }
  std::vector<std::string> keys;
  for (const auto& [section, node] : root) {
    const toml::table* table = node.as_table();
    if (table == nullptr) continue;
    for (const auto& [key, value] : *table) keys.push_back(std::string(section.str()) + "." + std::string(key.str()));
  }
  return keys;
}

Status CheckShapeLimits(const RunConfig& config, int64_t context, uint64_t kv_bytes) {
  const RunConfig::ShapeLimits& shape = config.shape;
  if (shape.max_context > 0 && context > shape.max_context) {
    return Status::ResourceExhausted("the run's sequences are up to " + std::to_string(context) +
                                     " tokens (prompt + completion); shape '" + shape.name + "' allows " +
                                     std::to_string(shape.max_context));
  }
  const uint64_t budget = static_cast<uint64_t>(shape.kv_cache_mib) << 20;
  if (budget > 0 && kv_bytes > budget) {
    return Status::ResourceExhausted("each worker's KV cache needs " + std::to_string(kv_bytes >> 20) +
                                     " MiB; shape '" + shape.name + "' allows " +
                                     std::to_string(shape.kv_cache_mib) + " MiB");
  }
  return Status::Ok();
}

}  // namespace flywheel::pipeline
