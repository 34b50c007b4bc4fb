"""Encode / decode time of the two per-step messages that scale with the batch.

TokenDeltas (scheduler -> detokenizer) and RequestOutputs (detokenizer -> api)
of 64 one-token deltas, through the engine's codec (trillium/actors/codec.py):
best of 7 rounds of 200, and the envelope's size.

Run: .venv/bin/python bench/step_messages_codec.py [--batch 64]
"""

import argparse
import time

from trillium.actors.assembly import engine_codec
from trillium.actors.protocol.outputs import RequestDelta, RequestOutputDelta, RequestOutputs, TokenDeltas


def _best_ms(fn, n: int = 200, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="deltas per message")
    args = parser.parse_args()
    codec = engine_codec()
    ids = [f"cmpl-{i:032x}-0" for i in range(args.batch)]
    messages = {
        "TokenDeltas": TokenDeltas(1, tuple(RequestDelta(rid, (1234,), num_prompt_tokens=32) for rid in ids)),
        "RequestOutputs": RequestOutputs(tuple(
            RequestOutputDelta(request_id=rid, text=" word", new_token_ids=(1234,), finished=False,
                               num_prompt_tokens=32) for rid in ids)),
    }
    for name, message in messages.items():
        frames = codec.encode(message)
        assert codec.decode(frames) == message
        print(f"{name} x{args.batch}: encode {_best_ms(lambda: codec.encode(message)):.3f} ms, "
              f"decode {_best_ms(lambda: codec.decode(frames)):.3f} ms, {len(frames[0])} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
