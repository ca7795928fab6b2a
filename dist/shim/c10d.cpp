// k3mini's bridge to PyTorch's c10d: a store (file or TCP, under a key prefix) and a process
// group, Gloo's or (built with K3MINI_NCCL) NCCL's, behind a C ABI on host buffers. Every C++
// exception is caught here and returned as its message: one crossing the FFI would abort the
// process.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef K3MINI_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<::c10d::Backend> pg;
  // NCCL's device: the host buffers pass through it (a copy each way). None for Gloo.
  std::optional<at::Device> cuda;
  // The most bytes an operation moves at once (0: whole buffers in one operation).
  int64_t piece_bytes;
  // Why an operation failed: a failed group runs no more (its peers' state is unknown).
  std::string failed;
};

// The dtypes the Rust side sends (`Dtype` in src/c10d.rs).
at::ScalarType scalar(int dtype) {
  switch (dtype) {
    case 0:
      return at::kFloat;
    case 1:
      return at::kDouble;
    default:
      throw std::invalid_argument("unknown dtype code " + std::to_string(dtype));
  }
}

at::Tensor wrap(const void* data, size_t n, int dtype) {
  // from_blob neither copies nor frees: the buffer is the caller's for the call's length.
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(n)},
                       at::TensorOptions().dtype(scalar(dtype)));
}

void fail(const char* what, char* err, size_t len) {
  if (err != nullptr && len > 0) {
    std::strncpy(err, what, len - 1);
    err[len - 1] = '\0';
  }
}

// Runs `body`, returning 0, or 1 with the exception's message in `err`.
template <typename F>
int guarded(char* err, size_t len, F body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    fail(e.what(), err, len);
  } catch (...) {
    fail("an exception that is not a std::exception", err, len);
  }
  return 1;
}

// Elements of each rank's piece an operation moves at once when `pieces` such pieces go
// together: within the group's `piece_bytes` (what NCCL stages on its device at once), or all.
int64_t chunk(const Group& g, int64_t n, int64_t elem_size, int64_t pieces) {
  if (g.piece_bytes <= 0) {
    return std::max<int64_t>(n, 1);
  }
  return std::max<int64_t>(g.piece_bytes / (elem_size * pieces), 1);
}

// `host` where the group computes: a copy on NCCL's device, or itself.
at::Tensor on_device(const Group& g, const at::Tensor& host) {
  return g.cuda ? host.to(*g.cuda) : host;
}

// Room for `host`'s elements where the group computes, or `host` itself.
at::Tensor room(const Group& g, const at::Tensor& host) {
  return g.cuda ? at::empty(host.sizes(), host.options().device(*g.cuda)) : host;
}

// Brings `done` back into `host` once `work` has finished (nothing to bring on Gloo). A
// CUDA-to-host copy of pageable memory waits for the stream the collective's end was queued on.
void finish(const Group& g, const c10::intrusive_ptr<::c10d::Work>& work, at::Tensor host,
            const at::Tensor& done) {
  work->wait();
  if (g.cuda) {
    host.copy_(done);
  }
}

// An element-wise operation (`start` on one staged tensor) over `host` in chunks.
template <typename F>
void elementwise(const Group& g, at::Tensor host, F start) {
  const int64_t n = host.numel();
  const int64_t step = chunk(g, n, host.element_size(), 1);
  for (int64_t at = 0; at < n; at += step) {
    auto part = host.narrow(0, at, std::min(step, n - at));
    std::vector<at::Tensor> tensors{on_device(g, part)};
    finish(g, start(tensors), part, tensors[0]);
  }
}

// Runs one operation of `group` (`body` starts it and waits with `finish`). `wait()` has no
// deadline of its own: a deadline here would return while the backend still writes the caller's
// buffers. What bounds it is the timeout the group was made with, which Gloo applies to every
// transfer (a peer gone or silent past it fails the operation) and NCCL, in blocking-wait mode,
// to each operation.
template <typename F>
int operation(void* group, char* err, size_t len, F body) {
  auto* g = static_cast<Group*>(group);
  if (!g->failed.empty()) {
    fail(("the group failed earlier: " + g->failed).c_str(), err, len);
    return 1;
  }
  int status = guarded(err, len, [&] { body(*g); });
  if (status != 0) {
    g->failed = err != nullptr && len > 0 ? err : "an operation failed";
  }
  return status;
}

c10::intrusive_ptr<::c10d::Backend> gloo_group(c10::intrusive_ptr<::c10d::Store> store, int rank,
                                        int world, std::chrono::milliseconds timeout,
                                        int device_kind, const char* device) {
  auto options = ::c10d::ProcessGroupGloo::Options::create(timeout);
  switch (device_kind) {
    case 0:
      options->devices.push_back(::c10d::ProcessGroupGloo::createDefaultDevice());
      break;
    case 1:
      options->devices.push_back(::c10d::ProcessGroupGloo::createDeviceForHostname(device));
      break;
    default:
      options->devices.push_back(::c10d::ProcessGroupGloo::createDeviceForInterface(device));
  }
  options->threads = 2;
  return c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, world, options);
}

c10::intrusive_ptr<::c10d::Backend> nccl_group(c10::intrusive_ptr<::c10d::Store> store, int rank,
                                        int world, std::chrono::milliseconds timeout,
                                        int cuda) {
#ifdef K3MINI_NCCL
  auto seen = static_cast<int>(c10::cuda::device_count());
  if (cuda >= seen) {
    throw std::invalid_argument("NCCL needs CUDA device " + std::to_string(cuda) +
                                ", and this process sees " + std::to_string(seen) +
                                " CUDA device(s)");
  }
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(cuda));
  c10::cuda::set_device(device.index());
  // In blocking-wait mode an operation past the timeout throws (caught and named here); without
  // it NCCL's watchdog ends the process. Read when the group is made; a user's setting of either
  // name torch reads stands. (setenv races only a concurrent getenv: this runs as the rank
  // starts, before training's threads.)
  if (std::getenv("TORCH_NCCL_BLOCKING_WAIT") == nullptr &&
      std::getenv("NCCL_BLOCKING_WAIT") == nullptr) {
    setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 0);
  }
  auto options = ::c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto pg = c10::make_intrusive<::c10d::ProcessGroupNCCL>(store, rank, world, options);
  // NCCL connects lazily, at the first collective: connect now, so joining returns once every
  // rank has, as Gloo's does, and a missing rank fails the join.
  pg->setBoundDeviceId(device);
  pg->eagerConnectSingleDevice(device);
  return pg;
#else
  throw std::invalid_argument(
      "this build has no NCCL (build k3mini with the nccl feature against a CUDA PyTorch)");
#endif
}

}  // namespace

extern "C" {

// A group of `world` ranks meeting in a store, moving at most `piece_bytes` at once (0: whole
// buffers): a file at `path` when `host` is null, else the TCP
// store at host:port (its server on `is_server`). Keys go under `prefix`. Gloo's when `cuda` is
// negative: this rank's connections listen on the address `device` names, this machine's
// hostname (`device_kind` 0, as torch does by default), an address or hostname (1) or a network
// interface (2). NCCL's on CUDA device `cuda` otherwise. Null on failure, the reason in `err`.
void* k3_group_new(const char* path, const char* host, int port, int is_server,
                   const char* prefix, int device_kind, const char* device, int cuda, int rank,
                   int world, long long timeout_ms, long long piece_bytes, char* err,
                   size_t err_len) {
  Group* out = nullptr;
  guarded(err, err_len, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10::intrusive_ptr<::c10d::Store> store;
    if (host == nullptr) {
      store = c10::make_intrusive<::c10d::FileStore>(path, world);
    } else {
      ::c10d::TCPStoreOptions opts;
      opts.port = static_cast<std::uint16_t>(port);
      opts.isServer = is_server != 0;
      opts.numWorkers = world;
      opts.waitWorkers = false;
      opts.timeout = timeout;
      store = c10::make_intrusive<::c10d::TCPStore>(host, opts);
    }
    store->setTimeout(timeout);
    store = c10::make_intrusive<::c10d::PrefixStore>(prefix, store);
    if (cuda < 0) {
      out = new Group{gloo_group(store, rank, world, timeout, device_kind, device), std::nullopt,
                      piece_bytes, std::string()};
    } else {
      out = new Group{nccl_group(store, rank, world, timeout, cuda),
                      at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(cuda)), piece_bytes,
                      std::string()};
    }
  });
  return out;
}

// Destructors are noexcept: one that throws (a store's I/O) ends the process whatever is caught
// here; the catch is for what deleting may throw before them.
void k3_group_free(void* group) {
  auto* g = static_cast<Group*>(group);
  // NCCL's communicators end with the group: aborted after a failure (a peer may be gone, and a
  // clean shutdown would wait for it), shut down otherwise.
  try {
    if (g->cuda && g->failed.empty()) {
      g->pg->shutdown();
    } else if (g->cuda) {
      g->pg->abort();
    }
  } catch (...) {
  }
  try {
    delete g;
  } catch (...) {
  }
}

int k3_all_reduce(void* group, void* data, size_t n, int dtype, char* err, size_t err_len) {
  return operation(group, err, err_len, [&](Group& g) {
    elementwise(g, wrap(data, n, dtype),
                [&](std::vector<at::Tensor>& t) { return g.pg->allreduce(t); });
  });
}

// From `input` into `output`, `n` a rank's piece: a reduce-scatter (`gather` 0: `input` holds
// world pieces, `output` one) or an all-gather (1: the other way round). In one go when the
// pieces fit the staging (always on Gloo), else a slice [at, at + len) of every piece at a time.
int k3_between(void* group, int gather, const void* input, void* output, size_t n, int dtype,
               char* err, size_t err_len) {
  return operation(group, err, err_len, [&](Group& g) {
    const int64_t world = g.pg->getSize(), piece = static_cast<int64_t>(n);
    auto in_host = wrap(input, gather ? n : n * world, dtype);
    auto out_host = wrap(output, gather ? n * world : n, dtype);
    auto start = [&](at::Tensor& out, at::Tensor& in) {
      return gather ? g.pg->_allgather_base(out, in) : g.pg->_reduce_scatter_base(out, in);
    };
    const int64_t step = chunk(g, piece, in_host.element_size(), world + 1);
    if (step >= piece) {
      auto in = on_device(g, in_host);
      auto out = room(g, out_host);
      finish(g, start(out, in), out_host, out);
      return;
    }
    for (int64_t at = 0; at < piece; at += step) {
      const int64_t len = std::min(step, piece - at);
      at::Tensor in;
      if (gather) {
        in = on_device(g, in_host.narrow(0, at, len));
      } else {
        std::vector<at::Tensor> slices;
        for (int64_t r = 0; r < world; ++r) {
          slices.push_back(in_host.narrow(0, r * piece + at, len));
        }
        in = on_device(g, at::cat(slices));
      }
      auto out = at::empty({gather ? world * len : len}, in.options());
      start(out, in)->wait();
      if (gather) {
        for (int64_t r = 0; r < world; ++r) {
          out_host.narrow(0, r * piece + at, len).copy_(out.narrow(0, r * len, len));
        }
      } else {
        out_host.narrow(0, at, len).copy_(out);
      }
    }
  });
}

int k3_broadcast(void* group, void* data, size_t n, int dtype, int root, char* err,
                 size_t err_len) {
  return operation(group, err, err_len, [&](Group& g) {
    ::c10d::BroadcastOptions opts;
    opts.rootRank = root;
    elementwise(g, wrap(data, n, dtype),
                [&](std::vector<at::Tensor>& t) { return g.pg->broadcast(t, opts); });
  });
}

int k3_barrier(void* group, char* err, size_t err_len) {
  return operation(group, err, err_len, [](Group& g) {
    ::c10d::BarrierOptions opts;
    if (g.cuda) {
      opts.device = *g.cuda;
      opts.device_ids = {g.cuda->index()};
    }
    g.pg->barrier(opts)->wait();
  });
}

}  // extern "C"
