"""What it costs to hand a speculative step its inputs on the device, and why they go through a
program of their own (`ModelRunner._spec_inputs`, docs/async_scheduling.md "MTP speculation").

Under MTP with asynchronous scheduling a step's input ids, positions, slots, step counters and
`SpecBatch` come either from the host (nothing fed) or from the feed program (fed from the step in
flight). jit compiles one program per argument placement: this script first shows that a numpy
argument, a committed device array and an uncommitted device array are three cache entries of one
jitted function (so the step must see one form), then times, on the step's real input arrays
(an MTP engine on the embedded tiny checkpoint, its smallest bucket):

* `jax.device_put` of those arrays as one tree onto the device (committing them by hand);
* the jitted upload `_spec_inputs(..., feed=None)` (what every unfed speculative step runs).

    PYTHONPATH=. .venv/bin/python scripts/probe_spec_inputs_upload.py --out DIR [--calls 1000]

Writes `DIR/spec_inputs_upload.json` and prints it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def placements() -> dict:
    """Cache entries of one jitted function after a numpy, a committed and an uncommitted argument."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    f = jax.jit(lambda a: a + 1)
    x = np.ones(8, np.int32)
    out = {}
    f(x)
    out["numpy"] = f._cache_size()
    f(jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    out["numpy+committed"] = f._cache_size()
    f(jnp.asarray(x))
    out["numpy+committed+uncommitted"] = f._cache_size()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=1000)
    args = p.parse_args()

    import jax
    import numpy as np

    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.step_inputs import STEPS

    engine = build_engine(EngineArgs(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                     precompile_token_paddings=[], compile_progress=False, disable_log_stats=True,
                                     speculative_config={"method": "mtp", "num_speculative_tokens": 3}))
    runner = engine.runner
    batch, extra = runner._dummy(runner.buckets[0])
    batch.hot = None
    steps, sp = extra[STEPS], runner._dummy_spec
    tree = (batch.input_ids_T, batch.positions_T, batch.slot_mapping, steps, sp)
    n_arrays = len(jax.tree.leaves(tree))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def timed(fn) -> float:
        jax.block_until_ready(fn())
        t = time.perf_counter()
        for _ in range(args.calls):
            r = fn()
        jax.block_until_ready(r)
        return 1e6 * (time.perf_counter() - t) / args.calls

    put_us = timed(lambda: jax.device_put(tree, dev))
    upload_us = timed(lambda: runner._spec_inputs(batch, np.asarray(steps), sp, None)[2])
    res = {"jax": jax.__version__, "backend": jax.default_backend(), "calls": args.calls,
           "bucket_tokens": int(batch.input_ids_T.shape[0]), "arrays": n_arrays,
           "jit_cache_entries": placements(), "device_put_tree_us": round(put_us, 1),
           "jitted_upload_us": round(upload_us, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_inputs_upload.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
