"""cffi build script for nsbox._native: nsbox_spawn() (csrc/spawn.c, csrc/spec.c).

The C headers are the single source of truth for the structures and constants
shared with Python; the cdef below is read from them, dropping the
preprocessor lines cffi's parser does not understand.
"""

import os
import re
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def header_for_cdef(name: str) -> str:
    text = (CSRC / name).read_text()
    kept = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            # cffi understands "#define NAME <integer>", nothing else.
            if not re.match(r"#define\s+\w+\s+(0x[0-9a-fA-F]+|\d+)\s*(/\*.*\*/)?$", stripped):
                continue
        kept.append(line)
    return "\n".join(kept)


ffibuilder = FFI()
ffibuilder.cdef(header_for_cdef("protocol.h"))
ffibuilder.cdef(header_for_cdef("create.h"))
ffibuilder.set_source(
    "nsbox._native",
    '#include "protocol.h"\n#include "create.h"\n',
    # setuptools insists on paths relative to setup.py.
    sources=[os.path.relpath(CSRC / "spawn.c"), os.path.relpath(CSRC / "spec.c")],
    include_dirs=[os.path.relpath(CSRC)],
    extra_compile_args=["-std=gnu11", "-Wall", "-Wextra", "-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
