// The .npy format: magic "\x93NUMPY", a major and minor version byte, a little-endian header
// length (2 bytes in 1.0, 4 bytes in 2.0 and 3.0), then the header: a Python dict literal with
// exactly the keys 'descr', 'fortran_order' and 'shape', padded with spaces and a newline. The
// data follows immediately. We parse the dict with a tiny tokenizer instead of a Python-literal
// evaluator, accepting what numpy writes plus harmless variations (either quote style, any key
// order, extra whitespace, a trailing comma, Python 2's "3L" integers).
#include "tools/npy.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

namespace flashcte::tools {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// Any single dimension and the total byte count stay below this, so products never overflow and
// a hostile header cannot ask for an absurd allocation before the truncation check.
constexpr int64_t kMaxDim = int64_t{1} << 62;

// Quotes a fragment of untrusted text for an error message: printable ASCII as is, the rest
// escaped, at most `limit` characters.
std::string quote(const char* p, size_t n, size_t limit = 40) {
  std::string s = "'";
  for (size_t i = 0; i < n && i < limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(p[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      s += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      s += buf;
    }
  }
  if (n > limit) s += "...";
  return s + "'";
}

// A cursor over the header text.
class HeaderParser {
 public:
  HeaderParser(const char* p, size_t n) : p_(p), end_(p + n) {}

  bool parse(NpyDtype* dtype, bool* fortran, std::vector<int64_t>* shape, std::string* error) {
    skip_space();
    if (!consume('{')) return fail("header does not start with '{'", error);
    bool have_descr = false, have_fortran = false, have_shape = false;
    for (;;) {
      skip_space();
      if (consume('}')) break;
      std::string key;
      if (!parse_string(&key)) return fail("expected a quoted key in the header dict", error);
      skip_space();
      if (!consume(':'))
        return fail("expected ':' after key " + quote(key.data(), key.size()), error);
      skip_space();
      if (key == "descr") {
        if (have_descr) return fail("key 'descr' appears twice", error);
        have_descr = true;
        if (peek() == '[') {
          return fail(
              "unsupported dtype: structured arrays (a list 'descr') are not supported; "
              "expected '<f4', '<f2', '<f8', '<i4' or '<i8'",
              error);
        }
        std::string descr;
        if (!parse_string(&descr)) return fail("'descr' is not a quoted string", error);
        if (!parse_descr(descr, dtype, error)) return false;
      } else if (key == "fortran_order") {
        if (have_fortran) return fail("key 'fortran_order' appears twice", error);
        have_fortran = true;
        if (consume_word("True")) {
          *fortran = true;
        } else if (consume_word("False")) {
          *fortran = false;
        } else {
          return fail("'fortran_order' is neither True nor False", error);
        }
      } else if (key == "shape") {
        if (have_shape) return fail("key 'shape' appears twice", error);
        have_shape = true;
        if (!parse_shape(shape, error)) return false;
      } else {
        return fail("unexpected key " + quote(key.data(), key.size()) +
                        " in the header (expected 'descr', 'fortran_order', 'shape')",
                    error);
      }
      skip_space();
      if (consume(',')) continue;
      if (consume('}')) break;
      return fail("expected ',' or '}' in the header dict", error);
    }
    skip_space();
    if (p_ != end_) {
      return fail(
          "unexpected text after the header dict: " + quote(p_, static_cast<size_t>(end_ - p_)),
          error);
    }
    if (!have_descr) return fail("the header has no 'descr'", error);
    if (!have_fortran) return fail("the header has no 'fortran_order'", error);
    if (!have_shape) return fail("the header has no 'shape'", error);
    return true;
  }

 private:
  static bool fail(const std::string& message, std::string* error) {
    *error = "malformed .npy header: " + message;
    return false;
  }

  char peek() const { return p_ < end_ ? *p_ : '\0'; }
  bool consume(char c) {
    if (p_ < end_ && *p_ == c) {
      ++p_;
      return true;
    }
    return false;
  }
  bool consume_word(const char* w) {
    const size_t n = std::strlen(w);
    if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, w, n) != 0) return false;
    p_ += n;
    return true;
  }
  // numpy pads with spaces and ends with '\n'; tolerate any ASCII whitespace and NUL padding
  // (some writers pad with NULs).
  void skip_space() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r' || *p_ == '\0')) {
      ++p_;
    }
  }

  // A Python string literal without escapes (numpy never writes any in these keys).
  bool parse_string(std::string* s) {
    const char q = peek();
    if (q != '\'' && q != '"') return false;
    ++p_;
    const char* start = p_;
    while (p_ < end_ && *p_ != q) {
      if (*p_ == '\\' || *p_ == '\n') return false;
      ++p_;
    }
    if (p_ == end_) return false;
    s->assign(start, static_cast<size_t>(p_ - start));
    ++p_;
    return true;
  }

  bool parse_descr(const std::string& d, NpyDtype* dtype, std::string* error) {
    // '=' is native order, which is little-endian on every machine this builds for.
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "npy.cc assumes a little-endian host");
    if (d.size() == 3 && (d[0] == '<' || d[0] == '=')) {
      const std::string t = d.substr(1);
      if (t == "f2") return *dtype = NpyDtype::kFloat16, true;
      if (t == "f4") return *dtype = NpyDtype::kFloat32, true;
      if (t == "f8") return *dtype = NpyDtype::kFloat64, true;
      if (t == "i4") return *dtype = NpyDtype::kInt32, true;
      if (t == "i8") return *dtype = NpyDtype::kInt64, true;
    }
    std::string why;
    if (!d.empty() && d[0] == '>') why = " (big-endian data is not supported)";
    *error = "unsupported dtype " + quote(d.data(), d.size()) + why +
             "; expected '<f4', '<f2', '<f8', '<i4' or '<i8'";
    return false;
  }

  bool parse_shape(std::vector<int64_t>* shape, std::string* error) {
    shape->clear();
    if (!consume('(')) return fail("'shape' is not a tuple", error);
    for (;;) {
      skip_space();
      if (consume(')')) break;
      if (peek() < '0' || peek() > '9') {
        return fail("'shape' holds something other than a non-negative integer", error);
      }
      int64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        const int digit = *p_ - '0';
        if (v > (kMaxDim - digit) / 10) {
          return fail("a dimension in 'shape' is absurdly large", error);
        }
        v = v * 10 + digit;
        ++p_;
      }
      consume('L');  // Python 2 long literal
      if (shape->size() == static_cast<size_t>(kNpyMaxRank)) {
        return fail("'shape' has more than " + std::to_string(kNpyMaxRank) + " dimensions", error);
      }
      shape->push_back(v);
      skip_space();
      if (consume(',')) continue;
      if (consume(')')) break;
      return fail("expected ',' or ')' in 'shape'", error);
    }
    return true;
  }

  const char* p_;
  const char* end_;
};

// Copies Fortran-ordered elements into C order. An odometer walks the C index and keeps the
// matching Fortran offset incrementally, so the cost is one add per element for any rank.
void fortran_to_c(const uint8_t* src, const std::vector<int64_t>& shape, int64_t elements,
                  int itemsize, uint8_t* dst) {
  const int rank = static_cast<int>(shape.size());
  std::vector<int64_t> fstride(rank), index(rank, 0);
  int64_t s = 1;
  for (int i = 0; i < rank; ++i) {
    fstride[i] = s;
    s *= shape[i];
  }
  int64_t foff = 0;
  for (int64_t c = 0; c < elements; ++c) {
    std::memcpy(dst + c * itemsize, src + foff * itemsize, itemsize);
    for (int axis = rank - 1; axis >= 0; --axis) {
      if (++index[axis] < shape[axis]) {
        foff += fstride[axis];
        break;
      }
      foff -= (shape[axis] - 1) * fstride[axis];
      index[axis] = 0;
    }
  }
}

// The element count of a shape: 0 when any dimension is 0 (however large the others are),
// else the product, saturated at INT64_MAX instead of overflowing.
int64_t shape_elements(const std::vector<int64_t>& shape) {
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return INT64_MAX;
  }
  return n;
}

uint32_t read_le(const uint8_t* p, int n) {
  uint32_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string npy_header(NpyDtype dtype, const std::vector<int64_t>& shape, bool* version2) {
  std::string dict = std::string("{'descr': '") + npy_descr(dtype) +
                     "', 'fortran_order': False, 'shape': " + shape_string(shape) + ", }";
  // Pad with spaces so magic + version + length + dict + '\n' is a multiple of 64.
  // Version 1.0 stores the header length in 2 bytes; padding adds at most 64 bytes.
  *version2 = dict.size() + 64 > 65535;
  const size_t prefix = kMagicLen + 2 + (*version2 ? 4 : 2);
  const size_t total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict += '\n';
  std::string out(kMagic, kMagicLen);
  out += static_cast<char>(*version2 ? 2 : 1);
  out += '\0';
  const uint32_t len = static_cast<uint32_t>(dict.size());
  for (int i = 0; i < (*version2 ? 4 : 2); ++i) out += static_cast<char>((len >> (8 * i)) & 0xff);
  return out + dict;
}

}  // namespace

const char* npy_descr(NpyDtype dtype) {
  switch (dtype) {
    case NpyDtype::kFloat16:
      return "<f2";
    case NpyDtype::kFloat32:
      return "<f4";
    case NpyDtype::kFloat64:
      return "<f8";
    case NpyDtype::kInt32:
      return "<i4";
    case NpyDtype::kInt64:
      return "<i8";
  }
  return "?";
}

const char* npy_dtype_name(NpyDtype dtype) {
  switch (dtype) {
    case NpyDtype::kFloat16:
      return "float16";
    case NpyDtype::kFloat32:
      return "float32";
    case NpyDtype::kFloat64:
      return "float64";
    case NpyDtype::kInt32:
      return "int32";
    case NpyDtype::kInt64:
      return "int64";
  }
  return "?";
}

int npy_itemsize(NpyDtype dtype) {
  switch (dtype) {
    case NpyDtype::kFloat16:
      return 2;
    case NpyDtype::kFloat32:
    case NpyDtype::kInt32:
      return 4;
    case NpyDtype::kFloat64:
    case NpyDtype::kInt64:
      return 8;
  }
  return 1;
}

int64_t NpyArray::elements() const { return shape_elements(shape); }

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

bool parse_npy(const uint8_t* data, size_t size, NpyArray* out, std::string* error) {
  if (data == nullptr && size != 0) {
    *error = "no data";
    return false;
  }
  if (size < kMagicLen || std::memcmp(data, kMagic, kMagicLen) != 0) {
    *error = "not a .npy file (it does not start with the magic \"\\x93NUMPY\")";
    return false;
  }
  if (size < kMagicLen + 2) {
    *error = "truncated header: the file ends inside the version bytes";
    return false;
  }
  const int major = data[kMagicLen], minor = data[kMagicLen + 1];
  if (major < 1 || major > 3 || minor != 0) {
    *error = "unsupported .npy format version " + std::to_string(major) + "." +
             std::to_string(minor) + " (expected 1.0, 2.0 or 3.0)";
    return false;
  }
  const int len_bytes = major == 1 ? 2 : 4;
  const size_t len_at = kMagicLen + 2;
  if (size < len_at + len_bytes) {
    *error = "truncated header: the file ends inside the header length";
    return false;
  }
  const size_t header_len = read_le(data + len_at, len_bytes);
  const size_t header_at = len_at + len_bytes;
  if (size - header_at < header_len) {
    *error = "truncated header: it declares " + std::to_string(header_len) +
             " header bytes but only " + std::to_string(size - header_at) + " follow";
    return false;
  }
  NpyDtype dtype = NpyDtype::kFloat32;
  bool fortran = false;
  std::vector<int64_t> shape;
  HeaderParser parser(reinterpret_cast<const char*>(data + header_at), header_len);
  if (!parser.parse(&dtype, &fortran, &shape, error)) return false;

  // Element count and byte size, without overflow: each dimension is below 2^62, and we stop as
  // soon as the product passes 2^62 (no real file is that large; its data could not follow).
  const int itemsize = npy_itemsize(dtype);
  int64_t elements = 1;
  bool zero = false;
  for (int64_t d : shape) zero |= d == 0;
  if (!zero) {
    for (int64_t d : shape) {
      if (d != 0 && elements > kMaxDim / d) {
        *error = "shape " + shape_string(shape) + " has too many elements";
        return false;
      }
      elements *= d;
    }
  } else {
    elements = 0;
  }
  if (elements > kMaxDim / itemsize) {
    *error = "shape " + shape_string(shape) + " has too many bytes";
    return false;
  }
  const uint64_t bytes = static_cast<uint64_t>(elements) * static_cast<uint64_t>(itemsize);
  const size_t data_at = header_at + header_len;
  const uint64_t have = size - data_at;
  if (have < bytes) {
    *error = "truncated data: shape " + shape_string(shape) + " of " + npy_dtype_name(dtype) +
             " needs " + std::to_string(bytes) + " bytes but only " + std::to_string(have) +
             " follow the header";
    return false;
  }
  if (have > bytes) {
    *error = std::to_string(have - bytes) + " unexpected bytes after the data of shape " +
             shape_string(shape) + " of " + npy_dtype_name(dtype) +
             " (the file is corrupt or the header is wrong)";
    return false;
  }
  out->dtype = dtype;
  out->shape = std::move(shape);
  out->data.resize(bytes);
  if (bytes == 0) return true;
  if (fortran && out->shape.size() > 1) {
    fortran_to_c(data + data_at, out->shape, elements, itemsize, out->data.data());
  } else {
    std::memcpy(out->data.data(), data + data_at, bytes);
  }
  return true;
}

bool read_npy(const std::string& path, NpyArray* out, std::string* error) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) {
    *error = path + ": cannot open: " + std::strerror(errno);
    return false;
  }
  std::vector<uint8_t> bytes;
  uint8_t buf[1 << 16];
  for (;;) {
    const size_t n = std::fread(buf, 1, sizeof(buf), f.get());
    bytes.insert(bytes.end(), buf, buf + n);
    if (n < sizeof(buf)) break;
  }
  if (std::ferror(f.get())) {
    *error = path + ": cannot read: " + std::strerror(errno);
    return false;
  }
  if (!parse_npy(bytes.data(), bytes.size(), out, error)) {
    *error = path + ": " + *error;
    return false;
  }
  return true;
}

std::vector<uint8_t> serialize_npy(NpyDtype dtype, const std::vector<int64_t>& shape,
                                   const void* data) {
  bool v2 = false;
  const std::string header = npy_header(dtype, shape, &v2);
  const size_t bytes = static_cast<size_t>(shape_elements(shape)) * npy_itemsize(dtype);
  std::vector<uint8_t> out(header.begin(), header.end());
  if (bytes) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    out.insert(out.end(), p, p + bytes);
  }
  return out;
}

bool write_npy(const std::string& path, NpyDtype dtype, const std::vector<int64_t>& shape,
               const void* data, std::string* error) {
  bool v2 = false;
  const std::string header = npy_header(dtype, shape, &v2);
  const size_t bytes = static_cast<size_t>(shape_elements(shape)) * npy_itemsize(dtype);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) {
    *error = path + ": cannot create: " + std::strerror(errno);
    return false;
  }
  bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size();
  if (ok && bytes) ok = std::fwrite(data, 1, bytes, f) == bytes;
  const int saved = errno;
  if (std::fclose(f) != 0 && ok) {
    *error = path + ": cannot write: " + std::strerror(errno);
    return false;
  }
  if (!ok) {
    *error = path + ": cannot write: " + std::strerror(saved);
    return false;
  }
  return true;
}

}  // namespace flashcte::tools
