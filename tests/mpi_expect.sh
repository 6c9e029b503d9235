#!/usr/bin/env bash
# Runs a command (an mpirun job) and checks how it ends, for the mpi-labelled CLI tests:
#   mpi_expect.sh EXIT REGEX COUNT -- command...
# EXIT: "ok" (exit 0) or "fail" (non-zero); REGEX must match at least COUNT lines of the output.
set -u
want_exit=$1 regex=$2 count=$3
shift 4
out=$("$@" 2>&1)
rc=$?
echo "$out"
echo "(exit code $rc)"
n=$(printf '%s\n' "$out" | grep -cE -- "$regex")
if [ "$want_exit" = ok ] && [ $rc -ne 0 ]; then echo "FAIL: expected exit 0"; exit 1; fi
if [ "$want_exit" = fail ] && [ $rc -eq 0 ]; then echo "FAIL: expected a non-zero exit"; exit 1; fi
if [ "$n" -lt "$count" ]; then echo "FAIL: '$regex' matched $n line(s), expected at least $count"; exit 1; fi
echo "OK"
