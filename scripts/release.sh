#!/usr/bin/env bash
# Release binaries of the `idem` command, one archive per target, with their SHA-256 sums:
#
#   scripts/release.sh                          # this machine's target
#   scripts/release.sh x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu
#
# Each target is built with `cargo build --release --locked --target T -p idem-cli --features full` (every broker
# and OpenTelemetry; its standard library added
# with rustup when missing; a target of another architecture also needs its C linker, e.g. Debian's
# gcc-aarch64-linux-gnu with CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc). The archives
# land in dist/: idem-VERSION-TARGET.tar.gz holding the binary, README.md, LICENSE, docs/, deploy/ and
# examples/config/, and SHA256SUMS beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
host=$(rustc -vV | sed -n 's/^host: //p')
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=("$host"); fi
mkdir -p dist
for target in "${targets[@]}"; do
  if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx "$target"; then
    rustup target add "$target"
  fi
  echo "building idem $version for $target…"
  cargo build --release --locked --target "$target" -p idem-cli --features full
  stage=$(mktemp -d)
  name="idem-$version-$target"
  mkdir -p "$stage/$name/examples"
  cp "target/$target/release/idem" "$stage/$name/"
  cp -r README.md LICENSE docs deploy "$stage/$name/"
  cp -r examples/config "$stage/$name/examples/"
  tar -C "$stage" -czf "dist/$name.tar.gz" "$name"
  rm -rf "$stage"
  echo "dist/$name.tar.gz"
done
(cd dist && sha256sum idem-"$version"-*.tar.gz > SHA256SUMS)
echo "dist/SHA256SUMS"
