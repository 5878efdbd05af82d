"""Which source lines an engine step program's XLA:CPU kernels come from (for the suite's time).

    PYTHONPATH=. .venv/bin/python scripts/probe_step_kernels.py --out DIR [--hisparse] [--top 25]

XLA:CPU compiles every kernel of a program (a fusion, or an operation left alone) as an LLVM module
of its own, so a step program's compile time follows its number of kernels (docs/test_suite.md).
This builds an engine on the suite's 7-layer twin of the tiny checkpoint as the engine tests do
(max_model_len 2048, 4 sequences, one 64-token step bucket, programs compiled on first use; with
`--hisparse`, a 36-page pool under Hybrid HiSparse, whose prompts then also run the hot program),
runs three 900-token prompts for 16 greedy tokens with XLA's dump on (`--xla_dump_to`,
`--xla_dump_hlo_as_text`; the compilation cache off), and attributes each kernel's object file to
the innermost frame of this repository's code in the stack trace XLA keeps with the instruction
(the optimised HLO's FileNames / FunctionNames / FileLocations / StackFrames tables). Prints, per
step program, the kernels per source file and per function (innermost three frames), and writes
`DIR/step_kernels.json`. Kernels XLA made up itself (copies, concatenations, reduce-windows of
cumulative sums) have no frame of ours and are counted under their own name.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

WORKER = r"""
import os, sys
os.environ["GLM53_COMPILATION_CACHE"] = "off"
sys.path.insert(0, os.getcwd())
import numpy as np
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.types import SamplingParams
from tests.helpers.shallow_model import shallow_model_dir
hot = sys.argv[1] == "1"
kw = dict(num_gpu_blocks_override=36, attention_config={"hisparse_config": {"host_pool_gib": 0.05,
          "prefill_buffer_size": 1024}}) if hot else {}
e = build_engine(EngineArgs(model=shallow_model_dir(), max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=64,
                            cuda_graph_sizes=[], precompile_token_paddings=[], compile_progress=False,
                            disable_log_stats=True, skip_precompile=True, **kw))
rng = np.random.default_rng(0)
for i in range(3):
    e.add_request(f"r{i}", rng.integers(10, 400, 900).tolist(), SamplingParams(temperature=0, max_tokens=16))
while e.has_unfinished_requests():
    e.step()
"""


def _tables(lines: list[str]) -> tuple[dict, dict, dict, dict]:
    """The optimised HLO's source tables: file names, function names, locations, stack frames."""
    files, funcs, locs, frames, section = {}, {}, {}, {}, None
    for line in lines:
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        m = re.match(r"(\d+) (.*)", s)
        if section is None or not m:
            if section == "StackFrames" and not s:
                break
            continue
        i, rest = int(m.group(1)), m.group(2)
        if section == "FileNames":
            files[i] = rest.strip('"')
        elif section == "FunctionNames":
            funcs[i] = rest.strip('"')
        else:
            d = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
            if section == "FileLocations":
                locs[i] = (d["file_name_id"], d["function_name_id"], d["line"])
            else:
                frames[i] = (d["file_location_id"], d["parent_frame_id"])
    return files, funcs, locs, frames


def attribute(hlo_path: str, repo: str) -> dict:
    """Kernels of one dumped program → {"kernels": n, "by_file": {...}, "by_function": {...}}."""
    with open(hlo_path) as f:
        lines = f.read().split("\n")
    files, funcs, locs, frames = _tables(lines)

    def ours(frame_id):
        out, seen = [], set()
        while frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            loc, parent = frames[frame_id]
            file_id, func_id, _ = locs[loc]
            path = files[file_id]
            if path.startswith(repo) and "site-packages" not in path:
                out.append((os.path.relpath(path, repo), funcs[func_id]))
            if parent in (frame_id, 0):
                break
            frame_id = parent
        return out

    frame_of = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*stack_frame_id=(\d+)", line)
        if m:
            frame_of[m.group(1)] = int(m.group(2))
    by_file, by_func = collections.Counter(), collections.Counter()
    objects = glob.glob(hlo_path.replace(".cpu_after_optimizations.txt", ".obj-file.*.o"))
    for obj in objects:
        name = os.path.basename(obj).split("obj-file.", 1)[1]
        name = re.sub(r"(_kernel_module)?\.o$", "", re.sub(r"^__compute_module_", "", name))
        chain = ours(frame_of[name]) if name in frame_of else []
        if not chain:
            key = "(no frame of ours) " + name.split(".")[0]
            by_file[key] += 1
            by_func[key] += 1
            continue
        by_file[chain[0][0]] += 1
        by_func[" < ".join(f"{os.path.basename(p)}:{fn}" for p, fn in chain[:3])] += 1
    return {"kernels": len(objects), "by_file": dict(by_file.most_common()), "by_function": dict(by_func.most_common())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for step_kernels.json")
    ap.add_argument("--hisparse", action="store_true", help="a HiSparse engine on a small pool (plain and hot programs)")
    ap.add_argument("--top", type=int, default=25, help="rows printed per table")
    args = ap.parse_args(argv)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dump = tempfile.mkdtemp(prefix="step-kernels-")
    env = {**os.environ, "PYTHONPATH": repo}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=2"  # as the suite
                        f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*jit_step.*").strip()
    subprocess.run([sys.executable, "-c", WORKER, "1" if args.hisparse else "0"], cwd=repo, env=env, check=True)
    programs = sorted(glob.glob(os.path.join(dump, "*jit_step.cpu_after_optimizations.txt")))
    result = {}
    for i, path in enumerate(programs):
        name = "plain" if i == 0 else ("hot" if args.hisparse and i == 1 else f"program {i}")
        r = result[name] = attribute(path, repo)
        print(f"== {name} step program: {r['kernels']} kernels")
        for table in ("by_file", "by_function"):
            for key, n in list(r[table].items())[:args.top]:
                print(f"  {n:4d}  {key}")
            print()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
