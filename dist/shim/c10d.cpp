// k3mini's bridge to PyTorch's c10d: a store (file or TCP, under a key prefix) and a Gloo process
// group, behind a C ABI on host buffers. Every C++ exception is caught here and returned as its
// message: one crossing the FFI would abort the process.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<::c10d::ProcessGroupGloo> pg;
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

// Runs one operation of `group`, started by `start`, to its end. `wait()` has no deadline of its
// own: a deadline here would return while Gloo's threads still write the caller's buffers. What
// bounds it is the timeout the group was made with, which Gloo applies to every transfer (a
// peer gone or silent past it fails the operation).
template <typename F>
int operation(void* group, char* err, size_t len, F start) {
  auto* g = static_cast<Group*>(group);
  if (!g->failed.empty()) {
    fail(("the group failed earlier: " + g->failed).c_str(), err, len);
    return 1;
  }
  int status = guarded(err, len, [&] { start(g)->wait(); });
  if (status != 0) {
    g->failed = err != nullptr && len > 0 ? err : "an operation failed";
  }
  return status;
}

}  // namespace

extern "C" {

// A Gloo group of `world` ranks meeting in a store: a file at `path` when `host` is null, else
// the TCP store at host:port (its server on `is_server`). Keys go under `prefix`. This rank's
// connections listen on the address `device` names: this machine's hostname (`device_kind` 0,
// as torch does by default), an address or hostname (1) or a network interface (2). Null on
// failure, the reason in `err`.
void* k3_group_new(const char* path, const char* host, int port, int is_server,
                   const char* prefix, int device_kind, const char* device, int rank, int world,
                   long long timeout_ms, char* err, size_t err_len) {
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
    auto pg = c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, world, options);
    out = new Group{pg, std::string()};
  });
  return out;
}

// Destructors are noexcept: one that throws (a store's I/O) ends the process whatever is caught
// here; the catch is for what deleting may throw before them.
void k3_group_free(void* group) {
  try {
    delete static_cast<Group*>(group);
  } catch (...) {
  }
}

int k3_all_reduce(void* group, void* data, size_t n, int dtype, char* err, size_t err_len) {
  return operation(group, err, err_len, [&](Group* g) {
    std::vector<at::Tensor> tensors{wrap(data, n, dtype)};
    return g->pg->allreduce(tensors);
  });
}

// From `input` into `output`, `n` a rank's piece: a reduce-scatter (`gather` 0: `input` holds
// world pieces, `output` one) or an all-gather (1: the other way round).
int k3_between(void* group, int gather, const void* input, void* output, size_t n, int dtype,
               char* err, size_t err_len) {
  return operation(group, err, err_len, [&](Group* g) {
    size_t whole = n * static_cast<size_t>(g->pg->getSize());
    auto in = wrap(input, gather ? n : whole, dtype);
    auto out = wrap(output, gather ? whole : n, dtype);
    return gather ? g->pg->_allgather_base(out, in) : g->pg->_reduce_scatter_base(out, in);
  });
}

int k3_broadcast(void* group, void* data, size_t n, int dtype, int root, char* err,
                 size_t err_len) {
  return operation(group, err, err_len, [&](Group* g) {
    std::vector<at::Tensor> tensors{wrap(data, n, dtype)};
    ::c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return g->pg->broadcast(tensors, opts);
  });
}

int k3_barrier(void* group, char* err, size_t err_len) {
  return operation(group, err, err_len, [](Group* g) { return g->pg->barrier(); });
}

}  // extern "C"
