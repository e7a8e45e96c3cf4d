#include "transport/api.h"

#include <spdlog/spdlog.h>

#include <charconv>
#include <cmath>
#include <exception>

#include "base/json.h"

namespace flywheel::transport {

namespace {

using nlohmann::json;

struct TableRow {
  StatusCode code;
  int http_status;
  const char* error_code;
};

// The Status -> HTTP table of api.h, row for row.
constexpr TableRow kTable[] = {
    {StatusCode::kInvalidArgument, 400, "bad_request"},
    {StatusCode::kNotFound, 404, "not_found"},
    {StatusCode::kMismatch, 409, "conflict"},
    {StatusCode::kResourceExhausted, 413, "too_large"},
    {StatusCode::kCorruption, 422, "invalid_content"},
    {StatusCode::kIOError, 500, "io_error"},
    {StatusCode::kInternal, 500, "internal"},
    {StatusCode::kUnavailable, 503, "unavailable"},
};

const TableRow& RowOf(StatusCode code) {
  static constexpr TableRow kBug{StatusCode::kOk, 500, "internal"};
  for (const TableRow& row : kTable) {
    if (row.code == code) return row;
  }
  return kBug;
}

const char* OpenAiType(int status) {
  if (status == 401) return "authentication_error";
  if (status == 403) return "permission_error";
  if (status == 404) return "not_found_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

}  // namespace

int HttpStatusOf(StatusCode code) {
  return RowOf(code).http_status;
}

const char* ErrorCodeOf(StatusCode code) {
  return RowOf(code).error_code;
}

ApiError ApiError::From(const Status& status) {
  if (status.ok()) spdlog::error("api: an OK status answered as an error");
  const TableRow& row = RowOf(status.code());
  return ApiError{row.http_status, row.error_code,
                  status.ok() ? std::string("internal error") : status.message()};
}

json ErrorBody(const ApiError& error, ErrorShape shape) {
  json inner = json::object();
  if (shape == ErrorShape::kOpenAi) {
    inner["message"] = error.message;
    inner["type"] = OpenAiType(error.status);
    inner["param"] = nullptr;
    inner["code"] = error.code;
    return json{{"error", std::move(inner)}};
  }
  if (error.details.is_object()) inner = error.details;
  inner["code"] = error.code;
  inner["message"] = error.message;
  return json{{"error", std::move(inner)}};
}

HttpResponse ErrorResponse(const ApiError& error, ErrorShape shape) {
  return JsonResponse(error.status, ErrorBody(error, shape));
}

HttpResponse ErrorResponse(const Status& status, ErrorShape shape) {
  return ErrorResponse(ApiError::From(status), shape);
}

HttpResponse JsonResponse(int status, const json& body) {
  return {status, "application/json", body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"};
}

HttpResponse JsonResponse(int status, const nlohmann::ordered_json& body) {
  return {status, "application/json",
          body.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n"};
}

std::optional<ApiError> ParseErrorBody(int http_status, std::string_view body) {
  Result<json> parsed = ParseJson(body, "an error answer", JsonLimits{.max_bytes = 1 << 20});
  if (!parsed.ok() || !parsed->is_object()) return std::nullopt;
  auto found = parsed->find("error");
  if (found == parsed->end() || !found->is_object()) return std::nullopt;
  json inner = *found;
  ApiError error;
  error.status = http_status;
  const json* code = inner.contains("code") && inner["code"].is_string() ? &inner["code"]
                     : inner.contains("type") && inner["type"].is_string() ? &inner["type"]
                                                                            : nullptr;
  if (code == nullptr) return std::nullopt;
  error.code = code->get<std::string>();
  if (inner.contains("message") && inner["message"].is_string()) {
    error.message = inner["message"].get<std::string>();
  }
  inner.erase("code");
  inner.erase("message");
  error.details = std::move(inner);
  return error;
}

std::string DescribeErrorBody(int http_status, std::string_view body) {
  if (std::optional<ApiError> error = ParseErrorBody(http_status, body)) {
    return "HTTP " + std::to_string(http_status) + " " + error->code + ": " + error->message;
  }
  return "HTTP " + std::to_string(http_status) + ": " + std::string(body.substr(0, 200));
}

ApiResult::ApiResult(Result<json> result)
    : ok_(result.ok()),
      status_(result.ok() ? 200 : HttpStatusOf(result.status().code())),
      error_(result.ok() ? ApiError{} : ApiError::From(result.status())) {
  if (ok_) body_ = std::move(result).value();
}

HttpResponse ApiResult::ToResponse(ErrorShape shape) const {
  return ok_ ? JsonResponse(status_, body_) : ErrorResponse(error_, shape);
}

Query::Query(std::string_view target) {
  const size_t question = target.find('?');
  if (question == std::string_view::npos) return;
  std::string_view query = target.substr(question + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    const size_t equals = pair.find('=');
    if (!pair.empty()) {
      parameters_.emplace_back(
          std::string(pair.substr(0, equals)),
          std::string(equals == std::string_view::npos ? "" : pair.substr(equals + 1)));
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
}

std::optional<std::string> Query::Get(std::string_view key) const {
  for (const auto& [name, value] : parameters_) {
    if (name == key) return value;
  }
  return std::nullopt;
}

Result<uint64_t> Query::Unsigned(std::string_view key, uint64_t fallback) const {
  const std::optional<std::string> text = Get(key);
  if (!text) return fallback;
  uint64_t value = 0;
  const char* end = text->data() + text->size();
  const auto [stop, ec] = std::from_chars(text->data(), end, value);
  if (text->empty() || ec != std::errc() || stop != end) {
    return Status::InvalidArgument("query parameter '" + std::string(key) +
                                   "' is not a valid number: '" + *text + "'");
  }
  return value;
}

Result<double> Query::Number(std::string_view key, double fallback) const {
  const std::optional<std::string> text = Get(key);
  if (!text) return fallback;
  double value = 0;
  const char* end = text->data() + text->size();
  const auto [stop, ec] = std::from_chars(text->data(), end, value);
  if (text->empty() || ec != std::errc() || stop != end || !std::isfinite(value)) {
    return Status::InvalidArgument("query parameter '" + std::string(key) +
                                   "' is not a valid number: '" + *text + "'");
  }
  return value;
}

HttpHandler JsonGetHandler(std::function<ApiResult(const std::string& target)> handler,
                           ErrorShape shape) {
  return [handler = std::move(handler), shape](const std::string& target) {
    return handler(target).ToResponse(shape);
  };
}

HttpPostHandler JsonPostHandler(
    std::function<awaitable<ApiResult>(std::string target, std::string body)> handler,
    ErrorShape shape) {
  return [handler = std::move(handler), shape](std::string target,
                                               std::string body) -> awaitable<HttpResponse> {
    // Named first: GCC 12 mishandles temporaries inside a co_await full-expression.
    awaitable<ApiResult> call = handler(std::move(target), std::move(body));
    const ApiResult result = co_await std::move(call);
    co_return result.ToResponse(shape);
  };
}

HttpApiHandler JsonApiHandler(std::function<awaitable<ApiResult>(HttpRequest request)> handler,
                              ErrorShape shape) {
  return [handler = std::move(handler), shape](HttpRequest request) -> awaitable<HttpResponse> {
    awaitable<ApiResult> call = handler(std::move(request));
    const ApiResult result = co_await std::move(call);
    co_return result.ToResponse(shape);
  };
}

void AddStatusRoutes(HttpServer& server, std::function<json()> status,
                     std::function<std::string(const json&)> metrics) {
  server.Route(
      "/healthz", [](const std::string&) { return HttpResponse{200, "text/plain", "ok\n"}; },
      /*is_public=*/true);
  server.Route("/v1/status", [status](const std::string&) {
    return HttpResponse{200, "application/json",
                        status().dump(2, ' ', false, json::error_handler_t::replace) + "\n"};
  });
  server.Route("/metrics", [status, metrics](const std::string&) {
    return HttpResponse{200, "text/plain; version=0.0.4", metrics(status())};
  });
}

}  // namespace flywheel::transport
