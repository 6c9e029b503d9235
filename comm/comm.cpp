#include "comm/comm.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "comm/mpi_check.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#if DFLASH_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include "core/cuda/check.h"
#endif

namespace dflash::comm {

Layout make_layout(int world_size, int world_rank, int tp) {
  DFLASH_CHECK(world_size >= 1 && world_rank >= 0 && world_rank < world_size,
               "parallel layout: rank " << world_rank << " of " << world_size);
  DFLASH_REQUIRE_HINT(tp >= 1 && world_size % tp == 0,
                    "parallel.tp = " << tp << " does not divide the world size " << world_size,
                    "launch a multiple of tp ranks (mpirun -n k*" << tp << ") or change parallel.tp");
  Layout l;
  l.world_size = world_size;
  l.world_rank = world_rank;
  l.tp_size = tp;
  l.tp_rank = world_rank % tp;
  l.tp_group = world_rank / tp;
  l.num_tp_groups = world_size / tp;
  return l;
}

Layout start_ranks(std::unique_ptr<MpiEnv>& mpi, int* argc, char*** argv, int tp, const std::string& log_level) {
  if (tp > 1 || env_rank() >= 0) mpi = std::make_unique<MpiEnv>(argc, argv);
  const int world = mpi ? mpi->size() : 1, rank = mpi ? mpi->rank() : 0;
  init_logging(rank, log_level);
  return make_layout(world, rank, tp);
}

// ---------------------------------------------------------------------------------------------
// MpiEnv

MpiEnv::MpiEnv(int* argc, char*** argv) {
  int initialized = 0;
  DFLASH_MPI_CHECK(MPI_Initialized(&initialized));
  if (!initialized) {
    int provided = 0;
    DFLASH_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    owns_ = true;
  }
  DFLASH_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  DFLASH_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  DFLASH_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  MPI_Comm node = MPI_COMM_NULL;
  DFLASH_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
  DFLASH_MPI_CHECK(MPI_Comm_rank(node, &local_rank_));
  DFLASH_MPI_CHECK(MPI_Comm_size(node, &local_size_));
  MPI_Comm_free(&node);
  char name[MPI_MAX_PROCESSOR_NAME] = {0};
  int len = 0;
  DFLASH_MPI_CHECK(MPI_Get_processor_name(name, &len));
  host_.assign(name, static_cast<size_t>(len));
}

MpiEnv::~MpiEnv() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

Device MpiEnv::bind_device() const {
  const int gpus = cuda_device_count();
  DFLASH_REQUIRE_HINT(local_rank_ < gpus, "rank " << rank_ << " is local rank " << local_rank_ << " of " << local_size_
                                                << " on host " << host_ << ", which has " << gpus << " visible GPU(s)",
                    "start at most one rank per GPU on each node (mpirun -n <GPUs>), or check CUDA_VISIBLE_DEVICES");
  return Device::cuda(local_rank_);
}

void abort_job(const std::string& why, int code) {
  int rank = 0, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "[rank %d] fatal: %s\n", rank, why.c_str());
  std::fflush(stderr);
  spdlog::shutdown();
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

// ---------------------------------------------------------------------------------------------
// Watchdog

Watchdog::Watchdog(double timeout_s, std::string who) : timeout_s_(timeout_s), who_(std::move(who)) {
  DFLASH_REQUIRE_HINT(timeout_s > 0, who_ << ": collective timeout " << timeout_s << " s must be positive",
                    "set parallel.timeout_s to the longest a collective may legitimately take (e.g. 600)");
  thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Watchdog::Guard::Guard(Watchdog* w, const char* op) : w_(w) {
  {
    std::lock_guard<std::mutex> lock(w_->mu_);
    w_->op_ = op;
    w_->started_ = std::chrono::steady_clock::now();
  }
  w_->cv_.notify_all();
}

Watchdog::Guard::~Guard() {
  std::lock_guard<std::mutex> lock(w_->mu_);
  w_->op_ = nullptr;
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (op_ == nullptr) {
      cv_.wait(lock);
      continue;
    }
    const auto deadline = started_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                         std::chrono::duration<double>(timeout_s_));
    const char* op = op_;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && op_ == op && !stop_ &&
        std::chrono::steady_clock::now() >= deadline) {
      // A blocked MPI / NCCL call cannot be interrupted from here: report and leave; mpirun sees
      // the rank exit and tears the job down instead of letting every rank hang.
      std::fprintf(stderr,
                   "%s: collective %s did not finish within %.0f s; ending this rank so that mpirun stops the job "
                   "(another rank probably failed or stopped before reaching it)\n",
                   who_.c_str(), op, timeout_s_);
      std::fflush(stderr);
      std::_Exit(124);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Communicator

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::U8: case DType::F8E4M3: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
  }
}

#if DFLASH_WITH_CUDA
ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8: case DType::F8E4M3: return ncclUint8;
  }
  return ncclFloat32;
}

// Waits for the stream while watching NCCL's asynchronous error state; the watchdog bounds it.
void wait_nccl(ncclComm_t comm, cudaStream_t stream, const std::string& what) {
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) DFLASH_CUDA_CHECK(q);
    ncclResult_t async = ncclSuccess;
    DFLASH_NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
    if (async != ncclSuccess) {
      ncclCommAbort(comm);
      DFLASH_FAIL(what << ": NCCL reported " << ncclGetErrorString(async) << " (" << ncclGetLastError(comm) << ")");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}
#endif

}  // namespace

Communicator::Communicator(MPI_Comm parent, int color, int key, Device device, double timeout_s, std::string name)
    : device_(device), name_(std::move(name)) {
  DFLASH_MPI_CHECK(MPI_Comm_split(parent, color, key, &comm_));
  DFLASH_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DFLASH_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DFLASH_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  watchdog_ = std::make_unique<Watchdog>(timeout_s, "rank " + std::to_string(world_rank) + " (" + name_ + " group, rank " +
                                                        std::to_string(rank_) + " of " + std::to_string(size_) + ")");
  if (device_.is_cuda()) {
#if DFLASH_WITH_CUDA
    ncclUniqueId id;
    if (rank_ == 0) DFLASH_NCCL_CHECK(ncclGetUniqueId(&id));
    {
      auto g = watchdog_->guard("MPI_Bcast(ncclUniqueId)");
      DFLASH_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm_));
    }
    DFLASH_CUDA_CHECK(cudaSetDevice(device_.index));
    ncclComm_t comm = nullptr;
    auto g = watchdog_->guard("ncclCommInitRank");
    DFLASH_NCCL_CHECK(ncclCommInitRank(&comm, size_, id, rank_));
    nccl_ = comm;
#else
    DFLASH_FAIL_HINT(name_ << " group on " << device_.str() << ": this build has no CUDA/NCCL backend",
                     "reconfigure with -DDFLASH_CUDA=ON");
#endif
  }
}

Communicator::~Communicator() {
#if DFLASH_WITH_CUDA
  if (nccl_) ncclCommDestroy(static_cast<ncclComm_t>(nccl_));
#endif
  if (comm_ != MPI_COMM_NULL) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
}

void Communicator::check_tensor(const Tensor& t, const char* op) const {
  DFLASH_CHECK(t.defined() && t.is_contiguous(), name_ << " " << op << ": needs a contiguous tensor, got " << t.describe());
  DFLASH_CHECK(t.device() == device_ || (t.device().is_cpu() && device_.is_cpu()),
               name_ << " " << op << ": tensor on " << t.device().str() << " but the group runs on " << device_.str());
}

void Communicator::all_reduce_sum(Tensor& t) {
  check_tensor(t, "all_reduce");
  if (size_ == 1 || t.numel() == 0) return;
  auto g = watchdog_->guard("all_reduce");
  if (device_.is_cpu()) {
    if (t.dtype() == DType::BF16 || t.dtype() == DType::F16) {
      Tensor f = t.to_dtype(DType::F32);
      DFLASH_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, f.raw_data(), static_cast<int>(f.numel()), MPI_FLOAT, MPI_SUM, comm_));
      convert_elements(f.raw_data(), DType::F32, t.raw_data(), t.dtype(), t.numel());
      return;
    }
    const MPI_Datatype mt = mpi_type(t.dtype());
    DFLASH_CHECK(mt != MPI_DATATYPE_NULL, name_ << " all_reduce: dtype " << dtype_name(t.dtype()) << " not supported");
    DFLASH_CHECK(t.numel() < INT32_MAX, name_ << " all_reduce: " << t.numel() << " elements exceed MPI's int count");
    DFLASH_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t.raw_data(), static_cast<int>(t.numel()), mt, MPI_SUM, comm_));
    return;
  }
#if DFLASH_WITH_CUDA
  void* stream = DeviceContext::get(device_.index).stream();
  all_reduce_sum_async(t.raw_data(), t.numel(), t.dtype(), stream);
  wait_nccl(static_cast<ncclComm_t>(nccl_), static_cast<cudaStream_t>(stream), name_ + " all_reduce");
#endif
}

void Communicator::all_reduce_sum_async(void* data, int64_t count, DType dtype, void* stream) {
  DFLASH_CHECK(device_.is_cuda(), name_ << " all_reduce_sum_async: needs a device group, this one is on " << device_.str());
  DFLASH_CHECK(count >= 0 && data != nullptr, name_ << " all_reduce_sum_async: bad buffer (" << data << ", " << count << ")");
  if (size_ == 1 || count == 0) return;
#if DFLASH_WITH_CUDA
  // NCCL counts are elements, not bytes.
  DFLASH_NCCL_CHECK(ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(dtype), ncclSum,
                                  static_cast<ncclComm_t>(nccl_), static_cast<cudaStream_t>(stream)));
#else
  (void)dtype, (void)stream;
#endif
}

void Communicator::wait_async(void* stream, const std::string& op) {
  if (size_ == 1) return;
  auto g = watchdog_->guard(op.c_str());
#if DFLASH_WITH_CUDA
  wait_nccl(static_cast<ncclComm_t>(nccl_), static_cast<cudaStream_t>(stream), name_ + " " + op);
#else
  (void)stream;
#endif
}

void Communicator::all_gather(const Tensor& in, Tensor& out) {
  check_tensor(in, "all_gather");
  check_tensor(out, "all_gather");
  DFLASH_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * size_,
               name_ << " all_gather: out " << out.describe() << " must hold " << size_ << " x " << in.describe());
  auto g = watchdog_->guard("all_gather");
  if (device_.is_cpu()) {
    const int bytes = static_cast<int>(in.nbytes());
    DFLASH_MPI_CHECK(MPI_Allgather(in.raw_data(), bytes, MPI_BYTE, out.raw_data(), bytes, MPI_BYTE, comm_));
    return;
  }
#if DFLASH_WITH_CUDA
  auto comm = static_cast<ncclComm_t>(nccl_);
  auto stream = static_cast<cudaStream_t>(DeviceContext::get(device_.index).stream());
  DFLASH_NCCL_CHECK(ncclAllGather(in.raw_data(), out.raw_data(), static_cast<size_t>(in.numel()),
                                  nccl_type(in.dtype()), comm, stream));
  wait_nccl(comm, stream, name_ + " all_gather");
#endif
}

void Communicator::broadcast(Tensor& t, int root) {
  check_tensor(t, "broadcast");
  DFLASH_CHECK(root >= 0 && root < size_, name_ << " broadcast: root " << root << " not in [0, " << size_ << ")");
  if (size_ == 1) return;
  auto g = watchdog_->guard("broadcast");
  if (device_.is_cpu()) {
    DFLASH_MPI_CHECK(MPI_Bcast(t.raw_data(), static_cast<int>(t.nbytes()), MPI_BYTE, root, comm_));
    return;
  }
#if DFLASH_WITH_CUDA
  auto comm = static_cast<ncclComm_t>(nccl_);
  auto stream = static_cast<cudaStream_t>(DeviceContext::get(device_.index).stream());
  DFLASH_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()),
                                  root, comm, stream));
  wait_nccl(comm, stream, name_ + " broadcast");
#endif
}

void Communicator::barrier() {
  auto g = watchdog_->guard("barrier");
  DFLASH_MPI_CHECK(MPI_Barrier(comm_));
}

}  // namespace dflash::comm
