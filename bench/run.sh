#!/bin/bash
# bench/bench.py in every identity mode this machine offers: as root, in
# root mode and as the two users the test suite uses (nsbox-sub, with a
# subordinate id range: mode subuid; nsbox-single, without: mode single),
# each with a copy of nsbox staged as for the tests (tests/stage.sh). Not as
# root, once, as the current user. Arguments go to bench.py.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-python3}
say() { printf '\n== %s\n' "$*"; }

rootfs/busybox.sh >/dev/null
rootfs/debian.sh >/dev/null
rootfs/images.sh 2>/dev/null  # the OCI image of the image rows
if [[ $(id -u) -ne 0 ]]; then
    say "identity mode of $(id -un) only (run as root for all three)"
    exec "$python" bench/bench.py "$@"
fi

stage=${NSBOX_BENCH_STAGE:-/var/tmp/nsbox-bench-stage}
source tests/stage.sh
say "staging in $stage"
stage_nsbox "$repo" "$stage" "${NSBOX_TEST_PYTHON:-/usr/bin/python3}" bench rootfs/build/oci
ensure_test_users
status=0
for run in root:root subuid:nsbox-sub single:nsbox-single; do
    say "identity mode ${run%%:*} (user ${run#*:}): $python bench/bench.py $*"
    (cd "$stage/src" && as_user "${run#*:}" "$stage/venv/bin/python" bench/bench.py "$@") || status=1
done
exit $status
