#!/bin/bash
# Build a tiny BusyBox test rootfs -> rootfs/build/busybox.tar, from the static
# /bin/busybox of Debian's busybox-static package. Everything is owned by 0:0.
set -euo pipefail

BUSYBOX=/bin/busybox

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$here/build
out=$build/busybox.tar
stamp=$out.stamp
say() { echo "busybox.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

[[ -x $BUSYBOX ]] || die "$BUSYBOX not found: apt-get install busybox-static"
# A dynamic busybox (Debian's plain 'busybox' package) would need the host's
# libc inside the rootfs.
if [[ $(LC_ALL=C ldd "$BUSYBOX" 2>&1 || true) != *"not a dynamic executable"* ]]; then
    die "$BUSYBOX is dynamically linked: apt-get install busybox-static"
fi

mkdir -p "$build"
exec 9>"$build/.busybox.lock"  # serialise concurrent runs
flock 9

# Cache: the recipe hash covers this script and the busybox binary it copies.
hash=$(cat "$here/busybox.sh" "$BUSYBOX" | sha256sum | cut -d' ' -f1)
if [[ -f $out && -f $stamp && $(<"$stamp") == "$hash" ]]; then
    say "up to date ($out)"
    exit 0
fi

version=$("$BUSYBOX" 2>&1 | head -n1 | cut -d' ' -f1-2 || true)
say "building from $BUSYBOX ($version) ..."
start=$SECONDS
tmp=$(mktemp "$build/.busybox.tar.XXXXXX")
root=$(mktemp -d "$build/.busybox-root.XXXXXX")
trap 'rm -rf "$tmp" "$root"' EXIT
umask 022  # modes below must not depend on the caller's umask
chmod 755 "$root"  # mktemp -d made it 0700; this becomes / in the tarball

mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,home,proc,sys,dev,run,var}
install -m 755 "$BUSYBOX" "$root/bin/busybox"
# One absolute symlink per applet, at the path busybox itself reports.
"$BUSYBOX" --list-full | while read -r path; do
    [[ $path == bin/busybox ]] && continue
    mkdir -p "$root/$(dirname "$path")"
    ln -s /bin/busybox "$root/$path"
done
install -d -m 700 "$root/root"
install -d -m 1777 "$root/tmp" "$root/var/tmp"

cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
tty:x:5:
nogroup:x:65534:
EOF
# Locked passwords ('*'): nobody can log in with a password.
install -m 600 /dev/stdin "$root/etc/shadow" <<'EOF'
root:*:19000:0:99999:7:::
nobody:*:19000:0:99999:7:::
EOF
echo nsbox >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tnsbox\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"

tar --owner=0 --group=0 --numeric-owner --sort=name -C "$root" -cf "$tmp" .
chmod 644 "$tmp"    # mktemp makes it 0600; tests may run as another user
mv -f "$tmp" "$out"  # atomic: same directory
echo "$hash" >"$stamp"
say "done: $out ($(du -h "$out" | cut -f1), $((SECONDS - start))s)"
