// tests/io/manifest_test.cpp — memopt/io/manifest.hpp: manifest.json round-trips through
// dump() and parse(), each malformed field is refused naming it and the value seen, and
// verify_checkpoint finds a missing, truncated or changed file, or a missing manifest, and
// names it. (The Trainer's checkpoints that write them: checkpoint_test.cpp.)
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "support.hpp"

#include <memopt/io/manifest.hpp>

TEST_CASE("manifest.json: each malformed field is refused, naming it and the value", "[checkpoint]") {
  const std::string good_file = R"({"bytes": 10, "xxh3": "0123456789abcdef"})";
  const std::string files = R"({"model.safetensors": )" + good_file + R"(, "trainer.pt": )" + good_file +
                            R"(, "state.json": )" + good_file + "}";
  auto manifest = [&](const std::string& format, const std::string& version, const std::string& step,
                      const std::string& f) {
    return R"({"format": )" + format + R"(, "version": )" + version + R"(, "step": )" + step + R"(, "files": )" + f + "}";
  };
  const auto m = memopt::io::Manifest::parse(manifest(R"("memopt-checkpoint")", "2", "7", files), "m.json");
  CHECK(m.step == 7);
  CHECK(m.files.at("trainer.pt").bytes == 10);
  CHECK(memopt::io::Manifest::parse(m.dump(), "again").files == m.files);

  struct Case {
    std::string text;
    std::vector<std::string> parts;
  };
  const std::string fmt = R"("memopt-checkpoint")";
  const std::vector<Case> cases = {
      {"{\"format\": ", {"is not valid JSON"}},
      {"[1, 2]", {"must be a JSON object", "[1,2]"}},
      {R"({"version": 2})", {"\"format\" is missing"}},
      {manifest(R"("zip")", "2", "7", files), {"\"format\" is \"zip\"", "memopt-checkpoint"}},
      {manifest(fmt, "3", "7", files), {"\"version\" is 3", "reads version 2"}},
      {manifest(fmt, "2", "-1", files), {"\"step\" must be an integer >= 0", "(got -1)"}},
      {manifest(fmt, "2", "\"7\"", files), {"\"step\" must be an integer >= 0", "(got \"7\")"}},
      {manifest(fmt, "2", "7", "[]"), {"\"files\" must be an object", "(got [])"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": 5})"), {"\"model.safetensors\" must be an object", "(got 5)"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": {"xxh3": "0123456789abcdef"}})"), {"\"bytes\" is missing"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": {"bytes": -4, "xxh3": "0123456789abcdef"}})"),
       {"\"bytes\" must be an integer >= 0", "(got -4)"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": {"bytes": 4, "xxh3": "XYZ"}})"),
       {"\"xxh3\" must be 16 lowercase hex digits", "(got \"XYZ\")"}},
      {manifest(fmt, "2", "7", R"({"../x": )" + good_file + "}"), {"\"../x\" is not a plain file name"}},
      {manifest(fmt, "2", "7", R"({"trainer.pt\u0000x": )" + good_file + "}"), {"is not a plain file name"}},
      {manifest(fmt, "2", "7", R"({"model.safetensors": )" + good_file + "}"), {"does not list \"trainer.pt\""}},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    memopt::test::require_error([&] { memopt::io::Manifest::parse(c.text, "ckpt/manifest.json"); },
                                "memopt::io: checkpoint manifest 'ckpt/manifest.json'", c.parts);
  }
}

TEST_CASE("verify_checkpoint: every listed file present, of its size and checksum, or named", "[checkpoint]") {
  memopt::test::TempDir dir;
  const std::string ckpt = dir.file("step-00000003");
  memopt::io::Manifest manifest;
  manifest.step = 3;
  for (const auto& name : memopt::io::checkpoint_files()) {
    memopt::test::write_text(ckpt + "/" + name, "contents of " + name);
    manifest.files[name] = memopt::io::digest_file(ckpt + "/" + name);
  }
  const std::string who = "memopt::io: checkpoint '" + ckpt + "'";
  memopt::test::require_error([&] { memopt::io::verify_checkpoint(ckpt); }, who, {"manifest.json is missing", "HINT"});
  memopt::test::write_text(ckpt + "/manifest.json", manifest.dump());
  const auto verified = memopt::io::verify_checkpoint(ckpt);
  CHECK(verified.step == 3);
  CHECK(verified.files == manifest.files);
  CHECK(verified.files.at("trainer.pt").bytes == static_cast<int64_t>(std::string("contents of trainer.pt").size()));

  memopt::test::write_text(ckpt + "/state.json", "contents of state.jsoN");  // same size, one byte changed
  memopt::test::require_error([&] { memopt::io::verify_checkpoint(ckpt); }, who,
                              {"'state.json' fails its checksum", manifest.files.at("state.json").xxh3, "HINT"});
  memopt::test::write_text(ckpt + "/state.json", "contents");  // truncated
  memopt::test::require_error([&] { memopt::io::verify_checkpoint(ckpt); }, who,
                              {"'state.json' has 8 bytes, the manifest says 22", "truncated"});
  std::filesystem::remove(ckpt + "/state.json");
  memopt::test::require_error([&] { memopt::io::verify_checkpoint(ckpt); }, who, {"'state.json' is missing"});
  memopt::test::require_error([&] { memopt::io::verify_checkpoint(dir.file("nowhere")); }, "memopt::io: checkpoint",
                              {"is not a directory", "'latest'"});
}
