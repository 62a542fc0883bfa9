"""cffi build script for nsbox._native: starting the zygote and packing its
clone requests (csrc/pyext/spawn.c, csrc/common/clone_request.c).

The C headers are the single source of truth for the structures and constants
shared with Python; the cdef below is read from them, dropping the
preprocessor lines cffi's parser does not understand. The kernel's flags
(KERNEL_CONSTANTS) are valued by the C compiler from the system headers.
"""

import os
import re
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def header_for_cdef(name: str) -> str:
    text = (CSRC / name).read_text()
    kept = []
    ifndef = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            # "#ifndef NAME" and then "#define NAME value" is a fallback for a
            # system header: NAME's value comes from the headers (below).
            after_ifndef, m = ifndef, re.match(r"#ifndef\s+(\w+)\s*$", stripped)
            ifndef = m.group(1) if m else None
            if after_ifndef and re.match(rf"#define\s+{after_ifndef}\b", stripped):
                continue
            # cffi understands "#define NAME <integer>", nothing else.
            if not re.match(r"#define\s+\w+\s+(0x[0-9a-fA-F]+|\d+)\s*(/\*.*\*/)?$", stripped):
                continue
        kept.append(line)
    return "\n".join(kept)


# Kernel flags that Python puts into a clone request, with the values the C
# compiler finds in the system headers (cffi's "#define NAME ..."), the
# headers csrc/create/ is compiled with: nsbox/create/zygote.py copies none
# of them.
KERNEL_CONSTANTS = [
    # <linux/sched.h>: the namespaces of clone3
    "CLONE_NEWNS", "CLONE_NEWCGROUP", "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWUSER", "CLONE_NEWPID",
    "CLONE_NEWNET",
    # <linux/mount.h>: mount(2) flags and mount_setattr(2) attributes
    "MS_RDONLY", "MS_NOSUID", "MS_NODEV", "MS_NOEXEC", "MS_BIND", "MS_REC", "MS_PRIVATE",
    "MOUNT_ATTR_RDONLY", "MOUNT_ATTR_NOSUID", "MOUNT_ATTR_NODEV", "MOUNT_ATTR_NOEXEC",
    # <fcntl.h>, or create.h's fallback: open_tree(2), mount_setattr(2)
    "AT_RECURSIVE",
]

ffibuilder = FFI()
ffibuilder.cdef(header_for_cdef("common/protocol.h"))
ffibuilder.cdef(header_for_cdef("common/create.h"))
ffibuilder.cdef("\n".join(f"#define {name} ..." for name in KERNEL_CONSTANTS))
ffibuilder.set_source(
    "nsbox._native",
    # The kernel's own headers for the mount and clone flags: glibc's
    # <sys/mount.h> may clash with <linux/mount.h>, and we need nothing else
    # of either.
    "#include <fcntl.h>\n#include <linux/mount.h>\n#include <linux/sched.h>\n"
    '#include "common/protocol.h"\n#include "common/create.h"\n',
    # setuptools insists on paths relative to setup.py.
    sources=[os.path.relpath(CSRC / "pyext" / "spawn.c"), os.path.relpath(CSRC / "common" / "clone_request.c")],
    include_dirs=[os.path.relpath(CSRC)],
    extra_compile_args=["-std=gnu11", "-Wall", "-Wextra", "-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
