#include "memory/host_tensor.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <stdexcept>
#include <utility>

#include "cuda/device.h"
#include "cuda/host_memory.h"

namespace asteria::memory {
namespace {

// What every storage made here carries. Note [Own tensors]: a tensor is ours exactly when its
// storage's deleter is HostContext::release; the context then says where its memory lives.
struct HostContext {
  std::shared_ptr<HostBlock> block;
  size_t offset = 0;  // of the storage's first byte in the block
  std::shared_ptr<void> pin;
  bool on_device = false;

  static void release(void* ctx) { delete static_cast<HostContext*>(ctx); }
};

const HostContext* context_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& data = t.storage().data_ptr();
  if (data.get_deleter() != &HostContext::release) return nullptr;
  return static_cast<const HostContext*>(data.get_context());
}

size_t nbytes_of(const char* what, at::IntArrayRef sizes, at::ScalarType dtype) {
  uint64_t n = c10::elementSize(dtype);
  for (const int64_t size : sizes) {
    TORCH_CHECK_VALUE(size >= 0, what, ": negative size in ", sizes);
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(n, static_cast<uint64_t>(size), &n), what, ": ",
                      sizes, " of ", dtype, " overflows");
  }
  return static_cast<size_t>(n);
}

// The tensor over `data` whose storage owns `ctx` (the maker owns it from .context() on).
at::Tensor make(std::unique_ptr<HostContext> ctx, void* data, at::IntArrayRef sizes,
                at::OptionalIntArrayRef strides, int64_t storage_offset, at::ScalarType dtype,
                c10::Device device) {
  return at::for_blob(data, sizes)
      .strides(strides)
      .storage_offset(storage_offset)
      .context(ctx.release(), &HostContext::release)
      .target_device(device)
      .options(at::TensorOptions().dtype(dtype).device(device))
      .make_tensor();
}

}  // namespace

HostPinning pinning_from(std::optional<bool> pinned) {
  if (!pinned) return HostPinning::kAuto;
  return *pinned ? HostPinning::kPinned : HostPinning::kPageable;
}

at::Tensor tensor_over_block(std::shared_ptr<HostBlock> block, size_t offset, at::IntArrayRef sizes,
                             at::ScalarType dtype, std::shared_ptr<void> pin) {
  const size_t nbytes = nbytes_of("tensor_over_block", sizes, dtype);
  TORCH_CHECK(offset <= block->size() && nbytes <= block->size() - offset,
              "tensor_over_block: ", nbytes, " bytes at offset ", offset, " do not fit a block of ",
              block->size());
  char* data = block->data() + offset;
  auto ctx = std::make_unique<HostContext>();
  ctx->block = std::move(block);
  ctx->offset = offset;
  ctx->pin = std::move(pin);
  return make(std::move(ctx), data, sizes, std::nullopt, 0, dtype, c10::Device(c10::kCPU));
}

at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype, std::optional<bool> pinned,
                      bool reuse) {
  const size_t nbytes = nbytes_of("host_empty", sizes, dtype);
  std::shared_ptr<HostBlock> block;
  try {
    block = HostBlock::allocate(nbytes, pinning_from(pinned), kMaxRegistrationBytes, reuse);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "host_empty(pinned=True): ", e.what(),
                "; pass pinned=None to pin only where a GPU is available");
  }
  return tensor_over_block(std::move(block), 0, sizes, dtype);
}

at::Tensor slot_view(SlotLease& lease, at::IntArrayRef sizes, at::ScalarType dtype) {
  const size_t nbytes = nbytes_of("StagingSlot.view", sizes, dtype);
  TORCH_CHECK_VALUE(nbytes <= lease.bytes(), "StagingSlot.view: a ", sizes, " ", dtype,
                    " tensor needs ", nbytes, " bytes; the slot has ", lease.bytes());
  std::shared_ptr<void> pin = lease.pin();  // throws once the lease was released
  return tensor_over_block(lease.block(), lease.offset(), sizes, dtype, std::move(pin));
}

void slot_record(SlotLease& lease, int64_t stream, int device) {
  lease.add_fence(cuda::record_stream_fence(static_cast<std::uintptr_t>(stream), device));
}

at::Tensor device_view(const at::Tensor& host, int device) {
  TORCH_CHECK(cuda::cuda_enabled(),
              "device_view: this asteria build has no CUDA; device views of host memory need a "
              "CUDA build (rebuild against a CUDA torch with nvcc available)");
  TORCH_CHECK(cuda::host_registration_available(),
              "device_view: the CUDA runtime sees no GPU on this machine");
  const HostContext* ctx = context_of(host);
  TORCH_CHECK_VALUE(ctx != nullptr,
                    "device_view: the tensor's memory does not come from asteria.memory "
                    "(host_empty, a StagingRing slot, a SpillStore read); copy it into one first");
  TORCH_CHECK_VALUE(!ctx->on_device, "device_view: the tensor is a device view already");
  TORCH_CHECK_VALUE(ctx->block->pinned(),
                    "device_view: the tensor's host memory is not pinned; allocate it with "
                    "pinned=True (or pinned=None on a machine with a GPU)");
  if (device < 0) device = cuda::host_current_device();
  // The bytes the tensor reaches, not its whole storage: a slice of a block larger than one
  // registration chunk maps when it lies inside one chunk (Note [Device views across
  // registrations] in host_block.cpp).
  const size_t item = c10::elementSize(host.scalar_type());
  size_t extent = 0;  // elements from the first one the tensor reaches
  if (host.numel() > 0) {
    extent = 1;
    for (int64_t d = 0; d < host.dim(); ++d) {
      TORCH_CHECK_VALUE(host.stride(d) >= 0, "device_view: negative strides are not supported");
      extent += static_cast<size_t>(host.size(d) - 1) * static_cast<size_t>(host.stride(d));
    }
  }
  const size_t skipped = static_cast<size_t>(host.storage_offset()) * item;
  char* first =
      static_cast<char*>(ctx->block->device_pointer(ctx->offset + skipped, extent * item, device));
  // The view keeps the host tensor's storage offset (its storage starts `skipped` bytes before
  // the first byte it reaches; those bytes are never read through it).
  auto view_ctx = std::make_unique<HostContext>(*ctx);
  view_ctx->on_device = true;
  return make(std::move(view_ctx), first - skipped, host.sizes(), host.strides(),
              host.storage_offset(), host.scalar_type(),
              c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

Timeout to_timeout(const char* what, std::optional<double> timeout_s) {
  if (!timeout_s) return std::nullopt;
  TORCH_CHECK_VALUE(*timeout_s >= 0, what, ": timeout_s must be >= 0 or None, got ", *timeout_s);
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(*timeout_s));
}

std::unique_ptr<StagingRing> make_staging_ring(int slots, int64_t slot_bytes,
                                               std::optional<bool> pinned) {
  TORCH_CHECK_VALUE(slots >= 1, "StagingRing: slots must be >= 1, got ", slots);
  TORCH_CHECK_VALUE(slot_bytes >= 1, "StagingRing: slot_bytes must be >= 1, got ", slot_bytes);
  try {
    return std::make_unique<StagingRing>(slots, static_cast<size_t>(slot_bytes),
                                         pinning_from(pinned));
  } catch (const std::runtime_error& e) {  // pinning refused
    throw std::runtime_error(std::string("StagingRing(pinned=True): ") + e.what() +
                             "; pass pinned=None to pin only where a GPU is available");
  }
}

std::unique_ptr<SlotLease> acquire_slot(StagingRing& ring, std::optional<double> timeout_s) {
  return ring.acquire(to_timeout("StagingRing.acquire", timeout_s));
}

bool wait_slot(const SlotLease& lease, std::optional<double> timeout_s) {
  return lease.wait_for(to_timeout("StagingSlot.wait", timeout_s));
}

std::optional<HostTensorInfo> host_tensor_info(const at::Tensor& t) {
  const HostContext* ctx = context_of(t);
  if (ctx == nullptr) return std::nullopt;
  HostTensorInfo info;
  info.block_bytes = static_cast<int64_t>(ctx->block->size());
  info.offset = static_cast<int64_t>(ctx->offset);
  info.pinned = ctx->block->pinned();
  info.device_view = ctx->on_device;
  info.staging_slot = ctx->pin != nullptr;
  return info;
}

std::map<std::string, int64_t> host_memory_stats_dict() {
  const HostMemoryStats s = host_memory_stats();
  return {{"live_blocks", s.live_blocks},
          {"live_bytes", s.live_bytes},
          {"registered_blocks", s.registered_blocks},
          {"registered_bytes", s.registered_bytes},
          {"peak_bytes", s.peak_bytes},
          {"allocated_blocks", s.allocated_blocks},
          {"cached_blocks", s.cached_blocks},
          {"cached_bytes", s.cached_bytes},
          {"reused_blocks", s.reused_blocks}};
}

}  // namespace asteria::memory
