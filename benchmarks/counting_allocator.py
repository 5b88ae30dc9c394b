"""A counting CPU allocator for measuring peak tensor bytes (benchmarks only).

``install()`` builds (once, cached by torch's JIT extension machinery) and loads a small C++
extension whose ``c10::Allocator`` forwards every CPU allocation to c10's own
``alloc_cpu``/``free_cpu`` and counts the bytes requested, live and peak, with atomics, so the
allocations made on every thread (autograd's, gloo's worker threads) are counted. It is then
registered as *the* CPU allocator with ``c10::SetCPUAllocator``.

Call ``install()`` in a process before it creates any tensor it wants counted: a tensor keeps
the deleter of the allocator that made it, so tensors made before ``install()`` are freed by
c10's default allocator and never touch the counters, and tensors made after are counted both
ways. (Tensors made before do not corrupt the counts; they are simply invisible.)

Python API (after ``install()``): ``live()``, ``peak()``, ``reset_peak()`` (peak := live),
``allocs()`` (number of allocations so far), ``validate()`` (the 1 MiB self-test), and for
profiling ``set_tracing(True)`` then ``peak_sizes()`` (the sizes of the blocks alive at the
highest point since the last ``reset_peak()``).

Build requirements: a C++ compiler and ``ninja`` (``pip install ninja``; torch's JIT extension
builder needs it). The first build takes about a minute on 2 cores; later processes load the
cached shared object. ``build()`` in the parent and ``install(path)`` in spawned children
avoids building (and taking the build lock) in every child.

[Note: Counting]
  - The counted size is the size requested by c10 (``nbytes`` of the storage), not what the
    system allocator rounds it up to: "tensor bytes", like ``torch.cuda.memory_allocated``.
  - Each block carries a 64-byte header holding its size, so freeing needs no lookup table
    and no lock; the pointer handed to c10 stays 64-byte aligned (c10's own alignment) and the
    DataPtr's context is the data pointer itself, so c10's raw_allocate/raw_deallocate work.
  - Zero-byte requests get a null pointer (as c10's allocator does) and are not counted.
  - ``peak`` is raised with a compare-exchange loop after each allocation; ``reset_peak``
    sets it to the current ``live``.
  - Allocations are reported to torch's profiler when memory profiling is on
    (``torch.profiler.profile(profile_memory=True)``), like c10's default CPU allocator does.

[Note: Priority]
  ``SetCPUAllocator(alloc, priority)`` replaces the current CPU allocator only if ``priority``
  is >= the priority of the one installed (c10's default registers itself with 0). We use the
  maximum, 255, so that nothing loaded later with a default priority replaces ours silently;
  ``install()`` checks that torch now allocates through it.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Optional

NAME = "composable_shard_bench_counting_cpu_alloc"

CPP_SOURCE = r"""
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace {

constexpr size_t kHeader = 64;  // keeps c10's 64-byte alignment of the user pointer

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocs{0};

// Optional tracing (off by default): the size of every live block, and the sizes alive at the
// highest point since the last reset_peak(). Guarded by one mutex; only for profiling runs.
std::atomic<bool> g_trace{false};
std::mutex g_trace_mu;
std::unordered_map<void*, int64_t> g_trace_live;
int64_t g_trace_bytes = 0;
int64_t g_trace_peak = 0;
std::vector<int64_t> g_trace_peak_sizes;

void trace_alloc(void* user, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  g_trace_live[user] = nbytes;
  g_trace_bytes += nbytes;
  if (g_trace_bytes > g_trace_peak) {
    g_trace_peak = g_trace_bytes;
    g_trace_peak_sizes.clear();
    g_trace_peak_sizes.reserve(g_trace_live.size());
    for (const auto& kv : g_trace_live) {
      g_trace_peak_sizes.push_back(kv.second);
    }
  }
}

void trace_free(void* user) {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  auto it = g_trace_live.find(user);
  if (it != g_trace_live.end()) {  // blocks made before tracing started are not in the table
    g_trace_bytes -= it->second;
    g_trace_live.erase(it);
  }
}

void raise_peak(int64_t now) {
  int64_t seen = g_peak.load(std::memory_order_relaxed);
  while (now > seen &&
         !g_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void counting_delete(void* user) {
  if (user == nullptr) {
    return;
  }
  char* base = static_cast<char*>(user) - kHeader;
  int64_t nbytes = 0;
  std::memcpy(&nbytes, base, sizeof(nbytes));
  if (g_trace.load(std::memory_order_relaxed)) {
    trace_free(user);
  }
  int64_t now = g_live.fetch_sub(nbytes, std::memory_order_relaxed) - nbytes;
  if (c10::memoryProfilingEnabled()) {
    c10::reportMemoryUsageToProfiler(user, -nbytes, static_cast<size_t>(now), 0,
                                     c10::Device(c10::DeviceType::CPU));
  }
  c10::free_cpu(base);
}

struct CountingCPUAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return c10::DataPtr(nullptr, nullptr, &counting_delete,
                          c10::Device(c10::DeviceType::CPU));
    }
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    int64_t nbytes = static_cast<int64_t>(n);
    std::memcpy(base, &nbytes, sizeof(nbytes));
    void* user = base + kHeader;
    g_allocs.fetch_add(1, std::memory_order_relaxed);
    int64_t now = g_live.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
    raise_peak(now);
    if (g_trace.load(std::memory_order_relaxed)) {
      trace_alloc(user, nbytes);
    }
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(user, nbytes, static_cast<size_t>(now), 0,
                                       c10::Device(c10::DeviceType::CPU));
    }
    return c10::DataPtr(user, user, &counting_delete,
                        c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCPUAllocator g_allocator;  // static lifetime, as SetCPUAllocator requires

}  // namespace

void install_allocator() { c10::SetCPUAllocator(&g_allocator, /*priority=*/255); }
bool is_installed() { return c10::GetCPUAllocator() == &g_allocator; }
int64_t live() { return g_live.load(); }
int64_t peak() { return g_peak.load(); }
int64_t allocs() { return g_allocs.load(); }
void reset_peak() {
  g_peak.store(g_live.load());
  std::lock_guard<std::mutex> lock(g_trace_mu);
  g_trace_peak = g_trace_bytes;
  g_trace_peak_sizes.clear();
  for (const auto& kv : g_trace_live) {
    g_trace_peak_sizes.push_back(kv.second);
  }
}
void set_tracing(bool on) { g_trace.store(on); }
int64_t traced_live() {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  return g_trace_bytes;
}
std::vector<int64_t> peak_sizes() {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  return g_trace_peak_sizes;
}
"""

FUNCTIONS = ["install_allocator", "is_installed", "live", "peak", "allocs", "reset_peak", "set_tracing",
             "traced_live", "peak_sizes"]

_ext: Optional[ModuleType] = None


def build(verbose: bool = False) -> str:
    """Compile (or find cached) and return the path of the extension's shared object."""
    from torch.utils.cpp_extension import load_inline

    mod = load_inline(name=NAME, cpp_sources=[CPP_SOURCE], functions=FUNCTIONS,
                      extra_cflags=["-O2"], verbose=verbose)
    return str(mod.__file__)


def install(path: Optional[str] = None) -> ModuleType:
    """Load the extension (from ``path`` if given, else build/load it) and make it the CPU
    allocator of this process. Idempotent."""
    global _ext
    if _ext is not None:
        return _ext
    if path:
        spec = importlib.util.spec_from_file_location(NAME, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[NAME] = mod
    else:
        from torch.utils.cpp_extension import load_inline
        mod = load_inline(name=NAME, cpp_sources=[CPP_SOURCE], functions=FUNCTIONS, extra_cflags=["-O2"])
    mod.install_allocator()
    if not mod.is_installed():
        raise RuntimeError("c10::SetCPUAllocator did not take our allocator (a higher priority one is installed?)")
    _ext = mod
    return mod


def _require() -> ModuleType:
    if _ext is None:
        raise RuntimeError("counting allocator not installed: call install() first")
    return _ext


def live() -> int:
    return int(_require().live())


def peak() -> int:
    return int(_require().peak())


def allocs() -> int:
    return int(_require().allocs())


def reset_peak() -> None:
    _require().reset_peak()


def set_tracing(on: bool) -> None:
    """Record the size of every live block (from now on) and the sizes alive at the highest point
    since the last ``reset_peak()``; costs a mutex per allocation: profiling runs only."""
    _require().set_tracing(bool(on))


def traced_live() -> int:
    return int(_require().traced_live())


def peak_sizes() -> list:
    """Sizes (bytes) of the blocks alive at the highest point since the last ``reset_peak()``
    (tracing on; blocks allocated before tracing started are not included)."""
    return [int(x) for x in _require().peak_sizes()]


def validate() -> dict:
    """Self-test: a 1 MiB tensor raises live and (after reset) peak by exactly 1 MiB, and
    freeing it returns live to where it was. Returns the figures and ``ok``."""
    import torch

    mib = 1 << 20
    reset_peak()
    live0, peak0, n0 = live(), peak(), allocs()
    t = torch.empty(mib, dtype=torch.uint8)
    live1, peak1, n1 = live(), peak(), allocs()
    ptr_ok = t.untyped_storage().nbytes() == mib
    del t
    live2, peak2 = live(), peak()
    res = {
        "live_before": live0, "live_with_1MiB": live1, "live_after_free": live2,
        "peak_rise": peak1 - peak0, "live_rise": live1 - live0, "allocs": n1 - n0,
        "peak_after_free": peak2,
        "ok": (peak1 - peak0 == mib and live1 - live0 == mib and live2 == live0 and n1 - n0 == 1
               and ptr_ok and peak2 == peak1),
    }
    return res


if __name__ == "__main__":  # build and self-test: python benchmarks/counting_allocator.py
    print("built", build(verbose="-v" in sys.argv))
    install()
    print(validate())

