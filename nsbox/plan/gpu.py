"""GPUs in a sandbox: what `gpus` ("all", a count, "device=0,1") turns into.

Rootless, as Apptainer and podman do it, with no hook and no mknod:

- CDI (the Container Device Interface of podman and the NVIDIA container
  toolkit) where the host has a spec for kind nvidia.com/gpu in /etc/cdi or
  /var/run/cdi (NSBOX_CDI_SPEC_DIRS, colon-separated, replaces that list):
  the selected devices' and the spec's own containerEdits apply. Device
  nodes and mounts become binds, env entries the sandbox's environment.
  Hooks cannot run (they need privilege over the container): the toolkit's
  update-ldcache is emulated by the libraries' sonames bound beside them
  and their folders on LD_LIBRARY_PATH, create-symlinks by a bind of the
  link's target at the link; any other hook is skipped with a note.
- Otherwise discovery: the control nodes (/dev/nvidiactl, nvidia-uvm,
  nvidia-uvm-tools, nvidia-modeset), the selected /dev/nvidiaN, the driver's
  libraries from the loader cache (`ldconfig -p`), bound read-only at the
  paths the host has them, their folders on LD_LIBRARY_PATH, and its
  programs (nvidia-smi...) from PATH, bound read-only in /usr/bin.

Device nodes are binds of the host's nodes onto the sandbox's /dev (a tmpfs
without nodev), as /dev/null is: a user namespace cannot mknod, but may open
a node whose mount allows devices. On the host-composed root, files already
visible there (/usr, the merged-usr links) are not bound again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..host.dirs import trusted_uids
from ..errors import SandboxSetupError
from ..spec import Bind
from .rootfs import USR_LINK_NAMES

CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # later wins, as in the CDI spec
KIND = "nvidia.com/gpu"
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# The driver's user-space libraries (Apptainer's nvliblist, as patterns).
LIBRARY = re.compile(r"(libcuda|libcudadebugger|libnvcuvid|libnvoptix|libnvidia-[A-Za-z0-9_.-]+?"
                     r"|lib(EGL|GLESv1_CM|GLESv2|GLX)_nvidia|libvdpau_nvidia)\.so(\.[0-9.]+)?")
PROGRAMS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
@dataclass
class Setup:
    """What a GPU request adds to a sandbox."""

    binds: list[Bind] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    library_dirs: list[str] = field(default_factory=list)  # put before LD_LIBRARY_PATH
    notes: list[str] = field(default_factory=list)
    source: str = ""  # "CDI spec PATH" or "discovery"

    def bind(self, source: str, target: str, readonly: bool) -> None:
        if any(b.target == target for b in self.binds):
            return
        try:
            self.binds.append(Bind(source, target, readonly=readonly))
        except ValueError as e:  # a spec's path that is not absolute and normalized
            raise _fail(f"{self.source}: {e}") from None

    def apply_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` (the sandbox's, the image's in it) with this added over it,
        as a CDI spec's edits go over a container's (a CUDA image's
        NVIDIA_VISIBLE_DEVICES=all must not hide the selection), and the
        library folders before its LD_LIBRARY_PATH."""
        out = {**env, **self.env}
        if self.library_dirs:
            old = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
            out["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys([*self.library_dirs, *old]))
        return out


def resolve(request: str, *, host_root: bool) -> Setup:
    """The binds and environment of `request` (nsbox.spec.normalize_gpus()'s form) on this
    host. host_root: the sandbox's root is the host-composed one."""
    found = _cdi_spec()
    setup = _from_cdi(request, *found) if found else _discover(request, host_root)
    if host_root:
        _for_host_root(setup)
    return setup


def _for_host_root(setup: Setup) -> None:
    """The host-composed root shows the host's /usr, read-only: what is
    there already is not bound again, and nothing can be added there."""
    kept = []
    for b in setup.binds:
        if _visible_on_host_root(b):
            continue
        if _in_host_usr(b.target):
            if not os.path.lexists(b.target):  # else the host's own file is there
                setup.notes.append(f"{b.target} is not added: the host root's /usr is the host's, read-only")
            continue
        kept.append(b)
    setup.binds = kept
    # The host's own loader cache is the sandbox's: it covers /usr.
    setup.library_dirs = [d for d in setup.library_dirs if not _in_host_usr(d)]


def _fail(text: str) -> SandboxSetupError:
    return SandboxSetupError(f"gpus: {text}")


# ---- CDI ---------------------------------------------------------------


def _cdi_dirs() -> list[str]:
    override = os.environ.get("NSBOX_CDI_SPEC_DIRS")
    return [d for d in override.split(":") if d] if override is not None else list(CDI_DIRS)


def _cdi_spec() -> tuple[Path, dict[str, Any]] | None:
    """The last spec of kind nvidia.com/gpu in the CDI directories."""
    found = None
    for directory in _cdi_dirs():
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = Path(directory, name)
            if path.suffix not in (".json", ".yaml", ".yml") or not path.is_file():
                continue
            _check_trusted(Path(directory))
            _check_trusted(path)
            spec = _load(path)
            if spec.get("kind") == KIND:
                found = (path, spec)
    return found


def _check_trusted(path: Path) -> None:
    """A CDI spec names host paths that sandboxes get, read-write unless it
    says `ro`: only you and root may have written it (as for a state
    directory, nsbox/host/dirs.py)."""
    st = path.stat()
    if st.st_uid not in trusted_uids() or st.st_mode & 0o022:
        raise _fail(f"CDI spec {path} could have been written by another user (owner uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):o}); refusing the host paths it names; to fix: "
                    f"`chmod go-w {path}`, owned by root or you")


def _load(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise _fail(f"CDI spec {path}: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise _fail(f"CDI spec {path}: expected a mapping")
    return data


def _select(request: str, names: list[str], what: str) -> list[str]:
    """The names `request` picks among `names` (index names first)."""
    numbered = sorted((n for n in names if n.isdigit()), key=int)
    others = sorted(n for n in names if not n.isdigit() and n != "all")
    ordered = numbered or others
    if not ordered:
        raise _fail(f"no NVIDIA GPU found ({what} lists no device)")
    if request == "all":
        return ordered
    if request.isdigit():
        if int(request) > len(ordered):
            raise _fail(f"{request} GPUs requested, {len(ordered)} found ({what})")
        return ordered[:int(request)]
    chosen = []
    for wanted in request[len("device="):].split(","):
        name = wanted.removeprefix(KIND + "=")
        if name not in names:
            raise _fail(f"no GPU {wanted!r} ({what} has {', '.join(ordered)})")
        chosen.append(name)
    return list(dict.fromkeys(chosen))


def _from_cdi(request: str, path: Path, spec: dict[str, Any]) -> Setup:
    devices = {str(d.get("name")): d for d in spec.get("devices") or [] if isinstance(d, dict)}
    chosen = _select(request, list(devices), f"CDI spec {path}")
    setup = Setup(source=f"CDI spec {path}")
    edits = [spec.get("containerEdits") or {}] + [devices[n].get("containerEdits") or {} for n in chosen]
    mounted: dict[str, str] = {}  # container path -> host path
    for edit in edits:
        for node in edit.get("deviceNodes") or []:
            target = node.get("path")
            source = node.get("hostPath") or target
            if not target or not os.path.exists(source):
                raise _fail(f"CDI spec {path}: device node {source} does not exist on this host")
            setup.bind(source, target, readonly=False)
        for mount in edit.get("mounts") or []:
            options = mount.get("options") or []
            if mount.get("type") not in (None, "bind") and "bind" not in options and "rbind" not in options:
                setup.notes.append(f"CDI mount of type {mount.get('type')} at {mount.get('containerPath')} skipped")
                continue
            source, target = mount.get("hostPath"), mount.get("containerPath")
            if not source or not target or not os.path.exists(source):
                raise _fail(f"CDI spec {path}: mount source {source} does not exist on this host")
            setup.bind(source, target, readonly="ro" in options)
            mounted[target] = source
        for entry in edit.get("env") or []:
            name, _, value = str(entry).partition("=")
            setup.env[name] = value
    # ldconfig's links first: the toolkit's create-symlinks names them.
    hooks = [h for e in edits for h in e.get("hooks") or [] if isinstance(h, dict)]
    hooks.sort(key=lambda h: "update-ldcache" not in [str(a) for a in h.get("args") or []])
    for hook in hooks:
        _emulate_hook(hook, setup, mounted)
    # CDI names devices by index or UUID; what was chosen is what CUDA's
    # own selection should know too, unless the spec says otherwise.
    setup.env.setdefault("NVIDIA_VISIBLE_DEVICES", "all" if request == "all" else ",".join(chosen))
    return setup


def _emulate_hook(hook: dict[str, Any], setup: Setup, mounted: dict[str, str]) -> None:
    args = [str(a) for a in hook.get("args") or []]
    if "update-ldcache" in args:
        folders = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--folder"]
        folders += [a.split("=", 1)[1] for a in args if a.startswith("--folder=")]
        for folder in folders:
            _bind_sonames(folder, setup, mounted)
            setup.library_dirs.append(folder)
    elif "create-symlinks" in args:
        links = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--link"]
        links += [a.split("=", 1)[1] for a in args if a.startswith("--link=")]
        for link in links:
            target, _, at = link.partition("::")
            resolved = os.path.normpath(os.path.join(os.path.dirname(at), target))
            if resolved in mounted and at:
                setup.bind(mounted[resolved], at, readonly=True)
    else:
        name = next((a for a in args if not a.startswith("-") and a not in ("hook", "nvidia-ctk", "nvidia-cdi-hook")),
                    hook.get("path", "?"))
        setup.notes.append(f"the CDI hook {name} is not run: hooks need privileges a rootless sandbox does not have")


def _bind_sonames(folder: str, setup: Setup, mounted: dict[str, str]) -> None:
    """What ldconfig would link in `folder`: each mounted library also under
    the names the host links to it there (libcuda.so.1 -> libcuda.so.580...)."""
    for target, source in list(mounted.items()):
        if os.path.dirname(target) != folder.rstrip("/") or ".so" not in target:
            continue
        real = os.path.realpath(source)
        host_dir = os.path.dirname(source)
        try:
            names = os.listdir(host_dir)
        except OSError:
            continue
        for name in names:
            link = os.path.join(host_dir, name)
            if os.path.islink(link) and os.path.realpath(link) == real and re.search(r"\.so\.\d+$", name):
                setup.bind(source, f"{folder.rstrip('/')}/{name}", readonly=True)
                mounted[f"{folder.rstrip('/')}/{name}"] = source


# ---- discovery -----------------------------------------------------------


def _dev_dir() -> str:
    # Tests point this at stand-in nodes; /dev otherwise.
    return os.environ.get("NSBOX_GPU_DEV_DIR", "/dev")


def _gpu_nodes() -> dict[str, str]:
    """Index -> host path of each /dev/nvidiaN."""
    dev = _dev_dir()
    try:
        names = os.listdir(dev)
    except OSError:
        return {}
    return {n[len("nvidia"):]: f"{dev}/{n}" for n in names if re.fullmatch(r"nvidia[0-9]+", n)}


def _uuids() -> dict[str, str]:
    """GPU UUID -> minor number, from the driver's /proc files."""
    out = {}
    base = "/proc/driver/nvidia/gpus"
    for bus in os.listdir(base) if os.path.isdir(base) else ():
        try:
            text = Path(base, bus, "information").read_text()
        except OSError:
            continue
        uuid = re.search(r"GPU UUID:\s*(\S+)", text)
        minor = re.search(r"Device Minor:\s*(\d+)", text)
        if uuid and minor:
            out[uuid.group(1)] = minor.group(1)
    return out


def _discover(request: str, host_root: bool) -> Setup:
    nodes = _gpu_nodes()
    if not nodes:
        raise _fail("no NVIDIA GPU found on this host (no CDI spec in "
                    f"{' or '.join(_cdi_dirs()) or 'no directory'}, no {_dev_dir()}/nvidia[0-9]* device)")
    if request.startswith("device="):
        uuids = _uuids()
        request = "device=" + ",".join(uuids.get(i, i) for i in request[len("device="):].split(","))
    chosen = _select(request, list(nodes), f"{_dev_dir()}/nvidia*")
    setup = Setup(source="discovery")
    dev = _dev_dir()
    for name in CONTROL_NODES:
        if os.path.exists(f"{dev}/{name}"):
            setup.bind(f"{dev}/{name}", f"/dev/{name}", readonly=False)
    for index in chosen:
        setup.bind(nodes[index], f"/dev/nvidia{index}", readonly=False)
    libraries = driver_libraries()
    if not libraries:
        setup.notes.append("no NVIDIA driver library in the loader cache (ldconfig -p): only device nodes bound")
    for path in libraries:
        setup.bind(path, path, readonly=True)
    setup.library_dirs = list(dict.fromkeys(os.path.dirname(p) for p in libraries))
    # Programs go where every PATH looks (/usr/local/nvidia/bin is the
    # driver's own on some hosts), as Apptainer's do; the host root has them.
    for path in driver_programs():
        setup.bind(path, path if host_root else f"/usr/bin/{os.path.basename(path)}", readonly=True)
    setup.env["NVIDIA_VISIBLE_DEVICES"] = "all" if request == "all" else ",".join(chosen)
    return setup


def _abi() -> str | None:
    """The loader cache's tag of this machine's libraries (None: take all)."""
    return {"x86_64": "x86-64", "aarch64": "AArch64", "ppc64le": "64bit"}.get(platform.machine())


def driver_libraries(cache_text: str | None = None) -> list[str]:
    """The driver's libraries the loader cache names, one path per name."""
    if cache_text is None:
        cache_text = _ldconfig_p()
    abi = _abi()
    out: dict[str, str] = {}
    for line in cache_text.splitlines():
        m = re.match(r"\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if not m or not LIBRARY.fullmatch(m.group(1)):
            continue
        if abi is not None and abi not in m.group(2).split(","):
            continue
        if os.path.exists(m.group(3)):
            out.setdefault(m.group(1), m.group(3))
    return list(out.values())


def ldconfig() -> str | None:
    """ldconfig, which a user's PATH often lacks (/sbin)."""
    return next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), shutil.which("ldconfig"))


def _ldconfig_p() -> str:
    ldconfig_path = ldconfig()
    if ldconfig_path is None:
        return ""
    # A test names its own cache file (ldconfig -C); the host's otherwise.
    cache = os.environ.get("NSBOX_GPU_LD_CACHE")
    try:
        return subprocess.run([ldconfig_path, "-p", *(["-C", cache] if cache else [])], capture_output=True,
                              text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def driver_programs(search: Iterable[str] | None = None) -> list[str]:
    dirs = list(search) if search is not None else [
        *os.environ.get("PATH", "").split(":"), "/usr/bin", "/usr/local/nvidia/bin"]
    out = []
    for name in PROGRAMS:
        path = shutil.which(name, path=":".join(d for d in dirs if d))
        if path:
            out.append(os.path.abspath(path))
    return out


def _in_host_usr(path: str) -> bool:
    """A path the host-composed root takes from the host, read-only."""
    real = os.path.realpath(path)
    tops = ["usr", *(n for n in USR_LINK_NAMES if not os.path.islink(f"/{n}"))]
    return any(real == f"/{t}" or real.startswith(f"/{t}/") for t in tops)


def _visible_on_host_root(bind: Bind) -> bool:
    """A file the host-composed root already shows at bind.target."""
    if bind.target.startswith("/dev/") or not os.path.exists(bind.target):
        return False
    return os.path.realpath(bind.target) == os.path.realpath(bind.source) and _in_host_usr(bind.target)
