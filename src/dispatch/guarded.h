// The one guard of the public entry points: the library never throws across its headers, so what
// a call's body throws becomes an error Status here.
#ifndef FLASHCTE_SRC_DISPATCH_GUARDED_H_
#define FLASHCTE_SRC_DISPATCH_GUARDED_H_

#include <exception>
#include <new>
#include <string>

#include "flashcte/flashcte.h"

namespace flashcte::internal {

// Runs `body` (returning a Status): a failed allocation becomes "memory: allocation of `what`
// failed" (kMemory; the bodies allocate before they write), anything else thrown a kInternal
// error with its text (a library bug).
template <class Body>
Status guarded(const char* what, const Body& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Status::Error(std::string("memory: allocation of ") + what + " failed",
                         ErrorKind::kMemory);
  } catch (const std::exception& e) {
    return Status::Error(std::string("internal: ") + e.what(), ErrorKind::kInternal);
  }
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_GUARDED_H_
