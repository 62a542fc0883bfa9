#!/bin/bash
# Runs the test suite in every identity mode this machine offers, and ends
# with a table of the components (tests/components.py) it did without, each
# with the command that installs it.
#
# Not as root: installs nsbox and the Python test dependencies into the
# active environment (a venv), builds the fixture root filesystems it can,
# and runs the suite once, as the current user. A test whose component is
# absent is skipped.
#
# As root: installs the Debian packages of absent components first (it says
# which), then tests all three identity modes (see nsbox/host/idmap.py), each
# with a real user of that kind:
#   root          this process
#   nsbox-sub     created here, with an /etc/subuid and /etc/subgid range
#   nsbox-single  created here, with no range
# What they run is staged in $NSBOX_TEST_STAGE (default /var/tmp/nsbox-test;
# see tests/stage.sh): a venv with nsbox installed, a copy of tests/, and
# the fixture tarballs. A SLURM cluster the tests start is stopped at the
# end. Device modes (/dev/net/tun, /dev/fuse) are left as they are.
#
# With CI=true, an absent component fails the run instead.
# NSBOX_TEST_PRETEND_MISSING=a,b (or all) treats components as absent.
# Arguments are passed to pytest.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-python3}
say() { printf '\n== %s\n' "$*"; }
ci() { [[ ${CI:-} =~ ^(1|true|yes|TRUE|True)$ ]]; }
pretend=",${NSBOX_TEST_PRETEND_MISSING:-},"

# Missing Debian packages, as root: said, then installed. The services of
# slurm-wlm and munge are not started by the install (a policy-rc.d that
# denies them, unless the machine has one): tests/slurm/setup.sh starts the
# daemons the test needs, and this script stops them.
install_packages() {
    local pkgs
    pkgs=$("$python" tests/components.py packages)
    [[ -n $pkgs ]] || return 0
    if ! command -v apt-get >/dev/null; then
        say "missing packages, not installed (no apt-get here): $pkgs"
        return 0
    fi
    say "installing the Debian packages of absent test components: $pkgs"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || echo "apt-get update failed; trying with the current package lists"
    local own_policy=0 status=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    # shellcheck disable=SC2086 # a list of package names
    apt-get install -y -q --no-install-recommends $pkgs >/dev/null || status=$?
    [[ $own_policy == 0 ]] || rm -f /usr/sbin/policy-rc.d
    if [[ $status != 0 ]]; then
        ci && exit "$status"
        echo "apt-get install failed (exit $status); the tests that need them will be skipped"
    fi
}

# A fixture tarball: built where its component can be (cached); otherwise
# the tests that need it are skipped (failed under CI).
build_fixture() {
    local name=$1
    if [[ $pretend == *",$name,"* || $pretend == *",all,"* ]]; then
        echo "$name: treated as absent (NSBOX_TEST_PRETEND_MISSING)"
    elif ! "rootfs/$name.sh"; then
        ci && exit 1
        echo "$name: not built; the tests that need it will be skipped"
    fi
}

if [[ $(id -u) -eq 0 ]]; then
    install_packages
fi

say "fixture root filesystems"
build_fixture busybox
build_fixture debian

if [[ $(id -u) -ne 0 ]]; then
    say "running as $(id -un), not root: testing this user's identity mode only"
    if ! "$python" -m pip install -q -e ".[inspect,test]"; then
        echo "could not install nsbox and its test dependencies into $("$python" -c 'import sys; print(sys.prefix)')." >&2
        echo "In a venv: python3 -m venv ~/nsbox-venv && . ~/nsbox-venv/bin/activate && make test" >&2
        exit 1
    fi
    reports=$(mktemp -d)
    trap 'rm -rf "$reports"' EXIT
    status=0
    NSBOX_TEST_FIXTURES="$repo/rootfs/build" NSBOX_TEST_COMPONENTS_REPORT="$reports/$(id -un)" \
        "$python" -m pytest "$@" || status=$?
    say "components this run did without (their tests were skipped)"
    "$python" tests/components.py report "$reports/$(id -un)"
    exit $status
fi

stage=${NSBOX_TEST_STAGE:-/var/tmp/nsbox-test}
syspy=${NSBOX_TEST_PYTHON:-/usr/bin/python3}
source tests/stage.sh
say "staging the suite in $stage (python: $syspy)"
# csrc: the clone request parser is fuzzed under sanitizers (test_clone_request_fuzz.py)
stage_nsbox "$repo" "$stage" "$syspy" tests pyproject.toml csrc
rm -rf "$stage/fixtures"
mkdir -p "$stage/fixtures"
shopt -s nullglob
for tar in rootfs/build/*.tar; do cp "$tar" "$stage/fixtures/"; done
shopt -u nullglob
chmod -R a+rX "$stage/fixtures"
reports=$stage/reports
rm -rf "$reports"
install -d -m 1777 "$reports"

say "test users"
ensure_test_users

# The root pass's SLURM test starts a cluster (tests/slurm/setup.sh) that
# the other passes use; one that was not running before is stopped at the
# end.
slurm_up() { pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || pgrep -x munged >/dev/null; }
if ! slurm_up; then
    trap 'slurm_up && { say "stopping the SLURM cluster the tests started"; tests/slurm/setup.sh --stop; }' EXIT
fi

declare -A result
run_mode() {
    local mode=$1 user=$2
    shift 2
    say "identity mode '$mode' (user $user)"
    if (cd "$stage/src" && as_user "$user" NSBOX_TEST_FIXTURES="$stage/fixtures" NSBOX_TEST_EXPECT_MODE="$mode" \
            NSBOX_TEST_COMPONENTS_REPORT="$reports/$mode" CI="${CI:-}" \
            NSBOX_TEST_PRETEND_MISSING="${NSBOX_TEST_PRETEND_MISSING:-}" \
            "$stage/venv/bin/python" -m pytest -p no:cacheprovider "$@"); then
        result[$mode]=passed
    else
        result[$mode]=FAILED
    fi
}
# The whole suite: tests/unit (which creates no sandbox, so the identity
# mode cannot change its outcome) and tests marked `once` (the same, in
# tests/host) run once, in the root pass; the other passes run the rest of
# tests/host. Named tests run in every pass.
if [[ $# -eq 0 ]]; then
    run_mode root root
    run_mode subuid nsbox-sub tests/host -m "not once"
    run_mode single nsbox-single tests/host -m "not once"
else
    run_mode root root "$@"
    run_mode subuid nsbox-sub "$@"
    run_mode single nsbox-single "$@"
fi

say "summary"
status=0
for mode in root subuid single; do
    printf '  %-7s %s\n' "$mode" "${result[$mode]}"
    [[ ${result[$mode]} == passed ]] || status=1
done
say "components the runs did without (their tests were skipped; counts summed over the modes)"
"$python" tests/components.py report "$reports"/root "$reports"/subuid "$reports"/single
exit $status
