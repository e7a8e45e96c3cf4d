// The flags that every networked command shares, declared once: the bearer token
// (--token, --token-file, --scoped-token-file) and TLS (--tls-cert, --tls-key, --tls-ca).
// A command adds the ones it takes, with a line saying whose token or certificate it is;
// the flags' names, value types, exclusions and how they are read (a token file must be
// private to its owner; FLYWHEEL_TOKEN as the fallback where a command allows it; SCOPES:FILE
// for scoped tokens) are the same in every command.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "transport/http.h"
#include "transport/tls.h"

namespace CLI {
class App;
}

namespace flywheel::tools {

struct TokenFlags {
  std::string token;                // --token T
  std::string token_file;           // --token-file F
  std::vector<std::string> scoped;  // --scoped-token-file SCOPES:F, repeatable
};

// --token T and --token-file F (which excludes --token); `token_help` says what the token is
// for.
void AddTokenFlags(CLI::App* app, TokenFlags& flags, const std::string& token_help);
// --token-file F alone, for commands that never take a token on the command line.
void AddTokenFileFlag(CLI::App* app, TokenFlags& flags, const std::string& help);
// --scoped-token-file SCOPES:F (repeatable); `help` names the scopes that matter to the command.
void AddScopedTokenFlag(CLI::App* app, TokenFlags& flags, const std::string& help);
// --tls-cert and --tls-key into `tls`, and --tls-ca when `ca_help` is not empty.
void AddTlsFlags(CLI::App* app, transport::TlsOptions& tls, const std::string& cert_help,
                 const std::string& ca_help);

enum class TokenFallback {
  kNone,
  kEnvironment,  // $FLYWHEEL_TOKEN when neither --token nor --token-file is given
};

// The token the flags give: --token-file's (ReadTokenFile), else --token, else the fallback's,
// else "".
Result<std::string> ResolveToken(const TokenFlags& flags, TokenFallback fallback);

// The first line of a token file, trailing whitespace removed; NotFound / InvalidArgument
// (empty, or open to group or others: CheckPrivateFile in base/env.h) name `flag` and the
// path, never the token.
Result<std::string> ReadTokenFile(const std::string& path, const std::string& flag);

// --scoped-token-file SCOPES:FILE entries ("read:/etc/fw/dashboard.token",
// "read,submit:rollout.token"): each file's token with those scopes (transport/http.h).
// Errors name the flag and the file, never a token.
Result<std::vector<transport::ScopedToken>> ReadScopedTokens(const std::vector<std::string>& specs);

}  // namespace flywheel::tools
