#!/usr/bin/env bash
# The pages stay true to the tree (test docs_links; no build needed):
#   1. every relative link of README.md, DEVELOPERS.md, docs/*.md and bench/README.md names a file or folder
#      that exists;
#   2. every `bench/results/` folder those pages name (`h200-<name>/`, `h100x2-<name>/...`) exists (at any depth
#      under bench/results/: a rerun may sit inside its call's folder);
#   3. docs/layout.md names every top-level source folder (one with a CMakeLists.txt) and every file of scripts/;
#   4. every docs/<page>.md the sources, scripts and configs name (messages, hints, comments) exists.
# Prints each broken reference and fails if there is one.
#   docs_test.sh ROOT
set -uo pipefail
cd "$1" || exit 2
bad=0
broken() { echo "$1"; bad=$((bad + 1)); }

for f in README.md DEVELOPERS.md docs/*.md bench/README.md; do
  d=$(dirname "$f")
  # [text](target) and [text](target#anchor): the target up to ')' or '#'
  while read -r l; do
    case "$l" in '' | http://* | https://* | mailto:*) continue ;; esac
    [ -e "$d/$l" ] || broken "$f: the link '$l' names no file ($d/$l)"
  done < <(grep -o '](\([^)# ]*\)[)#]' "$f" | sed -E 's/^\]\(([^)# ]*)[)#]$/\1/')
done

results=$(find bench/results -mindepth 1 -type d -printf '%f\n' | sort -u)
while read -r r; do
  [ -z "$r" ] && continue
  grep -qxF "$r" <<<"$results" || broken "bench/results/ has no folder '$r' (named as '$r/' in the pages)"
done < <(grep -ohE '\bh[0-9]{3}(x[0-9])?-[A-Za-z0-9_.-]*[A-Za-z0-9]/' README.md DEVELOPERS.md docs/*.md bench/README.md |
  tr -d '/' | sort -u)

for dir in */; do
  dir=${dir%/}
  [ -f "$dir/CMakeLists.txt" ] || continue
  grep -qF "\`$dir/\`" docs/layout.md || broken "docs/layout.md has no row for the folder $dir/"
done
for s in scripts/*; do
  s=$(basename "$s")
  grep -qF "$s" docs/layout.md || broken "docs/layout.md does not name scripts/$s"
done

while read -r page; do
  [ -f "$page" ] || broken "the sources name $page, which does not exist ($(grep -rlF "$page" --include='*.cpp' --include='*.h' \
    --include='*.cu' --include='*.cuh' --include='*.sh' --include='*.py' --include='*.yaml' --include='*.in' \
    --exclude-dir='build*' . | head -n 3 | tr '\n' ' '))"
done < <(grep -rohE 'docs/[A-Za-z0-9_.-]+\.md' --include='*.cpp' --include='*.h' --include='*.cu' --include='*.cuh' \
  --include='*.sh' --include='*.py' --include='*.yaml' --include='*.in' --exclude-dir='build*' . | sort -u)

if [ "$bad" -gt 0 ]; then
  echo "FAIL: $bad broken reference(s) in the pages"
  exit 1
fi
echo "OK: links, bench/results folders and docs/layout.md agree with the tree"
