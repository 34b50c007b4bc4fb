"""Cost per message of authenticating an engine link: HMAC per envelope vs ZeroMQ CURVE.

Sends ``--messages`` PUSH -> PULL messages one at a time (send, then receive:
latency plus cost, the pattern of the engine's per-step hops) over ``ipc://``
in one process, for a small envelope (a per-step message, 300 B) and a large
one (128 KiB, a tensor frame), and prints wall-clock and CPU microseconds per message (all threads; the best
of 5 rounds each) for:

    plain   no proof (the links before issue 16)
    hmac    trillium.actors.link_auth: sign on send, verify on receive
            (a keyed MAC over every frame, sender id and counter: BLAKE2b
            up to 16 KiB, HMAC-SHA256 above)
    curve   ZeroMQ CURVE (per-run keypairs, a ZAP authenticator thread
            that allows only the client's public key); encryption runs in
            ZeroMQ's I/O thread

Results are printed, never asserted. Run:

    PYTHONPATH=. python bench/link_auth.py --messages 5000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from trillium.actors.link_auth import LinkKey, Signer, Verifier


_ROUNDS = 5


def _pair(ctx: zmq.Context, address: str, curve: tuple | None = None):
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    if curve is not None:
        server_public, server_secret, client_public, client_secret = curve
        pull.curve_secretkey = server_secret
        pull.curve_publickey = server_public
        pull.curve_server = True
        push.curve_secretkey = client_secret
        push.curve_publickey = client_public
        push.curve_serverkey = server_public
    pull.bind(address)
    push.connect(address)
    return push, pull


def _time(push, pull, frames, count: int, sign=None, verify=None) -> tuple[float, float]:
    """(wall, CPU) microseconds per message, each the best of _ROUNDS rounds. CPU time counts
    every thread of the process (ZeroMQ's I/O threads too, where CURVE does its work)."""
    for _ in range(50):  # warm up (and finish the CURVE handshake)
        push.send_multipart(sign(frames) if sign else frames, copy=False)
        received = pull.recv_multipart(copy=False)
    best_wall = best_cpu = float("inf")
    for _ in range(_ROUNDS):  # WHY the best round: a shared box's other load only adds time
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            push.send_multipart(sign(frames) if sign else frames, copy=False)
            received = pull.recv_multipart(copy=False)
            if verify is not None:
                verify([frame.buffer for frame in received])
        best_wall = min(best_wall, (time.perf_counter() - start) / count * 1e6)
        best_cpu = min(best_cpu, (time.process_time() - start_cpu) / count * 1e6)
    return best_wall, best_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5000, help="messages per measurement")
    args = parser.parse_args()
    ctx = zmq.Context()
    # WHY a context of its own: the ZAP authenticator answers for every socket of
    # its context, and the plain / hmac pairs must not wait on it.
    curve_ctx = zmq.Context()
    directory = tempfile.mkdtemp(prefix="trl-bench-")
    sizes = {"300 B": [os.urandom(300)], "128 KiB": [os.urandom(300), os.urandom(128 * 1024)]}
    key = LinkKey.generate()
    signer, verifier = Signer(key, "api"), Verifier(key, ["api"])

    auth = ThreadAuthenticator(curve_ctx)
    auth.start()
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    auth.configure_curve_callback("*", _AllowOne(client_public))
    print(f"zmq {zmq.zmq_version()}, pyzmq {zmq.pyzmq_version()}, curve available: {zmq.has('curve')}")
    print(f"{'link':<8}{'message':>10}{'wall us':>10}{'cpu us':>10}{'cpu overhead us':>18}")
    for size, frames in sizes.items():
        results = {}
        for mode in ("plain", "hmac", "curve"):
            address = f"ipc://{directory}/{mode}-{size.replace(' ', '')}"
            curve = (server_public, server_secret, client_public, client_secret) if mode == "curve" else None
            push, pull = _pair(curve_ctx if curve else ctx, address, curve)
            if mode == "hmac":
                results[mode] = _time(push, pull, frames, args.messages, signer.sign, verifier.verify)
            else:
                results[mode] = _time(push, pull, frames, args.messages)
            push.close(0)
            pull.close(0)
        for mode, (wall, cpu) in results.items():
            print(f"{mode:<8}{size:>10}{wall:>10.1f}{cpu:>10.1f}{cpu - results['plain'][1]:>18.1f}")
    auth.stop()


class _AllowOne:
    def __init__(self, public_key: bytes) -> None:
        self._key = public_key  # z85, as the authenticator passes it

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


if __name__ == "__main__":
    main()
