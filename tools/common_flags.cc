#include "tools/common_flags.h"

#include <CLI/CLI.hpp>
#include <cctype>
#include <cstdlib>
#include <fstream>

#include "base/env.h"

namespace flywheel::tools {

void AddTokenFlags(CLI::App* app, TokenFlags& flags, const std::string& token_help) {
  app->add_option("--token", flags.token, token_help)->type_name("T");
  AddTokenFileFlag(app, flags, "Read the token from this file (keeps it out of the process list)");
  app->get_option("--token-file")->excludes("--token");
}

void AddTokenFileFlag(CLI::App* app, TokenFlags& flags, const std::string& help) {
  app->add_option("--token-file", flags.token_file, help)->type_name("F");
}

void AddScopedTokenFlag(CLI::App* app, TokenFlags& flags, const std::string& help) {
  app->add_option("--scoped-token-file", flags.scoped, help)->type_name("SCOPES:F");
}

void AddTlsFlags(CLI::App* app, transport::TlsOptions& tls, const std::string& cert_help,
                 const std::string& ca_help) {
  app->add_option("--tls-cert", tls.cert_file, cert_help)->type_name("F");
  app->add_option("--tls-key", tls.key_file, "TLS private key (PEM) of --tls-cert")->type_name("F");
  if (!ca_help.empty()) app->add_option("--tls-ca", tls.ca_file, ca_help)->type_name("F");
}

Result<std::string> ResolveToken(const TokenFlags& flags, TokenFallback fallback) {
  if (!flags.token_file.empty()) return ReadTokenFile(flags.token_file, "--token-file");
  if (!flags.token.empty() || fallback == TokenFallback::kNone) return flags.token;
  const char* from_env = std::getenv("FLYWHEEL_TOKEN");
  return std::string(from_env != nullptr ? from_env : "");
}

Result<std::string> ReadTokenFile(const std::string& path, const std::string& flag) {
  FW_RETURN_IF_ERROR(CheckPrivateFile(path, flag));
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read " + flag + " " + path);
  std::string token;
  std::getline(in, token);
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) return Status::InvalidArgument(flag + " " + path + " is empty");
  return token;
}

Result<std::vector<transport::ScopedToken>> ReadScopedTokens(
    const std::vector<std::string>& specs) {
  std::vector<transport::ScopedToken> tokens;
  for (const std::string& spec : specs) {
    const size_t colon = spec.find(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == spec.size()) {
      return Status::InvalidArgument(
          "--scoped-token-file '" + spec +
          "' is not SCOPES:FILE (e.g. read:/etc/flywheel/dashboard.token)");
    }
    Result<uint32_t> scopes = transport::ParseScopes(spec.substr(0, colon));
    if (!scopes.ok()) return scopes.status().WithContext("--scoped-token-file " + spec);
    FW_ASSIGN_OR_RETURN(std::string token,
                        ReadTokenFile(spec.substr(colon + 1), "--scoped-token-file"));
    tokens.push_back({std::move(token), *scopes});
  }
  return tokens;
}

}  // namespace flywheel::tools
