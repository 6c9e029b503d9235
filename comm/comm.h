#pragma once
// One rank per GPU under mpirun: MPI start-up, rank / node / device binding, the TP and DP groups,
// and collectives on tensors. Device tensors go through NCCL (communicators bootstrapped from an
// ncclUniqueId sent over MPI); host tensors through MPI, so the same code runs under mpirun on a
// machine without GPUs. Every collective runs under a watchdog: one that does not finish within
// the timeout makes the rank say which operation hung and take the whole job down instead of
// hanging. NCCL_* environment variables are left as the user set them (never overridden).
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/tensor.h"

namespace dflash::comm {

// Where a rank sits: world, its tensor-parallel group (consecutive ranks) and the data-parallel
// group (all ranks). Pure arithmetic, checked.
struct Layout {
  int world_size = 1, world_rank = 0;
  int tp_size = 1, tp_rank = 0, tp_group = 0;  // tp_group = world_rank / tp_size
  int num_tp_groups = 1;
};
// Throws (naming the numbers) unless 1 <= tp and tp divides world_size.
Layout make_layout(int world_size, int world_rank, int tp);

// MPI start-up and shutdown (RAII). Initializes MPI (thread level FUNNELED) unless already
// initialized, sets MPI_ERRORS_RETURN so failures come back as dflash::Error, and finds the rank's
// node-local rank (MPI_Comm_split_type SHARED) and host name.
class MpiEnv {
 public:
  MpiEnv(int* argc, char*** argv);
  ~MpiEnv();
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  const std::string& host() const { return host_; }
  // True when this process runs under mpirun with more than one rank, or was started by it.
  bool distributed() const { return size_ > 1; }

  // The GPU this rank uses: its local rank. Throws a clear error when the node has more ranks
  // than visible GPUs (naming the host and both numbers).
  Device bind_device() const;

 private:
  bool owns_ = false;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::string host_;
};

// The start of a program that may run under mpirun with a TP size `tp` (dflash_eval, dflash_features,
// target_bench): MPI when tp > 1 or mpirun started this process (into `mpi`, which the caller keeps
// beyond run_app: a rank that fails prints its message before MPI_Finalize, which waits for every
// rank), logging tagged with the rank at `log_level`, and the layout (checked: tp divides the world).
Layout start_ranks(std::unique_ptr<MpiEnv>& mpi, int* argc, char*** argv, int tp, const std::string& log_level);

// Logs `why` with the rank, then ends every rank of the job (MPI_Abort) with `code`. Used when a
// rank throws under mpirun, so the job stops instead of the other ranks waiting forever.
[[noreturn]] void abort_job(const std::string& why, int code = 1);

// A thread that ends the job when a guarded operation runs past its timeout.
class Watchdog {
 public:
  explicit Watchdog(double timeout_s, std::string who);
  ~Watchdog();
  // RAII guard around one operation.
  class Guard {
   public:
    Guard(Watchdog* w, const char* op);
    ~Guard();
   private:
    Watchdog* w_;
  };
  Guard guard(const char* op) { return Guard(this, op); }
  double timeout_s() const { return timeout_s_; }

 private:
  void loop();
  double timeout_s_;
  std::string who_;
  std::mutex mu_;
  std::condition_variable cv_;
  const char* op_ = nullptr;
  std::chrono::steady_clock::time_point started_;
  bool stop_ = false;
  std::thread thread_;
};

// A group of ranks with collectives on host tensors (MPI) or device tensors (NCCL).
class Communicator {
 public:
  // Splits `parent` by `color` (ranks ordered by `key`). For a CUDA device the group also gets an
  // NCCL communicator on that device. `name` ("tp", "dp") names it in messages.
  Communicator(MPI_Comm parent, int color, int key, Device device, double timeout_s, std::string name);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  Device device() const { return device_; }
  const std::string& name() const { return name_; }

  // In place, element-wise sum over the group. f32, f64, bf16 (host bf16 sums in f32), i32, i64.
  void all_reduce_sum(Tensor& t);
  // out = concatenation of every rank's `in` along dim 0 (rank order); out.size(0) = size * in.size(0).
  void all_gather(const Tensor& in, Tensor& out);
  void broadcast(Tensor& t, int root);
  void barrier();
  // Device groups only, for overlapping communication with compute: enqueue an in-place sum of
  // `count` elements at `data` (f32 / bf16 / f64 device memory) on `stream` (a cudaStream_t the
  // caller orders with events) and return at once; wait_async(stream) then waits for everything
  // enqueued there, watching NCCL's error state, under the same timeout as the other collectives.
  void all_reduce_sum_async(void* data, int64_t count, DType dtype, void* stream);
  void wait_async(void* stream, const std::string& op);

 private:
  void check_tensor(const Tensor& t, const char* op) const;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  Device device_;
  std::string name_;
  std::unique_ptr<Watchdog> watchdog_;
  void* nccl_ = nullptr;  // ncclComm_t when the device is CUDA
};

}  // namespace dflash::comm
