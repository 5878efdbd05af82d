"""Drive our OpenAI server with evalscope's `perf` tool in multi-turn mode and check what it reads.

evalscope (a third-party benchmark client, from PyPI) replays multi-turn conversations against
`/v1/chat/completions`: every turn sends the whole history so far, with the server's real answers
in it, so turn N's prompt starts with turn N-1's prompt and answer (the prefix a prefix cache
reuses). It reads `usage.prompt_tokens_details.cached_tokens` from the server; a server that does
not report it gets an estimate instead (the whole previous context counted as cached), which
shows as an eligible cache hit rate of exactly 100.00%. This script:

1. finds evalscope: `--evalscope-python PY`, else this interpreter if it has it (the project's
   `bench` extra: `pip install '.[bench]'`), else a separate virtual environment that it creates
   with `pip install 'evalscope[perf]…'` (`--venv`, default `$GLM53_HOME/evalscope-venv`,
   `$GLM53_HOME` defaulting to `~/.cache/glm53`; the first install takes a few minutes). A
   separate environment keeps evalscope's ~70 dependencies (transformers, datasets, pandas,
   modelscope, …) out of the project's;
2. writes a small multi-turn data set, `DIR/multiturn.jsonl`: one conversation per line, a JSON
   array of OpenAI messages (a shared system message, then user turns separated by placeholder
   assistant messages, which evalscope replaces by the server's real answers) — evalscope's
   `custom_multi_turn` format;
3. starts `python -m serving.run` (the tiny model unless `--model`) on a free loopback port, with
   `--enable-prefix-caching` when this checkout's server accepts that flag (`--no-prefix-caching`
   leaves it off), and waits for `/health`;
4. runs `evalscope perf --multi-turn --dataset custom_multi_turn` against it (greedy, streaming,
   `--max-tokens N` with `ignore_eos` so every answer has N tokens);
5. checks that every turn of every conversation succeeded and that evalscope's eligible cache hit
   rate is not the estimate's 100.00% (with prefix caching on, also that it is above 0; without
   it, that it is 0 in every conversation), then stops the server.

    PYTHONPATH=. python scripts/evalscope_multiturn.py --out runs/evalscope

Outputs under DIR: `multiturn.jsonl`, `server.log`, `evalscope_stdout.txt` (evalscope's printed
report), `evalscope/multiturn/parallel_P_number_N/` (evalscope's own files: `benchmark_summary.json`,
`trace_summary.json`, `benchmark_percentile.json`, `benchmark.log`, its sqlite db) and
`evalscope_multiturn.json` (this script's checks). Exit status 0 when every check passed.

Options: `--conversations 8`, `--turns 3`, `--parallel 4`, `--max-tokens 16`,
`--first-turn-words 300`, `--user-words 60` (words per later user turn; this tokenizer
makes about 3.3 tokens of a word), `--model DIR`, `--server-timeout 900` (seconds to a
healthy server), `--run-timeout 1800`, `--server-arg ARG` (repeatable, passed to serving.run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Keep in step with the `bench` extra in pyproject.toml.
EVALSCOPE_SPEC = "evalscope[perf]>=1.14,<2"
SERVED_MODEL_NAME = "glm-5.3-tiny"
RUN_NAME = "multiturn"

_WORDS = (
    "the a cache page block token request server client model prompt answer question turn history "
    "system user assistant first second third next last long short fast slow small large shared "
    "prefix reuse memory device host step batch queue decode prefill chunk budget limit count "
    "weather city river mountain garden morning evening travel book story poem number list "
    "explain describe compare summarize continue repeat check measure count write read plan"
).split()


# ----------------------------------------------------------------------------------- evalscope
def _has_evalscope(python: str) -> bool:
    return subprocess.run([python, "-c", "import evalscope.perf"], capture_output=True).returncode == 0


def find_evalscope(explicit: str | None, venv: str) -> str:
    """The interpreter to run evalscope with, installing it into `venv` when needed."""
    if explicit:
        if not _has_evalscope(explicit):
            raise SystemExit(f"--evalscope-python {explicit}: cannot import evalscope.perf")
        return explicit
    if _has_evalscope(sys.executable):
        return sys.executable
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        print(f"creating {venv} for evalscope", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if not _has_evalscope(py):
        print(f"installing {EVALSCOPE_SPEC} into {venv} (a few minutes)", flush=True)
        subprocess.run([py, "-m", "pip", "install", "-q", EVALSCOPE_SPEC], check=True)
    return py


# ----------------------------------------------------------------------------------- data set
def write_dataset(path: str, conversations: int, turns: int, first_turn_words: int, user_words: int,
                  seed: int) -> int:
    """`conversations` lines of [system, user, assistant, user, …, user] → number of user turns.

    The first user turn is long (`first_turn_words` words, about 1000 tokens): prefix-cache hits
    come in 64-token units (pages a hit covers in part are copied on write), so a short turn
    would do, but a long shared context also makes the hit rate close to what long multi-turn
    chats see; each conversation's words differ, so hits come from the conversation's own
    history, not from other conversations."""
    rng = random.Random(seed)
    system = ("You are a helpful assistant. Answer every question of the user in a few sentences, "
              "and keep the earlier turns of the conversation in mind.")
    with open(path, "w", encoding="utf-8") as f:
        for c in range(conversations):
            msgs = [{"role": "system", "content": system}]
            for t in range(turns):
                if t:
                    msgs.append({"role": "assistant", "content": "(replaced by the server's answer)"})
                n = first_turn_words if t == 0 else user_words
                words = " ".join(rng.choice(_WORDS) for _ in range(n))
                msgs.append({"role": "user", "content": f"Conversation {c}, turn {t + 1}: {words}?"})
            f.write(json.dumps(msgs) + "\n")
    return conversations * turns


# ----------------------------------------------------------------------------------- server
def prefix_caching_supported() -> tuple[bool, str]:
    """Whether this checkout's server accepts --enable-prefix-caching (its own flag check)."""
    sys.path.insert(0, REPO_ROOT)
    from serving.cli_args import make_arg_parser, validate_args

    try:
        validate_args(make_arg_parser().parse_args(["--enable-prefix-caching"]))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the server's refusal, or a parser without the flag
        return False, str(e) or type(e).__name__
    return True, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, prefix_caching: bool, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving.run", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_MODEL_NAME]
    if args.model:
        cmd += ["--model", args.model]
    if prefix_caching:
        cmd.append("--enable-prefix-caching")
    cmd += args.server_arg
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(log_path, "w")
    print("server:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; last lines of {log_path}:\n"
                             + "".join(open(log_path).readlines()[-20:]))
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"the server was not healthy within {timeout_s:.0f} s (see {log_path})")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------------- checks
def check_results(result_dir: str, expected_turns: int, prefix_caching: bool) -> dict:
    """Read evalscope's summaries; → {"checks": [...], "ok": bool, numbers}.

    Had evalscope not read the server's cached_tokens it would have counted each turn's whole
    previous context as cached: an eligible cache hit rate of exactly 100% in every trace."""
    with open(os.path.join(result_dir, "benchmark_summary.json")) as f:
        summary = json.load(f)
    trace_path = os.path.join(result_dir, "trace_summary.json")
    trace = json.load(open(trace_path)) if os.path.exists(trace_path) else {"rows": []}
    rows = {r.get("metric"): r for r in trace.get("rows", [])}
    eligible = rows.get("Eligible Cache Hit Rate (%)")
    succeeded = summary.get("Success Requests")
    failed = summary.get("Failed Requests")
    checks = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    check("every turn succeeded", succeeded == expected_turns and not failed,
          f"{succeeded} succeeded, {failed} failed, {expected_turns} expected")
    check("evalscope reports an eligible cache hit rate", eligible is not None, json.dumps(eligible))
    if eligible is not None:
        check("eligible cache hit rate is not the estimate's 100.00%", abs(eligible["mean"] - 100.0) > 1e-6,
              f"mean {eligible['mean']:.2f}%, traces {eligible['min']:.2f}%..{eligible['max']:.2f}%")
        if prefix_caching:
            check("prefix caching hits (eligible rate > 0)", eligible["mean"] > 0, f"{eligible['mean']:.2f}%")
        else:  # the server reports cached_tokens = 0 on every turn
            check("without prefix caching evalscope reads 0 cached tokens", eligible["max"] == 0.0,
                  f"traces {eligible['min']:.2f}%..{eligible['max']:.2f}%")
    return {"checks": checks, "ok": all(c["ok"] for c in checks), "succeeded_requests": succeeded,
            "failed_requests": failed, "kv_cache_hit_rate_pct": summary.get("KV Cache Hit Rate (%)"),
            "eligible_cache_hit_rate_pct": eligible["mean"] if eligible else None,
            "benchmark_summary": summary, "trace_summary": trace}


# ----------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--evalscope-python", default=None)
    p.add_argument("--venv", default=os.path.join(os.environ.get("GLM53_HOME", os.path.expanduser("~/.cache/glm53")),
                                                  "evalscope-venv"))
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--first-turn-words", type=int, default=300)
    p.add_argument("--user-words", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--server-timeout", type=float, default=900)
    p.add_argument("--run-timeout", type=float, default=1800)
    p.add_argument("--server-arg", action="append", default=[])
    args = p.parse_args(argv)

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    evalscope_py = find_evalscope(args.evalscope_python, args.venv)
    version = subprocess.run([evalscope_py, "-c", "import evalscope; print(evalscope.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    data_path = os.path.join(out, "multiturn.jsonl")
    expected = write_dataset(data_path, args.conversations, args.turns, args.first_turn_words, args.user_words,
                             args.seed)

    supported, why = prefix_caching_supported()
    prefix_caching = supported and not args.no_prefix_caching
    if not supported:
        print(f"prefix caching: not available in this checkout ({why}); running without it", flush=True)

    result_dir = os.path.join(out, "evalscope", RUN_NAME)
    shutil.rmtree(result_dir, ignore_errors=True)  # evalscope would add to an earlier run's database
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(out, "server.log")
    proc = start_server(args, port, prefix_caching, log_path)
    try:
        wait_healthy(proc, url, args.server_timeout, log_path)
        cmd = [evalscope_py, "-m", "evalscope.cli.cli", "perf",
               "--url", url + "/v1/chat/completions", "--api", "openai", "--model", SERVED_MODEL_NAME,
               "--multi-turn", "--dataset", "custom_multi_turn", "--dataset-path", data_path,
               "--max-turns", str(args.turns), "--number", str(args.conversations), "--parallel", str(args.parallel),
               "--max-tokens", str(args.max_tokens), "--temperature", "0", "--stream",
               "--extra-args", json.dumps({"ignore_eos": True}),
               "--outputs-dir", os.path.join(out, "evalscope"), "--no-timestamp", "--name", RUN_NAME]
        print("evalscope:", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        run = subprocess.run(cmd, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=args.run_timeout, env=dict(os.environ, PYTHONPATH=""))
        elapsed = time.perf_counter() - t0
    finally:
        stop_server(proc)
    with open(os.path.join(out, "evalscope_stdout.txt"), "w") as f:
        f.write(run.stdout)
    print(run.stdout[-6000:])
    if run.returncode != 0:
        raise SystemExit(f"evalscope exited with {run.returncode} (see {out}/evalscope_stdout.txt)")

    cands = [d for d, _, files in os.walk(result_dir) if "benchmark_summary.json" in files]
    if not cands:
        raise SystemExit(f"no benchmark_summary.json under {result_dir}")
    res = check_results(cands[0], expected, prefix_caching)
    res.update({"evalscope_version": version, "evalscope_python": evalscope_py, "prefix_caching": prefix_caching,
                "prefix_caching_refused_because": None if supported else why, "conversations": args.conversations,
                "turns": args.turns, "parallel": args.parallel, "max_tokens": args.max_tokens,
                "expected_requests": expected, "evalscope_wall_s": elapsed, "result_dir": cands[0]})
    with open(os.path.join(out, "evalscope_multiturn.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"evalscope {version}; prefix caching {'on' if prefix_caching else 'off'}; "
          f"KV cache hit rate {res['kv_cache_hit_rate_pct']}%, eligible cache hit rate "
          f"{res['eligible_cache_hit_rate_pct']}%")
    for c in res["checks"]:
        print(f"{'PASS' if c['ok'] else 'FAIL'}: {c['check']} ({c['detail']})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
