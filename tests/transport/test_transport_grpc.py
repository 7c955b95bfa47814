"""gRPC-specific behaviour (the shared scenarios run for both backends via the `backend` fixture)."""

from __future__ import annotations

import os
import queue
import threading
import time

import grpc
import pytest
import torch

from transport.grpclink import METHOD, StreamSocket
from transport_helpers import run_ring, transports


def test_garbage_stream_is_rejected_and_server_keeps_serving() -> None:
    with transports(2, backend="grpc") as ts:
        channel = grpc.insecure_channel(ts[0].address)
        hold = threading.Event()

        def requests():
            yield os.urandom(100)
            yield os.urandom(5000)
            hold.wait(10)  # keep our side open: only the server can end the call early

        try:
            start = time.monotonic()
            call = channel.stream_stream(METHOD)(requests(), timeout=10)
            try:
                assert list(call) == []
            except grpc.RpcError as e:
                assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - start < 3.0, "the server did not hang up on garbage"
        finally:
            hold.set()
            channel.close()
        outs = run_ring(ts, [torch.ones(5), torch.zeros(5)], tag="after")
        assert outs[0].tolist() == [0.5] * 5


def test_oversized_message_is_refused() -> None:
    with transports(2, backend="grpc", max_message_bytes=1 << 16, chunk_bytes=1024) as ts:
        channel = grpc.insecure_channel(ts[0].address)
        try:
            call = channel.stream_stream(METHOD)(iter([bytes(1 << 20)]))
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            channel.close()


@pytest.mark.parametrize("slack", [0, 4])
@pytest.mark.parametrize("sizes", [[5, 20], [16, 16], [3, 40, 1, 9], [64], [0, 7, 0], [16, 3], [2, 16, 2], [17, 3]])
def test_a_messages_buffers_become_grpc_messages_of_at_most_the_cap_without_a_joined_copy(sizes, slack) -> None:
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    inbound: queue.SimpleQueue = queue.SimpleQueue()  # the peer's side: open until None
    sock = StreamSocket(outbox, iter(inbound.get, None), on_close=lambda: None, message_bytes=16, slack_bytes=slack)
    buffers = [os.urandom(n) for n in sizes]
    kinds = [bytes, bytearray, memoryview]  # what a link hands over: headers, frames, views
    sock.send_buffers([kinds[i % 3](b) for i, b in enumerate(buffers)])
    messages = []
    while not outbox.empty():
        messages.append(outbox.get_nowait())
    assert all(isinstance(m, bytes) and 0 < len(m) for m in messages)
    assert all(len(m) == 16 for m in messages[:-1])  # only the last message differs ...
    assert all(len(m) <= 16 + slack for m in messages[-1:])  # ... by at most the slack
    # a short tail within the slack rides in the last full message instead of a message of its own
    assert len(messages) == max(1, -(-(sum(sizes) - slack) // 16)) if sum(sizes) else not messages
    assert b"".join(messages) == b"".join(buffers)
    sock.shutdown()
    inbound.put(None)
    with pytest.raises(BrokenPipeError):
        sock.send_buffers([b"late"])
