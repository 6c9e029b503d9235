#pragma once
// WorkerPool: T threads kept for the pool's life (the caller's thread is one of them), each running
// the same function once per run(). Encoding wants long-lived threads: each keeps its per-thread
// word cache (text/bpe.h) warm from one batch of texts to the next; the CPU backend's ops share one
// pool through cpu::parallel_for (kernels/cpu/gemm.h).
#include <barrier>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

namespace dflash {

class WorkerPool {
 public:
  explicit WorkerPool(int threads) : sync_(threads < 1 ? 1 : threads) {
    const int n = threads < 1 ? 1 : threads;
    for (int i = 1; i < n; ++i)
      pool_.emplace_back([this, i] {
        for (;;) {
          sync_.arrive_and_wait();  // a run starts (or the pool stops)
          if (stop_) return;
          call(i);
          sync_.arrive_and_wait();  // the run ends
        }
      });
  }
  ~WorkerPool() {
    stop_ = true;
    sync_.arrive_and_wait();
    for (auto& t : pool_) t.join();
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(pool_.size()) + 1; }

  // Calls fn(thread index 0 .. threads-1) on every thread and returns when all have returned;
  // the first exception a thread threw is rethrown here.
  void run(const std::function<void(int)>& fn) {
    fn_ = &fn;
    errors_.assign(pool_.size() + 1, nullptr);
    sync_.arrive_and_wait();
    call(0);
    sync_.arrive_and_wait();
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void call(int i) {
    try {
      (*fn_)(i);
    } catch (...) {
      errors_[static_cast<size_t>(i)] = std::current_exception();
    }
  }

  std::barrier<> sync_;
  std::vector<std::thread> pool_;
  const std::function<void(int)>* fn_ = nullptr;
  std::vector<std::exception_ptr> errors_;
  bool stop_ = false;  // written before the barrier the workers read it after
};

}  // namespace dflash
