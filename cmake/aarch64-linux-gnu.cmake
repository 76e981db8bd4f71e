# Cross-compiling for 64-bit ARM Linux on an x86 Debian 12 host (scripts/test_aarch64.sh):
#   cmake -S . -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
# Debian's cross compiler g++-aarch64-linux-gnu, and the arm64 multiarch packages of the
# libraries (libhwy-dev:arm64, libgtest-dev:arm64, libgomp1:arm64, libopenblas-dev:arm64;
# scripts/install_deps.sh installs them). Tests run under qemu-user.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# The cross toolchain's own sysroot, then the multiarch libraries' directory; headers of the
# multiarch packages live in /usr/include (found through the compiler's default search path).
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Programs (the host's tools) from the host; libraries and headers only from the target's paths.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
# CMake package files from the host's /usr too: the multiarch ones are in
# /usr/lib/aarch64-linux-gnu/cmake (hwy, GTest), reached as /usr's lib/<arch> (the x86 ones in
# lib/x86_64-linux-gnu are not searched), and the header-only CLI11 and nlohmann-json, which have
# no arm64 package, in /usr/share/cmake. Under the roots above CMake finds neither.
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# The host's pkg-config, reading the arm64 .pc files (OpenBLAS's) instead of the x86 ones.
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)

# CTest and gtest_discover_tests run the test programs through QEMU. Plain qemu-aarch64, without
# -L /usr/aarch64-linux-gnu: the binaries then load the multiarch /lib/ld-linux-aarch64.so.1
# with the multiarch libc of the same version; with -L, the cross package's loader meets the
# multiarch libc.so.6 of another version and the first pthread_create loops forever.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
