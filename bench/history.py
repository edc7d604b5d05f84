"""How the conversation store (app.serving.history) scales: inserts ``--conversations`` conversations
(1,000 by default; each a few turns, the last answer with ``--steps`` step records), then times
listing them newest first, searching titles and text, and opening one. Prints the numbers; writes
nothing but a temporary database (removed after).

    python -m bench.history [--conversations 1000] [--steps 60]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from app.serving.history import HistoryStore
from engine.core.records import StepRecord, StepTimings

WORDS = ("tree draft target token verify accept reject branch oak river cache prefill sample greedy chain "
         "width depth bonus residual profile measure").split()


def step(index: int, rng: random.Random) -> StepRecord:
    n = 8
    return StepRecord(index=index, tokens=[rng.randrange(150_000) for _ in range(n)],
                      parents=[-1] + [rng.randrange(i) for i in range(1, n)], ranks=[0] + [1] * (n - 1),
                      draft_probs=[rng.random() for _ in range(n)], target_probs=[rng.random() for _ in range(n)],
                      accepted=[0, 1, 2], committed=[rng.randrange(150_000) for _ in range(3)],
                      timings=StepTimings(0.01, 0.02, 0.0))


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def timed(fn, repeat: int = 20) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=3, help="question/answer pairs per conversation")
    parser.add_argument("--steps", type=int, default=60, help="step records of each conversation's last answer")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    steps = [step(i, rng) for i in range(args.steps)]
    texts = {t: f"tok{t}" for s in steps for t in s.tokens}
    with tempfile.TemporaryDirectory(prefix="sequoia-history-bench-") as folder:
        store = HistoryStore(Path(folder) / "conversations.sqlite3")
        saves = []
        ids = []
        for k in range(args.conversations):
            history = []
            cid = None
            for _ in range(args.turns):
                history += [{"role": "user", "content": sentence(rng, 12)},
                            {"role": "assistant", "content": sentence(rng, 120)}]
                start = time.perf_counter()
                cid = store.save(cid, "", history, {"temperature": 0.0}, steps, texts)
                saves.append(time.perf_counter() - start)
            ids.append(cid)
        size = sum(p.stat().st_size for p in Path(folder).iterdir())
        print(f"{args.conversations} conversations, {args.turns} answers each, {args.steps} steps on the last: "
              f"{size / 1e6:.1f} MB on disk")
        print(f"save an answer:      median {statistics.median(saves) * 1e3:7.2f} ms, "
              f"p99 {sorted(saves)[int(len(saves) * 0.99)] * 1e3:7.2f} ms")
        t, rows = timed(lambda: store.list())
        print(f"list (200 newest):   median {t * 1e3:7.2f} ms ({len(rows)} rows)")
        t, rows = timed(lambda: store.list(limit=args.conversations))
        print(f"list (all):          median {t * 1e3:7.2f} ms ({len(rows)} rows)")
        for query in ("oak river", "residual", "no such words here"):
            t, rows = timed(lambda q=query: store.list(q), repeat=5)
            print(f"search {query!r:22} median {t * 1e3:7.2f} ms ({len(rows)} found)")
        t, loaded = timed(lambda: store.load(ids[len(ids) // 2]))
        print(f"open one (steps too): median {t * 1e3:7.2f} ms ({len(loaded.messages)} messages, "
              f"{len(loaded.steps)} steps)")
        store.close()
        t, _ = timed(lambda: HistoryStore(Path(folder) / "conversations.sqlite3").close(), repeat=3)
        print(f"open the store:      median {t * 1e3:7.2f} ms (its schema and a quick check of the file)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
