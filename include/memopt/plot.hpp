// memopt/plot.hpp — a run's metrics.jsonl as one PNG, drawn by gnuplot: loss over steps in the
// top panel; tracked tensor memory (live), the run's tracked peak and process RSS in the bottom.
// The one implementation of the plot: the examples' --plot call plot_metrics(), and scripts/plot
// compiles a three-line driver of plot_main() once (cached) — so an installed memopt has it too.
// Only the standard library and nlohmann::json (no LibTorch): that driver builds in seconds.
#pragma once

#include <stdlib.h>    // mkdtemp
#include <sys/wait.h>  // WIFEXITED, WEXITSTATUS

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

namespace memopt {

namespace detail {

inline constexpr const char* kInstallGnuplot = "apt-get install gnuplot-nox (or scripts/deps core)";

/// The gnuplot to run: $MEMOPT_GNUPLOT when set, else "gnuplot" from PATH.
inline std::string gnuplot_program() {
  const char* env = std::getenv("MEMOPT_GNUPLOT");
  return env != nullptr && *env != '\0' ? env : "gnuplot";
}

/// `s` as one single-quoted /bin/sh word.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// `s` as a single-quoted gnuplot string ('' is gnuplot's escaped quote).
inline std::string gnuplot_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

/// std::system's status as an exit code (-1: no shell, or killed by a signal).
inline int exit_code(int status) { return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

/// A number of a JSON object, or "?" (gnuplot's missing value, set below) when absent or not a number.
inline std::string column(const nlohmann::json& j, const char* key, const char* fallback = nullptr) {
  auto it = j.find(key);
  if ((it == j.end() || !it->is_number()) && fallback != nullptr) it = j.find(fallback);
  if (it == j.end() || !it->is_number() || !std::isfinite(it->get<double>())) return "?";
  std::ostringstream out;
  out.precision(10);
  out << it->get<double>();
  return out.str();
}

/// A temporary folder, removed with what it holds when this goes out of scope.
class TempDir {
 public:
  TempDir() {
    const auto base = std::filesystem::temp_directory_path();
    std::string pattern = (base / "memopt-plot-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr)
      throw std::runtime_error("memopt::plot_metrics: cannot create a temporary folder under " + base.string() +
                               ". HINT: set TMPDIR to a writable folder.");
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace detail

/// Whether gnuplot can be run (see detail::gnuplot_program(): $MEMOPT_GNUPLOT overrides it).
inline bool gnuplot_available() {
  const std::string cmd = "command -v " + detail::shell_quote(detail::gnuplot_program()) + " >/dev/null 2>&1";
  return detail::exit_code(std::system(cmd.c_str())) == 0;
}

/// Throws when gnuplot is missing: call it before a long run that ends with plot_metrics().
inline void check_gnuplot() {
  if (!gnuplot_available())
    throw std::runtime_error("memopt::plot_metrics: '" + detail::gnuplot_program() + "' was not found. HINT: " +
                             detail::kInstallGnuplot + ".");
}

/// What plot_metrics() drew.
struct PlotSummary {
  int64_t points = 0;  // "train" lines plotted
  int64_t first_step = 0;
  int64_t last_step = 0;
};

/// Reads the "train" lines of a metrics.jsonl (callbacks::JsonlMetrics; other events and lines
/// that are not JSON — a line cut by a crash — are skipped) and writes one PNG to `png_path`:
/// loss over steps; tracked_mib, peak_mib and rss_mib over steps (keys a line lacks are gaps).
/// Throws std::runtime_error with a HINT: no file, no "train" line, no gnuplot, gnuplot failing.
///   memopt::plot_metrics("runs/moe/metrics.jsonl", "runs/moe/metrics.png");
inline PlotSummary plot_metrics(const std::string& jsonl_path, const std::string& png_path) {
  namespace fs = std::filesystem;
  const std::string who = "memopt::plot_metrics: ";
  std::ifstream in(jsonl_path);
  if (!in)
    throw std::runtime_error(who + "cannot read '" + jsonl_path +
                             "'. HINT: pass the metrics.jsonl of a run (OUTPUT_DIR/metrics.jsonl of the examples).");

  const fs::path folder = fs::path(png_path).parent_path();
  std::error_code ec;
  if (!folder.empty() && !fs::is_directory(folder, ec))
    throw std::runtime_error(who + "cannot write '" + png_path + "': the folder '" + folder.string() +
                             "' does not exist. HINT: create it first, or write the PNG next to the metrics.");

  // ---- the data: one row per "train" line: step loss tracked peak rss ----
  detail::TempDir tmp;
  const fs::path data_path = tmp.path() / "metrics.tsv";
  std::ofstream data(data_path);
  PlotSummary summary;
  bool has_col[5] = {true, false, false, false, false};  // a column with one number at least is drawn
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || j.value("event", "") != "train" || !j.contains("step") || !j["step"].is_number()) continue;
    const std::string cols[5] = {detail::column(j, "step"), detail::column(j, "loss"),
                                 detail::column(j, "tracked_mib"), detail::column(j, "peak_mib", "peak_tracked_mib"),
                                 detail::column(j, "rss_mib")};
    for (int c = 1; c < 5; ++c) has_col[c] = has_col[c] || cols[c] != "?";
    data << cols[0] << '\t' << cols[1] << '\t' << cols[2] << '\t' << cols[3] << '\t' << cols[4] << '\n';
    const auto step = j["step"].get<int64_t>();
    if (summary.points == 0) summary.first_step = step;
    summary.last_step = step;
    ++summary.points;
  }
  data.close();
  if (summary.points == 0 || !has_col[1])
    throw std::runtime_error(who + "'" + jsonl_path + "' has no \"train\" line with a loss. HINT: plot the " +
                             "metrics.jsonl that callbacks::JsonlMetrics writes (lines like {\"event\":\"train\"," +
                             "\"step\":5,\"loss\":...}); a run writes them every --log_interval steps.");
  check_gnuplot();

  // ---- the gnuplot script: two panels over steps ----
  const std::string d = detail::gnuplot_quote(data_path.string());
  std::string mem;
  auto add = [&](int col, const char* title, const char* style) {
    if (!has_col[col]) return;
    mem += (mem.empty() ? "plot " : ", ") + d + " using 1:" + std::to_string(col + 1) + " with lines " + style +
           " title '" + title + "'";
  };
  add(2, "tensors live", "lw 2 lc rgb '#1f77b4'");
  add(3, "tensors peak (run so far)", "lw 2 dt 2 lc rgb '#d62728'");
  add(4, "process RSS", "lw 2 lc rgb '#2ca02c'");
  std::ostringstream gp;
  gp << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
        "  set terminal pngcairo noenhanced size 1000,720 font 'sans,10'\n"
        "} else {\n"
        "  set terminal png noenhanced size 1000,720\n"
        "}\n"
     << "set output " << detail::gnuplot_quote(png_path) << "\n"
     << "set datafile separator '\\t'\nset datafile missing '?'\n"
     << "set multiplot layout 2,1 title " << detail::gnuplot_quote(fs::path(jsonl_path).lexically_normal().string())
     << "\n"
        "set grid\nset key top right\nset xlabel 'step'\nset lmargin 10\n"
        "set ylabel 'loss'\n"
     << "plot " << d << " using 1:2 with linespoints lw 2 pt 7 ps 0.6 lc rgb '#9467bd' title 'loss'\n"
     << "set ylabel 'MiB'\nset yrange [0:*]\nset offsets 0, 0, graph 0.15, 0\nset key top left horizontal\n";
  if (!mem.empty()) gp << mem << "\n";
  gp << "unset multiplot\nunset output\n";
  const fs::path script_path = tmp.path() / "metrics.gp";
  std::ofstream(script_path) << gp.str();

  // ---- run it ----
  const fs::path err_path = tmp.path() / "gnuplot.err";
  const std::string cmd = detail::shell_quote(detail::gnuplot_program()) + " " +
                          detail::shell_quote(script_path.string()) + " 2>" + detail::shell_quote(err_path.string());
  const int code = detail::exit_code(std::system(cmd.c_str()));
  if (code != 0 || !fs::exists(png_path, ec) || fs::file_size(png_path, ec) == 0) {
    std::ifstream err_in(err_path);
    const std::string err((std::istreambuf_iterator<char>(err_in)), std::istreambuf_iterator<char>());
    throw std::runtime_error(who + "gnuplot failed (exit code " + std::to_string(code) + ") writing '" + png_path +
                             "': " + err + "HINT: check that the output folder exists and is writable.");
  }
  return summary;
}

/// The command line of scripts/plot: `plot METRICS.jsonl [OUT.png]` (OUT: METRICS with .png).
///   int main(int argc, char** argv) { return memopt::plot_main(argc, argv); }
inline int plot_main(int argc, char** argv, const char* name = "scripts/plot") {
  const std::string usage = std::string("usage: ") + name + " METRICS.jsonl [OUT.png]\n" +
                            "  draws loss and memory (tracked live, tracked peak, RSS) over steps from the \"train\"\n"
                            "  lines of a metrics.jsonl into one PNG; OUT defaults to METRICS with .png\n";
  if (argc >= 2 && (std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help")) {
    std::cout << usage;
    return 0;
  }
  if (argc < 2 || argc > 3) {
    std::cerr << usage;
    return 2;
  }
  const std::string jsonl = argv[1];
  const std::string png = argc == 3 ? argv[2] : std::filesystem::path(jsonl).replace_extension(".png").string();
  try {
    const PlotSummary s = plot_metrics(jsonl, png);
    std::cout << name << ": wrote " << png << " (" << s.points << " points, steps " << s.first_step << ".."
              << s.last_step << ")\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace memopt
