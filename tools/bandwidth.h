// The machine's streaming read bandwidth, measured rather than taken from a data sheet: threads
// (OpenMP, static split) each sum their own contiguous slice of a buffer many times larger than
// the last-level cache, so every byte comes from DRAM, with the CPU's widest vector loads.
// `flashcte bench --decode` states its K/V bytes per second against it (a decode step is one pass
// over the cache), and uses the same pass between calls to evict the cache from L3 (a model's other
// layers do that in real use).
#ifndef FLASHCTE_TOOLS_BANDWIDTH_H_
#define FLASHCTE_TOOLS_BANDWIDTH_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace flashcte::tools {

class ReadBandwidth {
 public:
  // Allocates and touches `bytes` (rounded down to whole 64-byte lines).
  explicit ReadBandwidth(size_t bytes);
  size_t bytes() const { return words_ * sizeof(uint64_t); }
  // One pass over the whole buffer on `threads` threads; returns GB/s (1e9 bytes per second).
  double Measure(int threads);
  // One pass over the buffer as runs of `run_bytes` (a multiple of 64) read in a shuffled order,
  // the pattern of a paged KV cache whose pages lie at scattered places: each run read from
  // start to end, the run that comes 8 KiB or more later requested into L2 (prefetcht1) as the
  // decode kernels request their rows. The ceiling a paged decode call is held to.
  double MeasureRuns(int threads, size_t run_bytes);

 private:
  struct Free {
    void operator()(uint64_t* p) const;
  };
  std::unique_ptr<uint64_t, Free> data_;
  size_t words_ = 0;
  uint64_t checksum_ = 0;  // keeps the sums observable
};

// The buffer size for an honest DRAM figure: 8x this machine's last-level cache, within
// [256 MiB, 1 GiB].
size_t BandwidthBufferBytes();

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_BANDWIDTH_H_
