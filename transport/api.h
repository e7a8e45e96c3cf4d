// The HTTP API kit: how flywheel's JSON APIs answer. One Status -> HTTP table, one error
// body, JSON answers, query parameters and the status routes, shared by the push API
// (docs/PUSH_API.md), the training service (docs/TRAINING_API.md), the trainer's rollout
// routes, the rollout workers' OpenAI routes and the HTTP server's own refusals.
//
// Errors. flywheel's own APIs answer every error as
//
//     {"error": {"code": "<snake_case>", "message": "<what was wrong, and where>", ...}}
//
// where "..." are the ApiError's details (e.g. "head_version"), beside code and message.
// The HTTP server (transport/http.h) answers its own refusals the same way: 401
// unauthorized, 403 forbidden, 404 not_found, 405 method_not_allowed, 413 too_large,
// 431 header_too_large, 500 internal. The OpenAI-compatible routes (rollout/openai_api.h)
// answer OpenAI's shape from the same ApiError (ErrorShape::kOpenAi):
//
//     {"error": {"message", "type", "param": null, "code"}}
//
// with type invalid_request_error (4xx but 401, 403, 404), authentication_error (401),
// permission_error (403), not_found_error (404) or server_error (5xx).
//
// The table. A Status from the code below an API becomes (ApiError::From):
//
//     StatusCode          HTTP  code             meaning for a client
//     kInvalidArgument    400   bad_request      the request is malformed or unusable
//     kNotFound           404   not_found        what it names does not exist
//     kMismatch           409   conflict         well-formed, but does not fit the state
//                                                (another base, other shapes, a stale version)
//     kResourceExhausted  413   too_large        a size or count limit would be exceeded
//     kCorruption         422   invalid_content  the sent bytes violate their format
//                                                (a checksum, a structure): do not resend them
//     kIOError            500   io_error         the server's own storage failed
//     kInternal           500   internal         a bug on the server
//     kUnavailable        503   unavailable      stopping, or not serving yet: retry later
//
// An API answers a more specific code where its document lists one (push's 409 pinned,
// 410 upload_expired, 507 insufficient_storage; training's 408 seq_timeout), always in the
// one shape, and never a status of the table for a different meaning.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "transport/http.h"

namespace flywheel::transport {

// The HTTP status and error code of a Status code, by the table above. kOk (a caller's
// bug) is 500 internal.
int HttpStatusOf(StatusCode code);
const char* ErrorCodeOf(StatusCode code);

// One error answer of an API.
struct ApiError {
  int status = 500;
  std::string code = "internal";
  std::string message;
  nlohmann::json details = nlohmann::json::object();  // further fields of the error object

  // By the table. REQUIRES: !status.ok().
  static ApiError From(const Status& status);
};

// The error document of `error` in `shape`.
nlohmann::json ErrorBody(const ApiError& error, ErrorShape shape = ErrorShape::kFlywheel);
// The answer for `error`: its status, application/json, ErrorBody.
HttpResponse ErrorResponse(const ApiError& error, ErrorShape shape = ErrorShape::kFlywheel);
// The answer for a non-OK status, by the table.
HttpResponse ErrorResponse(const Status& status, ErrorShape shape = ErrorShape::kFlywheel);

// `body` as application/json with `status`, one line (invalid UTF-8 replaced, never a throw).
HttpResponse JsonResponse(int status, const nlohmann::json& body);
HttpResponse JsonResponse(int status, const nlohmann::ordered_json& body);

// The client side: the error of an answer in either shape, or nullopt when `body` is not
// an error document. An OpenAI-shaped error without a code takes its type as the code.
// `http_status` fills ApiError::status.
std::optional<ApiError> ParseErrorBody(int http_status, std::string_view body);
// "<code>: <message>" of an error answer, or the start of the body when it is not one.
std::string DescribeErrorBody(int http_status, std::string_view body);

// What an API handler returns: a JSON answer (200 unless given) or an ApiError. Converts
// from Result<json> and from a non-OK Status (by the table).
class [[nodiscard]] ApiResult {
 public:
  ApiResult(nlohmann::json body, int status = 200)  // NOLINT: implicit by design
      : ok_(true), status_(status), body_(std::move(body)) {}
  ApiResult(ApiError error)  // NOLINT: implicit by design
      : ok_(false), status_(error.status), error_(std::move(error)) {}
  ApiResult(const Status& status)  // NOLINT: REQUIRES: !status.ok()
      : ApiResult(ApiError::From(status)) {}
  ApiResult(Result<nlohmann::json> result);  // NOLINT: implicit by design

  bool ok() const { return ok_; }
  int status() const { return status_; }
  // REQUIRES: ok()
  const nlohmann::json& body() const { return body_; }
  // REQUIRES: !ok()
  const ApiError& error() const { return error_; }

  HttpResponse ToResponse(ErrorShape shape = ErrorShape::kFlywheel) const;

 private:
  bool ok_;
  int status_;
  nlohmann::json body_;
  ApiError error_;
};

// The query string of a request target ("/v1/wait?version=3&fraction=0.5"). Parameters
// are split on '&' and '='; values are taken as they are (no percent-decoding: flywheel's
// parameters are numbers and names). The first of a repeated key wins.
class Query {
 public:
  explicit Query(std::string_view target);

  // The value of `key` ("" for a bare "key"), or nullopt when absent.
  std::optional<std::string> Get(std::string_view key) const;
  // A non-negative decimal integer: `fallback` when absent; InvalidArgument naming the
  // parameter when it is malformed, negative or out of range.
  Result<uint64_t> Unsigned(std::string_view key, uint64_t fallback) const;
  // A finite decimal number: `fallback` when absent; InvalidArgument when malformed.
  Result<double> Number(std::string_view key, double fallback) const;

 private:
  std::vector<std::pair<std::string, std::string>> parameters_;
};

// Adapters from handlers that return ApiResult to the server's handler types; errors in
// `shape`. The GET-route handler sees the request target.
HttpHandler JsonGetHandler(std::function<ApiResult(const std::string& target)> handler,
                           ErrorShape shape = ErrorShape::kFlywheel);
HttpPostHandler JsonPostHandler(
    std::function<awaitable<ApiResult>(std::string target, std::string body)> handler,
    ErrorShape shape = ErrorShape::kFlywheel);
HttpApiHandler JsonApiHandler(std::function<awaitable<ApiResult>(HttpRequest request)> handler,
                              ErrorShape shape = ErrorShape::kFlywheel);

// The status routes every flywheel process serves: GET /healthz (public, "ok"),
// GET /v1/status (status() as indented JSON) and GET /metrics (metrics(status()) as
// Prometheus text, version 0.0.4). Both need the read scope. REQUIRES: as
// HttpServer::Route().
void AddStatusRoutes(HttpServer& server, std::function<nlohmann::json()> status,
                     std::function<std::string(const nlohmann::json&)> metrics);

}  // namespace flywheel::transport
