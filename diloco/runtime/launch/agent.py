"""``diloco torchrun``: torchrun whose exit code says why its workers stopped.

``diloco torchrun ARGS`` takes exactly torchrun's arguments (``--nproc-per-node 8 -m diloco worker
...``) and runs torchrun's own elastic agent in this process. torchrun reports any failure of its
workers as exit code 1; this one exits with ``exit_codes.group_exit_code`` of the workers' codes,
so ``diloco run``'s supervisor and a Kubernetes Job's podFailurePolicy can tell "done" (0), "restart
me" (75) and "configuration error" (2) apart. A death signal to the agent (SIGTERM on a node
drain, a deleted or evicted pod) stops the workers as torchrun does and exits 75 (restart me:
the job is not finished), SIGINT 130 (``exit_codes.for_signal``); before the workers start (the
agent waiting in its rendezvous for the group's other nodes) it exits so at once (``StopBeforeWorkers``),
and a signal that lands while a log line is written still stops it (``signals_through_logging``).

``DILOCO_PARENT_PID``: the agent dies with that process (Linux's parent-death signal), so a
``diloco run`` that is killed outright leaves no group behind; the agent hands its own PID on
the same way, so each worker dies with its agent in turn (``diloco worker`` asks for it first
thing, before it loads torch).

Where it listens: torch's TCPStore servers (the rendezvous store, and the store the workers share)
listen on every interface, and nothing authenticates their clients. Here each one listens only on
the address its clients are told to dial, the store's host name resolved: ``--rdzv-endpoint``'s or
``--master-addr``'s host, ``--local-addr`` for the workers' store (``bind_stores``). With
``--local-addr`` the workers' Gloo and NCCL also use the interface that holds that address
(``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, unless set), not whatever the host name resolves
to. ``diloco run`` starts each group with ``--local-addr`` and the rendezvous at its ``--host``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any, Callable

from diloco.runtime.ops import exit_codes, stack_dumps

PARENT_ENV = "DILOCO_PARENT_PID"
#: what the workers' in-group backends are told to use, from ``--local-addr``
IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit at once (75) if the parent,
    ``expected_parent`` when given, is already gone (its death came before the request)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(exit_codes.RESTART)


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` (``--name=V`` or ``--name V``) in the workers' arguments, or None."""
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_Sockaddr)), ("netmask", ctypes.POINTER(_Sockaddr)),
                     ("ifu", ctypes.c_void_p), ("data", ctypes.c_void_p)]
_IFF_LOOPBACK = 0x8


def interface_addresses() -> list[tuple[str, str, bool]]:
    """Every IPv4 and IPv6 address of this host's interfaces: ``(interface, address, loopback)``
    (Linux ``getifaddrs``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr and entry.addr.contents.family in (socket.AF_INET, socket.AF_INET6):
                family, raw = entry.addr.contents.family, bytes(entry.addr.contents.data)
                # sockaddr_in: port, 4 address bytes; sockaddr_in6: port, flow info, 16 address bytes
                packed = raw[2:6] if family == socket.AF_INET else raw[6:22]
                out.append((entry.name.decode(), socket.inet_ntop(family, packed), bool(entry.flags & _IFF_LOOPBACK)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return out


def interface_of(address: str) -> str | None:
    """The interface that holds ``address`` (an IP address or a name, resolved), or None for a
    wildcard address (0.0.0.0, ::: every interface, as asked). RuntimeError where no interface does."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0])
        except socket.gaierror as e:
            raise RuntimeError(f"--local-addr {address} does not resolve: {e}") from None
    if ip.is_unspecified:
        return None
    found = interface_addresses()
    for name, held, _ in found:
        if ipaddress.ip_address(held.split("%")[0]) == ip:
            return name
    if ip.is_loopback:  # 127.0.0.2 and the rest of 127/8 belong to the loopback interface
        loopback = [name for name, _, is_loopback in found if is_loopback]
        if loopback:
            return loopback[0]
    raise RuntimeError(f"no interface of this host holds --local-addr {address} ({ip}); its interfaces hold "
                       f"{sorted({held for _, held, _ in found})}")


def store_listener(host: str, port: int) -> socket.socket:
    """A socket bound to ``host`` (resolved: its first address) and ``port`` (0: the kernel picks),
    for a TCPStore server to listen on. torch's DistNetworkError (a RuntimeError, what TCPStore
    raises itself) where it cannot be bound."""
    import torch.distributed as dist

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise dist.DistNetworkError(f"the store's host {host!r} does not resolve: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise dist.DistNetworkError(f"a TCPStore server cannot listen on {host}:{port} ({address[0]}): {e} "
                                    "(diloco torchrun binds it to the address its clients dial, which must "
                                    "be one of this host's)") from None
    return sock


def bound_tcp_store(host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                    timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = True,
                    multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True) -> Any:
    """``torch.distributed.TCPStore`` with its arguments, whose server (``is_master``) listens only
    on ``host_name`` (``store_listener``) instead of every interface."""
    from torch.distributed import TCPStore

    if is_master and master_listen_fd is None:
        sock = store_listener(host_name, port)
        port = sock.getsockname()[1]
        master_listen_fd = sock.detach()  # the store owns the descriptor from here (and closes it)
    return TCPStore(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                    master_listen_fd, use_libuv)


def bind_stores() -> None:
    """Make torchrun's elastic agent, in this process, create its TCPStore servers with
    ``bound_tcp_store``: the c10d and static rendezvous stores, and the store its workers share.
    RuntimeError if this torch's agent creates them elsewhere (then nothing here would bind them)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous, static_tcp_rendezvous

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    if not (hasattr(c10d_rendezvous_backend, "TCPStore") and hasattr(static_tcp_rendezvous, "TCPStore")
            and hasattr(handler, "_create_tcp_store_server")):
        import torch

        raise RuntimeError(f"torch {torch.__version__}: its elastic agent no longer creates its stores where diloco "
                           "torchrun binds them to one address (diloco/runtime/launch/agent.py, bind_stores)")
    c10d_rendezvous_backend.TCPStore = bound_tcp_store
    static_tcp_rendezvous.TCPStore = bound_tcp_store
    handler._create_tcp_store_server = lambda self, master_addr, master_port: bound_tcp_store(
        master_addr, master_port, is_master=True, multi_tenant=True)


class StopBeforeWorkers:
    """SIGTERM or SIGINT before torch's agent installs its own handlers (as it starts the workers):
    exit 75 or 130 at once, nothing being started yet. The agent's main thread waits in C++ there (the
    rendezvous store, for as long as the group's other nodes take to come), where a Python handler
    runs only once the call returns: a pod deleted then would sit until the kubelet's SIGKILL (137,
    which its Job counts). A thread woken through the signal wakeup fd acts instead, while this
    handler is still the signal's. Main thread only; ``close`` hands the signals back."""

    def __init__(self) -> None:
        self.signals = {int(signal.SIGTERM), int(signal.SIGINT)}
        self._before = {signum: signal.signal(signum, self.stop) for signum in self.signals}
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._wakeup_before = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="diloco-torchrun-start-up-signals", daemon=True)
        self._watcher.start()

    def stop(self, signum: int, _frame: Any = None) -> None:
        """Exit now with the signal's code (``exit_codes.for_signal``), saying so on stderr."""
        code = exit_codes.for_signal(signum)
        os.write(2, f"diloco torchrun: {signal.Signals(signum).name} before its workers started; exit "
                    f"{exit_codes.describe(code)}\n".encode())
        os._exit(code)

    def _watch(self) -> None:
        while data := os.read(self._read, 64):  # one byte per signal caught; b"" once close() closes the pipe
            for signum in set(data) & self.signals:
                if signal.getsignal(signum) == self.stop:
                    self.stop(signum)

    def close(self) -> None:
        """The handlers and wakeup fd from before, where this one's are still set; the watcher ends."""
        current = signal.set_wakeup_fd(self._wakeup_before)
        if current != self._write:  # another's since: leave it
            signal.set_wakeup_fd(current)
        for signum, handler in self._before.items():
            if signal.getsignal(signum) == self.stop:
                signal.signal(signum, handler)
        os.close(self._write)
        self._watcher.join(timeout=5)
        os.close(self._read)


def signals_through_logging(signal_error: type[BaseException]) -> Callable[[], None]:
    """Let ``signal_error`` (torchrun's SignalException) out of a log handler's ``emit``, in this
    process; returns what puts logging back as it was. torchrun's SIGTERM handler raises it wherever
    the agent's Python is; inside ``emit`` (torch's agent logs as it starts, restarts and stops its
    workers) the handler's ``except Exception`` hands it to ``handleError``, which prints "--- Logging
    error ---" and returns, and the agent would run on until the kubelet's SIGKILL."""
    handle_error = logging.Handler.handleError

    def restore() -> None:
        logging.Handler.handleError = handle_error  # type: ignore[method-assign]

    if getattr(handle_error, "lets_through", None) is signal_error:
        return restore

    def handleError(self: logging.Handler, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        error = sys.exc_info()[1]
        if isinstance(error, signal_error):
            raise error
        handle_error(self, record)

    handleError.lets_through = signal_error  # type: ignore[attr-defined]
    logging.Handler.handleError = handleError  # type: ignore[method-assign]
    return restore


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; returns the group's exit code (see the module doc). With
    ``--log-format json`` among the workers' arguments, this process logs JSON too."""
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        die_with_parent(int(parent))
    os.environ[PARENT_ENV] = str(os.getpid())  # the workers', whose parent this process is
    stack_dumps.forward_to_children()  # kill -USR1 (PID 1 of a pod): the workers dump their threads' stacks
    fmt, group = _flag(argv, "--log-format"), _flag(argv, "--group-id")
    if fmt == "json":  # the agent's own lines (torchrun's, the C++ store's) are records like its workers'
        from diloco.runtime.ops import logs

        logs.setup("json", component="torchrun", group=int(group) if group and group.isdigit() else None)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from transport.errors import raised_within

    local_addr = torchrun.parse_args(argv).local_addr
    if local_addr:  # the workers' Gloo and NCCL listen on this node's address, not the host name's
        ifname = interface_of(local_addr)
        for name in IFNAME_ENVS:
            if ifname is not None and not os.environ.get(name):
                os.environ[name] = ifname
    bind_stores()
    logging_as_before = signals_through_logging(SignalException)
    start_up = StopBeforeWorkers() if threading.current_thread() is threading.main_thread() else None
    try:
        torchrun.main(argv)
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        code = exit_codes.group_exit_code(codes)
        ranks = ", ".join(f"rank {r}: {exit_codes.describe(c)}" for r, c in sorted(codes.items()))
        print(f"diloco torchrun: workers stopped ({ranks}); exit {exit_codes.describe(code)}",
              file=sys.stderr, flush=True)
        return code
    except Exception as e:
        # torchrun's handler raises SignalException wherever the agent's Python is; in the first
        # bytecodes of a @metrics.prof method (before its `start` is set) the wrapper's `finally`
        # turns it into an UnboundLocalError raised while handling it. The agent has still stopped
        # its workers (SimpleElasticAgent.run's `finally`).
        signalled = raised_within(e, SignalException)
        if signalled is None:
            raise
        if e is not signalled:  # what went wrong while it stopped (a failed shutdown too) stays in the log
            traceback.print_exception(e, file=sys.stderr)
        code = exit_codes.for_signal(int(signalled.sigval))
        print(f"diloco torchrun: {signalled.sigval.name}: stopped every worker; exit {exit_codes.describe(code)}",
              file=sys.stderr, flush=True)
        return code
    finally:
        if start_up is not None:
            start_up.close()
        logging_as_before()
    return exit_codes.DONE
