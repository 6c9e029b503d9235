# Shared by scripts/*.sh: install what is missing, configure and build. Source it, don't run it.
set -euo pipefail

DFLASH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DFLASH_BUILD="${DFLASH_BUILD:-$DFLASH_ROOT/build}"
DFLASH_JOBS="${DFLASH_JOBS:-$(nproc)}"

# Debian 12 / Ubuntu 24.04 packages the build needs (CUDA itself comes from /usr/local/cuda).
DFLASH_APT_PACKAGES=(cmake ninja-build g++ pkg-config libopenmpi-dev openmpi-bin libhdf5-dev libcli11-dev
  libspdlog-dev libyaml-cpp-dev nlohmann-json3-dev libgtest-dev libgmock-dev libonig-dev libicu-dev)

say() { printf '\033[1m[dflash]\033[0m %s\n' "$*" >&2; }

ensure_packages() {
  local missing=()
  for p in "${DFLASH_APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# configure_and_build [extra cmake args...]: Release build in $DFLASH_BUILD (every target, or only
# the targets named in $DFLASH_TARGETS, e.g. "dflash_train dflash_plot").
configure_and_build() {
  if [ ! -f "$DFLASH_BUILD/build.ninja" ] || [ $# -gt 0 ]; then
    say "configuring $DFLASH_BUILD $*"
    cmake -S "$DFLASH_ROOT" -B "$DFLASH_BUILD" -G Ninja -DCMAKE_BUILD_TYPE="${DFLASH_BUILD_TYPE:-Release}" "$@"
  fi
  say "building ${DFLASH_TARGETS:-everything} with $DFLASH_JOBS jobs"
  # shellcheck disable=SC2086
  cmake --build "$DFLASH_BUILD" -j "$DFLASH_JOBS" ${DFLASH_TARGETS:+--target $DFLASH_TARGETS}
}

# Open MPI refuses to run as root unless told; CI and the GPU machines run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
