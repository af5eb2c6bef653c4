// memopt/io/json.hpp — a JSON object read from a file, with errors that name the file: one that
// cannot be opened, is not JSON or holds something else than an object, each with a HINT.
// Used by io/peft.hpp (adapter_config.json); pretrained.hpp's config.json and data/
// hf_tokenizer.hpp's tokenizer.json still read theirs inline.
//   nlohmann::json config = memopt::io::detail::read_json_object(path, "adapter config", "rewrite it with …");
#pragma once

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/io/safetensors.hpp"

namespace memopt::io::detail {

/// The JSON object in `path`; `what` names the file in errors ("adapter config"), `hint` says
/// how to make a good one.
inline nlohmann::json read_json_object(const std::string& path, std::string_view what, std::string_view hint) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "memopt::io: cannot open ", what, " '", path, "' (", std::strerror(errno),
              "). HINT: check the file's permissions");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    TORCH_CHECK(false, "memopt::io: ", what, " '", path, "' is not valid JSON (", e.what(), "). HINT: ", hint);
  }
  TORCH_CHECK(json.is_object(), "memopt::io: ", what, " '", path, "' must be a JSON object (got ", snippet(json),
              "). HINT: ", hint);
  return json;
}

}  // namespace memopt::io::detail
