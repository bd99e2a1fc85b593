// A CUDA device for fake tensors on a CPU-only torch (fakecuda.py builds and loads it).
//
// FakeTensorMode makes tensors on cuda:i without memory, but autograd asks the CUDA
// device guard for a stream whenever it records a node, and asks ATen's CUDA hooks
// whether CUDA is built before it accumulates a gradient. A CPU-only torch registers
// neither, so the first forward that needs a gradient aborts the process. This library
// registers both: a guard whose streams and events do nothing (it only remembers the
// current device and stream per thread, as torch's own FakeGuardImpl does, for up to
// 64 devices) and hooks that say CUDA is built and available. It never runs a kernel:
// every tensor it meets is fake. The hooks are read once, as torch imports, so the
// library is loaded before torch is (fakecuda.install). A CUDA torch on a host without
// a GPU (a cluster's login node) has a guard and hooks that need a device, which are
// replaced alike: the hooks by a higher priority, the guard once torch has loaded its
// own (fakecuda.node).

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;
using c10::StreamId;

constexpr DeviceIndex kDevices = 64;
thread_local DeviceIndex current_index = 0;
thread_local std::array<StreamId, kDevices> current_streams{};
std::atomic<StreamId> next_stream{1};

DeviceIndex slot(DeviceIndex index) {
  return index < 0 ? current_index : index;
}

struct FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    current_index = slot(d.index());
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current_index); }
  void setDevice(Device d) const override { current_index = slot(d.index()); }
  void uncheckedSetDevice(Device d) const noexcept override { current_index = slot(d.index()); }
  Stream getStream(Device d) const noexcept override {
    DeviceIndex i = slot(d.index());
    return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, i), current_streams[i]);
  }
  Stream getDefaultStream(Device d) const override {
    return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, slot(d.index())));
  }
  Stream getStreamFromGlobalPool(Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  Stream getNewStream(Device d, int /*priority*/) const override {
    return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, slot(d.index())), next_stream++);
  }
  Stream exchangeStream(Stream s) const noexcept override {
    DeviceIndex i = slot(s.device_index());
    StreamId old = current_streams[i];
    current_streams[i] = s.id();
    return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, i), old);
  }
  DeviceIndex deviceCount() const noexcept override { return kDevices; }
  void record(void** /*event*/, const Stream& /*stream*/, const DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* /*event*/, const DeviceIndex /*device_index*/) const noexcept override {}
  bool queryStream(const Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const DeviceIndex /*device_index*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const Stream& /*stream*/) const override {}
};

struct FakeCudaHooks final : public at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs /*args*/) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override { return true; }
  DeviceIndex deviceCount() const override { return kDevices; }
  DeviceIndex getCurrentDevice() const override { return current_index; }
  DeviceIndex current_device() const override { return current_index; }
  int getNumGPUs() const override { return kDevices; }
};

FakeCudaGuard guard;

}  // namespace

// torch reads the hooks registered under this name when it first needs them (as it
// imports): a CPU-only torch registers none; a CUDA one registers its own at a lower
// priority, which the registry then skips.
namespace at {
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(
    CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED, FakeCudaHooks)
}

// Registers the guard in place of whatever torch registered (none, or CUDA's own).
extern "C" void parabench_fake_cuda() {
  c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)].store(&guard);
}
