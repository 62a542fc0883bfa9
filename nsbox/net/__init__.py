"""Networks: user-mode outbound access (pasta, slirp4netns), the egress proxy, service networks, published ports.

Modules (each takes namespace descriptors and addresses, nothing of Sandbox):

  client.py   NetHelper: the single-threaded helper process (helper.py) that
              works inside other processes' namespaces; Namespaces (net and
              user namespace descriptors of a sandbox); listen_in/connect_in.
  proxy.py    ProxyServer + Allowlist (proxy mode), proxy_env().
  usernet.py  start(): pasta or slirp4netns on a namespace (nat mode);
              check_tun(), find_tool().
  ondemand.py the tap a network member's pasta starts on at its first
              packet out (made by the bridge worker, held by the helper).
  bridge.py   OwnerUserns, Network: service networks (bridge + veth pairs).
  ports.py    PortSpec, PublishedPort: `-p [ADDRESS:]HOSTPORT:PORT`.
  hosts.py    render_hosts(), render_resolv_conf().

Plugging a mode into sandbox creation (ns = Namespaces.of_pid(init_pid),
opened while the init's pidfd is held; close it when done with it):

  none    as today (clone with CLONE_NEWNET, loopback up by a child step).
  host    as today (no CLONE_NEWNET).
  proxy   like none. After the init runs (loopback up):
            sock = await listen_in(ns, "127.0.0.1", 3128)
            tg.start_soon(ProxyServer(allow).serve_socket, sock)
          and add proxy_env(3128) to the sandbox's environment. The proxy
          lives in the owner's task group: it ends with the owner.
  nat     like none. Before the go byte or after the init runs (either:
          pasta/slirp configure their own tap; loopback is not needed):
            un = await usernet.start(ns, watch_pidfd=pidfd)
          /etc/hosts: render_hosts(hostname, host_address=un.host_address);
          /etc/resolv.conf: render_resolv_conf(un.dns). Both are files the
          rootfs contributor writes before the clone (prepare()), so take
          the constant addresses usernet.GATEWAY/DNS there. un.stop() on
          close; the helper also stops it when the init exits.
          Check usernet.check_tun() and find_tool() at spec validation, so
          a missing tun device fails before anything is created.
  Network members (non-root): the sandbox's user namespace must be a child
          of the network's OwnerUserns (see bridge.py for why): the zygote
          clones it from inside that namespace (setns to OwnerUserns.fd
          first) and writes the child's maps as IdMap.nested_identity()
          directly. As root, Network.start(None) and ordinary sandboxes.
          After the init runs:
            m = await network.connect(name, ns, aliases=..., watch_pidfd=pidfd)
          then write network.hosts_for(name) into every member's
          /etc/hosts (again on every connect/disconnect).
  ports   after the init runs: p = await PublishedPort(spec, ns).open()
          (raises EADDRINUSE at once), tg.start_soon(p.serve). Keep `ns`
          open while it serves.
"""
