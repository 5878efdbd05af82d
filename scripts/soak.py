"""Soak test: mixed traffic against a real server for N minutes, with numbers.

    PYTHONPATH=. .venv/bin/python scripts/soak.py --minutes 10 --out DIR [--concurrency 8]
        [--server-args "--kv-cache-dtype fp8 --enable-prefix-caching"]

Starts `python -m serving.run` (the tiny checkpoint unless `--server-args` names a `--model`) on a
loopback port, with the chat output parsers on, and runs `--concurrency` client threads that each
pick a scenario at random (fixed seed) until the time is up:

* `multi_turn`: a 3-turn chat, each turn resending the history (prefix-cache hits);
* `stream_logprobs`: a streamed chat with `logprobs` / `top_logprobs`;
* `n_stop`: a completion with `n` = 2 and stop strings;
* `tools`: a chat offering a tool with `tool_choice` "auto";
* `abort`: a streamed completion the client drops after a few chunks;
* `bad`: a malformed or out-of-range request (a 4xx with an OpenAI error body is the success).

Recorded: outcomes by kind (`ok`, `expected_4xx`, and the errors `http_5xx`, `unexpected_4xx`,
`bad_error_body`, `stream_error_event`, `connection`), latency percentiles per scenario, the
server's RSS every 15 s with its slope in MiB/hour (least squares, over the whole run and over
the run after its first quarter), completed requests and generated tokens per 15 s, `/metrics`
at the end once traffic stopped (`vllm:num_requests_running`, `..._waiting` and
`vllm:kv_cache_usage_perc` must be back to 0), and the exit status of a SIGTERM shutdown. Writes
`DIR/soak.json`, `DIR/metrics_end.txt`, `DIR/soak.png` and `DIR/server.log`; prints the summary.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.bench_agentic import MODEL, Server  # noqa: E402

PARSERS = ["--reasoning-parser", "glm45", "--tool-call-parser", "glm47", "--enable-auto-tool-choice"]
SCENARIOS = {"multi_turn": 3, "stream_logprobs": 2, "n_stop": 2, "tools": 1, "abort": 1, "bad": 1}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
WORDS = "alpha beta gamma delta river stone cloud paper light window garden music".split()
BAD = [
    {"messages": []},  # no messages
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"model": "not-this-model", "messages": [{"role": "user", "content": "hi"}]},
]


class Recorder:
    """Thread-safe outcome counts, latencies and time series."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.by_scenario: dict[str, Counter] = defaultdict(Counter)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.done: list[tuple[float, int]] = []  # (seconds since start, generated tokens)
        self.examples: dict[str, str] = {}

    def record(self, scenario: str, outcome: str, latency: float, tokens: int = 0, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.by_scenario[scenario][outcome] += 1
            if outcome in ("ok", "expected_4xx"):
                self.latency[scenario].append(latency)
                self.done.append((time.monotonic() - self.t0, tokens))
            elif detail and outcome not in self.examples:
                self.examples[outcome] = detail[:500]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _check_status(r: httpx.Response, expect_error: bool) -> tuple[str, str]:
    if r.status_code >= 500:
        return "http_5xx", r.text
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            good = isinstance(err["message"], str) and err["code"] == r.status_code
        except Exception:  # noqa: BLE001
            good = False
        if not good:
            return "bad_error_body", r.text
        return ("expected_4xx", "") if expect_error else ("unexpected_4xx", r.text)
    return ("unexpected_2xx", r.text) if expect_error else ("ok", "")


def _stream(client: httpx.Client, path: str, body: dict, stop_after: int | None = None) -> tuple[str, str, int]:
    """POST a streaming request; (outcome, detail, chunks). Drops the connection after
    `stop_after` chunks when given."""
    chunks = 0
    with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            out, detail = _check_status(r, False)
            return out, detail, 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return "stream_error_event", line, chunks
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return "ok", "", chunks  # the client drops the stream here
    return "ok", "", chunks


def run_scenario(client: httpx.Client, name: str, rng: random.Random) -> tuple[str, str, int]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    if name == "multi_turn":
        msgs = [{"role": "system", "content": "You are terse."}]
        tokens = 0
        for _ in range(3):
            msgs.append({"role": "user", "content": _text(rng, rng.randint(5, 60))})
            r = client.post(chat, json={"model": MODEL, "messages": msgs, "max_tokens": rng.randint(4, 24),
                                        "temperature": 0.7, "seed": rng.randint(0, 2**31)})
            out, detail = _check_status(r, False)
            if out != "ok":
                return out, detail, tokens
            body = r.json()
            tokens += body["usage"]["completion_tokens"]
            msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
        return "ok", "", tokens
    if name == "stream_logprobs":
        return _stream(client, chat, {"model": MODEL, "messages": [{"role": "user", "content": _text(rng, 30)}],
                                      "max_tokens": rng.randint(8, 40), "stream": True, "logprobs": True,
                                      "top_logprobs": rng.randint(0, 5), "temperature": 1.0})
    if name == "n_stop":
        r = client.post(comp, json={"model": MODEL, "prompt": _text(rng, 40), "max_tokens": 24, "n": 2,
                                    "stop": [rng.choice(WORDS), "\n\n"], "temperature": 0.8})
        out, detail = _check_status(r, False)
        return out, detail, sum(1 for _ in r.json()["choices"]) if out == "ok" else 0
    if name == "tools":
        r = client.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                                    "tools": TOOLS, "tool_choice": "auto", "max_tokens": 32})
        out, detail = _check_status(r, False)
        return out, detail, r.json()["usage"]["completion_tokens"] if out == "ok" else 0
    if name == "abort":
        return _stream(client, comp, {"model": MODEL, "prompt": _text(rng, 50), "max_tokens": 200, "stream": True,
                                      "ignore_eos": True}, stop_after=rng.randint(1, 6))
    if name == "bad":
        body = dict(rng.choice(BAD))
        body.setdefault("model", MODEL)
        r = client.post(chat, json=body)
        out, detail = _check_status(r, True)
        return out, detail, 0
    raise ValueError(name)


def worker(base: str, rec: Recorder, deadline: float, seed: int) -> None:
    rng = random.Random(seed)
    names, weights = zip(*SCENARIOS.items())
    with httpx.Client(base_url=base, timeout=300) as client:
        while time.monotonic() < deadline:
            name = rng.choices(names, weights)[0]
            t = time.monotonic()
            try:
                out, detail, tokens = run_scenario(client, name, rng)
            except httpx.HTTPError as e:
                out, detail, tokens = "connection", repr(e), 0
            rec.record(name, out, time.monotonic() - t, tokens, detail)


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def slope_mib_per_hour(samples: list[tuple[float, float]]) -> float | None:
    if len(samples) < 3:
        return None
    t, m = np.array(samples).T
    return float(np.polyfit(t / 3600.0, m, 1)[0])


def plot(summary: dict, rss: list, done: list, path: Path, bucket_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if rss:
        t, m = np.array(rss).T
        a.plot(t / 60, m, marker=".")
    a.set(xlabel="minutes", ylabel="server RSS (MiB)",
          title=f"RSS (slope {summary['rss_slope_mib_per_hour_after_warmup']} MiB/h after warm-up)")
    if done:
        t = np.array([x[0] for x in done])
        tok = np.array([x[1] for x in done])
        edges = np.arange(0, t.max() + bucket_s, bucket_s)
        reqs, _ = np.histogram(t, edges)
        toks, _ = np.histogram(t, edges, weights=tok)
        b.plot(edges[:-1] / 60, reqs / bucket_s, label="requests/s")
        b.plot(edges[:-1] / 60, toks / bucket_s / 10, label="generated tokens/s ÷ 10")
        b.legend()
    b.set(xlabel="minutes", title="throughput per 15 s")
    fig.suptitle(summary["server_args"] or "default server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--server-args", default="", help="extra serving.run flags, one shell-quoted string")
    p.add_argument("--sample-s", type=float, default=15.0, help="RSS / throughput sampling period")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    flags = PARSERS + ["--max-model-len", "1024"] + shlex.split(args.server_args)
    server = Server(flags, args.out / "server.log")
    print(f"server up in {server.startup_s:.0f} s (pid {server.proc.pid}); {args.minutes} min at concurrency "
          f"{args.concurrency}", flush=True)
    t0 = time.monotonic()
    rec = Recorder(t0)
    deadline = t0 + 60 * args.minutes
    threads = [threading.Thread(target=worker, args=(server.base, rec, deadline, args.seed * 1000 + i), daemon=True)
               for i in range(args.concurrency)]
    for th in threads:
        th.start()
    rss: list[tuple[float, float]] = []
    while any(th.is_alive() for th in threads):
        rss.append((time.monotonic() - t0, rss_mib(server.proc.pid)))
        print(f"  {rss[-1][0] / 60:5.1f} min: RSS {rss[-1][1]:.0f} MiB, {sum(rec.outcomes.values())} requests, "
              f"outcomes {dict(rec.outcomes)}", flush=True)
        end = time.monotonic() + args.sample_s
        while time.monotonic() < end and any(th.is_alive() for th in threads):
            time.sleep(0.5)
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    settle = time.monotonic() + 60  # aborted streams leave the engine within a step or two
    while True:
        m = server.metrics()
        if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
            break
        if time.monotonic() > settle:
            break
        time.sleep(0.5)
    metrics_text = httpx.get(server.base + "/metrics", timeout=30).text
    (args.out / "metrics_end.txt").write_text(metrics_text)
    healthy = httpx.get(server.base + "/health", timeout=30).status_code == 200
    server.proc.terminate()  # SIGTERM: drains (nothing is running) and exits 0
    try:
        exit_code = server.proc.wait(60)
    except Exception:  # noqa: BLE001
        exit_code = None
    server.stop()
    warm = [x for x in rss if x[0] >= wall / 4]
    lat = {k: {f"p{q}": round(float(np.percentile(v, q)), 3) for q in (50, 90, 99)} | {"count": len(v)}
           for k, v in sorted(rec.latency.items())}
    errors = {k: v for k, v in rec.outcomes.items() if k not in ("ok", "expected_4xx")}
    summary = {
        "server_args": args.server_args, "minutes": round(wall / 60, 2), "concurrency": args.concurrency,
        "requests": sum(rec.outcomes.values()), "outcomes": dict(rec.outcomes), "errors": errors,
        "error_examples": rec.examples, "by_scenario": {k: dict(v) for k, v in rec.by_scenario.items()},
        "latency_s": lat, "generated_tokens": sum(x[1] for x in rec.done),
        "rss_mib_start": round(rss[0][1], 1) if rss else None, "rss_mib_end": round(rss[-1][1], 1) if rss else None,
        "rss_slope_mib_per_hour": _round(slope_mib_per_hour(rss)),
        "rss_slope_mib_per_hour_after_warmup": _round(slope_mib_per_hour(warm)),
        "end_running": m.get("vllm:num_requests_running"), "end_waiting": m.get("vllm:num_requests_waiting"),
        "end_kv_cache_usage_perc": m.get("vllm:kv_cache_usage_perc"), "healthy_at_end": healthy,
        "sigterm_exit_code": exit_code, "rss_samples": rss,
    }
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1))
    plot(summary, rss, rec.done, args.out / "soak.png", args.sample_s)
    print(json.dumps({k: v for k, v in summary.items() if k != "rss_samples"}, indent=1))
    return summary


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


if __name__ == "__main__":
    main()
