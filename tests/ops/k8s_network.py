"""The replay's network (for ``k8s_replay``): each datacenter's address plan, and a router
namespace with every pod's or node's namespace wired to it by a veth pair."""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import subprocess

from k8s_semantics import ReplayError

ROUTER_GW = "169.254.1.1"  # every pod's and node's next hop: the router end of its veth


def run(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(list(cmd), capture_output=True, text=True, input=input, timeout=60)
    if check and result.returncode != 0:
        raise ReplayError(f"{' '.join(cmd)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


@dataclasses.dataclass
class Datacenter:
    """One cluster's address plan: pods on ``pod_cidr``, nodes (host network) on ``node_cidr`` with
    interface ``node_ifname``, ClusterIPs on ``service_cidr``, load balancers on ``lb_cidr``."""

    name: str
    pod_cidr: str
    node_cidr: str
    service_cidr: str
    lb_cidr: str
    node_ifname: str = "eth1"
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # extra DNS names (e.g. an LB's)
    #: None: the pod network is routed to the other datacenters. An address: it is not (an overlay
    #: or a NATed pod network): pods leave the cluster translated to this address (the nodes' NAT),
    #: and outside sources reach them only through a Service's translation (a load balancer)
    pod_egress: str | None = None
    #: with pod_egress: the pod network is still routed (reachable from outside), only the pods'
    #: connections out of the datacenter are translated (source NAT on egress, a cloud's default
    #: for traffic leaving the pod range): the peer sees pod_egress (a node's address), not the pod's
    pod_routed: bool = False

    def __post_init__(self) -> None:
        self._pods = itertools.islice(ipaddress.ip_network(self.pod_cidr).hosts(), 1, None)
        self._services = itertools.islice(ipaddress.ip_network(self.service_cidr).hosts(), 9, None)
        self._lbs = itertools.islice(ipaddress.ip_network(self.lb_cidr).hosts(), 9, None)
        self.nodes: list[str] = []

    def next_pod_ip(self) -> str:
        return str(next(self._pods))

    def next_service_ip(self) -> str:
        return str(next(self._services))

    def next_lb_ip(self) -> str:
        return str(next(self._lbs))


class Network:
    """The router namespace and every pod's or node's namespace wired to it by a veth pair, with a
    /32 route each way (so every packet between two of them crosses the router, where the
    Services' DNAT happens)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.router = f"{prefix}-wan"
        self.namespaces: list[str] = []
        self._ids = itertools.count()
        self._nat: dict[str, str] = {}  # rule set name -> nft statements
        self._add_ns(self.router)
        self.exec(self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.exec(self.router, "ip", "link", "set", "lo", "up")

    def _add_ns(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self.namespaces.append(name)

    def exec(self, ns: str, *cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return run("ip", "netns", "exec", ns, *cmd, check=check, input=input)

    def attach(self, name: str, address: str, ifname: str = "eth0") -> str:
        """A new namespace ``name`` with ``address`` on ``ifname``, routed through the router."""
        ns = f"{self.prefix}-{name}"
        self._add_ns(ns)
        host = f"{self.prefix[:6]}v{next(self._ids)}"
        run("ip", "link", "add", host, "netns", self.router, "type", "veth", "peer", "name", ifname, "netns", ns)
        self.exec(self.router, "ip", "addr", "add", f"{ROUTER_GW}/32", "dev", host)
        self.exec(self.router, "ip", "link", "set", host, "up")
        self.exec(self.router, "ip", "route", "add", f"{address}/32", "dev", host)
        self.exec(ns, "ip", "link", "set", "lo", "up")
        self.exec(ns, "ip", "addr", "add", f"{address}/32", "dev", ifname)
        self.exec(ns, "ip", "link", "set", ifname, "up")
        self.exec(ns, "ip", "route", "add", ROUTER_GW, "dev", ifname)
        self.exec(ns, "ip", "route", "add", "default", "via", ROUTER_GW, "dev", ifname)
        return ns

    def remove(self, ns: str) -> None:
        if ns in self.namespaces:
            self.namespaces.remove(ns)
            run("ip", "netns", "del", ns, check=False)

    def set_nat(self, key: str, filters: list[str], nat: list[str]) -> None:
        """Replace one Service's statements in the router: filters (before address translation)
        and DNAT rules."""
        self._nat[key] = (filters, nat)
        f = "\n".join(s for fs, _ in self._nat.values() for s in fs)
        n = "\n".join(s for _, ns in self._nat.values() for s in ns)
        # the source check runs after any source translation (a datacenter's egress NAT), on the
        # connection's original destination (the balancer's address, before DNAT)
        ruleset = ("table ip replay\ndelete table ip replay\ntable ip replay {\n"
                   "  chain sources {\n    type filter hook postrouting priority 300; policy accept;\n"
                   f"{f}\n  }}\n"
                   "  chain services {\n    type nat hook prerouting priority dstnat; policy accept;\n"
                   f"{n}\n  }}\n}}\n")
        self.exec(self.router, "nft", "-f", "-", input=ruleset)

    def close(self) -> None:
        for ns in reversed(list(self.namespaces)):
            run("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()

