// tests/plot_test.cpp — memopt/plot.hpp: plot_metrics draws a PNG from a metrics.jsonl (where
// gnuplot is installed), and names what is wrong with bad input.
#include <catch2/catch.hpp>

#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include <memopt/plot.hpp>

#include "support.hpp"

TEST_CASE("plot_metrics draws a PNG, and says what is wrong with bad input", "[callbacks][plot]") {
  memopt::test::TempDir dir;
  const std::string empty = dir.file("empty.jsonl");
  std::ofstream(empty) << R"({"event":"summary","steps":3})" << "\n";
  auto require_plot_error = [](const std::function<void()>& fn, const std::string& part) {
    try {
      fn();
      FAIL("expected an error mentioning " << part);
    } catch (const std::runtime_error& e) {
      CHECK_THAT(e.what(), Catch::Contains("memopt::plot_metrics") && Catch::Contains(part) &&
                               Catch::Contains("HINT: "));
    }
  };
  require_plot_error([&] { memopt::plot_metrics(dir.file("missing.jsonl"), dir.file("a.png")); }, "cannot read");
  require_plot_error([&] { memopt::plot_metrics(empty, dir.file("a.png")); }, "no \"train\" line");
  if (!memopt::gnuplot_available()) {
    WARN("gnuplot is not installed: plot_metrics' drawing is not tested. HINT: apt-get install gnuplot-nox");
    return;
  }
  const std::string jsonl = dir.file("metrics.jsonl");
  {
    std::ofstream out(jsonl);
    out << R"({"event":"start"})" << "\n";
    for (int step = 1; step <= 4; ++step)
      out << nlohmann::json{{"event", "train"}, {"step", step}, {"loss", 5.0 / step}, {"tracked_mib", 10 + step},
                            {"peak_mib", 20}, {"rss_mib", 100 + step}}.dump()
          << "\n";
    out << R"({"event":"train","step":5,"lo)" << "\n";  // cut by a crash: skipped
  }
  const auto summary = memopt::plot_metrics(jsonl, dir.file("metrics.png"));
  CHECK(summary.points == 4);
  CHECK(summary.first_step == 1);
  CHECK(summary.last_step == 4);
  std::ifstream png(dir.file("metrics.png"), std::ios::binary);
  char magic[8] = {};
  png.read(magic, 8);
  CHECK(std::string(magic, 8) == std::string("\x89PNG\r\n\x1a\n", 8));
}
