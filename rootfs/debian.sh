#!/bin/bash
# Build the Debian bookworm minbase test rootfs -> rootfs/build/debian.tar
# (uncompressed tar, numeric ownership, files owned by uid/gid 0, no device nodes).
set -euo pipefail

SUITE=bookworm
MIRROR=http://deb.debian.org/debian
PACKAGES=adduser,procps

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$here/build
out=$build/debian.tar
stamp=$out.stamp
log=$build/debian.log  # full tool output; only its tail is shown on failure
say() { echo "debian.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }
fail() { tail -n 20 "$log" >&2; die "$1 failed, full log: $log"; }

mkdir -p "$build"
# Serialise concurrent runs (e.g. parallel test workers) on the same output.
exec 9>"$build/.debian.lock"
flock 9

# Cache: the recipe hash is the sha256 of this script.
hash=$(sha256sum "$here/debian.sh" | cut -d' ' -f1)
if [[ -f $out && -f $stamp && $(<"$stamp") == "$hash" ]]; then
    say "up to date ($out)"
    exit 0
fi

tmp=$(mktemp "$build/.debian.tar.XXXXXX")
tmpdir=
trap 'rm -rf "$tmp" ${tmpdir:+"$tmpdir"}' EXIT

# Customize hooks, run by sh with $1 = the new root: fixed /etc/hostname and
# /etc/hosts instead of copies from the build host; drop the host's resolv.conf.
hooks=(
    'rm -f "$1/etc/hostname" "$1/etc/hosts" "$1/etc/resolv.conf"'
    'printf "nsbox\n" >"$1/etc/hostname"'
    'printf "127.0.0.1\tlocalhost\n127.0.1.1\tnsbox\n::1\tlocalhost ip6-localhost ip6-loopback\n" >"$1/etc/hosts"'
)

# Trim docs, man pages and translations (tests don't need them); keep copyrights.
trim=(
    'path-exclude=/usr/share/man/*'
    'path-exclude=/usr/share/info/*'
    'path-exclude=/usr/share/locale/*'
    'path-include=/usr/share/locale/locale.alias'
    'path-exclude=/usr/share/doc/*'
    'path-include=/usr/share/doc/*/copyright'
)

start=$SECONDS
if command -v mmdebstrap >/dev/null; then
    if [[ $EUID -eq 0 ]]; then
        mode=root
    elif command -v newuidmap >/dev/null && grep -q "^$(id -un):" /etc/subuid 2>/dev/null \
        && unshare --user --map-root-user true 2>/dev/null; then
        mode=unshare  # unprivileged: mmdebstrap maps root via subuids
    else
        die "not root and mmdebstrap --mode=unshare unavailable: run as root, or install 'uidmap' and add /etc/subuid+/etc/subgid ranges for $(id -un)"
    fi
    say "building $SUITE minbase (+$PACKAGES) with mmdebstrap --mode=$mode ..."
    # The dpkg path-excludes apply to the initial install and stay in
    # /etc/dpkg/dpkg.cfg.d so later installs are trimmed too. apt lists and
    # caches are removed by mmdebstrap's own cleanup step. The merged-usr hook
    # sets up merged /usr with symlinks like debootstrap does, instead of
    # installing the usrmerge package, which drags in full perl (~50 MB).
    # mmdebstrap's tar output always prepends real device nodes for /dev
    # (console, null, zero, ...); mmtarfilter strips them but keeps the empty
    # /dev directory as a mount point, so unprivileged users can extract it.
    { mmdebstrap --mode="$mode" --variant=minbase --include="$PACKAGES" \
        --format=tar --quiet \
        "${trim[@]/#/--dpkgopt=}" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        "${hooks[@]/#/--customize-hook=}" \
        "$SUITE" - "$MIRROR" 2>"$log" \
        | mmtarfilter --path-exclude='/dev/*' >"$tmp"; } || fail mmdebstrap
elif command -v debootstrap >/dev/null; then
    # Fallback: debootstrap needs root and builds a directory, which we trim
    # and pack ourselves.
    [[ $EUID -eq 0 ]] || die "mmdebstrap not found and debootstrap needs root: install 'mmdebstrap' or run as root"
    say "mmdebstrap not found; building $SUITE minbase (+$PACKAGES) with debootstrap ..."
    tmpdir=$(mktemp -d "$build/.debian-root.XXXXXX")
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmpdir" "$MIRROR" >"$log" 2>&1 \
        || fail debootstrap
    for h in "${hooks[@]}"; do sh -c "$h" sh "$tmpdir"; done
    chmod 755 "$tmpdir"  # mktemp -d made it 0700; this becomes / in the tarball
    rm -f "$tmpdir"/var/lib/apt/lists/*_* "$tmpdir"/var/cache/apt/*.bin "$tmpdir"/var/cache/apt/archives/*.deb
    printf '%s\n' "${trim[@]}" >"$tmpdir/etc/dpkg/dpkg.cfg.d/nsbox-trim"  # for later installs
    for d in man info locale doc; do  # same effect as the path-excludes above
        if [[ -d $tmpdir/usr/share/$d ]]; then
            find "$tmpdir/usr/share/$d" -mindepth 1 -depth \( ! -type d ! -name copyright \
                ! -name locale.alias -delete \) -o \( -type d -empty -delete \)
        fi
    done
    find "$tmpdir/dev" -mindepth 1 -delete  # no device nodes (see above)
    tar --numeric-owner --xattrs --sort=name -C "$tmpdir" -cf "$tmp" .
else
    die "neither mmdebstrap nor debootstrap found: apt-get install mmdebstrap"
fi

# Sanity check: no device nodes anywhere (tar -tv lists them with type c/b).
if tar -tvf "$tmp" | grep -q '^[cb]'; then die "device nodes left in tarball"; fi

chmod 644 "$tmp"    # mktemp makes it 0600; tests may run as another user
mv -f "$tmp" "$out"  # atomic: same directory
echo "$hash" >"$stamp"
say "done: $out ($(du -h "$out" | cut -f1), $((SECONDS - start))s)"
