// One-line status text without a repeated code (see kvpool/common/status_text.h).
#include "kvpool/common/status_text.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvpool {

std::string StatusText(const absl::Status& status) {
  const std::string code = absl::StatusCodeToString(status.code());
  if (status.ok()) {
    return code;
  }
  absl::string_view msg = absl::StripAsciiWhitespace(status.message());
  const std::string prefix = absl::StrCat(code, ":");
  while (absl::ConsumePrefix(&msg, prefix)) {
    msg = absl::StripLeadingAsciiWhitespace(msg);
  }
  if (msg.empty() || msg == code) {
    return code;
  }
  return absl::StrCat(code, ": ", msg);
}

}  // namespace kvpool
