// One place that includes Boost.Asio/Beast for flywheel, with the aliases every transport
// file uses. Boost 1.74's awaitable.hpp uses std::exchange without including <utility>.
#pragma once

#include <utility>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/ssl.hpp>

namespace flywheel::transport {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = boost::asio::ip::tcp;
using boost::asio::awaitable;
using boost::asio::use_awaitable;
using error_code = boost::system::error_code;

}  // namespace flywheel::transport
