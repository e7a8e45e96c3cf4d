// Status and Result<T>: how every fallible call in flywheel reports failure.
//
// Run-time failures (I/O, parsing, bad input, network, CUDA API) are values, not
// exceptions. A Status carries a code and a message that names what was wrong and
// where (file, tensor, byte offset, peer). Exceptions are reserved for programmer
// error and never cross a thread or coroutine boundary.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace flywheel {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // the caller passed something unusable (flags, shapes, options)
  kCorruption,         // input bytes violate the format (checksums, bounds, structure)
  kNotFound,           // a named file, tensor or version does not exist
  kIOError,            // the operating system refused a read/write/map/rename
  kMismatch,           // well-formed input that does not fit (wrong base, other shapes)
  kResourceExhausted,  // a size limit would be exceeded
  kUnavailable,        // a device or peer is not there (e.g. no CUDA device)
  kInternal,           // a bug: an invariant did not hold
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status Mismatch(std::string m) { return {StatusCode::kMismatch, std::move(m)}; }
  static Status ResourceExhausted(std::string m) {
    return {StatusCode::kResourceExhausted, std::move(m)};
  }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "Corruption: <message>", or "OK".
  std::string ToString() const {
    if (ok()) return "OK";
    return std::string(StatusCodeName(code_)) + ": " + message_;
  }
  // Returns a copy whose message is prefixed with `context` ("context: message").
  Status WithContext(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kCorruption:
      return "corruption";
    case StatusCode::kNotFound:
      return "not found";
    case StatusCode::kIOError:
      return "I/O error";
    case StatusCode::kMismatch:
      return "mismatch";
    case StatusCode::kResourceExhausted:
      return "resource exhausted";
    case StatusCode::kUnavailable:
      return "unavailable";
    case StatusCode::kInternal:
      return "internal error";
  }
  return "unknown";
}

// Result<T> holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(v_).ok() && "Result constructed from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  // REQUIRES: ok()
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace flywheel

// Propagates a non-OK Status out of the enclosing function.
#define FW_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::flywheel::Status fw_status_ = (expr);  \
    if (!fw_status_.ok()) return fw_status_; \
  } while (0)

#define FW_CONCAT_INNER(a, b) a##b
#define FW_CONCAT(a, b) FW_CONCAT_INNER(a, b)
// Declares `lhs` from a Result<T>, or returns its Status.
#define FW_ASSIGN_OR_RETURN(lhs, expr) \
  FW_ASSIGN_OR_RETURN_IMPL(FW_CONCAT(fw_result_, __LINE__), lhs, expr)
#define FW_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
