// memopt/dist/world.hpp — the process group a run trains in, on PyTorch's own distributed
// engine (c10d): Gloo on CPU, NCCL for CUDA tensors when LibTorch was built with it
// (USE_C10D_NCCL), one GPU per rank: two ranks on one GPU are refused, naming both.
//
// dist::world() is set up once, from the environment torchrun gives each worker (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
// TORCHELASTIC_USE_AGENT_STORE):
//   - under torchrun the elastic agent already serves the TCPStore: every rank connects as a
//     client, through PrefixStore("/worker/attempt_<restart count>") so a restarted job
//     does not read the last attempt's keys;
//   - started by hand (the same variables, no agent) rank 0 serves the store;
//   - with no WORLD_SIZE (or 1) it is a world of one: no store, no thread, and every
//     collective returns at once (a gather or all-to-all copies `in` to `out`).
// Collectives are counted (collectives()), bounded by a timeout (MEMOPT_DIST_TIMEOUT seconds,
// default 120), and a failure names the ranks that stopped answering: each rank beats a
// heartbeat into the store every second, and a failed collective waits three beats to see
// whose stopped.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include "memopt/dist/env.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace memopt::dist {

/// The process group of this run. Get it with dist::world().
class World {
 public:
  using Group = c10d::ProcessGroupGloo;

  explicit World(const Env& env) : env_(env) {
    if (env_.world_size == 1) return;
    // ---- the store: the agent's (torchrun), or rank 0's ----
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(env_.master_port);
    store_options.isServer = !env_.agent_store && env_.rank == 0;
    store_options.numWorkers = env_.agent_store ? c10::nullopt : c10::optional<size_t>(env_.world_size);
    store_options.waitWorkers = false;
    store_options.timeout = env_.timeout;
    try {
      tcp_ = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, store_options);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "memopt::dist: rank ", env_.rank, " of ", env_.world_size, " could not ",
                  store_options.isServer ? "serve" : "reach", " the rendezvous store at ", env_.master_addr, ":",
                  env_.master_port, " (", e.what(), "). HINT: ", store_options.isServer ?
                  "another job may use MASTER_PORT; pick a free one" : "check MASTER_ADDR/MASTER_PORT and that rank 0 runs");
    }
    store_ = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env_.restart_count), tcp_);
    // ---- the process group: Gloo on the loopback device for a local job ----
    auto options = Group::Options::create(env_.timeout);
    options->devices.push_back(device());
    options->threads = 2;
    group_ = c10::make_intrusive<Group>(c10::static_intrusive_pointer_cast<c10d::Store>(store_), env_.rank,
                                        env_.world_size, options);
    heartbeat_ = std::thread([this] { beat(); });
  }

  ~World() { shutdown(); }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  int local_rank() const { return env_.local_rank; }
  /// More than one rank: collectives communicate.
  bool distributed() const { return env_.world_size > 1; }
  const Env& env() const { return env_; }
  /// Collectives issued so far (what tests count).
  int64_t collectives() const { return collectives_.load(); }

  /// Sums each tensor over the ranks, in place (fp32/fp64/int on Gloo: convert bf16 first).
  void all_reduce_sum(std::vector<torch::Tensor> tensors, const char* what = "all_reduce") {
    if (!distributed() || tensors.empty()) return;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& t : tensors) works.push_back(all_reduce_sum_async(t, what));
    for (auto& w : works) wait(what, w);
  }

  /// Starts summing `t` over the ranks in place; finish with wait().
  c10::intrusive_ptr<c10d::Work> all_reduce_sum_async(torch::Tensor t, const char* what = "all_reduce") {
    if (!distributed()) return {};
    std::vector<torch::Tensor> one{std::move(t)};
    return run(what, [&] { return on_group(one.front(), [&](auto& g) { return g.allreduce(one); }); });
  }

  /// Starts an all-to-all: `in` holds in_split[r] elements for each rank r in rank order,
  /// `out` receives out_split[r] elements from each rank r; finish with wait().
  c10::intrusive_ptr<c10d::Work> all_to_all_async(torch::Tensor out, torch::Tensor in, std::vector<int64_t> out_split,
                                                  std::vector<int64_t> in_split, const char* what = "all_to_all") {
    if (!distributed()) return local_copy(out, in);
    return run(what, [&] {
      return on_group(in, [&](auto& g) { return g.alltoall_base(out, in, out_split, in_split); });
    });
  }

  /// Copies root's `t` into every rank's `t`.
  void broadcast(torch::Tensor t, int root, const char* what = "broadcast") {
    if (!distributed()) return;
    std::vector<torch::Tensor> one{std::move(t)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    wait(what, run(what, [&] { return on_group(one.front(), [&](auto& g) { return g.broadcast(one, options); }); }));
  }

  /// Every rank's `t` (same shape and dtype on all), in rank order.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t, const char* what = "all_gather") {
    if (!distributed()) return {t};
    std::vector<std::vector<torch::Tensor>> out(1);
    for (int r = 0; r < size(); ++r) out[0].push_back(torch::empty_like(t));
    std::vector<torch::Tensor> in{t};
    wait(what, run(what, [&] { return on_group(t, [&](auto& g) { return g.allgather(out, in); }); }));
    return out[0];
  }

  /// Starts gathering every rank's `in` into `out` (world × `in`, in rank order, contiguous,
  /// any dtype: moved as bytes); finish with wait().
  c10::intrusive_ptr<c10d::Work> all_gather_into_async(torch::Tensor out, const torch::Tensor& in,
                                                        const char* what = "all_gather") {
    TORCH_CHECK(out.is_contiguous() && in.is_contiguous() && out.numel() == in.numel() * size() &&
                    out.scalar_type() == in.scalar_type(),
                "memopt::dist::World::all_gather_into_async: `out` must be contiguous and hold world_size (", size(),
                ") x ", in.numel(), " elements of ", in.scalar_type(), " (got ", out.numel(), " of ",
                out.scalar_type(), "). HINT: allocate it with torch::empty({world.size() * in.numel()})");
    if (!distributed()) return local_copy(out, in);
    const torch::Tensor out_bytes = out.view(torch::kByte);
    const int64_t n = in.numel() * static_cast<int64_t>(in.element_size());
    std::vector<std::vector<torch::Tensor>> outs(1);
    for (int r = 0; r < size(); ++r) outs[0].push_back(out_bytes.narrow(0, r * n, n));  // views: filled in place
    std::vector<torch::Tensor> ins{in.view(torch::kByte)};
    return run(what, [&] { return on_group(in, [&](auto& g) { return g.allgather(outs, ins); }); });
  }

  void barrier(const char* what = "barrier") {
    if (!distributed()) return;
    wait(what, run(what, [&] { return group_->barrier(); }));
  }

  /// Waits for an async collective; a failure names the ranks that stopped answering.
  void wait(const char* what, const c10::intrusive_ptr<c10d::Work>& work) {
    if (!work) return;  // a world of one's: done
    try {
      work->wait(env_.timeout);
    } catch (const std::exception& e) {
      fail(what, e.what());
    }
  }

  /// Fails on every rank whose `value` differs from rank 0's, naming `what`, the rank and both
  /// values (through the store; e.g. the model's parameter shapes at start).
  void check_same(const std::string& what, const std::string& value) {
    if (!distributed()) return;
    const std::string key = "memopt/check/" + what + "/" + std::to_string(check_count_++);
    store_->set(key + "/" + std::to_string(rank()), std::vector<uint8_t>(value.begin(), value.end()));
    for (int r = 0; r < size(); ++r) {
      if (r == rank() || (rank() != 0 && r != 0)) continue;  // rank 0 checks everyone, the others rank 0
      std::vector<uint8_t> got;
      try {
        got = store_->get(key + "/" + std::to_string(r));
      } catch (const std::exception& e) {
        fail(("check_same(" + what + ")").c_str(), e.what());
      }
      const std::string other(got.begin(), got.end());
      const int odd = rank() == 0 ? r : rank();
      if (other == value) continue;
      const auto [zero, theirs] = first_difference(rank() == 0 ? value : other, rank() == 0 ? other : value);
      TORCH_CHECK(false, "memopt::dist: rank ", odd, "'s ", what, " differ from rank 0's: rank 0 has ", zero, ", rank ",
                  odd, " ", theirs, ". HINT: every rank must build the same model with the same flags");
    }
  }

  /// Bytes under `key`, set by one rank and read by the others (blocks until set, up to the timeout).
  void store_set(const std::string& key, const std::string& value) {
    if (distributed()) store_->set("memopt/" + key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string store_get(const std::string& key) {
    if (!distributed()) return {};
    try {
      const auto v = store_->get("memopt/" + key);
      return {v.begin(), v.end()};
    } catch (const std::exception& e) {
      fail(("store get " + key).c_str(), e.what());
    }
  }

  /// Waits for the others (after a last barrier when nothing failed) and closes the group.
  void shutdown() {
    if (!distributed() || closed_) return;
    closed_ = true;
    if (!failed_) {
      try {
        group_->barrier()->wait(std::chrono::milliseconds(std::min<int64_t>(env_.timeout.count(), 30000)));
      } catch (const std::exception&) {
      }
    }
    {
      std::lock_guard<std::mutex> lock(beat_mutex_);
      stop_ = true;
    }
    beat_cv_.notify_all();
    if (heartbeat_.joinable()) heartbeat_.join();
#if defined(USE_C10D_NCCL)
    nccl_.reset();
#endif
    group_.reset();
    store_.reset();
    tcp_.reset();
  }

 private:
  static std::string shorten(const std::string& s) { return s.size() <= 200 ? s : s.substr(0, 200) + "..."; }

  // The first differing ';'-separated entries of two descriptions ("(none)" past the end).
  static std::pair<std::string, std::string> first_difference(const std::string& a, const std::string& b) {
    size_t i = 0, j = 0;
    while (i < a.size() || j < b.size()) {
      const size_t ei = std::min(a.find(';', i), a.size()), ej = std::min(b.find(';', j), b.size());
      const std::string x = a.substr(i, ei - i), y = b.substr(j, ej - j);
      if (x != y) return {x.empty() ? "(none)" : shorten(x), y.empty() ? "(none)" : shorten(y)};
      i = ei + 1;
      j = ej + 1;
    }
    return {shorten(a), shorten(b)};
  }

  std::shared_ptr<::gloo::transport::Device> device() const {
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0')
      return Group::createDeviceForInterface(ifname);
    const std::string& a = env_.master_addr;
    if (a == "127.0.0.1" || a == "localhost" || a == "::1") return Group::createDeviceForHostname("127.0.0.1");
    try {
      return Group::createDefaultDevice();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "memopt::dist: Gloo found no network device for this host (", e.what(),
                  "). HINT: set GLOO_SOCKET_IFNAME to the interface that reaches MASTER_ADDR (e.g. eth0)");
    }
  }

  // A world of one's gather or all-to-all: `in` is every rank's part.
  static c10::intrusive_ptr<c10d::Work> local_copy(torch::Tensor& out, const torch::Tensor& in) {
    torch::NoGradGuard no_grad;
    out.copy_(in.view(out.sizes()));
    return {};
  }

  // NCCL drives one GPU per rank: every rank's (host, GPU) through the store, and a clear error
  // on the ranks that share one (NCCL itself reports "Duplicate GPU detected" and no HINT).
  void check_own_gpu(const torch::Device& device) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const std::string mine = fmt::format("{} cuda:{}", host, device.index());
    store_set("nccl-gpu/" + std::to_string(rank()), mine);
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      const std::string theirs = store_get("nccl-gpu/" + std::to_string(r));
      TORCH_CHECK(theirs != mine, "memopt::dist: ranks ", std::min(r, rank()), " and ", std::max(r, rank()),
                  " both run on ", mine, ", and NCCL needs a GPU of its own for each rank. HINT: put rank r's model "
                  "on cuda:LOCAL_RANK (the examples' --device cuda does), and start at most as many ranks on a "
                  "machine as it has GPUs (nvidia-smi -L)");
    }
  }

  // The group for `t`'s device: NCCL for CUDA tensors when LibTorch has it (made on first
  // use, on its own store prefix), Gloo otherwise.
  template <class F>
  c10::intrusive_ptr<c10d::Work> on_group(const torch::Tensor& t, F&& f) {
#if defined(USE_C10D_NCCL)
    if (t.is_cuda()) {
      if (!nccl_) {
        check_own_gpu(t.device());
        auto store = c10::make_intrusive<c10d::PrefixStore>("nccl", c10::static_intrusive_pointer_cast<c10d::Store>(store_));
        nccl_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::static_intrusive_pointer_cast<c10d::Store>(store),
                                                             env_.rank, env_.world_size);
      }
      return f(*nccl_);
    }
#endif
    (void)t;
    return f(*group_);
  }

  template <class Start>
  c10::intrusive_ptr<c10d::Work> run(const char* what, Start&& start) {
    ++collectives_;
    try {
      return start();
    } catch (const std::exception& e) {
      fail(what, e.what());
    }
  }

  // A new client connection to the store, under this attempt's prefix (throws when unreachable).
  c10::intrusive_ptr<c10d::PrefixStore> connect(std::chrono::milliseconds timeout) const {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(env_.master_port);
    o.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, o);
    return c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env_.restart_count),
                                                  c10::static_intrusive_pointer_cast<c10d::Store>(tcp));
  }

  // Every second: this rank's beat count into the store (its own connection).
  void beat() {
    c10::intrusive_ptr<c10d::PrefixStore> store;
    try {
      store = connect(std::chrono::milliseconds(5000));
    } catch (const std::exception&) {
      return;  // no heartbeat: failures then name no rank
    }
    int64_t count = 0;
    std::unique_lock<std::mutex> lock(beat_mutex_);
    while (!stop_) {
      lock.unlock();
      try {
        const std::string v = std::to_string(++count);
        store->set("memopt/heartbeat/" + std::to_string(rank()), std::vector<uint8_t>(v.begin(), v.end()));
      } catch (const std::exception&) {
        return;  // the store is gone (rank 0 or the agent ended)
      }
      lock.lock();
      beat_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return stop_; });
    }
  }

  // The other ranks whose heartbeat did not move over ~3 s; {-1} when the store itself is gone.
  std::vector<int> silent_ranks() {
    try {
      auto store = connect(std::chrono::milliseconds(3000));
      auto read = [&] {
        std::vector<std::string> beats;
        for (int r = 0; r < size(); ++r) {
          const std::string key = "memopt/heartbeat/" + std::to_string(r);
          if (!store->check({key})) {
            beats.emplace_back();
            continue;
          }
          const auto v = store->get(key);
          beats.emplace_back(v.begin(), v.end());
        }
        return beats;
      };
      const auto before = read();
      std::this_thread::sleep_for(std::chrono::milliseconds(3200));
      const auto after = read();
      std::vector<int> silent;
      for (int r = 0; r < size(); ++r)
        if (r != rank() && before[static_cast<size_t>(r)] == after[static_cast<size_t>(r)]) silent.push_back(r);
      return silent;
    } catch (const std::exception&) {
      return {-1};
    }
  }

  [[noreturn]] void fail(const char* what, const std::string& error) {
    failed_ = true;
    const auto silent = silent_ranks();
    std::string who;
    if (silent == std::vector<int>{-1}) {
      who = env_.agent_store ? "the torchrun agent's store is gone" : "rank 0, which serves the store, is gone";
    } else if (silent.empty()) {
      who = "every other rank still beats: one may be stuck or on another step";
    } else {
      who = "lost rank(s):";
      for (int r : silent) who.append(" ").append(std::to_string(r));  // not " " + ...: GCC 12 -O3 warns
    }
    TORCH_CHECK(false, "memopt::dist: rank ", rank(), " of ", size(), ": ", what, " failed: ", who, " (", error,
                "). HINT: see the lost rank's own log for why it ended; with torchrun --max_restarts and "
                "--save_every, the job restarts from the last checkpoint (--resume latest)");
  }

  Env env_;
  c10::intrusive_ptr<c10d::TCPStore> tcp_;
  c10::intrusive_ptr<c10d::PrefixStore> store_;
  c10::intrusive_ptr<Group> group_;
#if defined(USE_C10D_NCCL)
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl_;
#endif
  std::atomic<int64_t> collectives_{0};
  int64_t check_count_ = 0;
  bool failed_ = false, closed_ = false;
  std::thread heartbeat_;
  std::mutex beat_mutex_;
  std::condition_variable beat_cv_;
  bool stop_ = false;
};

namespace detail {
inline std::unique_ptr<World>& world_slot() {
  static std::unique_ptr<World> world;
  return world;
}
}  // namespace detail

/// The run's process group, set up from the environment on first use (a world of one when
/// there is no WORLD_SIZE).   if (memopt::dist::world().rank() == 0) fmt::print("...");
inline World& world() {
  auto& slot = detail::world_slot();
  if (!slot) slot = std::make_unique<World>(Env::from_environment());
  return *slot;
}

/// A world of this process alone, whatever the environment (what a Trainer with
/// TrainerOptions::data_parallel(false) uses).
inline World& local_world() {
  static World alone{Env{}};
  return alone;
}

/// Ends the process group (a last barrier first); world() afterwards starts a new one.
inline void shutdown() { detail::world_slot().reset(); }

}  // namespace memopt::dist
