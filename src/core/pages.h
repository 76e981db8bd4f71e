// Zeroed memory for large buffers that are streamed whole: the KV cache, the tools' tensors and
// the bandwidth buffer the decode bench measures against (one allocator, so the roofline and the
// cache it bounds sit on the same kind of pages).
//
// A buffer of at least kHugePageBytes starts on a 2 MiB boundary and asks Linux for transparent
// huge pages (madvise MADV_HUGEPAGE, which is what the default THP mode "madvise" waits for).
// On 4 KiB pages a streaming read takes a TLB miss every 4 KiB, and under a hypervisor each is a
// two-level page walk: on the Zen 4 EPYC KVM guest (AVX-512, 2 threads) a 256 MiB streaming read
// ran at a median 29.0-32.0 GB/s on 4 KiB pages against 34.2-35.6 GB/s on huge pages (3
// interleaved runs of 9 passes each), and a bf16 decode call over 4096 cached tokens (32/8 heads,
// d = 128, cold) read K/V at a median 22.4 against 25.0 GB/s (5 interleaved runs of 21 calls).
// Smaller buffers stay on 64-byte lines: rounding them up to 2 MiB would waste more than it saves.
// Where the kernel refuses huge pages the buffer is simply on small pages.
#ifndef FLASHCTE_SRC_CORE_PAGES_H_
#define FLASHCTE_SRC_CORE_PAGES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flashcte::internal {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;
inline constexpr size_t kLineBytes = 64;

// `bytes` (0 allowed) of zeroed memory, released with std::free; throws std::bad_alloc.
inline void* allocate_pages(size_t bytes) {
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : kLineBytes;
  // No object is larger than PTRDIFF_MAX bytes.
  if (bytes > static_cast<size_t>(PTRDIFF_MAX) - align) throw std::bad_alloc();
  // aligned_alloc wants a multiple of the alignment; 0 bytes still get a line.
  const size_t padded = bytes == 0 ? align : (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, padded);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Before the first touch, so the zeroing below faults the buffer in as huge pages. Advice:
  // a refusal (THP disabled, an old kernel) changes nothing but the page size.
  if (align == kHugePageBytes) (void)madvise(p, padded, MADV_HUGEPAGE);
#endif
  std::memset(p, 0, padded);
  return p;
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_CORE_PAGES_H_
