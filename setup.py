"""Build glue: the cffi extension (csrc/pyext/spawn.c, csrc/common/clone_request.c), the text buffer
(csrc/pyext/text.c) and the static programs.

Everything else about the package lives in pyproject.toml.
"""

import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
# The static programs nsbox runs: the sandbox's PID 1, the helper that
# creates a sandbox's namespaces, and the one that ties the network helper's
# programs (pasta) to its life.
PROGRAMS = {
    "nsbox-init": ["init/main.c", "init/child.c", "init/spawn.c", "init/open.c", "init/kill.c", "init/reply.c",
                   "init/seccomp.c"],
    "nsbox-create": ["create/main.c", "create/child.c", "create/idmap.c", "create/lock.c", "create/proc.c",
                     "common/clone_request.c"],
    "nsbox-tied": ["tied/main.c"],
}


class BuildExtWithPrograms(build_ext):
    """Builds the extensions, then the static programs.

    The init runs as PID 1 inside root filesystems that may have no C library
    at all, so it is linked statically, and the others too (for a fast exec).
    """

    def run(self) -> None:
        super().run()
        out_dir = (ROOT / "nsbox") if self.inplace else Path(self.build_lib) / "nsbox"
        out_dir.mkdir(parents=True, exist_ok=True)
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        for name, sources in PROGRAMS.items():
            cmd = [
                *cc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
                "-static", "-I", str(ROOT / "csrc"), "-o", str(out_dir / name),
                *(str(ROOT / "csrc" / s) for s in sources),
            ]
            self.announce(f"building {name}: " + " ".join(cmd), level=2)
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise SystemExit(
                    f"nsbox: building {name} failed:\n{result.stderr}\n"
                    "nsbox needs a C compiler and a static C library "
                    "(Debian/Ubuntu: libc6-dev; Fedora/RHEL: glibc-static)."
                )

    def get_outputs(self) -> list[str]:
        outputs = super().get_outputs()
        if not self.inplace:
            outputs += [str(Path(self.build_lib) / "nsbox" / name) for name in PROGRAMS]
        return outputs


setup(
    cffi_modules=["nsbox/_build_ffi.py:ffibuilder"],
    # CPython's C API, not cffi: it builds a str in place, which the
    # limited API cannot (PyUnicode_New and the characters' address).
    ext_modules=[Extension("nsbox._text", ["csrc/pyext/text.c"], extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra"])],
    cmdclass={"build_ext": BuildExtWithPrograms},
)
