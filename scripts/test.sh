#!/usr/bin/env bash
# Builds everything and runs the whole test suite (labels cpu, gpu, mpi; gpu tests skip without a GPU).
# Usage: scripts/test.sh [ctest options, e.g. -L cpu or -R Golden]
source "$(dirname "$0")/common.sh"
ensure_packages
configure_and_build
say "running tests"
cd "$DFLASH_BUILD"
ctest --output-on-failure -j "$DFLASH_JOBS" --timeout 900 "$@"
