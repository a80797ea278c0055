# Sourced by scripts/test.sh and scripts/check_wheel.sh: with ccache on PATH, CMake compiles
# through it (CMake reads CMAKE_<LANG>_COMPILER_LAUNCHER from the environment when it first
# configures a tree), so the wheel's build finds the objects of the C++ build: same sources, same
# flags, another tree. Depend mode takes the headers from the compile's own -MD output instead of
# running the preprocessor first (a miss costs what a plain compile does: nvcc's preprocessing
# adds about 30%), and the build directory stays out of the hash (ccache reads
# -gencode=...,code=sm_90a as a -g option, and with debug information it hashes the directory).
# Settings already in the environment win.
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_CUDA_COMPILER_LAUNCHER=${CMAKE_CUDA_COMPILER_LAUNCHER:-ccache}
  export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}
  export CCACHE_DEPEND=${CCACHE_DEPEND:-1}
  export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi
