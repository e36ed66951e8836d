"""What the settle after a reply costs, per reply token and against the reply's generation.

Runs the bundled model in a scratch home: a few turns with growing replies; for each, the
reply's generation time (tokens / tok/s) and the deferred housekeeping's settle time
(Housekeeping.settle_ms), then the next turn's decode count with and without a settle.
Usage: python scripts/settle_cost.py [--threads N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvchat.config import load_settings
from kvchat.service.chat import ChatService

ASKS = [
    ("Write two sentences about the sea.", 48),
    ("Now write a short paragraph about mountains.", 96),
    ("Describe a city at night in detail.", 192),
    ("Tell a long story about a lighthouse keeper.", 384),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        settings = load_settings(n_ctx=4096, temperature=0.0, n_threads=args.threads)
        svc = ChatService(settings, home=Path(home))
        svc.upkeep.deferred = True
        try:
            session = svc.sessions.new_session()
            print("reply_tokens  gen_ms  settle_ms  settle_ms/token  settle/gen  settled_tokens")
            for text, max_tokens in ASKS:
                report = svc.send(session.id, text, max_tokens=max_tokens)
                gen_ms = 1000 * report.tokens.generated / (report.tokens_per_s or 1)
                done = svc.upkeep.run_pending()
                n = report.tokens.generated
                print(
                    f"{n:>12}  {gen_ms:>6.0f}  {done.settle_ms:>9.0f}  "
                    f"{done.settle_ms / max(n, 1):>15.2f}  {done.settle_ms / gen_ms:>10.3f}  "
                    f"{done.settled:>14}"
                )
        finally:
            svc.close()


if __name__ == "__main__":
    main()
