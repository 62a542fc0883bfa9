"""The bridge worker: the process that is a service network.

The network helper (helper.py) forks one per network. It joins the owner's
user namespace (unprivileged), makes the network's namespace with its
bridge, and stays there: it holds both alive, keeps the member table (names,
aliases, addresses) and makes each member's veth pair.

Why a process that stays: a member joins between its sandbox's clone and
its start, so the join is on the path of every member's creation. A forked
child per join, entering namespaces and opening netlink sockets afresh,
cost ~14 ms; here a join is one netlink request on a warm socket (a veth
pair, one end enslaved to the bridge and up, the other made right inside
the member's namespace) and a few ioctls inside the member (address,
netmask, up). The worker holds CAP_NET_ADMIN over the member's namespace,
whose user namespace is a child of the owner's, so it may enter it and
come back. (Pairs made in advance and moved in would cost more: moving a
device between namespaces waits for an RCU grace period, ~20 ms here.)

A network of one nsbox process lives as long as its socket to that
process. A named network (`nsbox network create`) outlives the process
that made it: the worker then also listens on a unix socket in the owner's
runtime directory, where any process of the owner finds it, and stops on
a "stop" request. Its members' inits are watched through their pidfds: a
member whose sandbox is gone leaves the table.

Requests (the helper's framing: one JSON object plus descriptors, fields
``*_fd`` index the descriptors; replies carry the request's ``seq``):
  info                                   -> {subnet, internal, host_access, mapping, members}
                                            + the owner's user namespace (fd)
  reserve {name, aliases, sandbox, extra} -> {address, members}   (extra: its extra /etc/hosts entries)
  take    {name, member_fd, pidfd_fd?, ifname?, tap?} -> {host_ifname}   (ifname: eth0 unless given, ethN)
                                            + with tap ({ifname, address, prefix, gateway, dns, mtu}):
                                            the member's tap and a packet socket onto it (ondemand.py)
  leave   {name, sandbox?, unlink}       -> {members}   (only if the name is still that sandbox's)
          {members: [[name, sandbox]...], unlink}          (several at once)
  stop                                   (named networks; refused while members live)
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import re
import select
import socket
import struct
from typing import Any

from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

import ondemand
from nscalls import (CLONE_NEWNET, CLONE_NEWUSER, IFF_UP, MAX_FDS, MAX_MESSAGE, PR_SET_NAME, configure, describe,
                     libc, no_ipv6, send_reply, setns, unshare)

IFNAME = "eth0"
NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_DELLINK, NLMSG_ERROR = 16, 17, 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400


class Stop(Exception):
    """Ends the worker once its reply is sent."""


class BridgeWorker:
    def __init__(self, req: dict[str, Any]) -> None:
        no_ipv6("all", "default")  # nothing in here speaks IPv6; it makes every new link slower
        self.rtnl = Rtnl()
        self.rtnl.link(RTM_NEWLINK, index=1, up=True)
        self.rtnl.link(RTM_NEWLINK, ifname=req["bridge"], kind="bridge", up=True, create=True)
        self.bridge = socket.if_nametoindex(req["bridge"])
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.settings = {k: req[k] for k in ("subnet", "internal", "host_access", "mapping")}
        self.hosts = list(ipaddress.IPv4Network(req["subnet"]).hosts())[1:]  # .1: no gateway here
        self.last = -1  # index in self.hosts of the last address given
        self.members: dict[str, dict[str, Any]] = {}
        self.watched: dict[int, str] = {}  # a member's init pidfd -> its name
        self.reserved_by: dict[str, int] = {}  # a name reserved, not joined yet -> the client's fd
        self.client = -1  # the fd of the client whose request is being served
        self.made = 0
        self.path = req.get("path") or ""  # a named network's socket, until it stops

    # ---- requests ------------------------------------------------------

    def info(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        return {**self.settings, "members": self.table()}, [os.open("/proc/self/ns/user", os.O_RDONLY)]

    def reserve(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        name, aliases = req["name"], list(req.get("aliases", []))
        taken = {n for m in self.members.values() for n in (m["name"], *m["aliases"])}
        if name in taken or taken.intersection(aliases):
            raise ValueError(f"already has a member called {name} (or one of {aliases})")
        address = self._free_address()
        self.members[name] = {"name": name, "aliases": aliases, "address": address, "host_ifname": "",
                              "sandbox": req.get("sandbox"), "extra": dict(req.get("extra", {}))}
        self.reserved_by[name] = self.client  # until it joins: dropped if that client goes first
        return {"address": address, "members": self.table()}, []

    def take(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        member = self.members.get(req["name"])
        if member is None or member["host_ifname"]:
            raise ValueError(f"{req['name']} is not a reserved member")
        ifname = req.get("ifname") or IFNAME
        if not re.fullmatch(r"eth[0-9]{1,3}", ifname):
            raise ValueError(f"member interface must be ethN, not {ifname!r}")
        self.made += 1
        host = f"veth{self.made}"
        netns = fds[req["member_fd"]]
        made = False
        # Inside the member for its sysctl and ioctls; the netlink socket
        # stays bound to the network's namespace.
        setns(netns, CLONE_NEWNET, "member's network namespace")
        try:
            no_ipv6("default")  # its eth0, as Docker's: IPv4 only (its loopback keeps ::1)
            self.rtnl.link(RTM_NEWLINK, ifname=host, kind="veth", master=self.bridge, up=True, create=True,
                           peer=[("IFLA_IFNAME", ifname), ("IFLA_NET_NS_FD", netns)])
            made = True
            configure(ifname, member["address"])
            out = ondemand.make_tap(**req["tap"]) if req.get("tap") else []
        except BaseException:
            if made:
                self._unlink(host)
            raise
        finally:
            setns(self.home, CLONE_NEWNET, "network's namespace")
        member["host_ifname"] = host
        self.reserved_by.pop(member["name"], None)
        if req.get("pidfd_fd") is not None:
            self.watched[os.dup(fds[req["pidfd_fd"]])] = member["name"]
        return {"host_ifname": host}, out

    def leave(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        for name, sandbox in req.get("members") or [(req["name"], req.get("sandbox"))]:
            self._leave(name, sandbox, bool(req.get("unlink")))
        return {"members": self.table()}, []

    def _leave(self, name: str, sandbox: str | None, unlink: bool) -> None:
        member = self.members.get(name)
        if member is not None and sandbox not in (None, member["sandbox"]):
            return  # that name is another sandbox's now
        self.members.pop(name, None)
        self.reserved_by.pop(name, None)
        for pidfd in [fd for fd, n in self.watched.items() if n == name]:
            del self.watched[pidfd]
            os.close(pidfd)
        if member is not None and member["host_ifname"] and unlink:
            self._unlink(member["host_ifname"])  # else it goes with the member's namespace

    def stop(self, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        if self.members:
            raise ValueError(f"it has members: {', '.join(sorted(self.members))}")
        if self.path:
            os.unlink(self.path)  # gone by name before the caller hears it is
            self.path = ""
        raise Stop

    # ---- helpers -------------------------------------------------------

    def table(self) -> list[dict[str, Any]]:
        return list(self.members.values())

    def _free_address(self) -> str:
        """The next free address after the last one given: an address is not
        reused while the subnet has others (members may still hold the
        previous owner's in their neighbour tables)."""
        used = {m["address"] for m in self.members.values()}
        for i in range(len(self.hosts)):
            at = (self.last + 1 + i) % len(self.hosts)
            if str(self.hosts[at]) not in used:
                self.last = at
                return str(self.hosts[at])
        raise ValueError(f"is full ({len(self.hosts)} members)")

    def _unlink(self, host_ifname: str) -> None:
        try:
            self.rtnl.link(RTM_DELLINK, ifname=host_ifname)  # its peer in the member goes with it
        except OSError as e:
            if e.errno != errno.ENODEV:  # else gone already, with the member's namespace
                raise

    def _forget_exited(self, pidfd: int) -> None:
        self.leave({"name": self.watched[pidfd]}, [])  # its veth pair went with its namespace

    # ---- the loop ------------------------------------------------------

    def serve(self, first: socket.socket, listener: socket.socket | None) -> None:
        """Serves `first` (the socket to the process that made it) and, for
        a named network, every client of `listener`, until told to stop
        (named) or until `first` closes (a network of one process)."""
        ops = {"info": self.info, "reserve": self.reserve, "take": self.take, "leave": self.leave,
               "stop": self.stop}
        clients = {first.fileno(): first}
        while True:
            poller = select.poll()
            for fd in [*clients, *self.watched, *([listener.fileno()] if listener else [])]:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll():
                if fd in self.watched:
                    self._forget_exited(fd)
                elif listener is not None and fd == listener.fileno():
                    conn, _ = listener.accept()
                    clients[conn.fileno()] = conn
                elif fd in clients and not self._handle(clients[fd], ops):
                    if clients[fd] is first and listener is None:  # a network of that process
                        return
                    clients.pop(fd).close()
                    for name in [n for n, by in self.reserved_by.items() if by == fd]:
                        del self.reserved_by[name]  # its process went before the member joined
                        self.members.pop(name, None)

    def _handle(self, chan: socket.socket, ops: dict[str, Any]) -> bool:
        """Serves one request; False when the client is gone."""
        try:
            data, fds, _, _ = socket.recv_fds(chan, MAX_MESSAGE, MAX_FDS)
        except (ConnectionResetError, BlockingIOError):
            return False
        if not data:
            return False
        out: list[int] = []
        seq = None
        try:
            try:
                req = json.loads(data)
                seq = req.get("seq")
                self.client = chan.fileno()
                result, out = ops[req.get("op")](req, fds)
                send_reply(chan, {"ok": True, **result}, out, seq)
            except Stop:
                send_reply(chan, {"ok": True}, [], seq)
                raise
            except Exception as e:
                send_reply(chan, {"ok": False, "error": describe(e)}, [], seq)
        except (BrokenPipeError, ConnectionResetError):
            return False
        finally:
            for fd in [*fds, *out]:
                os.close(fd)
        return True


class Rtnl:
    """A netlink route socket of the namespace it was made in, one request
    at a time. pyroute2's message classes encode the requests; this class
    only sends them and reads the kernel's acknowledgement. (pyroute2's own
    IPRoute runs an asyncio loop for each call: 2-3 ms of CPU per request
    here, 5 ms to make one, and ~4 MiB more held by every worker.)"""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
        self.sock.bind((0, 0))  # no multicast group: only the replies to our requests arrive
        self.seq = 0

    def link(self, msg_type: int, *, index: int = 0, ifname: str | None = None, kind: str | None = None,
             master: int | None = None, up: bool = False, create: bool = False,
             peer: list[tuple[str, Any]] | None = None) -> None:
        """One RTM_NEWLINK or RTM_DELLINK request (a link named by `index` or
        `ifname`); raises OSError with the kernel's errno if refused."""
        attrs: list[tuple[str, Any]] = [("IFLA_IFNAME", ifname)] if ifname else []
        if master is not None:
            attrs.append(("IFLA_MASTER", master))
        if kind:
            info: list[tuple[str, Any]] = [("IFLA_INFO_KIND", kind)]
            if peer is not None:  # a veth pair: its other end, made where IFLA_NET_NS_FD says
                info.append(("IFLA_INFO_DATA", {"attrs": [("VETH_INFO_PEER", {"attrs": peer})]}))
            attrs.append(("IFLA_LINKINFO", {"attrs": info}))
        msg = ifinfmsg()
        msg["index"] = index
        msg["flags"] = msg["change"] = IFF_UP if up else 0
        msg["attrs"] = attrs
        self.seq += 1
        msg["header"]["type"] = msg_type
        msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | (NLM_F_CREATE | NLM_F_EXCL if create else 0)
        msg["header"]["sequence_number"] = self.seq
        msg.encode()
        self.sock.send(msg.data)
        self._ack()

    def _ack(self) -> None:
        """Reads up to this request's acknowledgement (an nlmsgerr: the
        header, then 0 or minus an errno)."""
        while True:
            data = self.sock.recv(65536)
            at = 0
            while at + 20 <= len(data):
                length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, at)
                if kind == NLMSG_ERROR and seq == self.seq:
                    err = -struct.unpack_from("=i", data, at + 16)[0]
                    if err:
                        raise OSError(err, f"netlink: {os.strerror(err)}")
                    return
                at += max((length + 3) & ~3, 16)


def run(chan: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """The forked worker's life: set up, say ready on `chan` (with the
    network's namespace), serve. Never returns."""
    code = 1
    try:
        libc.prctl(PR_SET_NAME, b"nsbox-bridge", 0, 0, 0)  # findable in ps
        if req.get("path"):  # outliving the nsbox process: not holding its output or a mount open
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
        keep = {chan.fileno(), *fds}
        for name in os.listdir("/proc/self/fd"):  # nothing of the helper's (its channel, pasta's pipes)
            if int(name) > 2 and int(name) not in keep:
                try:
                    os.close(int(name))
                except OSError:
                    pass
        listener = None
        try:
            if req.get("user_fd") is not None:
                setns(fds[req["user_fd"]], CLONE_NEWUSER, "user namespace")
            unshare(CLONE_NEWNET, "network namespace")
            worker = BridgeWorker(req)
            if req.get("path"):
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                listener.bind(req["path"])
                listener.listen(16)
        except Exception as e:
            chan.send(json.dumps({"error": describe(e)}).encode())
            return
        for fd in fds:
            os.close(fd)
        socket.send_fds(chan, [b"{}"], [worker.home])
        try:
            worker.serve(chan, listener)
        except Stop:
            pass
        code = 0
    finally:
        os._exit(code)
