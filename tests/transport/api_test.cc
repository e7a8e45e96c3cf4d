// The HTTP API kit (transport/api.h): the Status -> HTTP table row by row, the two error
// shapes, query parsing, the handler adapters, the status routes, and the server's own
// refusals (401, 403, 404, 405, 413, 431, 500) in the route's error shape, over loopback.
#include "transport/api.h"

#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <string>
#include <thread>

namespace flywheel::transport {
namespace {

using nlohmann::json;

json BodyOf(const HttpResponse& response) {
  return json::parse(response.body);
}

// Each status code's expected HTTP status and error code, stated call by call (not a copy
// of the kit's table): the accessors, ApiError::From and ErrorResponse must all agree.
void ExpectRow(StatusCode code, int status, const char* error_code) {
  SCOPED_TRACE(StatusCodeName(code));
  EXPECT_EQ(HttpStatusOf(code), status);
  EXPECT_STREQ(ErrorCodeOf(code), error_code);
  if (code == StatusCode::kOk) return;
  const ApiError error = ApiError::From(Status(code, "what went wrong"));
  EXPECT_EQ(error.status, status);
  EXPECT_EQ(error.code, error_code);
  EXPECT_EQ(error.message, "what went wrong");
  const HttpResponse response = ErrorResponse(Status(code, "what went wrong"));
  EXPECT_EQ(response.status, status);
  EXPECT_EQ(BodyOf(response)["error"]["code"], error_code);
}

TEST(ApiTableTest, EveryStatusCodeHasItsRow) {
  // The caller's fault: 4xx.
  ExpectRow(StatusCode::kInvalidArgument, 400, "bad_request");
  ExpectRow(StatusCode::kNotFound, 404, "not_found");
  ExpectRow(StatusCode::kMismatch, 409, "conflict");
  ExpectRow(StatusCode::kResourceExhausted, 413, "too_large");
  ExpectRow(StatusCode::kCorruption, 422, "invalid_content");
  // The server's: 5xx.
  ExpectRow(StatusCode::kIOError, 500, "io_error");
  ExpectRow(StatusCode::kInternal, 500, "internal");
  ExpectRow(StatusCode::kUnavailable, 503, "unavailable");
  // Ok is a caller's bug, never a success.
  ExpectRow(StatusCode::kOk, 500, "internal");
}

TEST(ApiShapeTest, FlywheelShapeCarriesCodeMessageAndDetails) {
  const ApiError error{409, "version_conflict", "v3 is not above the head v4",
                       json{{"head_version", 4}}};
  const HttpResponse response = ErrorResponse(error);
  EXPECT_EQ(response.status, 409);
  EXPECT_EQ(response.content_type, "application/json");
  EXPECT_EQ(BodyOf(response), (json{{"error",
                                     {{"code", "version_conflict"},
                                      {"message", "v3 is not above the head v4"},
                                      {"head_version", 4}}}}));
}

TEST(ApiShapeTest, DetailsCannotOverwriteCodeOrMessage) {
  const ApiError error{400, "bad_request", "the real message",
                       json{{"code", "forged"}, {"message", "forged"}}};
  const json body = BodyOf(ErrorResponse(error));
  EXPECT_EQ(body["error"]["code"], "bad_request");
  EXPECT_EQ(body["error"]["message"], "the real message");
}

TEST(ApiShapeTest, OpenAiShapeHasMessageTypeParamAndCode) {
  struct Case {
    int status;
    const char* type;
  };
  for (const Case& c : {Case{400, "invalid_request_error"}, Case{401, "authentication_error"},
                        Case{403, "permission_error"}, Case{404, "not_found_error"},
                        Case{409, "invalid_request_error"}, Case{413, "invalid_request_error"},
                        Case{500, "server_error"}, Case{503, "server_error"}}) {
    SCOPED_TRACE(c.status);
    const ApiError error{c.status, "some_code", "the message", json{{"ignored", 1}}};
    const json body = BodyOf(ErrorResponse(error, ErrorShape::kOpenAi));
    EXPECT_EQ(body, (json{{"error",
                           {{"message", "the message"},
                            {"type", c.type},
                            {"param", nullptr},
                            {"code", "some_code"}}}}));
  }
}

TEST(ApiShapeTest, InvalidUtf8InAMessageIsReplacedNotThrown) {
  const ApiError error{400, "bad_request", std::string("byte \xff here")};
  HttpResponse response;
  EXPECT_NO_THROW(response = ErrorResponse(error));
  EXPECT_NE(response.body.find("byte"), std::string::npos);
  EXPECT_NO_THROW((void)BodyOf(response));
}

TEST(ApiShapeTest, ParseErrorBodyReadsBothShapesAndRefusesOthers) {
  const std::optional<ApiError> ours = ParseErrorBody(
      409, ErrorResponse(ApiError{409, "pinned", "unpin first", json{{"pin", 3}}}).body);
  ASSERT_TRUE(ours.has_value());
  EXPECT_EQ(ours->status, 409);
  EXPECT_EQ(ours->code, "pinned");
  EXPECT_EQ(ours->message, "unpin first");
  EXPECT_EQ(ours->details, (json{{"pin", 3}}));

  const std::optional<ApiError> openai =
      ParseErrorBody(400, R"({"error": {"message": "bad", "type": "invalid_request_error"}})");
  ASSERT_TRUE(openai.has_value());
  EXPECT_EQ(openai->code, "invalid_request_error");
  EXPECT_EQ(openai->message, "bad");

  EXPECT_FALSE(ParseErrorBody(400, "not json").has_value());
  EXPECT_FALSE(ParseErrorBody(400, R"({"status": "error", "reason": "old shape"})").has_value());
  EXPECT_FALSE(ParseErrorBody(400, R"({"error": "a string"})").has_value());
  EXPECT_EQ(DescribeErrorBody(404, ErrorResponse(Status::NotFound("no v9")).body),
            "HTTP 404 not_found: no v9");
  EXPECT_EQ(DescribeErrorBody(502, "bad gateway"), "HTTP 502: bad gateway");
}

TEST(ApiResultTest, ConvertsFromJsonStatusAndResult) {
  const ApiResult created(json{{"id", "u1"}}, 201);
  EXPECT_TRUE(created.ok());
  EXPECT_EQ(created.ToResponse().status, 201);
  EXPECT_EQ(BodyOf(created.ToResponse()), (json{{"id", "u1"}}));

  const ApiResult failed = Status::Mismatch("other shapes");
  EXPECT_FALSE(failed.ok());
  EXPECT_EQ(failed.status(), 409);
  EXPECT_EQ(BodyOf(failed.ToResponse())["error"]["code"], "conflict");

  const Result<json> good = json{{"a", 1}};
  EXPECT_EQ(ApiResult(good).ToResponse().status, 200);
  const Result<json> bad = Status::Corruption("checksum");
  const HttpResponse response = ApiResult(bad).ToResponse(ErrorShape::kOpenAi);
  EXPECT_EQ(response.status, 422);
  EXPECT_EQ(BodyOf(response)["error"]["type"], "invalid_request_error");
  EXPECT_EQ(BodyOf(response)["error"]["code"], "invalid_content");
}

TEST(QueryTest, ParsesParametersAndNumbers) {
  const Query query("/v1/wait?version=12&fraction=0.5&flag&empty=&version=99");
  EXPECT_EQ(query.Get("version"), "12");  // the first of a repeated key
  EXPECT_EQ(query.Get("flag"), "");
  EXPECT_EQ(query.Get("empty"), "");
  EXPECT_FALSE(query.Get("missing").has_value());
  EXPECT_FALSE(query.Get("vers").has_value());
  EXPECT_EQ(*query.Unsigned("version", 7), 12u);
  EXPECT_EQ(*query.Unsigned("missing", 7), 7u);
  EXPECT_DOUBLE_EQ(*query.Number("fraction", 1.0), 0.5);
  EXPECT_DOUBLE_EQ(*query.Number("missing", 1.0), 1.0);
  EXPECT_FALSE(Query("/v1/wait").Get("version").has_value());
  EXPECT_FALSE(Query("/v1/wait?").Get("").has_value());
}

TEST(QueryTest, MalformedNumbersAreInvalidArgumentNamingTheParameter) {
  for (const char* target : {"/x?offset=-1", "/x?offset=12abc", "/x?offset=", "/x?offset=1.5",
                             "/x?offset=99999999999999999999999", "/x?offset= 1"}) {
    SCOPED_TRACE(target);
    const Result<uint64_t> value = Query(target).Unsigned("offset", 0);
    ASSERT_FALSE(value.ok());
    EXPECT_EQ(value.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(value.status().message().find("'offset'"), std::string::npos);
    EXPECT_EQ(ApiError::From(value.status()).status, 400);
  }
  for (const char* target : {"/x?f=abc", "/x?f=nan", "/x?f=inf", "/x?f=0.5x", "/x?f="}) {
    SCOPED_TRACE(target);
    EXPECT_FALSE(Query(target).Number("f", 0).ok());
  }
}

// A server with a flywheel-shaped API, an OpenAI-shaped POST route and the status routes.
class KitServer {
 public:
  KitServer() {
    HttpServerOptions options;
    options.token = "fleet-token";
    options.scoped_tokens.push_back({"read-token", kScopeRead});
    auto server = HttpServer::Start(io_.get_executor(), {"127.0.0.1", 0}, options);
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    server_->RouteApi(
        "/v1/things", JsonApiHandler([](HttpRequest request) -> awaitable<ApiResult> {
          if (request.path == "/v1/things/missing") co_return Status::NotFound("no such thing");
          if (request.path == "/v1/things/throws") throw std::runtime_error("a bug");
          const Query query(request.target);
          Result<uint64_t> n = query.Unsigned("n", 1);
          if (!n.ok()) co_return n.status();
          co_return json{{"n", *n}, {"method", request.method}};
        }), 64);
    server_->RoutePost(
        "/v1/completions",
        JsonPostHandler(
            [](std::string, std::string body) -> awaitable<ApiResult> {
              if (body.empty()) co_return Status::InvalidArgument("empty body");
              co_return json{{"ok", true}};
            },
            ErrorShape::kOpenAi),
        64, kScopeSample, ErrorShape::kOpenAi);
    AddStatusRoutes(
        *server_, [] { return json{{"role", "test"}, {"up", true}}; },
        [](const json& status) { return "flywheel_up " + std::string(status["up"] ? "1" : "0") + "\n"; });
    thread_ = std::thread([this] { io_.run(); });
  }
  ~KitServer() {
    std::promise<void> stopped;
    asio::post(io_, [&] {
      server_->Stop();
      stopped.set_value();
    });
    stopped.get_future().wait();
    thread_.join();
  }
  Endpoint endpoint() const { return {"127.0.0.1", server_->port()}; }

 private:
  asio::io_context io_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
};

HttpGetOptions As(std::string token) {
  HttpGetOptions options;
  options.token = std::move(token);
  return options;
}

// Status and parsed body of a call; the body must be JSON.
std::pair<int, json> Call(const Endpoint& at, const std::string& method, const std::string& target,
                          const std::string& body, const std::string& token) {
  Result<HttpResponse> response = HttpCall(at, method, target, body, As(token));
  EXPECT_TRUE(response.ok()) << response.status().ToString();
  if (!response.ok()) return {0, json()};
  EXPECT_EQ(response->content_type, "application/json") << target;
  return {response->status, json::parse(response->body)};
}

TEST(ApiServerTest, HandlersAnswerJsonAndTheTable) {
  KitServer server;
  auto [status, body] = Call(server.endpoint(), "GET", "/v1/things?n=5", "", "fleet-token");
  EXPECT_EQ(status, 200);
  EXPECT_EQ(body, (json{{"n", 5}, {"method", "GET"}}));
  std::tie(status, body) = Call(server.endpoint(), "GET", "/v1/things?n=x", "", "fleet-token");
  EXPECT_EQ(status, 400);
  EXPECT_EQ(body["error"]["code"], "bad_request");
  std::tie(status, body) = Call(server.endpoint(), "GET", "/v1/things/missing", "", "fleet-token");
  EXPECT_EQ(status, 404);
  EXPECT_EQ(body["error"]["message"], "no such thing");
  std::tie(status, body) = Call(server.endpoint(), "GET", "/v1/things/throws", "", "fleet-token");
  EXPECT_EQ(status, 500);
  EXPECT_EQ(body["error"]["code"], "internal");
}

TEST(ApiServerTest, TheServersOwnRefusalsHaveTheOneShape) {
  KitServer server;
  struct Case {
    std::string method, target, body, token;
    int status;
    std::string code;
  };
  const Case cases[] = {
      {"GET", "/v1/status", "", "", 401, "unauthorized"},
      {"GET", "/v1/status", "", "wrong", 401, "unauthorized"},
      {"POST", "/v1/things", "{}", "", 401, "unauthorized"},
      {"GET", "/nowhere", "", "fleet-token", 404, "not_found"},
      {"POST", "/v1/status", "{}", "fleet-token", 405, "method_not_allowed"},
      {"POST", "/v1/things", std::string(100, 'x'), "fleet-token", 413, "too_large"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.method + " " + c.target + " as '" + c.token + "'");
    auto [status, body] = Call(server.endpoint(), c.method, c.target, c.body, c.token);
    EXPECT_EQ(status, c.status);
    ASSERT_TRUE(body.contains("error")) << body.dump();
    EXPECT_EQ(body["error"]["code"], c.code) << body.dump();
    EXPECT_TRUE(body["error"]["message"].is_string()) << body.dump();
    EXPECT_FALSE(body["error"].contains("type")) << body.dump();
  }
}

TEST(ApiServerTest, OpenAiRoutesRefuseInTheOpenAiShape) {
  KitServer server;
  struct Case {
    std::string method, body, token;
    int status;
    std::string type;
  };
  const Case cases[] = {
      {"POST", "{}", "", 401, "authentication_error"},
      {"POST", "{}", "read-token", 403, "permission_error"},
      {"GET", "", "fleet-token", 405, "invalid_request_error"},
      {"POST", std::string(100, 'x'), "fleet-token", 413, "invalid_request_error"},
      {"POST", "", "fleet-token", 400, "invalid_request_error"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.method + " as '" + c.token + "'");
    auto [status, body] = Call(server.endpoint(), c.method, "/v1/completions", c.body, c.token);
    EXPECT_EQ(status, c.status);
    EXPECT_EQ(body["error"]["type"], c.type) << body.dump();
    EXPECT_TRUE(body["error"].contains("param")) << body.dump();
    EXPECT_TRUE(body["error"]["message"].is_string()) << body.dump();
  }
  auto [status, body] = Call(server.endpoint(), "POST", "/v1/completions", "{}", "fleet-token");
  EXPECT_EQ(status, 200);
  EXPECT_EQ(body, (json{{"ok", true}}));
}

TEST(ApiServerTest, StatusRoutesServeStatusMetricsAndHealth) {
  KitServer server;
  Result<HttpResponse> status = HttpGet(server.endpoint(), "/v1/status", As("read-token"));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->status, 200);
  EXPECT_EQ(json::parse(status->body), (json{{"role", "test"}, {"up", true}}));
  Result<HttpResponse> metrics = HttpGet(server.endpoint(), "/metrics", As("read-token"));
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->content_type, "text/plain; version=0.0.4");
  EXPECT_EQ(metrics->body, "flywheel_up 1\n");
  Result<HttpResponse> health = HttpGet(server.endpoint(), "/healthz");  // public
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok\n");
}

}  // namespace
}  // namespace flywheel::transport
