#!/bin/bash
# Build OCI images from the fixture root filesystems -> rootfs/build/oci/
# (an OCI image layout with tags `busybox` and `debian`, one gzip layer each),
# for benchmarks and manual tries:
#   skopeo copy --dest-tls-verify=false oci:rootfs/build/oci:debian docker://127.0.0.1:PORT/debian:12
#   nsbox image import --tag debian rootfs/build/oci
# The test suite builds its own images in its session (tests/imagekit.py).
# Needs umoci (apt-get install umoci) and rootfs/busybox.sh, rootfs/debian.sh run first.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$here/build
out=$build/oci
say() { echo "images.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

command -v umoci >/dev/null || die "umoci not found: apt-get install umoci"
for name in busybox debian; do
    [[ -f $build/$name.tar ]] || die "$build/$name.tar is missing: run rootfs/$name.sh"
done

mkdir -p "$build"
exec 9>"$build/.images.lock"  # serialise concurrent runs
flock 9

hash=$(cat "$here/images.sh" "$build/busybox.tar.stamp" "$build/debian.tar.stamp" 2>/dev/null | sha256sum | cut -d' ' -f1)
if [[ -d $out && -f $out.stamp && $(<"$out.stamp") == "$hash" ]]; then
    say "up to date ($out)"
    exit 0
fi

start=$SECONDS
tmp=$build/.oci.$$
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
umoci init --layout "$tmp"
for name in busybox debian; do
    umoci new --image "$tmp:$name"
    umoci raw add-layer --image "$tmp:$name" "$build/$name.tar"
    umoci config --image "$tmp:$name" --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --config.cmd=/bin/sh
done
chmod -R a+rX "$tmp"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "$hash" >"$out.stamp"
say "done: $out ($(du -sh "$out" | cut -f1), $((SECONDS - start))s)"
