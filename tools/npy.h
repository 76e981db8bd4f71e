// A small reader and writer for NumPy's .npy format (versions 1.0, 2.0 and 3.0), enough for the
// CLI's tensors: little-endian float16/float32/float64/int32/int64, C or Fortran order, any rank.
// Our own because no Debian package reads .npy from C++ (cnpy and libnpy are not packaged).
//
// parse_npy works on bytes in memory and is written to be fed hostile input (a libFuzzer target
// drives it): every length is checked before it is used, nothing is allocated before the data it
// describes is known to be present, and every failure is a message, never a crash.
#ifndef FLASHCTE_TOOLS_NPY_H_
#define FLASHCTE_TOOLS_NPY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flashcte::tools {

enum class NpyDtype { kFloat16, kFloat32, kFloat64, kInt32, kInt64 };

// "<f2", "<f4", ... as written in the header.
const char* npy_descr(NpyDtype dtype);
// "float16", "float32", ... for messages.
const char* npy_dtype_name(NpyDtype dtype);
int npy_itemsize(NpyDtype dtype);

// NumPy allows 64 dimensions; so do we.
inline constexpr int kNpyMaxRank = 64;

struct NpyArray {
  NpyDtype dtype = NpyDtype::kFloat32;
  std::vector<int64_t> shape;
  // The elements in C (row-major) order, little-endian, whatever order the file used.
  std::vector<uint8_t> data;

  int rank() const { return static_cast<int>(shape.size()); }
  int64_t elements() const;
};

// Parses a whole .npy file image. On failure returns false and sets *error to what is wrong
// (without a file name; the caller adds it). `*out` is unspecified on failure.
bool parse_npy(const uint8_t* data, size_t size, NpyArray* out, std::string* error);

// Reads and parses `path`; errors start with the path.
bool read_npy(const std::string& path, NpyArray* out, std::string* error);

// Serializes a C-order array: version 1.0 (2.0 when the header needs more than 64 KiB), header
// padded so the data starts on a 64-byte boundary, as numpy.save does. `data` holds
// product(shape) elements of `dtype`.
std::vector<uint8_t> serialize_npy(NpyDtype dtype, const std::vector<int64_t>& shape,
                                   const void* data);

// Writes `path` (replacing it); errors start with the path.
bool write_npy(const std::string& path, NpyDtype dtype, const std::vector<int64_t>& shape,
               const void* data, std::string* error);

// "(2, 3)", "(5,)", "()" as numpy prints shapes.
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_NPY_H_
