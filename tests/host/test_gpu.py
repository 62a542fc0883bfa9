"""GPU passthrough (nsbox/plan/gpu.py) without a GPU: a CDI spec and stand-in
device nodes, driver libraries and programs the tests make.

A user namespace cannot mknod, so the stand-in nodes are the host's own
/dev/zero, /dev/full and /dev/null under the names of NVIDIA's; what the
sandbox gets is then a real character device bound at /dev/nvidia0, as a
GPU's node is. The libraries are real ELF files in the loader cache of a
test-made cache file (ldconfig -C).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nsbox
from nsbox.host import dirs, layers, live
from nsbox.plan import gpu
from nsbox.compose import load_project
from nsbox.compose.errors import ComposeError
from nsbox.compose.mapping import service_spec
from nsbox.errors import SandboxSetupError
from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment
from nsbox.plan.rootfs import Bind
from nsbox.spec import SandboxSpec

LIB = "/opt/fake-nvidia/lib"  # outside /usr: the host root shows the host's /usr, read-only


def make_driver(root: Path) -> Path:
    """A driver folder as the NVIDIA toolkit's hosts have one: a versioned
    library, its soname link, a program."""
    driver = root / "driver"
    driver.mkdir()
    (driver / "libfakecuda.so.580.1").write_text("fake cuda\n")
    os.symlink("libfakecuda.so.580.1", driver / "libfakecuda.so.1")
    (driver / "nvidia-smi").write_text("#!/bin/sh\necho fake smi\n")
    os.chmod(driver / "nvidia-smi", 0o755)
    root.chmod(0o755)
    return driver


@pytest.fixture
def cdi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CDI spec (YAML, as nvidia-ctk writes it) with two stand-in GPUs."""
    driver = make_driver(tmp_path)
    spec = {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/zero"}]}},
            {"name": "1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1", "hostPath": "/dev/full"}]}},
            {"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/zero"},
                                                               {"path": "/dev/nvidia1", "hostPath": "/dev/full"}]}},
        ],
        "containerEdits": {
            "env": ["FAKE_DRIVER=580.1"],
            "deviceNodes": [{"path": "/dev/nvidiactl", "hostPath": "/dev/null"}],
            "mounts": [
                {"hostPath": str(driver / "libfakecuda.so.580.1"), "containerPath": f"{LIB}/libfakecuda.so.580.1",
                 "options": ["ro", "nosuid", "nodev", "bind"]},
                {"hostPath": str(driver / "nvidia-smi"), "containerPath": "/opt/fake-nvidia/bin/nvidia-smi",
                 "options": ["ro", "nosuid", "nodev", "bind"]},
            ],
            "hooks": [
                {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                 "args": ["nvidia-cdi-hook", "create-symlinks", "--link", f"libfakecuda.so.1::{LIB}/libfakecuda.so"]},
                {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                 "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB]},
                {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                 "args": ["nvidia-cdi-hook", "chmod", "--mode", "755", "--path", "/dev/dri"]},
            ],
        },
    }
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    import yaml

    (spec_dir / "nvidia.yaml").write_text(yaml.safe_dump(spec))
    (spec_dir / "other.json").write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "example.com/fpga", "devices": []}))
    monkeypatch.setenv("NSBOX_CDI_SPEC_DIRS", f"{tmp_path / 'missing'}:{spec_dir}")
    return spec_dir


SHOW = """
for n in nvidiactl nvidia0 nvidia1; do
  if [ -c /dev/$n ]; then echo "$n: char"; else echo "$n: none"; fi
done
echo "zero: $(head -c 4 /dev/nvidia0 2>/dev/null | od -An -tx1 | tr -d ' ')"
echo "env: $FAKE_DRIVER $NVIDIA_VISIBLE_DEVICES $LD_LIBRARY_PATH"
"""


async def show(sb: nsbox.Sandbox) -> str:
    r = await sb.exec(["sh", "-c", SHOW])
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.timeout(180)
async def test_cdi_all(cdi: Path, debian_rootfs: Path, capfd: pytest.CaptureFixture[str]) -> None:
    async with nsbox.Sandbox(debian_rootfs, gpus="all", env={"LD_LIBRARY_PATH": "/opt/mine"}) as sb:
        out = await show(sb)
        assert "nvidiactl: char\nnvidia0: char\nnvidia1: char\n" in out
        assert "zero: 00000000\n" in out  # /dev/zero's node, at /dev/nvidia0
        # The spec's env; the folder of update-ldcache before the sandbox's own.
        assert f"env: 580.1 all {LIB}:/opt/mine\n" in out
        # /dev/full's node at /dev/nvidia1: writable, as /dev/full is (ENOSPC).
        full = await sb.exec(["dd", "if=/dev/zero", "of=/dev/nvidia1", "bs=1", "count=1"])
        assert full.returncode != 0 and "No space left" in full.stderr, full.stderr
        # The library under its own name, its soname (ldconfig's link) and the
        # link create-symlinks names, all read-only, even for root.
        for name in ("libfakecuda.so.580.1", "libfakecuda.so.1", "libfakecuda.so"):
            r = await sb.exec(["cat", f"{LIB}/{name}"])
            assert r.stdout == "fake cuda\n", (name, r.stderr)
        w = await sb.exec(["sh", "-c", f"echo x > {LIB}/libfakecuda.so.1"])
        assert w.returncode != 0 and "Read-only" in w.stderr
        assert (await sb.exec(["/opt/fake-nvidia/bin/nvidia-smi"])).stdout == "fake smi\n"
    # A hook that is not emulated is named, not run.
    assert "the CDI hook chmod is not run" in capfd.readouterr().err


async def test_cdi_count_and_device_ids(cdi: Path, debian_rootfs: Path) -> None:
    async with nsbox.Sandbox(debian_rootfs, gpus=1) as sb:
        assert "nvidia0: char\nnvidia1: none\n" in await show(sb)
        assert "env: 580.1 0 " in await show(sb)
    for request in ("device=1", "device=nvidia.com/gpu=1"):
        # As a CUDA image's environment says: the selection wins.
        async with nsbox.Sandbox(debian_rootfs, gpus=request, env={"NVIDIA_VISIBLE_DEVICES": "all"}) as sb:
            out = await show(sb)
            assert "nvidiactl: char\nnvidia0: none\nnvidia1: char\n" in out, request
            assert "env: 580.1 1 " in out


async def test_cdi_on_the_host_root(cdi: Path) -> None:
    """The default root: nodes and the test's files (outside /usr) bound,
    their folder on LD_LIBRARY_PATH (the host's loader cache covers /usr)."""
    async with nsbox.Sandbox(gpus="device=0") as sb:
        out = await show(sb)
        assert "nvidia0: char\nnvidia1: none\n" in out and f"env: 580.1 0 {LIB}\n" in out
        assert (await sb.exec(["cat", f"{LIB}/libfakecuda.so.1"])).stdout == "fake cuda\n"


def test_host_root_files_are_not_bound_again(tmp_path: Path) -> None:
    """The host-composed root shows the host's /usr read-only: a bind there
    could not be made, and is not needed."""
    (tmp_path / "lib.so").write_text("")
    assert gpu._visible_on_host_root(Bind("/usr/bin/env", "/usr/bin/env"))
    assert not gpu._visible_on_host_root(Bind(str(tmp_path / "lib.so"), "/usr/bin/env"))
    assert not gpu._visible_on_host_root(Bind(str(tmp_path / "lib.so"), str(tmp_path / "lib.so")))
    assert not gpu._visible_on_host_root(Bind("/dev/null", "/dev/null"))
    # What /usr lacks cannot be added there: left out, and said.
    setup = gpu.Setup(binds=[Bind(str(tmp_path / "lib.so"), "/usr/lib/nsbox-test-none/lib.so"),
                             Bind("/usr/bin/env", "/usr/bin/env"), Bind("/dev/null", "/dev/nvidiactl"),
                             Bind(str(tmp_path / "lib.so"), "/usr/bin/env")])  # the host's own env stays
    setup.library_dirs = ["/usr/lib/x86_64-linux-gnu", str(tmp_path)]
    gpu._for_host_root(setup)
    assert [b.target for b in setup.binds] == ["/dev/nvidiactl"]
    assert setup.library_dirs == [str(tmp_path)]
    assert setup.notes == ["/usr/lib/nsbox-test-none/lib.so is not added: the host root's /usr is the host's, read-only"]


@pytest.mark.parametrize("request_, message", [
    (3, "gpus: 3 GPUs requested, 2 found (CDI spec "),
    ("device=7", "gpus: no GPU '7' (CDI spec "),
])
async def test_cdi_refuses_what_it_does_not_have(cdi: Path, request_: object, message: str) -> None:
    sb = nsbox.Sandbox(gpus=request_)
    with pytest.raises(SandboxSetupError) as e:
        await sb.start()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    # Refused before anything was made: no runtime dir, registry entry or layer.
    assert sb.id and live.read(sb.id) is None
    assert not (dirs.runtime_dir() / sb.id).exists() and not (layers.layers_dir() / sb.id).exists()


@pytest.mark.parametrize("edit, message", [
    ({"mounts": [{"hostPath": "/dev/null", "containerPath": "/opt/../etc/passwd", "options": ["bind"]}]},
     "bind target must be a normalized path"),
    ({"mounts": [{"hostPath": "/dev/null", "containerPath": "etc/passwd", "options": ["bind"]}]},
     "bind target must be an absolute path"),
    ({"deviceNodes": [{"path": "/dev/nvidia9", "hostPath": "/dev/nsbox-test-none"}]},
     "device node /dev/nsbox-test-none does not exist on this host"),
])
async def test_cdi_bad_spec_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: dict[str, object],
                                        message: str) -> None:
    spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/zero"}]}}],
            "containerEdits": edit}
    (tmp_path / "nvidia.json").write_text(json.dumps(spec))
    monkeypatch.setenv("NSBOX_CDI_SPEC_DIRS", str(tmp_path))
    with pytest.raises(SandboxSetupError) as e:
        async with nsbox.Sandbox(gpus="all"):
            pass
    assert str(e.value).startswith("gpus: ") and message in str(e.value) and "\n" not in str(e.value)


def test_cdi_unreadable_spec_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "nvidia.yaml").write_text("kind: nvidia.com/gpu\ndevices: [\n  {name: 0\n")
    monkeypatch.setenv("NSBOX_CDI_SPEC_DIRS", str(tmp_path))
    with pytest.raises(SandboxSetupError, match=rf"^gpus: CDI spec {tmp_path}/nvidia.yaml: [^\n]+$"):
        gpu.resolve("all", host_root=False)


def test_cdi_spec_others_could_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec names host paths a sandbox gets read-write: one that another
    user could have written (group/other-writable, or theirs) is refused."""
    spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/zero"}]}}],
            "containerEdits": {"mounts": [{"hostPath": "/", "containerPath": "/host"}]}}
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    (spec_dir / "nvidia.json").write_text(json.dumps(spec))
    monkeypatch.setenv("NSBOX_CDI_SPEC_DIRS", str(spec_dir))
    spec_dir.chmod(0o777)
    with pytest.raises(SandboxSetupError, match=rf"^gpus: CDI spec {spec_dir} could have been written by another user"):
        gpu.resolve("all", host_root=False)
    spec_dir.chmod(0o755)
    (spec_dir / "nvidia.json").chmod(0o666)
    with pytest.raises(SandboxSetupError, match="nvidia.json could have been written by another user .*mode 666"):
        gpu.resolve("all", host_root=False)
    (spec_dir / "nvidia.json").chmod(0o644)
    if os.geteuid() == 0:
        os.chown(spec_dir / "nvidia.json", 65534, 65534)
        with pytest.raises(SandboxSetupError, match="owner uid 65534"):
            gpu.resolve("all", host_root=False)
        os.chown(spec_dir / "nvidia.json", 0, 0)
    assert any(b.target == "/host" for b in gpu.resolve("all", host_root=False).binds)


@pytest.fixture
def discovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No CDI spec: stand-in /dev/nvidia* nodes, a driver library in a
    loader cache, nvidia-smi on PATH."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, host in (("nvidiactl", "null"), ("nvidia-uvm", "null"), ("nvidia0", "zero"), ("nvidia1", "full")):
        os.symlink(f"/dev/{host}", dev / name)
    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "ml.c").write_text("int nvmlInit(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", lib / "libnvidia-ml.so.580.1",
                    tmp_path / "ml.c"], check=True)
    (tmp_path / "ld.so.conf").write_text(f"{lib}\n")
    subprocess.run([gpu.ldconfig() or "ldconfig", "-i", "-C", tmp_path / "ld.so.cache", "-f", tmp_path / "ld.so.conf"],
                   check=True, capture_output=True)
    driver = make_driver(tmp_path)
    tmp_path.chmod(0o755)
    monkeypatch.setenv("NSBOX_CDI_SPEC_DIRS", str(tmp_path / "no-cdi"))
    monkeypatch.setenv("NSBOX_GPU_DEV_DIR", str(dev))
    monkeypatch.setenv("NSBOX_GPU_LD_CACHE", str(tmp_path / "ld.so.cache"))
    monkeypatch.setenv("PATH", f"{driver}:{os.environ['PATH']}")
    return tmp_path


def test_driver_libraries_from_the_loader_cache(discovered: Path) -> None:
    found = gpu.driver_libraries()
    assert found == [str(discovered / "lib" / "libnvidia-ml.so.1")]
    # Only the driver's own libraries, only this machine's ABI.
    text = ("\tlibnvidia-ml.so.1 (libc6) => /usr/lib32/libnvidia-ml.so.1\n"
            "\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6\n")
    assert gpu.driver_libraries(text) == []


async def test_discovery(discovered: Path, debian_rootfs: Path) -> None:
    lib = discovered / "lib"
    async with nsbox.Sandbox(debian_rootfs, gpus="device=1") as sb:
        out = await show(sb)
        assert "nvidiactl: char\nnvidia0: none\nnvidia1: char\n" in out
        assert f"env:  1 {lib}\n" in out
        assert (await sb.exec(["test", "-c", "/dev/nvidia-uvm"])).returncode == 0
        r = await sb.exec(["sh", "-c", f"cmp {lib}/libnvidia-ml.so.1 {lib}/libnvidia-ml.so.580.1 2>&1; "
                                       f"cat /proc/self/mountinfo | grep ' {lib}/libnvidia-ml.so.1 '"])
        # The bind is the library itself (its link resolved), read-only.
        assert r.returncode == 0 and " ro," in r.stdout, r.stdout
        # The driver's programs land on every PATH, wherever the host keeps them.
        assert (await sb.exec(["nvidia-smi"])).stdout == "fake smi\n"
        assert (await sb.exec(["test", "-e", str(discovered / "driver" / "nvidia-smi")])).returncode == 1
    async with nsbox.Sandbox(debian_rootfs, gpus="all") as sb:
        out = await show(sb)
        assert "nvidia0: char\nnvidia1: char\n" in out and "zero: 00000000" in out and "env:  all " in out
    # The host root: the test's files (outside /usr) at their own paths.
    async with nsbox.Sandbox(gpus=1) as sb:
        out = await show(sb)
        assert "nvidia0: char\nnvidia1: none\n" in out and f"env:  0 {lib}\n" in out
        assert (await sb.exec([str(discovered / "driver" / "nvidia-smi")])).stdout == "fake smi\n"
        # The soname the loader cache names, bound (its link resolved); nothing else of the folder.
        elf = await sb.exec(["sh", "-c", f"head -c 4 {lib}/libnvidia-ml.so.1 | od -An -c; ls {lib}"])
        assert elf.stdout.split() == ["177", "E", "L", "F", "libnvidia-ml.so.1"], elf


async def test_no_gpu_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NSBOX_CDI_SPEC_DIRS", str(tmp_path))
    monkeypatch.setenv("NSBOX_GPU_DEV_DIR", str(tmp_path))
    with pytest.raises(SandboxSetupError, match=r"^gpus: no NVIDIA GPU found on this host \(no CDI spec in "):
        async with nsbox.Sandbox(gpus="all"):
            pass
    env = {**os.environ, "NSBOX_CDI_SPEC_DIRS": str(tmp_path), "NSBOX_GPU_DEV_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "nsbox", "run", "--gpus", "all", "--", "true"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "gpus: no NVIDIA GPU found" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2, r.stderr  # the message (and a hint at most)


@pytest.mark.parametrize("value, normal", [
    (None, None), ("all", "all"), (-1, "all"), (2, "2"), ("2", "2"), ("count=2", "2"), ('"device=0,1"', "device=0,1"),
    ("device=GPU-3f1c,nvidia.com/gpu=1", "device=GPU-3f1c,nvidia.com/gpu=1"),
])
def test_gpus_request_forms(value: object, normal: str | None) -> None:
    assert SandboxSpec(gpus=value).gpus == normal  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, "0", "some", "device=", "device=a b", 1.5, [0]])
def test_gpus_bad_requests(bad: object) -> None:
    with pytest.raises(ValueError, match="gpus must be 'all', a number of GPUs, or device="):
        SandboxSpec(gpus=bad)  # type: ignore[arg-type]


async def test_cli(cdi: Path, debian_rootfs: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "nsbox", "run", "--rootfs", str(debian_rootfs), "--gpus", "device=1",
                        "--", "sh", "-c", SHOW], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "nvidia0: none\nnvidia1: char\n" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "nsbox", "run", "--gpus", "0", "--", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gpus must be 'all'" in bad.stderr and "Traceback" not in bad.stderr


def test_inspect_config() -> None:
    cfg = NsboxConfig(gpus=2, sandboxes={"trainer": {"gpus": "device=1"}, "plain": {"gpus": None}})
    specs = dict(cfg.settings())
    assert [specs[n].gpus for n in ("trainer", "plain")] == ["device=1", None]
    sb = NsboxSandboxEnvironment._make(cfg, specs["trainer"], "t")
    assert sb.spec.gpus == "device=1"
    with pytest.raises(ValueError, match="gpus must be"):
        NsboxConfig(gpus="many")


def compose(tmp_path: Path, service_yaml: str) -> str:
    (tmp_path / "compose.yaml").write_text(
        "services:\n  s:\n    image: alpine\n" + textwrap.indent(textwrap.dedent(service_yaml), "    "))
    return str(tmp_path / "compose.yaml")


@pytest.mark.parametrize("service_yaml, request_", [
    ("gpus: all", "all"),
    ("gpus: [{driver: nvidia, count: 2}]", "2"),
    ("runtime: nvidia", "all"),
    ("runtime: nvidia\nenvironment: {NVIDIA_VISIBLE_DEVICES: '0,1'}", "device=0,1"),
    ("runtime: nvidia\nenvironment: {NVIDIA_VISIBLE_DEVICES: none}", None),
    ("deploy: {resources: {reservations: {devices: [{driver: nvidia, count: 1, capabilities: [gpu]}]}}}", "1"),
    ("deploy: {resources: {reservations: {devices: [{capabilities: [gpu], count: all}]}}}", "all"),
    ("deploy: {resources: {reservations: {devices: [{driver: nvidia, device_ids: ['1', '3'], "
     "capabilities: [gpu, utility]}]}}}", "device=1,3"),
])
def test_compose_gpu_keys(tmp_path: Path, service_yaml: str, request_: str | None) -> None:
    project = load_project(compose(tmp_path, service_yaml))
    assert project.services["s"].gpus == request_
    assert service_spec(project.services["s"], project, image="alpine", network="none").gpus == request_


@pytest.mark.parametrize("service_yaml, message", [
    ("devices: [/dev/kvm]", "service s: nsbox cannot honour: devices (host devices other than GPUs are not "
                            "passed through; GPUs: use gpus)"),
    ("deploy: {resources: {reservations: {devices: [{driver: tpu, capabilities: [tpu]}]}}}",
     "deploy.resources.reservations.devices: driver tpu, capabilities ['tpu'] (only NVIDIA GPUs are passed through)"),
    ("runtime: kata", "runtime: kata"),
    ("device_cgroup_rules: ['c 195:* rmw']", "device_cgroup_rules (a rootless sandbox has no device cgroup)"),
    ("deploy: {resources: {reservations: {devices: [/dev/kvm]}}}",
     "deploy.resources.reservations.devices: /dev/kvm (only NVIDIA GPUs are passed through)"),
    ("deploy: {resources: {reservations: {devices: [{capabilities: [gpu], count: 1, device_ids: ['0']}]}}}",
     "count and device_ids cannot both be given"),
    ("gpus: all\ndeploy: {resources: {reservations: {devices: [{capabilities: [gpu], count: 1}]}}}",
     "GPUs are asked for more than once, differently"),
    ("gpus: [{count: 0}]", "count must be a positive number or all"),
])
def test_compose_refusals_name_key_and_reason(tmp_path: Path, service_yaml: str, message: str) -> None:
    with pytest.raises(ComposeError) as e:
        load_project(compose(tmp_path, service_yaml))
    assert message in str(e.value) and "\n" not in str(e.value)


async def test_compose_service_gets_its_gpu(cdi: Path, tmp_path: Path, debian_rootfs: Path) -> None:
    """deploy.resources.reservations.devices through the compose loader into a sandbox."""
    project = load_project(compose(tmp_path, """\
        deploy:
          resources:
            reservations:
              devices:
                - driver: nvidia
                  device_ids: ["1"]
                  capabilities: [gpu]
        """))
    spec = service_spec(project.services["s"], project, image="alpine", network="none")
    async with nsbox.Sandbox(spec=spec.replace(image=None, rootfs=str(debian_rootfs))) as sb:
        out = await show(sb)
        assert "nvidia0: none\nnvidia1: char\n" in out and "env: 580.1 1 " in out
