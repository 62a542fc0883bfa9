"""Writable layers: kept for reuse only when nothing of a sandbox remains."""

from __future__ import annotations

import os
from pathlib import Path

import nsbox
from nsbox import manage, rootfs


def reuse_dir() -> Path:
    return rootfs.layers_dir() / rootfs.REUSE


def kept() -> set[str]:
    try:
        return set(os.listdir(reuse_dir()))
    except FileNotFoundError:
        return set()


async def test_an_untouched_layer_is_kept_and_reused() -> None:
    manage.gc(nsbox.idmap.detect())  # start from an empty pool
    async with nsbox.Sandbox() as a:
        await a.exec(["true"])
        layer_a = a._layer
    assert layer_a is not None and layer_a.name in kept()
    async with nsbox.Sandbox() as b:
        assert b._layer is not None and not kept()  # taken from the pool
        assert (await b.read_file("/etc/hostname")).strip() == b.hostname
        assert b.hostname in await b.read_file("/etc/hosts")


async def test_nothing_of_a_sandbox_carries_over() -> None:
    # Every kind of change to the layer makes it unfit for reuse.
    changes = [
        "echo data > /root/file",
        "chmod 700 /",
        "rm /etc/hosts && ln -s /etc/shadow /etc/hosts",
        "ln /etc/hosts /etc/hosts2",
        "chmod 600 /etc/hostname",
        "mkdir /home/someone",
    ]
    for change in changes:
        manage.gc(nsbox.idmap.detect())
        async with nsbox.Sandbox() as a:
            r = await a.exec(["sh", "-c", change])
            assert r.success, (change, r.stderr)
        assert not kept(), f"a layer changed by {change!r} was kept"
        async with nsbox.Sandbox() as b:
            assert (await b.exec(["ls", "-A", "/root", "/home"])).stdout == "/home:\n\n/root:\n"
            stat = await b.exec(["stat", "-c", "%n %a %F %h", "/", "/etc/hosts", "/etc/hostname"])
            assert stat.stdout.splitlines()[0].startswith("/ 755 directory")
            assert stat.stdout.splitlines()[1:] == ["/etc/hosts 644 regular file 1", "/etc/hostname 644 regular file 1"]


async def test_gc_empties_the_pool() -> None:
    async with nsbox.Sandbox():
        pass
    assert kept()
    manage.gc(nsbox.idmap.detect())
    assert not kept()
    assert not [p for p in os.listdir(rootfs.layers_dir()) if p.startswith(".gc-")]
