#include "checkpoint/safetensors.h"

#include "base/json.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

namespace flywheel {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr size_t kLengthPrefixBytes = 8;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kSingleFileName = "model.safetensors";

std::string OffsetsString(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

uint64_t LoadLittleEndian64(const std::byte* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | std::to_integer<uint64_t>(bytes[i]);
  return value;
}

void StoreLittleEndian64(uint64_t value, std::byte* bytes) {
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<std::byte>(value >> (8 * i));
}

// nlohmann's parser keeps the last of duplicate keys; this callback records the first
// duplicate (at any depth) so the caller can reject the document instead.
class DuplicateKeyDetector {
 public:
  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open_objects_.push_back({open_objects_.empty() ? std::string() : last_key_, {}});
        break;
      case Json::parse_event_t::object_end:
        if (!open_objects_.empty()) open_objects_.pop_back();
        break;
      case Json::parse_event_t::key:
        if (parsed.is_string()) {
          last_key_ = parsed.get<std::string>();
          if (!open_objects_.empty() && !open_objects_.back().keys.insert(last_key_).second &&
              !duplicate_) {
            duplicate_ = last_key_;
            duplicate_owner_ = open_objects_.back().owner;
            duplicate_depth_ = open_objects_.size();
          }
        }
        break;
      default:
        break;
    }
    return true;
  }

  // The first duplicated key, the key of the object holding it, and that object's depth
  // (1 for the top level).
  const std::optional<std::string>& duplicate() const { return duplicate_; }
  const std::string& duplicate_owner() const { return duplicate_owner_; }
  size_t duplicate_depth() const { return duplicate_depth_; }

 private:
  struct OpenObject {
    std::string owner;
    std::set<std::string> keys;
  };
  std::vector<OpenObject> open_objects_;
  std::string last_key_;
  std::optional<std::string> duplicate_;
  std::string duplicate_owner_;
  size_t duplicate_depth_ = 0;
};

// serde_json, which the reference reader uses, refuses nesting deeper than 128. We do the
// same before nlohmann sees the text: its copy and dump recurse once per level.
constexpr int kMaxJsonDepth = 128;

// Offset of the bracket that nests deeper than kMaxJsonDepth, if any.
std::optional<size_t> FindExcessiveNesting(std::string_view text) {
  const size_t at = json_internal::OffsetTooDeep(text, kMaxJsonDepth);
  if (at == text.size()) return std::nullopt;
  return at;
}

// Parses `text` as JSON with duplicate-key detection. `what` names the document.
Result<Json> ParseJsonStrict(std::string_view text, const std::string& what) {
  if (const std::optional<size_t> at = FindExcessiveNesting(text)) {
    return Status::Corruption(what + " is not valid JSON: nesting deeper than " +
                              std::to_string(kMaxJsonDepth) + " levels at offset " +
                              std::to_string(*at));
  }
  // nlohmann's lexer reads a NUL byte as end of input and would ignore what follows it;
  // JSON text never contains one (not even inside strings).
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return Status::Corruption(what + " is not valid JSON: NUL byte at offset " +
                              std::to_string(nul));
  }
  DuplicateKeyDetector detector;
  Json parsed;
  try {
    parsed = Json::parse(text.begin(), text.end(), std::ref(detector));
  } catch (const Json::exception& error) {
    return Status::Corruption(what + " is not valid JSON: " + error.what());
  }
  if (detector.duplicate()) {
    if (detector.duplicate_depth() == 1) {
      return Status::Corruption(what + " names '" + *detector.duplicate() + "' twice");
    }
    return Status::Corruption(what + ": duplicate key '" + *detector.duplicate() + "' inside '" +
                              detector.duplicate_owner() + "'");
  }
  return parsed;
}

const char* JsonTypeName(const Json& value) {
  return value.type_name();
}

// A JSON number that is a non-negative integer, or nullopt.
std::optional<uint64_t> NonNegativeInteger(const Json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  return std::nullopt;
}

// A short rendering of `value` for an error message; arrays show their scalar elements.
std::string JsonForMessage(const Json& value) {
  constexpr size_t kMaxChars = 64;
  const auto scalar = [](const Json& item) {
    if (item.is_array()) return std::string("[...]");
    if (item.is_object()) return std::string("{...}");
    return item.dump(-1, ' ', false, Json::error_handler_t::replace);
  };
  std::string text;
  if (value.is_array()) {
    text = "[";
    for (size_t i = 0; i < value.size() && text.size() <= kMaxChars; ++i) {
      if (i > 0) text += ", ";
      text += scalar(value[i]);
    }
    text += "]";
  } else {
    text = scalar(value);
  }
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars - 3) + "...";
  return text;
}

struct ParsedEntry {
  TensorView view;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// An entry holds exactly the fields dtype, shape and data_offsets.
Status CheckEntryFields(const Json& entry, const std::string& where) {
  if (!entry.is_object()) {
    return Status::Corruption(where + ": entry is a JSON " + JsonTypeName(entry) +
                              ", not an object");
  }
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Status::Corruption(where + ": unknown field '" + key + "'");
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) {
      return Status::Corruption(where + ": missing field '" + field + "'");
    }
  }
  return Status::Ok();
}

Result<DType> ParseEntryDType(const Json& dtype, const std::string& where) {
  if (!dtype.is_string()) {
    return Status::Corruption(where + ": dtype is a JSON " + JsonTypeName(dtype) +
                              ", not a string");
  }
  const std::optional<DType> parsed = ParseDType(dtype.get_ref<const std::string&>());
  if (!parsed) {
    return Status::Corruption(where + ": unknown dtype '" + dtype.get<std::string>() + "'");
  }
  return *parsed;
}

// A shape: an array of integers in [0, 2^63).
Result<std::vector<int64_t>> ParseEntryShape(const Json& shape, const std::string& where) {
  if (!shape.is_array()) {
    return Status::Corruption(where + ": shape is a JSON " + JsonTypeName(shape) +
                              ", not an array");
  }
  std::vector<int64_t> dims;
  dims.reserve(shape.size());
  for (const Json& dim : shape) {
    if (dim.is_number_integer() && !dim.is_number_unsigned() && dim.get<int64_t>() < 0) {
      return Status::Corruption(where + ": negative dimension " +
                                std::to_string(dim.get<int64_t>()) + " in shape " +
                                JsonForMessage(shape));
    }
    const std::optional<uint64_t> value = NonNegativeInteger(dim);
    if (!value) {
      return Status::Corruption(
          where + ": shape " + JsonForMessage(shape) +
          " holds a dimension that is not a non-negative integer: " + JsonForMessage(dim));
    }
    if (*value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Status::Corruption(where + ": dimension " + std::to_string(*value) + " in shape " +
                                JsonForMessage(shape) + " exceeds 2^63-1");
    }
    dims.push_back(static_cast<int64_t>(*value));
  }
  return dims;
}

// data_offsets: [begin, end], begin <= end, into parsed->begin and parsed->end.
Status ParseEntryOffsets(const Json& offsets, const std::string& where, ParsedEntry* parsed) {
  std::optional<uint64_t> begin;
  std::optional<uint64_t> end;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = NonNegativeInteger(offsets[0]);
    end = NonNegativeInteger(offsets[1]);
  }
  if (!begin || !end) {
    return Status::Corruption(where + ": data_offsets " + JsonForMessage(offsets) +
                              " are not two non-negative integers");
  }
  if (*begin > *end) {
    return Status::Corruption(where + ": data_offsets " + OffsetsString(*begin, *end) +
                              " end before they begin");
  }
  parsed->begin = *begin;
  parsed->end = *end;
  return Status::Ok();
}

// Validates one tensor entry of the header (everything but its place in the data section).
Result<ParsedEntry> ParseTensorEntry(const std::string& name, const Json& entry,
                                     const std::string& source) {
  const std::string where = source + ": tensor '" + name + "'";
  FW_RETURN_IF_ERROR(CheckEntryFields(entry, where));
  ParsedEntry parsed;
  parsed.view.name = name;
  FW_ASSIGN_OR_RETURN(parsed.view.dtype, ParseEntryDType(entry["dtype"], where));
  FW_ASSIGN_OR_RETURN(parsed.view.shape, ParseEntryShape(entry["shape"], where));
  FW_RETURN_IF_ERROR(ParseEntryOffsets(entry["data_offsets"], where, &parsed));
  const uint64_t begin = parsed.begin;
  const uint64_t end = parsed.end;
  const Result<uint64_t> byte_size = TensorByteSize(parsed.view.dtype, parsed.view.shape);
  if (!byte_size.ok()) return Status::Corruption(where + ": " + byte_size.status().message());
  if (end - begin != *byte_size) {
    return Status::Corruption(where + ": data_offsets " + OffsetsString(begin, end) + " span " +
                              std::to_string(end - begin) + " bytes but " +
                              DTypeName(parsed.view.dtype) + " " + ShapeString(parsed.view.shape) +
                              " needs " + std::to_string(*byte_size));
  }
  return parsed;
}

Result<std::map<std::string, std::string>> ParseMetadata(const Json& value,
                                                         const std::string& source) {
  std::map<std::string, std::string> metadata;
  // The reference reader deserialises an Option<HashMap>, so null means "none".
  if (value.is_null()) return metadata;
  if (!value.is_object()) {
    return Status::Corruption(source + ": __metadata__ is a JSON " + JsonTypeName(value) +
                              ", not an object");
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return Status::Corruption(source + ": __metadata__ value for key '" + key + "' is a JSON " +
                                JsonTypeName(item) + ", not a string");
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

// ---------------------------------------------------------------------------------------
// Writing helpers.

struct HeaderLayout {
  std::vector<std::byte> header;  // u64 N + padded JSON
  std::vector<uint64_t> sizes;    // byte size of each tensor, in order
  uint64_t data_bytes = 0;        // sum of sizes
};

Result<HeaderLayout> BuildHeader(const CheckpointView& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  HeaderLayout layout;
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) {
    OrderedJson meta = OrderedJson::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  std::set<std::string_view> names;
  layout.sizes.reserve(tensors.size());
  for (const TensorView& tensor : tensors) {
    if (tensor.name == kMetadataKey) {
      return Status::InvalidArgument("tensor name '__metadata__' is reserved by safetensors");
    }
    if (!names.insert(tensor.name).second) {
      return Status::InvalidArgument("tensor '" + tensor.name + "' is listed twice");
    }
    const Result<uint64_t> size = TensorByteSize(tensor.dtype, tensor.shape);
    if (!size.ok()) {
      return Status::InvalidArgument("tensor '" + tensor.name + "': " + size.status().message());
    }
    const uint64_t begin = layout.data_bytes;
    if (__builtin_add_overflow(layout.data_bytes, *size, &layout.data_bytes)) {
      return Status::InvalidArgument("tensor '" + tensor.name +
                                     "': total data size overflows 64 bits");
    }
    OrderedJson entry = OrderedJson::object();
    entry["dtype"] = DTypeName(tensor.dtype);
    entry["shape"] = tensor.shape;
    entry["data_offsets"] = {begin, layout.data_bytes};
    header[tensor.name] = std::move(entry);
    layout.sizes.push_back(*size);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const OrderedJson::exception& error) {
    return Status::InvalidArgument(std::string("cannot encode safetensors header: ") +
                                   error.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxSafetensorsHeaderBytes) {
    return Status::ResourceExhausted("safetensors header of " + std::to_string(text.size()) +
                                     " bytes exceeds the " +
                                     std::to_string(kMaxSafetensorsHeaderBytes) + "-byte limit");
  }
  layout.header.resize(kLengthPrefixBytes + text.size());
  StoreLittleEndian64(text.size(), layout.header.data());
  std::memcpy(layout.header.data() + kLengthPrefixBytes, text.data(), text.size());
  return layout;
}

Status CheckDataSizes(const CheckpointView& tensors, const HeaderLayout& layout) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].data.size() != layout.sizes[i]) {
      return Status::InvalidArgument(
          "tensor '" + tensors[i].name + "': data has " + std::to_string(tensors[i].data.size()) +
          " bytes but " + DTypeName(tensors[i].dtype) + " " + ShapeString(tensors[i].shape) +
          " needs " + std::to_string(layout.sizes[i]));
    }
  }
  return Status::Ok();
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

// Rejects shard names that could leave the checkpoint directory or name nothing.
Status CheckShardName(const std::string& shard, const std::string& where) {
  if (shard.empty()) return Status::Corruption(where + ": empty shard file name");
  for (const char c : shard) {
    if (c == '/' || c == '\\' || c == '\0') {
      return Status::Corruption(where + ": shard file name '" + shard +
                                "' contains a path separator or NUL");
    }
  }
  if (shard.find("..") != std::string::npos || shard == ".") {
    return Status::Corruption(where + ": shard file name '" + shard + "' contains '..'");
  }
  return Status::Ok();
}

bool IsDirectory(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool Exists(const std::string& path) {
  return Env::Default()->FileExists(path);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// MappedFile

Result<MappedFile> MappedFile::Open(const std::string& path, Env* env) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<MappedRegion> region, env->MapReadOnly(path));
  MappedFile file;
  file.path_ = path;
  file.region_ = std::move(region);
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept = default;
MappedFile& MappedFile::operator=(MappedFile&& other) noexcept = default;
MappedFile::~MappedFile() = default;

// ---------------------------------------------------------------------------------------
// Reading

namespace {

// The header's JSON text: bytes [8, 8 + N) where N is the little-endian u64 at byte 0.
Result<std::string_view> HeaderText(std::span<const std::byte> bytes, const std::string& source) {
  if (bytes.size() < kLengthPrefixBytes) {
    return Status::Corruption(source + ": file is " + std::to_string(bytes.size()) +
                              " bytes, shorter than the 8-byte header length");
  }
  const uint64_t header_bytes = LoadLittleEndian64(bytes.data());
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return Status::Corruption(source + ": header length " + std::to_string(header_bytes) +
                              " exceeds the " + std::to_string(kMaxSafetensorsHeaderBytes) +
                              "-byte limit");
  }
  const uint64_t after_prefix = bytes.size() - kLengthPrefixBytes;
  if (header_bytes > after_prefix) {
    return Status::Corruption(source + ": header length " + std::to_string(header_bytes) +
                              " extends beyond the file (" + std::to_string(bytes.size()) +
                              " bytes)");
  }
  return std::string_view(reinterpret_cast<const char*>(bytes.data()) + kLengthPrefixBytes,
                          header_bytes);
}

// Sorted by offsets the tensors must tile the data section exactly: no gap, no overlap,
// nothing after the last. REQUIRES: `entries` sorted by (begin, end).
Status CheckTiling(const std::vector<ParsedEntry>& entries, uint64_t data_size,
                   const std::string& source) {
  uint64_t expected_begin = 0;
  const ParsedEntry* previous = nullptr;
  for (const ParsedEntry& entry : entries) {
    const auto where = [&] {
      return source + ": tensor '" + entry.view.name + "': data_offsets " +
             OffsetsString(entry.begin, entry.end);
    };
    if (entry.end > data_size) {
      return Status::Corruption(where() + " extend beyond the end of the file (data section is " +
                                std::to_string(data_size) + " bytes)");
    }
    if (entry.begin != expected_begin) {
      if (previous == nullptr) {
        return Status::Corruption(where() + " do not start at 0 (first tensor in offset order)");
      }
      if (entry.begin > expected_begin) {
        return Status::Corruption(where() + " leave a gap of " +
                                  std::to_string(entry.begin - expected_begin) +
                                  " bytes after tensor '" + previous->view.name + "' ending at " +
                                  std::to_string(expected_begin));
      }
      return Status::Corruption(where() + " overlap tensor '" + previous->view.name +
                                "' ending at " + std::to_string(expected_begin));
    }
    expected_begin = entry.end;
    previous = &entry;
  }
  if (expected_begin != data_size) {
    if (previous == nullptr) {
      return Status::Corruption(source + ": data section has " + std::to_string(data_size) +
                                " bytes but the header lists no tensors");
    }
    return Status::Corruption(source + ": " + std::to_string(data_size - expected_begin) +
                              " trailing bytes after the last tensor '" + previous->view.name +
                              "' (ends at " + std::to_string(expected_begin) + " of " +
                              std::to_string(data_size) + ")");
  }
  return Status::Ok();
}

}  // namespace

Result<SafetensorsImage> ParseSafetensors(std::span<const std::byte> bytes,
                                          const std::string& source) {
  FW_ASSIGN_OR_RETURN(const std::string_view text, HeaderText(bytes, source));
  FW_ASSIGN_OR_RETURN(const Json header, ParseJsonStrict(text, source + ": header"));
  if (!header.is_object()) {
    return Status::Corruption(source + ": header is a JSON " + JsonTypeName(header) +
                              ", not an object");
  }
  // The spec requires the first byte to be '{' (no leading whitespace).
  if (text.front() != '{') {
    return Status::Corruption(source + ": header does not start with '{'");
  }

  SafetensorsImage image;
  image.header_bytes = text.size();
  const std::span<const std::byte> data = bytes.subspan(kLengthPrefixBytes + text.size());

  std::vector<ParsedEntry> entries;
  entries.reserve(header.size());
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      FW_ASSIGN_OR_RETURN(image.metadata, ParseMetadata(value, source));
      continue;
    }
    FW_ASSIGN_OR_RETURN(ParsedEntry entry, ParseTensorEntry(name, value, source));
    entries.push_back(std::move(entry));
  }

  // Ties (empty tensors at one offset) stay in name order, the order nlohmann::json iterates
  // an object in.
  std::stable_sort(entries.begin(), entries.end(),
                   [](const ParsedEntry& left, const ParsedEntry& right) {
                     return std::tie(left.begin, left.end) < std::tie(right.begin, right.end);
                   });
  FW_RETURN_IF_ERROR(CheckTiling(entries, data.size(), source));

  image.tensors.reserve(entries.size());
  for (ParsedEntry& entry : entries) {
    entry.view.data = data.subspan(entry.begin, entry.end - entry.begin);
    image.tensors.push_back(std::move(entry.view));
  }
  return image;
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  FW_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  FW_ASSIGN_OR_RETURN(SafetensorsImage image, ParseSafetensors(mapped.bytes(), path));
  SafetensorsFile file;
  file.file_ = std::move(mapped);
  file.image_ = std::move(image);
  return file;
}

// ---------------------------------------------------------------------------------------
// Checkpoint

const std::map<std::string, std::string>& Checkpoint::metadata() const {
  static const std::map<std::string, std::string> kEmpty;
  return files_.empty() ? kEmpty : files_.front()->metadata();
}

namespace {

// What a checkpoint path names: an index of shards, or one safetensors file.
struct CheckpointPaths {
  std::string index;
  std::string single;
};

Result<CheckpointPaths> ResolveCheckpointPaths(const std::string& path) {
  CheckpointPaths paths;
  if (IsDirectory(path)) {
    if (Exists(JoinPath(path, kIndexFileName))) {
      paths.index = JoinPath(path, kIndexFileName);
    } else if (Exists(JoinPath(path, kSingleFileName))) {
      paths.single = JoinPath(path, kSingleFileName);
    } else {
      return Status::NotFound(path + ": directory holds neither " + std::string(kIndexFileName) +
                              " nor " + kSingleFileName);
    }
  } else if (std::string_view(path).ends_with(".json")) {
    paths.index = path;
  } else {
    paths.single = path;
  }
  return paths;
}

// The index's weight_map (tensor -> shard) into *weight_map; returns each shard's tensors.
Result<std::map<std::string, std::set<std::string>>> ReadWeightMap(
    const std::string& index_path, std::map<std::string, std::string>* weight_map) {
  FW_ASSIGN_OR_RETURN(MappedFile index_file, MappedFile::Open(index_path));
  const std::string_view index_text(reinterpret_cast<const char*>(index_file.bytes().data()),
                                    index_file.bytes().size());
  FW_ASSIGN_OR_RETURN(const Json index, ParseJsonStrict(index_text, index_path));
  if (!index.is_object()) {
    return Status::Corruption(index_path + ": index is a JSON " + JsonTypeName(index) +
                              ", not an object");
  }
  if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
    return Status::Corruption(index_path + ": missing 'weight_map' object");
  }
  std::map<std::string, std::set<std::string>> shards;
  for (const auto& [tensor, shard] : index["weight_map"].items()) {
    if (!shard.is_string()) {
      return Status::Corruption(index_path + ": weight_map entry for tensor '" + tensor +
                                "' is a JSON " + JsonTypeName(shard) + ", not a string");
    }
    const std::string& shard_name = shard.get_ref<const std::string&>();
    FW_RETURN_IF_ERROR(CheckShardName(shard_name, index_path + ": tensor '" + tensor + "'"));
    shards[shard_name].insert(tensor);
    weight_map->emplace(tensor, shard_name);
  }
  return shards;
}

// A shard holds exactly the tensors the weight_map assigns to it (`expected`).
Status CheckShard(const SafetensorsFile& file, const std::string& shard_name,
                  const std::set<std::string>& expected,
                  const std::map<std::string, std::string>& weight_map,
                  const std::string& index_path) {
  for (const TensorView& tensor : file.tensors()) {
    const auto mapped = weight_map.find(tensor.name);
    if (mapped == weight_map.end()) {
      return Status::Corruption(index_path + ": tensor '" + tensor.name + "' of shard '" +
                                shard_name + "' is not in the weight_map");
    }
    if (mapped->second != shard_name) {
      return Status::Corruption(index_path + ": tensor '" + tensor.name + "' appears in shard '" +
                                shard_name + "' but the weight_map assigns it to '" +
                                mapped->second + "'");
    }
  }
  if (file.tensors().size() != expected.size()) {
    std::set<std::string_view> present;
    for (const TensorView& tensor : file.tensors()) present.insert(tensor.name);
    for (const std::string& tensor : expected) {
      if (!present.contains(tensor)) {
        return Status::Corruption(index_path + ": tensor '" + tensor + "' is mapped to shard '" +
                                  shard_name + "' but that shard does not hold it");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Checkpoint> Checkpoint::Open(const std::string& path) {
  FW_ASSIGN_OR_RETURN(const CheckpointPaths paths, ResolveCheckpointPaths(path));
  Checkpoint checkpoint;
  if (!paths.single.empty()) {
    FW_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(paths.single));
    checkpoint.files_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    checkpoint.tensors_ = checkpoint.files_.front()->tensors();
    return checkpoint;
  }
  const std::string& index_path = paths.index;
  FW_ASSIGN_OR_RETURN(const auto shards, ReadWeightMap(index_path, &checkpoint.weight_map_));
  const std::string dir = std::filesystem::path(index_path).parent_path().string();
  for (const auto& [shard_name, expected] : shards) {
    const std::string shard_path = JoinPath(dir, shard_name);
    Result<SafetensorsFile> file = SafetensorsFile::Open(shard_path);
    if (!file.ok()) return file.status().WithContext(index_path);
    FW_RETURN_IF_ERROR(
        CheckShard(*file, shard_name, expected, checkpoint.weight_map_, index_path));
    checkpoint.files_.push_back(std::make_unique<SafetensorsFile>(std::move(file).value()));
    const auto& shard_tensors = checkpoint.files_.back()->tensors();
    checkpoint.tensors_.insert(checkpoint.tensors_.end(), shard_tensors.begin(),
                               shard_tensors.end());
  }
  return checkpoint;
}

// ---------------------------------------------------------------------------------------
// Writing

Result<std::vector<std::byte>> SafetensorsHeader(
    const CheckpointView& tensors, const std::map<std::string, std::string>& metadata) {
  FW_ASSIGN_OR_RETURN(HeaderLayout layout, BuildHeader(tensors, metadata));
  return std::move(layout.header);
}

Result<std::vector<std::byte>> SerializeSafetensors(
    const CheckpointView& tensors, const std::map<std::string, std::string>& metadata) {
  FW_ASSIGN_OR_RETURN(HeaderLayout layout, BuildHeader(tensors, metadata));
  FW_RETURN_IF_ERROR(CheckDataSizes(tensors, layout));
  std::vector<std::byte> out = std::move(layout.header);
  out.reserve(out.size() + layout.data_bytes);
  for (const TensorView& tensor : tensors) {
    out.insert(out.end(), tensor.data.begin(), tensor.data.end());
  }
  return out;
}

Status WriteSafetensors(const std::string& path, const CheckpointView& tensors,
                        const std::map<std::string, std::string>& metadata) {
  FW_ASSIGN_OR_RETURN(HeaderLayout layout, BuildHeader(tensors, metadata));
  FW_RETURN_IF_ERROR(CheckDataSizes(tensors, layout));
  FW_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path));
  FW_RETURN_IF_ERROR(file.Append(layout.header));
  for (const TensorView& tensor : tensors) FW_RETURN_IF_ERROR(file.Append(tensor.data));
  return file.Commit();
}

// ---------------------------------------------------------------------------------------
// SafetensorsWriter

Result<SafetensorsWriter> SafetensorsWriter::Create(
    const std::string& path, const CheckpointView& layout,
    const std::map<std::string, std::string>& metadata) {
  FW_ASSIGN_OR_RETURN(HeaderLayout header, BuildHeader(layout, metadata));
  uint64_t total = 0;
  if (__builtin_add_overflow(header.header.size(), header.data_bytes, &total) ||
      total > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) ||
      total > std::numeric_limits<size_t>::max()) {
    return Status::InvalidArgument(path + ": file size overflows");
  }
  FW_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path));
  const int fd = file.file().fd();
  const std::string& temp_path = file.file().path();
  if (fd < 0) return Status::Internal(temp_path + ": temporary file has no descriptor to map");
  if (::ftruncate(fd, static_cast<off_t>(total)) != 0) {
    const int error = errno;
    return ErrnoStatus("ftruncate to " + std::to_string(total) + " bytes", temp_path, error);
  }
  // Reserve the blocks now so a full disk is an error here, not SIGBUS on a store later.
  // Filesystems without fallocate keep the sparse file.
  if (::fallocate(fd, 0, 0, static_cast<off_t>(total)) != 0) {
    const int error = errno;
    if (error == ENOSPC || error == EDQUOT) {
      return ErrnoStatus("fallocate " + std::to_string(total) + " bytes", temp_path, error);
    }
  }
  // A shared, writable mapping: unlike Env::MapReadOnly, stores go to the file itself.
  void* map = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) return ErrnoStatus("mmap", temp_path, errno);

  SafetensorsWriter writer;
  writer.map_ = static_cast<std::byte*>(map);
  writer.map_size_ = total;
  std::memcpy(writer.map_, header.header.data(), header.header.size());
  uint64_t offset = header.header.size();
  writer.tensors_.reserve(layout.size());
  for (size_t i = 0; i < layout.size(); ++i) {
    writer.tensors_.push_back({layout[i].name, layout[i].dtype, layout[i].shape,
                               std::span<std::byte>(writer.map_ + offset, header.sizes[i])});
    offset += header.sizes[i];
  }
  writer.path_ = path;
  writer.file_ = std::move(file);
  return writer;
}

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& other) noexcept {
  *this = std::move(other);
}

SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    file_ = std::move(other.file_);
    tensors_ = std::exchange(other.tensors_, {});
  }
  return *this;
}

SafetensorsWriter::~SafetensorsWriter() {
  Abandon();
}

void SafetensorsWriter::Abandon() {
  tensors_.clear();
  if (map_ != nullptr) ::munmap(std::exchange(map_, nullptr), std::exchange(map_size_, 0));
  file_.Abandon();
}

Status SafetensorsWriter::Commit() {
  if (!file_.is_open()) {
    return Status::InvalidArgument(path_ +
                                   ": SafetensorsWriter::Commit on a writer that is "
                                   "not open (already committed or moved from)");
  }
  // The mapping's stores reach the file through msync; AtomicFile then does the rest
  // (fsync, close, rename, directory fsync).
  Status status;
  if (::msync(map_, map_size_, MS_SYNC) != 0) {
    status = ErrnoStatus("msync", file_.file().path(), errno);
  } else if (::munmap(std::exchange(map_, nullptr), std::exchange(map_size_, 0)) != 0) {
    status = ErrnoStatus("munmap", file_.file().path(), errno);
  }
  if (!status.ok()) {
    Abandon();
    return status;
  }
  tensors_.clear();
  return file_.Commit();
}

// ---------------------------------------------------------------------------------------
// Sharded checkpoints

Status WriteShardedCheckpoint(const std::string& dir, const CheckpointView& tensors,
                              const std::map<std::string, std::string>& weight_map,
                              const std::map<std::string, std::string>& metadata) {
  std::set<std::string_view> names;
  // Shards in order of first use; each keeps its tensors in the given order.
  std::vector<std::pair<std::string, CheckpointView>> shards;
  std::map<std::string, size_t> shard_slot;
  uint64_t total_size = 0;
  for (const TensorView& tensor : tensors) {
    if (!names.insert(tensor.name).second) {
      return Status::InvalidArgument(dir + ": tensor '" + tensor.name + "' is listed twice");
    }
    const auto mapped = weight_map.find(tensor.name);
    if (mapped == weight_map.end()) {
      return Status::InvalidArgument(dir + ": tensor '" + tensor.name +
                                     "' has no shard in the weight map");
    }
    const Status name_ok = CheckShardName(mapped->second, dir + ": tensor '" + tensor.name + "'");
    if (!name_ok.ok()) return Status::InvalidArgument(name_ok.message());
    auto [slot, inserted] = shard_slot.emplace(mapped->second, shards.size());
    if (inserted) shards.push_back({mapped->second, {}});
    shards[slot->second].second.push_back(tensor);
    if (__builtin_add_overflow(total_size, tensor.data.size(), &total_size)) {
      return Status::InvalidArgument(dir + ": total size overflows 64 bits");
    }
  }
  for (const auto& [tensor, shard] : weight_map) {
    if (!names.contains(tensor)) {
      return Status::InvalidArgument(dir + ": weight map names tensor '" + tensor +
                                     "' that is not in the checkpoint");
    }
  }

  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return Status::IOError(dir + ": create directory: " + error.message());

  for (const auto& [shard, shard_tensors] : shards) {
    FW_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, shard), shard_tensors, metadata));
  }

  // Sorted keys and two-space indent, as transformers writes the index.
  OrderedJson index = OrderedJson::object();
  index["metadata"] = OrderedJson::object();
  index["metadata"]["total_size"] = total_size;
  index["weight_map"] = OrderedJson::object();
  for (const auto& [tensor, shard] : weight_map) index["weight_map"][tensor] = shard;
  std::string text;
  try {
    text = index.dump(2) + "\n";
  } catch (const OrderedJson::exception& e) {
    return Status::InvalidArgument(dir + ": cannot encode index: " + e.what());
  }
  return WriteFileAtomically(JoinPath(dir, kIndexFileName),
                             std::as_bytes(std::span(text.data(), text.size())));
}

}  // namespace flywheel
