// Versioned result slots: per block, the newest published result and its version.
//
// Contract
// --------
// * Thread safety: all members may be called concurrently from any thread (one mutex).
// * Ownership: a slot holds a std::shared_ptr<const T>; readers get a shared reference that stays
//   valid after a newer version replaces it, so a worker never frees what a reader still uses.
// * Monotonic: publish() installs a result only when its version is newer than the slot's, so
//   a slow job finishing after a faster, newer one cannot roll a block back.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

namespace asteria::core {

template <typename T>
struct Versioned {
  int64_t version = 0;
  std::shared_ptr<const T> value;
};

template <typename T>
class VersionedSlots {
 public:
  // Installs `value` as `version` of `block`; false (and no change) when the slot already holds
  // this version or a newer one.
  // The value it replaces is released after the mutex: a result that reached Python may need
  // the GIL to be freed, and a thread holding the GIL may be waiting for this mutex (latest()).
  bool publish(const std::string& block, int64_t version, std::shared_ptr<const T> value) {
    std::shared_ptr<const T> replaced;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = slots_.find(block);
      if (it != slots_.end() && it->second.version >= version) return false;
      Versioned<T>& slot = slots_[block];
      replaced = std::move(slot.value);
      slot = Versioned<T>{version, std::move(value)};
    }
    return true;
  }

  std::optional<Versioned<T>> latest(const std::string& block) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(block);
    if (it == slots_.end()) return std::nullopt;
    return it->second;
  }

  // Drops `block`'s result if the slot still holds `version` (its memory is then freed once no
  // future or caller holds it); false when the slot is empty or holds another version. Released
  // after the mutex, as in publish().
  bool erase(const std::string& block, int64_t version) {
    std::shared_ptr<const T> released;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = slots_.find(block);
      if (it == slots_.end() || it->second.version != version) return false;
      released = std::move(it->second.value);
      slots_.erase(it);
    }
    return true;
  }

  std::optional<int64_t> version(const std::string& block) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(block);
    if (it == slots_.end()) return std::nullopt;
    return it->second.version;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return slots_.size();
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, Versioned<T>> slots_;
};

}  // namespace asteria::core
