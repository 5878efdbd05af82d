"""P/D benchmark: a PCP2 × DCP2 prefill engine vs a DP2 prefill engine, each feeding the same DP2
Hybrid-HiSparse decode engine through vllm-router, vs one colocated engine of the decode layout.

The agentic workload of `scripts/bench_agentic.py` (13-turn conversations in the reference's
74,160 : 753 : 220 proportions, scaled down by `--scale`; each turn's prompt is the previous
prompt, its output and new user tokens; greedy, `ignore_eos`), run at each concurrency of the
sweep by c client threads over 2·c conversations. Rows:

* `colocated`: one server of the decode layout (`--data-parallel-size 2 --enable-expert-parallel`,
  HiSparse, prefix caching) doing prefill and decode; its streams (with top-2 logprobs) are the
  reference of the equality rule (`glm53.equality`);
* `pd-pcp2xdcp2`: a prefill server with `--prefill-context-parallel-size 2
  --decode-context-parallel-size 2` (the reference prefill layout, scaled) and the decode server;
* `pd-dp2`: a prefill server with `--data-parallel-size 2` and the same decode server (the
  reference's comparison, DP prefill);
* `pd-dp2-2proc` (not in the default `--modes`): the `pd-dp2` pair with the decode engine spread
  over two processes of one device each (serving/multihost: one replica per process; its P/D
  connector in the leader, which pulls every request's KV and sends the followers' page writes
  over the step channel), the same layout as the one-process decode server.

P/D rows go through a real `vllm-router --vllm-pd-disaggregation` (cache_aware prefill policy,
round_robin decode). Each server process gets 4 simulated CPU devices, so all of them share the
machine's cores: compare rows inside one run only; the figures measure the machinery on a tiny
model, not GPUs. `--prefill-offload-gib N` gives every prefill engine the CPU KV offload of the
reference (a MultiConnector; the DP2 prefill engine one store of N GiB per replica). The default,
0, runs them without it, so later turns reuse the prefill engines' device prefix caches only.

Columns: those of bench_agentic (TTFT p50/p90, interactivity = 1 / mean TPOT, logical throughput,
mean running requests of the decode engine, preemptions, HiSparse hot hit rate, equality with the
colocated run) plus `kv_bytes_per_request` and `xfer_ms_per_request` (Δ `vllm:nixl_bytes_transferred`
and `vllm:nixl_xfer_time_seconds` over pulls), `remote_prompt_tokens` (prompt tokens landed
instead of computed), `landed_host` (pulls landed in the HiSparse host pool), `failed_transfers`,
`acceptance_length` (with `--speculative-config`: 1 + accepted / verified drafts of the engine that
decodes).

    PYTHONPATH=. .venv/bin/python scripts/bench_pd.py --out /tmp/pd            # quick: scale 64, 4 turns, c = 1, 4
    PYTHONPATH=. .venv/bin/python scripts/bench_pd.py --scale 32 --turns 13 --concurrency 1,4,8 --out DIR
    PYTHONPATH=. .venv/bin/python scripts/bench_pd.py --modes colocated,pd-dp2,pd-dp2-2proc --out DIR
    PYTHONPATH=. .venv/bin/python scripts/bench_pd.py --modes colocated,pd-pcp2xdcp2 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}' --out DIR    # MTP3 on every engine

Writes OUT/summary.json, OUT/summary.csv, OUT/server_*.log and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.bench_agentic import Server, Workload, _free_port, run_point, summarize, wait_healthy  # noqa: E402

DECODE = ["--data-parallel-size", "2", "--enable-expert-parallel"]
PREFILL = {"pd-pcp2xdcp2": ["--prefill-context-parallel-size", "2", "--decode-context-parallel-size", "2"],
           "pd-dp2": ["--data-parallel-size", "2", "--enable-expert-parallel"],
           "pd-dp2-2proc": ["--data-parallel-size", "2", "--enable-expert-parallel"]}
COLUMNS = ["mode", "concurrency", "requests", "errors", "ttft_p50_s", "ttft_p90_s", "interactivity",
           "logical_throughput_tok_s", "mean_running", "preemptions", "hot_hit_rate", "kv_bytes_per_request",
           "xfer_ms_per_request", "remote_prompt_tokens", "landed_host", "failed_transfers", "acceptance_length",
           "greedy_identical",
           "equal_under_rule", "equality", "divergences", "turns_after_a_divergence"]


class Router:
    """vllm-router in P/D mode in front of a prefill and a decode `Server`; `metrics()` sums theirs."""

    def __init__(self, prefill: Server, decode: Server, log_path: Path):
        exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        self.prefill, self.decode = prefill, decode
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [exe, "--vllm-pd-disaggregation", "--prefill", prefill.base, "--decode", decode.base, "--host", "127.0.0.1",
             "--port", str(self.port), "--prefill-policy", "cache_aware", "--decode-policy", "round_robin",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()), "--request-timeout-secs",
             "3600"], stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OPENAI_API_KEY": ""})
        try:
            wait_healthy(self.proc, self.base, 60, log_path, "vllm-router")
        except RuntimeError:
            self.stop()
            raise

    def metrics(self) -> dict[str, float]:
        """The decode server's metrics (running requests, preemptions, HiSparse and P/D counters),
        with the host landings apart as `vllm:kv_transfer_landed_requests_total{host}`."""
        from prometheus_client.parser import text_string_to_metric_families

        out = self.decode.metrics()
        text = httpx.get(self.decode.base + "/metrics", timeout=30).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:kv_transfer_landed_requests_total" and s.labels.get("place") == "host":
                    out["vllm:kv_transfer_landed_requests_total{host}"] = s.value
        return out

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--decode-blocks", type=int, default=48, help="device pages per decode replica")
    ap.add_argument("--host-pool-gib", type=float, default=0.1)
    ap.add_argument("--modes", default="colocated,pd-pcp2xdcp2,pd-dp2")
    ap.add_argument("--prefill-offload-gib", type=float, default=0.0,
                    help="CPU KV offload of every prefill engine (GiB, per data-parallel replica; 0: none)")
    ap.add_argument("--speculative-config", default=None,
                    help='JSON, e.g. {"method": "mtp", "num_speculative_tokens": 3}: MTP speculation on every '
                         "engine (the reference runs MTP3 on both sides)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wl = Workload.scaled(args.scale, args.turns)
    concs = [int(c) for c in args.concurrency.split(",")]
    max_len = 1 << (wl.final_context + 64).bit_length()
    from glm53.tiny_checkpoint import default_model_dir
    from glm53.tokenizer import tokenizer_vocab_size

    vocab = tokenizer_vocab_size(str(default_model_dir()))
    common = ["--max-model-len", str(max_len), "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
              "--enable-prefix-caching", "--disable-log-stats"]
    k = 0
    if args.speculative_config:  # every server; a decode step of 8 requests verifies 8 (k + 1) rows
        k = json.loads(args.speculative_config)["num_speculative_tokens"]
        common += ["--speculative-config", args.speculative_config]
    decode_flags = common + DECODE + ["--cuda-graph-sizes", str(8 * (k + 1)), "--num-gpu-blocks-override",
                                      str(args.decode_blocks),
                                      "--attention-config",
                                      json.dumps({"hisparse_config": {"host_pool_gib": args.host_pool_gib}})]
    env_before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    rows, ref = [], {}
    try:
        for mode in args.modes.split(","):
            print(f"== {mode}: starting servers", flush=True)
            if mode == "colocated":
                target = Server(decode_flags, args.out / "server_colocated.log")
                stop = [target]
            else:
                def role(r: str, offload_gib: float = 0.0) -> list[str]:
                    pd = {"kv_connector": "JaxTransferConnector", "kv_role": r}
                    if offload_gib > 0:
                        pd = {"kv_connector": "MultiConnector", "kv_role": r, "kv_connector_extra_config": {
                            "connectors": [pd, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                "kv_connector_extra_config": {
                                                    "cpu_bytes_to_use": int(offload_gib * 2**30)}}]}}
                    return ["--kv-transfer-config", json.dumps(pd)]

                offload = args.prefill_offload_gib
                spread = {"num_processes": 2, "devices_per_process": 1} if mode.endswith("-2proc") else {}
                decode = Server(decode_flags + role("kv_consumer"), args.out / f"server_{mode}_decode.log", **spread)
                prefill = Server(common + PREFILL[mode] + ["--cuda-graph-sizes"] + role("kv_producer", offload),
                                 args.out / f"server_{mode}_prefill.log")
                target = Router(prefill, decode, args.out / f"router_{mode}.log")
                stop = [target, prefill, decode]
            try:
                for i, c in enumerate(concs):
                    results, samples, before, after, wall = run_point(target, wl, c, vocab, mode == "colocated", 0.5,
                                                                      conv_offset=1000 * i)
                    if mode == "colocated":
                        ref[c] = results
                    row = summarize(mode, c, results, samples, before, after, wall, None, ref.get(c))
                    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
                    pulls = d("vllm:nixl_bytes_transferred_count")
                    row["kv_bytes_per_request"] = round(d("vllm:nixl_bytes_transferred_sum") / pulls) if pulls else None
                    row["xfer_ms_per_request"] = (round(1e3 * d("vllm:nixl_xfer_time_seconds_sum") / pulls, 2)
                                                  if pulls else None)
                    row["remote_prompt_tokens"] = int(d("vllm:kv_transfer_remote_prompt_tokens_total"))
                    row["landed_host"] = int(d("vllm:kv_transfer_landed_requests_total{host}"))
                    row["failed_transfers"] = int(d("vllm:nixl_num_failed_transfers_total"))
                    drafts = d("vllm:spec_decode_num_drafts_total")  # MTP: the serving engine's verifications
                    row["acceptance_length"] = (round(1 + d("vllm:spec_decode_num_accepted_tokens_total") / drafts, 3)
                                                if drafts else None)
                    rows.append(row)
                    print("  " + ", ".join(f"{k}={row.get(k)}" for k in COLUMNS[1:]), flush=True)
            finally:
                for s in stop:
                    s.stop()
    finally:
        if env_before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = env_before
    (args.out / "summary.json").write_text(json.dumps({"workload": wl.__dict__, "rows": rows}, indent=1))
    with open(args.out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"\nworkload {wl}; table in {args.out / 'summary.csv'}")
    print(" | ".join(COLUMNS))
    for r in rows:
        print(" | ".join(str(r.get(k)) for k in COLUMNS))
    return rows


if __name__ == "__main__":
    main()
