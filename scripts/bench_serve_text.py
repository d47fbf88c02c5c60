"""Benchmark of ``router-sim serve`` with text and chat prompts (the tokenizer's cost).

Run: ``python scripts/bench_serve_text.py`` (about two minutes; ``--quick`` for a short run).

1. Per-decision CPU with tokenization: ``POST /route`` with an 8,192-token text prompt against
   the same prompt as token ids, through a ``router-sim serve`` process in front of two
   ``router-sim worker`` processes; the CPU seconds the serve process used (``/proc``), divided
   by the requests, one request in flight at a time. The tokenizer is a byte-level BPE of
   ``--vocab`` entries trained here by the ``tokenizers`` library (its fast Rust tokenizer, the
   kind models ship) on synthetic text, as no model's tokenizer is on this machine; the same
   figure in process (``tokenizers`` encode alone) is printed beside it.
2. ``POST /v1/chat/completions`` through the router against straight to an engine-shaped
   stand-in (``tests/engine_standins.py``, vLLM's surface, in its own process), each at
   ``--rates`` requests/s open loop (:mod:`router_sim.service.openloop`: latencies charged from
   each request's scheduled send time), non-streamed, ``--chat-tokens`` tokens of prompt; the
   overhead is the difference of the percentiles.

Every process is started here and stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router_sim.service.openloop import http_request, run_open_loop

ROOT = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _lexicon(rng: random.Random, n: int) -> list[str]:
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(26)]  # a rough English letter frequency order
    return ["".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(n)]


def make_tokenizer(folder: Path, vocab: int) -> tuple[Tokenizer, list[str]]:
    """A byte-level BPE tokenizer trained on synthetic text (words of random letters,
    Zipf-distributed, in sentences), saved as a model ships it (``tokenizer.json`` +
    ``tokenizer_config.json`` with a chat template); and the lexicon of that text."""
    rng = random.Random(7)
    lexicon = _lexicon(rng, 50_000)
    zipf = [1.0 / (k + 1) for k in range(len(lexicon))]
    corpus = [" ".join(rng.choices(lexicon, zipf, k=100)) + "." for _ in range(8_000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok, lexicon


def text_of(tok: Tokenizer, lexicon: list[str], tokens: int, seed: int) -> str:
    """Sentences of the lexicon's words that tokenize to ``tokens`` ids, or a few fewer (cut
    at a word)."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tok.encode(" ".join(words), add_special_tokens=False).ids) < tokens:
        words += rng.choices(lexicon, k=max(16, tokens // 8))
    lo, hi = 0, len(words)  # the most words whose text has at most ``tokens`` ids
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok.encode(" ".join(words[:mid]), add_special_tokens=False).ids) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def start(argv: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{' '.join(argv)} failed to start")
    return p, json.loads(line)


def router_sim(*args: str) -> list[str]:
    return [sys.executable, "-m", "router_sim", *args]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return dict(json.loads(r.read()))


def wait_up(serve: str, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(serve + "/workers", timeout=5) as r:
            if sum(w["up"] for w in json.loads(r.read())["workers"]) == n:
                return
        time.sleep(0.05)  # poll interval
    raise RuntimeError("workers did not come up")


def route_cpu(serve: str, pid: int, body: dict[str, Any], n: int) -> float:
    """CPU microseconds of the serve process per ``POST /route`` of ``body``."""
    for _ in range(20):
        post(serve + "/route", body)
    before = cpu_s(pid)
    for _ in range(n):
        post(serve + "/route", body)
    return (cpu_s(pid) - before) / n * 1e6


def in_process_us(tok: Tokenizer, text: str, n: int) -> float:
    start_cpu = time.process_time()
    for _ in range(n):
        tok.encode(text)
    return (time.process_time() - start_cpu) / n * 1e6


def open_loop(
    url: str, body: bytes, rate: float, seconds: float, pid: int
) -> tuple[float, float, int, float]:
    """(p50 ms, p99 ms, errors + unanswered, CPU us of process ``pid`` per answer) of an
    open-loop run at ``rate``."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    req = http_request(host, int(port), "/v1/chat/completions", "application/json", body)
    before = cpu_s(pid)
    report = run_open_loop(host, int(port), [req], rate, seconds, warmup_s=1.0, connections=64)
    cpu = (cpu_s(pid) - before) / max(1, report.answered_total) * 1e6
    lat = report.latency_s
    return lat["p50"] * 1e3, lat["p99"] * 1e3, report.errors + report.unanswered, cpu


def sequential_pairs(
    direct: str, serve: str, body: dict[str, Any], n: int
) -> tuple[float, float, float, float]:
    """(direct p50, p99, routed p50, p99) in ms of ``n`` pairs of the same chat request sent
    one at a time, alternately straight to the stand-in and through the router: the cost of
    the hop with no queueing in it."""
    times: dict[str, list[float]] = {direct: [], serve: []}
    for _ in range(n):
        for base in (direct, serve):
            t = time.perf_counter()
            post(base + "/v1/chat/completions", body)
            times[base].append((time.perf_counter() - t) * 1e3)
    a, b = sorted(times[direct]), sorted(times[serve])
    q = lambda v, x: v[min(len(v) - 1, int(x * len(v)))]  # noqa: E731
    return q(a, 0.5), q(a, 0.99), q(b, 0.5), q(b, 0.99)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, shorter runs")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=[500.0],
        help="open-loop rates of the chat comparison, comma-separated (default 500)",
    )
    ap.add_argument("--chat-tokens", type=int, default=256)
    args = ap.parse_args()
    n = 200 if args.quick else 1000
    seconds = 3.0 if args.quick else 10.0
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tok"
        tok, lexicon = make_tokenizer(folder, args.vocab)
        text = text_of(tok, lexicon, args.prompt_tokens - 1, 1)  # + the BOS
        ids = tok.encode(text).ids
        print(
            f"tokenizer: byte-level BPE, {tok.get_vocab_size()} entries; prompt: {len(ids)} "
            f"tokens, {len(text)} characters"
        )
        try:
            fleet: list[dict[str, Any]] = []
            for i in range(2):
                p, ready = start(router_sim("worker", "--id", str(i), "--speedup", "1000"))
                procs.append(p)
                fleet.append({k: ready[k] for k in ("id", "http", "events", "replay")})
            path = Path(tmp) / "fleet.json"
            path.write_text(json.dumps({"tokens_per_block": 16, "workers": fleet}))
            p, ready = start(
                router_sim("serve", "--fleet", str(path), "--port", "0", "--tokenizer", str(folder))
            )
            procs.append(p)
            serve = ready["http"]
            wait_up(serve, 2)
            by_ids = route_cpu(serve, p.pid, {"prompt": ids}, n)
            by_text = route_cpu(serve, p.pid, {"prompt": text}, n)
            alone = in_process_us(tok, text, n)
            print(
                f"POST /route, serve CPU per decision: ids {by_ids:.0f} us, text {by_text:.0f} "
                f"us (+{by_text - by_ids:.0f} us); tokenizers encode alone {alone:.0f} us"
            )
            for q in procs:
                q.send_signal(signal.SIGTERM)
                q.wait(10)
            procs.clear()

            # chat completions through the router vs straight to a stand-in
            standin = [sys.executable, str(ROOT / "tests" / "engine_standins.py")]
            p, entry = start([*standin, "--engine", "vllm", "--tokenizer", str(folder)])
            procs.append(p)
            path.write_text(json.dumps({"tokens_per_block": 16, "workers": [entry]}))
            p, ready = start(
                router_sim("serve", "--fleet", str(path), "--port", "0", "--tokenizer", str(folder))
            )
            procs.append(p)
            serve = ready["http"]
            wait_up(serve, 1)
            system = text_of(tok, lexicon, args.chat_tokens, 2)
            body = json.dumps(
                {
                    "model": "test-model",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": "what now?"},
                    ],
                    "max_tokens": 4,
                }
            ).encode()
            post(serve + "/v1/chat/completions", json.loads(body))
            standin_pid, serve_pid = procs[0].pid, procs[1].pid
            pairs = sequential_pairs(
                entry["http"], serve, json.loads(body), 100 if args.quick else 500
            )
            print(
                "chat completions one at a time, alternately straight and through the router: "
                f"direct p50 {pairs[0]:.2f} ms p99 {pairs[1]:.2f} ms; routed p50 {pairs[2]:.2f} ms "
                f"p99 {pairs[3]:.2f} ms; overhead p50 {pairs[2] - pairs[0]:.2f} ms p99 "
                f"{pairs[3] - pairs[1]:.2f} ms"
            )
            for rate in args.rates:
                direct = open_loop(entry["http"], body, rate, seconds, standin_pid)
                routed = open_loop(serve, body, rate, seconds, serve_pid)
                print(
                    f"chat completions at {rate:g}/s open loop, {args.chat_tokens}-token system "
                    f"prompt: direct p50 {direct[0]:.2f} ms p99 {direct[1]:.2f} ms; through the "
                    f"router p50 {routed[0]:.2f} ms p99 {routed[1]:.2f} ms; overhead p50 "
                    f"{routed[0] - direct[0]:.2f} ms p99 {routed[1] - direct[1]:.2f} ms "
                    f"(errors {direct[2]}, {routed[2]}); CPU per request: stand-in "
                    f"{direct[3]:.0f} us, router {routed[3]:.0f} us"
                )
        finally:
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGTERM)
                    try:
                        q.wait(10)
                    except subprocess.TimeoutExpired:
                        q.kill()


if __name__ == "__main__":
    main()
