"""The step channel's messages in the coordination service's store, with a stand-in for its client: process 0 keeps
every message of its last steps (the adapter writes between them too) and deletes the older ones; a follower reads
an adapter write back as process 0 sent it."""

from __future__ import annotations

import pytest

from jaxserve import compat, distributed
from jaxserve.lora import LoraAdapter


class StoreClient:
    """The three calls of the coordination service client that the channel makes, over a dict."""

    def __init__(self) -> None:
        self.store: dict[str, bytes] = {}

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        self.store[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        return self.store[key]

    def key_value_delete(self, key: str) -> None:
        del self.store[key]


@pytest.fixture
def client(monkeypatch):
    client = StoreClient()
    monkeypatch.setattr(compat, "distributed_client", lambda: client)
    monkeypatch.setattr(distributed.atexit, "register", lambda *args: None)  # no stop sent at this test's exit
    return client


def _adapter(path: str | None) -> LoraAdapter:
    return LoraAdapter("a", 4, {}, path=path)


def test_the_store_keeps_the_messages_of_the_last_steps(client, monkeypatch):
    monkeypatch.setattr(distributed, "_KEPT_STEPS", 2)
    channel = distributed.StepChannel()
    for kind in "ASAASSAS":  # an adapter write or a step, messages 0 to 7
        if kind == "A":
            channel.send_adapter(1, _adapter("/adapters/a"))
        else:
            channel._send(distributed._STEP, 0, b"")
    # The last two steps (5 and 7) and the adapter write between them.
    assert sorted(int(key.rsplit("/", 1)[1]) for key in client.store) == [5, 6, 7]


def test_a_follower_reads_an_adapter_write_as_sent(client):
    leader = distributed.StepChannel()
    follower = distributed.StepChannel()
    follower._name = leader._name  # the same channel on another process
    leader.send_adapter(3, _adapter("/adapters/a"))
    leader.send_adapter(3, None)
    assert follower.receive(None) == distributed.AdapterWrite(3, "a", "/adapters/a")
    assert follower.receive(None) == distributed.AdapterWrite(3, None, None)
    assert distributed.AdapterWrite(3, None, None).read() is None
    with pytest.raises(ValueError, match="comes from memory: a multi-process run serves adapters from a PEFT"):
        leader.send_adapter(3, _adapter(None))
    with pytest.raises(RuntimeError, match="could not read LoRA adapter 'a' from /nowhere, which process 0 loaded"):
        distributed.AdapterWrite(3, "a", "/nowhere").read()
