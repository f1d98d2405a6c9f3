// Torch tensors over Asteria's host memory: host_empty, views of staging slots, device views of
// pinned (mapped) host memory, and the fences a slot's copies record.
//
// Contract
// --------
// * Ownership: every tensor made here owns its memory through its storage. The storage's DataPtr
//   carries a context (HostContext) that holds the HostBlock (memory/host_block.h) and, for a
//   staging slot, a pin of the slot (memory/staging_ring.h); the context is deleted, by its
//   deleter, when the storage dies, i.e. when the last tensor sharing it (views included) is
//   gone. No tensor here is made with from_blob without a deleter. Storages are not resizable.
// * host_empty(sizes, dtype, pinned): a contiguous, uninitialized CPU tensor over a fresh block.
//   pinned: nullopt pins where possible (a CUDA build that sees a GPU), true requires pinning (an
//   error elsewhere), false never pins.
// * slot_view(lease, sizes, dtype): a contiguous CPU tensor over the start of a leased slot; it
//   pins the slot until the tensor and all its views are gone. std::invalid_argument when it does
//   not fit the slot.
// * slot_record(lease, stream, device): records a fence on a raw CUDA stream handle of `device`
//   (cuda/host_memory.h); device < 0 records the CPU stand-in fence.
// * device_view(host, device): a CUDA tensor of host's sizes, strides and dtype that aliases its
//   pinned memory (zero-copy, read and written over the interconnect); its storage holds the block
//   (and pin) too, so it keeps the memory alive after the host tensors are gone. Errors: CPU build,
//   no GPU, a tensor whose memory is not from here, or a block that is not pinned.
// * make_staging_ring / acquire_slot / wait_slot: the staging ring's Python-facing entry points
//   (sizes as int64, timeouts as optional seconds; negative values are std::invalid_argument).
// * host_tensor_info(t): where t's memory lives when it is ours (recognized by the deleter
//   function of its storage, not by address), nullopt otherwise.
//
// Thread safety: free functions, no shared state beyond the blocks' own counters.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "memory/host_block.h"
#include "memory/staging_ring.h"

namespace asteria::memory {

at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype, std::optional<bool> pinned,
                      bool reuse = false);

// A CPU tensor over bytes [offset, offset + nbytes of sizes x dtype) of `block`, owning it.
at::Tensor tensor_over_block(std::shared_ptr<HostBlock> block, size_t offset, at::IntArrayRef sizes,
                             at::ScalarType dtype, std::shared_ptr<void> pin = nullptr);

at::Tensor slot_view(SlotLease& lease, at::IntArrayRef sizes, at::ScalarType dtype);

void slot_record(SlotLease& lease, int64_t stream, int device);

at::Tensor device_view(const at::Tensor& host, int device);

struct HostTensorInfo {
  int64_t block_bytes = 0;
  int64_t offset = 0;  // of the tensor's storage in its block
  bool pinned = false;
  bool device_view = false;
  bool staging_slot = false;
};

std::optional<HostTensorInfo> host_tensor_info(const at::Tensor& t);

std::unique_ptr<StagingRing> make_staging_ring(int slots, int64_t slot_bytes,
                                               std::optional<bool> pinned);

std::unique_ptr<SlotLease> acquire_slot(StagingRing& ring, std::optional<double> timeout_s);

bool wait_slot(const SlotLease& lease, std::optional<double> timeout_s);

// Seconds as a Timeout (nullopt: no limit).
Timeout to_timeout(const char* what, std::optional<double> timeout_s);

// host_memory_stats() as a dict for Python.
std::map<std::string, int64_t> host_memory_stats_dict();

// HostPinning for host_empty's `pinned` argument.
HostPinning pinning_from(std::optional<bool> pinned);

}  // namespace asteria::memory
