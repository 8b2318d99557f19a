#!/usr/bin/env bash
# Checks the documentation: README.md stays short, and every relative link in README.md and docs/*.md points at a
# file or directory that exists. Run from the repository root: scripts/check-docs.sh
set -euo pipefail

max_readme_lines=300
failed=0

readme_lines=$(wc -l < README.md)
if [ "$readme_lines" -gt "$max_readme_lines" ]; then
  echo "README.md has $readme_lines lines, more than $max_readme_lines: move reference material to docs/" >&2
  failed=1
fi

checked=0
for file in README.md docs/*.md; do
  dir=$(dirname "$file")
  # Link targets outside fenced code blocks: the text between `](` and the next `)`.
  while IFS= read -r target; do
    target=${target%%[[:space:]]*}     # drop a link title: ](path "title")
    target=${target#<}                 # ](<path>)
    target=${target%>}
    case "$target" in
      '' | '#'* | http://* | https://* | mailto:*) continue ;;
    esac
    path=${target%%#*}                 # drop the anchor
    path=${path%%\?*}                  # and a query
    checked=$((checked + 1))
    if [ ! -e "$dir/$path" ]; then
      echo "$file: broken link: $target ($dir/$path does not exist)" >&2
      failed=1
    fi
  done < <(awk '/^[[:space:]]*(```|~~~)/ { fenced = !fenced; next } !fenced' "$file" |
             grep -o '](\([^)]*\))' | sed 's/^](//; s/)$//' || true)
done

if [ "$failed" -ne 0 ]; then
  echo "check-docs: FAILED" >&2
  exit 1
fi
echo "check-docs: README.md has $readme_lines lines (at most $max_readme_lines); $checked relative links, all resolve"
