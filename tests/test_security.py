"""CURVE on the event stream, with real sockets on 127.0.0.1: the right keys read everything
(live and replay); a peer without a key, with the wrong server key, or with a key not on the
allow-list reads nothing, and a forged publisher cannot inject into a bind-mode subscriber."""

from __future__ import annotations

import contextlib
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq_helpers import (
    DEADLINE_S,
    SEQ,
    StateModel,
    free_tcp_port,
    payload,
    poll_until,
    stored,
    zmq_context,
)

from events.stream.publisher import ZmqEventPublisher
from events.stream.security import (
    CurveClient,
    CurveServer,
    KeyPair,
    SecurityError,
    curve_client_from,
    generate_keys,
    load_allowed_keys,
    load_keypair,
    load_public_key,
)
from events.stream.subscriber import ZmqEventSubscriber
from events.tools.cli import main as kv_events_main
from events.tools.listener import listen

Ctx = zmq.Context[zmq.Socket[bytes]]
pytestmark = pytest.mark.timeout(30)
QUIET_MS = 300  # how long a refused peer is watched for a frame, after the allowed one got all


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("keys")
    out: dict[str, Path] = {}
    for name in ("server", "client", "stranger", "impostor"):
        public, secret = generate_keys(folder, name)
        out[name], out[f"{name}_secret"] = public, secret
    return out


def _server(keys: dict[str, Path]) -> CurveServer:
    return CurveServer(load_keypair(keys["server_secret"]), load_allowed_keys([keys["client"]]))


def _client(keys: dict[str, Path], who: str = "client", server: str = "server") -> CurveClient:
    return CurveClient(load_keypair(keys[f"{who}_secret"]), load_public_key(keys[server]))


def _seqs(model: StateModel, worker: int) -> list[int]:
    return model.seqs.get(worker, [])


def test_right_keys_read_live_and_replayed_batches(ctx: Ctx, keys: dict[str, Path]) -> None:
    model = StateModel()
    with (
        ZmqEventPublisher(
            "tcp://127.0.0.1:*",
            "tcp://127.0.0.1:*",
            context=ctx,
            curve=_server(keys),
            drop_live=lambda seq: seq == 1,  # seq 1 reaches the subscriber only by replay
        ) as pub,
        ZmqEventSubscriber(context=ctx, curve=_client(keys)) as sub,
    ):
        sub.add_worker(0, pub.endpoint, pub.replay_endpoint)
        assert pub.wait_for_subscribers(1, DEADLINE_S)
        for i in range(3):
            pub.publish([stored(i, 10 + i)])
        poll_until(sub, model, lambda: _seqs(model, 0) == [0, 1, 2])
        assert model.blocks[0] == {10, 11, 12}
        assert sub.status(0).replayed >= 1 and sub.status(0).state == "ok"


@pytest.mark.parametrize(
    "peer",
    ["no key", "wrong server key", "key not on the allow-list"],
)
def test_unauthenticated_peers_read_neither_live_nor_replay(
    ctx: Ctx, keys: dict[str, Path], peer: str
) -> None:
    curve = {
        "no key": None,
        "wrong server key": _client(keys, "client", server="impostor"),
        "key not on the allow-list": _client(keys, "stranger"),
    }[peer]
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx, curve=_server(keys)
    ) as pub:
        pub.publish([stored(0, 1)])  # history the replay socket would hand out
        assert pub.flush(DEADLINE_S)
        socks = []
        try:
            for kind in (zmq.SUB, zmq.DEALER, zmq.SUB, zmq.DEALER):  # intruder, then control
                sock = ctx.socket(kind)
                socks.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                good = len(socks) > 2
                if good or curve is not None:
                    client = _client(keys) if good else curve
                    assert client is not None
                    sock.setsockopt(zmq.CURVE_SERVERKEY, client.server_public)
                    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.keys.public)
                    sock.setsockopt(zmq.CURVE_SECRETKEY, client.keys.secret)
                if kind == zmq.SUB:
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                    sock.connect(pub.endpoint)
                else:
                    assert pub.replay_endpoint is not None
                    sock.connect(pub.replay_endpoint)
            bad_sub, bad_dealer, good_sub, good_dealer = socks
            # the control subscriber counts; the intruder's subscription never arrives
            assert pub.wait_for_subscribers(1, DEADLINE_S)
            pub.publish([stored(1, 2)])
            assert good_sub.poll(int(DEADLINE_S * 1000)), "the allowed client got nothing"
            good_dealer.send_multipart([b"", SEQ.pack(0)])
            assert good_dealer.poll(int(DEADLINE_S * 1000)), "the allowed client got no replay"
            with contextlib.suppress(zmq.Again):  # no handshake: it may have nowhere to go
                bad_dealer.send_multipart([b"", SEQ.pack(0)], zmq.NOBLOCK)
            assert not bad_sub.poll(QUIET_MS) and not bad_dealer.poll(QUIET_MS)
            assert pub.stats.subscribers == 1
        finally:
            for sock in socks:
                sock.close(linger=0)


@pytest.mark.parametrize("forger", ["plain", "other keys"])
def test_bind_mode_subscriber_refuses_a_forged_publisher(
    ctx: Ctx, keys: dict[str, Path], forger: str
) -> None:
    live, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    model = StateModel()
    with ZmqEventSubscriber(context=ctx, curve=_client(keys), replay_timeout_ms=2000) as sub:
        sub.add_worker(0, live, replay, bind=True)
        forged = ctx.socket(zmq.PUB)
        try:
            forged.setsockopt(zmq.LINGER, 0)
            if forger == "other keys":  # a CURVE server, but not the one the subscriber trusts
                impostor = load_keypair(keys["impostor_secret"])
                forged.setsockopt(zmq.CURVE_SERVER, 1)
                forged.setsockopt(zmq.CURVE_SECRETKEY, impostor.secret)
            forged.connect(live)
            with ZmqEventPublisher(live, replay, context=ctx, curve=_server(keys)) as pub:
                poll_until(sub, model, lambda: pub.stats.subscribers == 1)
                for i in range(3):
                    # forged frames claim the same seqs with a block the publisher never had
                    forged.send_multipart([b"", SEQ.pack(i), payload([stored(i, 666)])])
                    pub.publish([stored(i, 10 + i)])
                poll_until(sub, model, lambda: _seqs(model, 0) == [0, 1, 2])
                for i in range(3, 6):
                    forged.send_multipart([b"", SEQ.pack(i), payload([stored(i, 666)])])
                model.apply(sub.poll(QUIET_MS))
        finally:
            forged.close(linger=0)
    assert model.blocks[0] == {10, 11, 12}
    assert _seqs(model, 0) == [0, 1, 2]


def test_listener_reads_a_curve_stream_only_with_keys(ctx: Ctx, keys: dict[str, Path]) -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", context=ctx, curve=_server(keys)) as pub:
        stop = threading.Event()

        def keep_publishing() -> None:
            i = 0
            while not stop.wait(0.02):  # a steady stream while the listeners join
                pub.publish([stored(i, 10 + i)])
                i += 1

        feeder = threading.Thread(target=keep_publishing, daemon=True)
        feeder.start()
        try:
            got: list[int] = []
            n = listen(
                [pub.endpoint],
                lambda w, frames, replay: got.append(SEQ.unpack(frames[1])[0]),
                count=3,
                timeout_s=DEADLINE_S,
                curve=curve_client_from(str(keys["client_secret"]), str(keys["server"])),
            )
            assert n == 3 and len(got) == 3
            plain = listen([pub.endpoint], lambda w, f, r: None, timeout_s=QUIET_MS / 1000)
            assert plain == 0
        finally:
            stop.set()
            feeder.join(DEADLINE_S)


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kv_events_main(["keygen", str(tmp_path / "k"), "--name", "engine"]) == 0
    secret = tmp_path / "k" / "engine.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair = load_keypair(secret)
    assert load_public_key(tmp_path / "k" / "engine.key") == pair.public
    assert len(pair.public) == len(pair.secret) == 40
    assert pair.secret.decode() not in repr(pair)
    capsys.readouterr()
    assert kv_events_main(["keygen", str(tmp_path / "k"), "--name", "engine"]) == 2
    assert "exists" in capsys.readouterr().err


def test_key_file_errors(tmp_path: Path, keys: dict[str, Path]) -> None:
    with pytest.raises(SecurityError, match="no secret key"):
        load_keypair(keys["client"])
    bogus = tmp_path / "bogus.key"
    bogus.write_text("not a certificate\n")
    with pytest.raises(SecurityError, match="not a CURVE key file"):
        load_public_key(bogus)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SecurityError, match=r"no \.key files"):
        load_allowed_keys([tmp_path / "empty"])
    with pytest.raises(SecurityError, match="both"):
        curve_client_from(str(keys["client_secret"]), None)
    assert curve_client_from(None, None) is None
    assert load_allowed_keys([keys["client"].parent]) >= {load_public_key(keys["client"])}
    assert isinstance(load_keypair(keys["client_secret"]), KeyPair)
