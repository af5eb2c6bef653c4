// tests/io/hf_config_test.cpp — memopt/io/hf_config.hpp: config.json round-trips and takes
// HF's defaults; head_dim, tied embeddings and rope_scaling / rope_parameters in both
// transformers' spellings; values of the wrong kind, a non-object file, mlp_bias, bad JSON,
// missing fields, unknown rope types and missing rope fields are refused naming the file, the
// field and the value. (The weights beside it: pretrained_test.cpp.)
#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/io/hf_config.hpp>
#include <memopt/models/llama.hpp>

#include "io/fixtures.hpp"
#include "support.hpp"

namespace {

using memopt::test::TempDir;
using memopt::test::read_text;
using memopt::test::write_text;
using memopt::test::io::hf_config;
using memopt::test::io::require_error;
using memopt::test::io::write_config;

}  // namespace

TEST_CASE("config.json: values of the wrong kind, a non-object, mlp_bias are refused naming file and field",
          "[io][pretrained]") {
  TempDir dir;
  const std::string path = dir.file("config.json");
  auto rejects = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& part) {
    auto json = memopt::io::to_json(memopt::test::io::tiny_config());
    edit(json);
    memopt::test::write_text(path, json.dump());
    require_error([&] { memopt::io::read_llama_config(path); }, {path, part});
  };
  // Optional fields are checked like required ones when present.
  rejects([](auto& j) { j["num_key_value_heads"] = 0; }, "field \"num_key_value_heads\" must be >= 1 (got 0)");
  rejects([](auto& j) { j["intermediate_size"] = 64.5; }, "field \"intermediate_size\" must be an integer (got 64.5)");
  rejects([](auto& j) { j["max_position_embeddings"] = "16"; }, "\"max_position_embeddings\" must be an integer");
  rejects([](auto& j) { j["rope_theta"] = "1e4"; }, "field \"rope_theta\" must be a number (got \"1e4\")");
  rejects([](auto& j) { j["tie_word_embeddings"] = "no"; }, "\"tie_word_embeddings\" must be true or false");
  rejects([](auto& j) { j["hidden_act"] = 3; }, "field \"hidden_act\" must be a string (got 3)");
  rejects([](auto& j) { j["mlp_bias"] = true; }, "field \"mlp_bias\" is true");
  // null means unset: HF's default (silu, no bias) is taken.
  auto json = memopt::io::to_json(memopt::test::io::tiny_config());
  json["hidden_act"] = nullptr;
  json["mlp_bias"] = false;
  memopt::test::write_text(path, json.dump());
  CHECK(memopt::io::read_llama_config(path).hidden_size() == 16);

  memopt::test::write_text(path, "[1, 2]");
  require_error([&] { memopt::io::read_llama_config(path); },
                {path, "must be a JSON object (got [1,2])"});
}

TEST_CASE("config.json round-trips and takes HF defaults", "[io][pretrained]") {
  TempDir dir;
  const std::string path = dir.file("config.json");
  const auto config = hf_config().causal(false).dropout(0.125).initializer_range(0.01);
  memopt::io::write_llama_config(config, path);
  CHECK(nlohmann::json::parse(read_text(path))["causal"] == false);
  const auto back = memopt::io::read_llama_config(path);
  CHECK(back.vocab_size() == 64);
  CHECK(back.hidden_size() == 32);
  CHECK(back.num_hidden_layers() == 2);
  CHECK(back.num_attention_heads() == 4);
  CHECK(back.num_key_value_heads() == 2);
  CHECK(back.intermediate_size() == 48);
  CHECK(back.max_position_embeddings() == 16);
  CHECK(back.rope_theta() == 500000.0);
  CHECK(back.rms_norm_eps() == 1e-6);
  CHECK(back.dropout() == 0.125);
  CHECK(back.initializer_range() == 0.01);
  CHECK_FALSE(back.causal());

  // The LLaMA rule's FFN width and implicit KV heads are written resolved.
  memopt::io::write_llama_config(memopt::models::LlamaConfig().hidden_size(256).num_attention_heads(4), path);
  const auto json = nlohmann::json::parse(read_text(path));
  CHECK(json["intermediate_size"] == 704);
  CHECK(json["num_key_value_heads"] == 4);

  // Only the four required fields: the rest are HF's defaults; null means unset.
  write_text(path, R"({"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": null, "rope_scaling": null})");
  const auto defaults = memopt::io::read_llama_config(path);
  CHECK(defaults.kv_heads() == 2);
  CHECK(defaults.intermediate_size() == 11008);
  CHECK(defaults.max_position_embeddings() == 2048);
  CHECK(defaults.rms_norm_eps() == 1e-6);
  CHECK(defaults.rope_theta() == 10000.0);
  CHECK(defaults.causal());

  // transformers 5 writes theta inside rope_parameters (and head_dim); both are read, and a
  // head_dim of hidden_size / num_attention_heads stays implicit (written back as before).
  write_text(path, R"({"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "head_dim": 32, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})");
  CHECK(memopt::io::read_llama_config(path).rope_theta() == 500000.0);
  CHECK(memopt::io::read_llama_config(path).head_dim() == 0);
  CHECK(memopt::io::read_llama_config(path).rope_scaling().type() == memopt::nn::RopeType::kDefault);
}

TEST_CASE("config.json: head_dim, tied embeddings and RoPE scaling in both transformers' spellings",
          "[io][pretrained]") {
  using memopt::nn::RopeType;
  TempDir dir;
  const std::string path = dir.file("config.json");
  // Llama 3.2 1B's fields, as transformers 4 wrote them.
  write_text(path, R"({"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                       "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": true,
                       "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8192, "rope_type": "llama3"}})");
  const auto llama32 = memopt::io::read_llama_config(path);
  CHECK(llama32.tie_word_embeddings());
  CHECK(llama32.head_size() == 64);
  CHECK(llama32.rope_theta() == 500000.0);
  CHECK(llama32.rope_scaling().type() == RopeType::kLlama3);
  CHECK(llama32.rope_scaling().factor() == 32.0);
  CHECK(llama32.rope_scaling().low_freq_factor() == 1.0);
  CHECK(llama32.rope_scaling().high_freq_factor() == 4.0);
  CHECK(llama32.rope_scaling().original_max_position_embeddings() == 8192);
  // Its estimate counts the tied embedding once: 1.24 B parameters, as published.
  CHECK(memopt::models::describe(llama32).num_parameters() == 1'235'814'400);

  // transformers 5's rope_parameters; llama3 without original_max_position_embeddings takes
  // max_position_embeddings, as transformers does.
  write_text(path, R"({"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                       "head_dim": 24, "max_position_embeddings": 64,
                       "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8,
                                           "low_freq_factor": 1, "high_freq_factor": 4}})");
  const auto v5 = memopt::io::read_llama_config(path);
  CHECK(v5.head_dim() == 24);
  CHECK(v5.rope_theta() == 500000.0);
  CHECK(v5.rope_scaling().factor() == 8.0);
  CHECK(v5.rope_scaling().original_max_position_embeddings() == 64);
  CHECK_FALSE(v5.tie_word_embeddings());

  // The old "type" key (Code Llama's linear scaling); rope_scaling wins over rope_parameters,
  // as in transformers.
  write_text(path, R"({"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                       "rope_scaling": {"type": "linear", "factor": 4.0},
                       "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})");
  CHECK(memopt::io::read_llama_config(path).rope_scaling().type() == RopeType::kLinear);
  CHECK(memopt::io::read_llama_config(path).rope_scaling().factor() == 4.0);

  // memopt writes them back (rope_scaling in transformers 4's place) and reads the same.
  for (const auto& scaling :
       {memopt::nn::RopeScaling().type(RopeType::kLlama3).factor(8).low_freq_factor(2).high_freq_factor(5)
            .original_max_position_embeddings(32),
        memopt::nn::RopeScaling().type(RopeType::kDynamic).factor(2.5), memopt::nn::RopeScaling()}) {
    const auto config = hf_config().head_dim(12).tie_word_embeddings(true).rope_scaling(scaling);
    memopt::io::write_llama_config(config, path);
    const auto json = nlohmann::json::parse(read_text(path));
    CHECK(json["head_dim"] == 12);
    CHECK(json["tie_word_embeddings"] == true);
    CHECK(json.contains("rope_scaling") == (scaling.type() != RopeType::kDefault));
    const auto back = memopt::io::read_llama_config(path);
    CHECK(back.head_dim() == 12);
    CHECK(back.tie_word_embeddings());
    CHECK(back.rope_scaling().type() == scaling.type());
    CHECK(back.rope_scaling().factor() == scaling.factor());
    CHECK(back.rope_scaling().low_freq_factor() == scaling.low_freq_factor());
    CHECK(back.rope_scaling().high_freq_factor() == scaling.high_freq_factor());
    CHECK(back.rope_scaling().original_max_position_embeddings() == scaling.original_max_position_embeddings());
  }
  // A default config writes no head_dim and no rope_scaling: run configs stay as they were.
  memopt::io::write_llama_config(hf_config(), path);
  const auto plain = nlohmann::json::parse(read_text(path));
  CHECK_FALSE(plain.contains("head_dim"));
  CHECK_FALSE(plain.contains("rope_scaling"));
  CHECK(plain["tie_word_embeddings"] == false);
}

TEST_CASE("bad config.json files give errors naming the file and field", "[io][pretrained]") {
  TempDir dir;
  const std::string path = dir.file("config.json");
  auto rejects = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<std::string>& parts) {
    write_config(dir, edit);
    auto all = parts;
    all.push_back(path);
    require_error([&] { memopt::io::read_llama_config(path); }, all);
  };
  rejects([](auto& j) { j.erase("hidden_size"); }, {"field \"hidden_size\" is missing"});
  rejects([](auto& j) { j["hidden_size"] = "512"; }, {"field \"hidden_size\" must be an integer (got \"512\")"});
  rejects([](auto& j) { j["num_hidden_layers"] = 0; }, {"field \"num_hidden_layers\" must be >= 1 (got 0)"});
  rejects([](auto& j) { j["rms_norm_eps"] = "tiny"; }, {"\"rms_norm_eps\" must be a number (got \"tiny\")"});
  rejects([](auto& j) { j["causal"] = 1; }, {"\"causal\" must be true or false (got 1)"});
  rejects([](auto& j) { j["hidden_act"] = "gelu"; }, {"\"hidden_act\" is \"gelu\"", "silu"});
  rejects([](auto& j) { j["rope_scaling"] = {{"type", "linear"}}; },
          {"(rope_scaling)': field \"factor\" is missing", "rope_type \"linear\" needs it"});
  rejects([](auto& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; },
          {"field \"rope_scaling\": rope_type \"yarn\" is not one memopt implements", "\"factor\":4.0",
           "default, linear, dynamic and llama3"});
  rejects([](auto& j) { j["rope_parameters"] = {{"rope_type", "longrope"}, {"rope_theta", 1e4}}; },
          {"field \"rope_parameters\": rope_type \"longrope\" is not one memopt implements"});
  rejects([](auto& j) {
            j["rope_parameters"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"high_freq_factor", 4.0},
                                    {"original_max_position_embeddings", 8}};
          },
          {"(rope_parameters)': field \"low_freq_factor\" is missing", "rope_type \"llama3\" needs it",
           "\"low_freq_factor\": 1.0"});
  rejects([](auto& j) { j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 4.0},
                                             {"high_freq_factor", 1.0}}; },
          {"llama3 needs 0 < low_freq_factor < high_freq_factor (got 4 and 1)"});
  rejects([](auto& j) { j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", "4"}}; },
          {"field \"factor\" must be a number (got \"4\")"});
  rejects([](auto& j) { j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 0}}; },
          {"factor must be finite and > 0 (got 0)"});
  rejects([](auto& j) { j["partial_rotary_factor"] = 0.5; }, {"\"partial_rotary_factor\" is 0.5", "whole heads"});
  rejects([](auto& j) { j["attention_bias"] = true; }, {"\"attention_bias\" is true"});
  rejects([](auto& j) { j["num_attention_heads"] = 5; }, {"hidden_size / num_attention_heads"});
  rejects([](auto& j) { j["rope_theta"] = 1e4; j["rope_parameters"] = {{"rope_theta", 5e5}}; },
          {"\"rope_theta\" is 10000 but rope_parameters.rope_theta is 500000"});
  rejects([](auto& j) { j["rope_parameters"] = 5e5; }, {"\"rope_parameters\" must be an object (got 500000"});
  rejects([](auto& j) { j["head_dim"] = 7; }, {"head_dim must be even (got 7)"});
  rejects([](auto& j) { j["head_dim"] = 0; }, {"field \"head_dim\" must be >= 1 (got 0)"});
  write_text(path, "{\"vocab_size\": ");
  require_error([&] { memopt::io::read_llama_config(path); }, {path, "not valid JSON"});
  require_error([&] { memopt::io::read_llama_config(dir.file("none.json")); }, {"cannot open config", "none.json"});
}
