"""The attacker side of bench/adversarial.py's gRPC attacks, run as its own process (no torch), so
that its threads, channels and buffers do not count in the honest members' memory.

    python bench/attacker.py MODE JSON-ARGS      # prints one JSON object: what the attack saw

Modes: grpc-loris, grpc-idle, grpc-big (against a data-plane gRPC listener), coord-flood
(against the coordinator). Arguments are one JSON object; see each function.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Iterator

import grpc

LINK_METHOD = "/diloco.transport.Link/Stream"


def _channel(target: str, **extra: Any) -> grpc.Channel:
    options = [("grpc.use_local_subchannel_pool", 1)] + list(extra.items())
    return grpc.insecure_channel(target, options=options)


def grpc_loris(target: str, streams: int, duration_s: float, hello_hex: str) -> dict[str, Any]:
    """``streams`` gRPC streams at a time, each sending a HELLO one byte every 0.5 s, restarted
    when the listener ends them; the life of each stream."""
    hello = bytes.fromhex(hello_hex)
    stop = threading.Event()
    lives: list[float] = []
    lock = threading.Lock()

    def trickle() -> Iterator[bytes]:
        for b in hello:
            if stop.wait(0.5):
                return
            yield bytes([b])

    def one() -> None:
        while not stop.is_set():
            channel = _channel(target)
            start = time.monotonic()
            try:
                for _ in channel.stream_stream(LINK_METHOD)(trickle(), timeout=duration_s + 10):
                    pass
            except grpc.RpcError:
                pass
            finally:
                channel.close()
            if not stop.is_set():
                with lock:
                    lives.append(time.monotonic() - start)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(duration_s)
    stop.set()
    for t in threads:
        t.join(5)
    return {"streams_cut": len(lives), "client_life_max_s": round(max(lives, default=0.0), 2)}


def grpc_idle(target: str, streams: int, duration_s: float) -> dict[str, Any]:
    """``streams`` idle gRPC streams opened at once and held; how the listener ended them."""
    stop = threading.Event()

    def idle() -> Iterator[bytes]:
        stop.wait(duration_s + 5)
        return
        yield b""

    channels = [_channel(target) for _ in range(8)]
    calls = [channels[i % 8].stream_stream(LINK_METHOD)(idle(), timeout=duration_s + 10) for i in range(streams)]
    time.sleep(duration_s)
    codes: dict[str, int] = {}
    for c in calls:
        code = c.code().name if c.done() else "still open"
        codes[code] = codes.get(code, 0) + 1
    stop.set()
    for c in calls:
        c.cancel()
    for ch in channels:
        ch.close()
    return {"ended_by_listener": codes}


def grpc_big(target: str, megabytes: int, times: int, timeout_s: float) -> dict[str, Any]:
    """A stream whose first message, before any handshake, is ``megabytes`` MiB; ``times`` times."""
    answers = []
    for _ in range(times):
        channel = _channel(target, **{"grpc.max_send_message_length": (megabytes + 1) << 20})
        try:
            list(channel.stream_stream(LINK_METHOD)(iter([bytes(megabytes << 20)]), timeout=timeout_s))
            answers.append("OK")
        except grpc.RpcError as e:
            answers.append(e.code().name)
        finally:
            channel.close()
    return {"answers": answers}


def coord_flood(target: str, method: str, requests_hex: list[str], callers: list[list[list[str]]],
                duration_s: float, slow_method: str, slow_calls: int, slow_metadata: list[list[str]]) -> dict[str, Any]:
    """One thread per (request, caller metadata) pair calling ``method`` over and over for
    ``duration_s`` (backing off 10 ms after RESOURCE_EXHAUSTED), plus ``slow_calls`` calls of
    ``slow_method`` that never send their request; the status codes seen."""
    stop = threading.Event()
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def count(code: str) -> None:
        with lock:
            codes[code] = codes.get(code, 0) + 1

    def flooder(request: bytes, md: tuple) -> None:
        channel = grpc.insecure_channel(target)
        call = channel.unary_unary(method)
        while not stop.is_set():
            try:
                call(request, metadata=md, timeout=duration_s + 5)
                count("OK")
            except grpc.RpcError as e:
                count(e.code().name)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    time.sleep(0.01)
        channel.close()

    def never() -> Iterator[bytes]:
        stop.wait(duration_s + 5)
        return
        yield b""

    threads = [threading.Thread(target=flooder, args=(bytes.fromhex(r), tuple(tuple(kv) for kv in md)), daemon=True)
               for r, md in zip(requests_hex, callers)]
    slow_channel = grpc.insecure_channel(target)
    for t in threads:
        t.start()
    slow_md = tuple(tuple(kv) for kv in slow_metadata)
    slow = [slow_channel.stream_unary(slow_method).future(never(), metadata=slow_md, timeout=duration_s + 5)
            for _ in range(slow_calls)]
    time.sleep(duration_s)
    stop.set()
    slow_codes: dict[str, int] = {}
    for f in slow:
        try:
            f.result(timeout=5)
            key = "OK"
        except grpc.RpcError as e:
            key = e.code().name
        except Exception:  # noqa: BLE001 - still pending
            key = "pending"
        slow_codes[key] = slow_codes.get(key, 0) + 1
    for t in threads:
        t.join(duration_s + 10)
    slow_channel.close()
    return {"flood_answers": codes, "slow_call_answers": slow_codes}


MODES = {"grpc-loris": grpc_loris, "grpc-idle": grpc_idle, "grpc-big": grpc_big, "coord-flood": coord_flood}

if __name__ == "__main__":
    print(json.dumps(MODES[sys.argv[1]](**json.loads(sys.argv[2]))))
