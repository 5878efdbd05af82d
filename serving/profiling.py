"""Device and host traces of a running server: `--profiler-config` and `POST /start_profile`,
`POST /stop_profile` (vLLM's routes and flag; its profiler is PyTorch's, ours is JAX's).

    python -m serving.run --profiler-config '{"profiler": "jax", "profiler_dir": "/tmp/glm53-trace"}'
    curl -X POST localhost:8000/start_profile; ...requests...; curl -X POST localhost:8000/stop_profile

A trace is `jax.profiler.start_trace(profiler_dir)` … `stop_trace()` taken on the engine thread
between two engine steps, so it holds whole steps: every device program (XLA's kernels on the
GPU timeline, with their HLO names), the host side, and one `engine_step` annotation per step
(`StepTraceAnnotation`, numbered from the server's start). JAX writes the run to
`<profiler_dir>/plugins/profile/<date_time>/`: `<host>.xplane.pb` (TensorBoard's profile plugin,
XProf) and, with `create_perfetto_trace` (the default), `perfetto_trace.json.gz`, which
ui.perfetto.dev opens as it is. `max_steps` ends a trace by itself after that many engine steps
(a bounded capture; 0 = until `/stop_profile`).

In a multi-process engine (serving/multihost) the leader sends the start and the stop to every
follower in the step stream, so each process traces the same steps, into
`<profiler_dir>/process_<id>/`.

Errors: starting a trace while one runs, or stopping when none does, is a `ProfilerError` (the
routes answer 400); a failure inside JAX's profiler propagates.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

PROFILE_OP = "profile"  # the multi-process step stream's operation: ("start", dir) | ("stop", None)


class ProfilerError(ValueError):
    """A start while a trace runs, a stop while none does, or a trace directory that cannot be written."""


@dataclasses.dataclass(frozen=True)
class ProfilerConfig:
    """`--profiler-config`. profiler: "jax" (the only one); profiler_dir: where runs are written
    (created when missing); create_perfetto_trace: also write `perfetto_trace.json.gz`;
    max_steps: end a trace after this many engine steps (0: at `/stop_profile` only);
    host_tracer_level (0–3, JAX's default 2) and python_tracer_level (0 or 1): `jax.profiler.
    ProfileOptions`; the Python tracer is off by default here (JAX's is on): it records every
    Python call of every thread, the HTTP server's included, which slows the server and
    multiplies the trace's size."""

    profiler_dir: str
    profiler: str = "jax"
    create_perfetto_trace: bool = True
    max_steps: int = 0
    host_tracer_level: int = 2
    python_tracer_level: int = 0

    def options(self):
        """The `jax.profiler.ProfileOptions` of a trace."""
        import jax

        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = self.host_tracer_level
        options.python_tracer_level = self.python_tracer_level
        return options

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfilerConfig:
        """Raises ValueError naming an unknown key or a bad value."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} (known: {sorted(known)})")
        if d.get("profiler", "jax") != "jax":
            raise ValueError(f"profiler: only \"jax\" (jax.profiler) is available, got {d.get('profiler')!r}")
        if not isinstance(d.get("profiler_dir"), str) or not d["profiler_dir"]:
            raise ValueError("profiler_dir: a directory path is required")
        try:  # a path that cannot be a directory fails at start-up, not at the first /start_profile
            os.makedirs(d["profiler_dir"], exist_ok=True)
        except OSError as e:
            raise ValueError(f"profiler_dir: cannot create {d['profiler_dir']!r}: {e}") from None
        if not isinstance(d.get("create_perfetto_trace", True), bool):
            raise ValueError("create_perfetto_trace: true or false")  # noqa: TRY004 - a flag error, as the others
        for key, hi in (("max_steps", None), ("host_tracer_level", 3), ("python_tracer_level", 1)):
            v = d.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (hi is not None and v > hi):
                raise ValueError(f"{key}: an integer >= 0{f' and <= {hi}' if hi else ''}, got {v!r}")
        return cls(**d)


def process_dir(profiler_dir: str, process_id: int, num_processes: int) -> str:
    """Where one process writes its runs: `profiler_dir`, or `profiler_dir/process_<id>` when
    several processes trace (they may share a host name, and so JAX's file names)."""
    return profiler_dir if num_processes == 1 else os.path.join(profiler_dir, f"process_{process_id}")


def latest_run(directory: str) -> str | None:
    """The newest run directory JAX wrote under `directory` (`plugins/profile/<date_time>`), or None."""
    runs = glob.glob(os.path.join(directory, "plugins", "profile", "*"))
    return max(runs, key=os.path.getmtime) if runs else None


class EngineProfiler:
    """The trace state of one engine (its thread calls everything here).

    step_sink: the multi-process leader's `runner.step_sink` (None in one process): the start
    and stop go to the followers through it, in step order."""

    def __init__(self, config: ProfilerConfig, step_sink=None, num_processes: int = 1) -> None:
        self.config = config
        self.step_sink = step_sink
        self.num_processes = num_processes
        self.active = False
        self.steps = 0  # engine steps in the current trace
        self.last_run: str | None = None

    def start(self) -> str:
        """Start a trace; returns the directory it is written under."""
        if self.active:
            raise ProfilerError("a trace is already running (POST /stop_profile ends it)")
        out = process_dir(self.config.profiler_dir, 0, self.num_processes)
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise ProfilerError(f"cannot write traces under {out}: {e}") from None
        import jax

        if self.step_sink is not None:
            self.step_sink(PROFILE_OP, ("start", self.config.profiler_dir, dataclasses.asdict(self.config)))
        jax.profiler.start_trace(out, create_perfetto_trace=self.config.create_perfetto_trace,
                                 profiler_options=self.config.options())
        self.active, self.steps = True, 0
        logger.info("profiler: tracing into %s%s", out,
                    f" (stops by itself after {self.config.max_steps} engine steps)" if self.config.max_steps else "")
        return out

    def stop(self) -> str | None:
        """End the trace; returns the run directory JAX wrote (process 0's)."""
        if not self.active:
            raise ProfilerError("no trace is running (POST /start_profile starts one)")
        self.active = False
        import jax

        jax.profiler.stop_trace()
        if self.step_sink is not None:
            self.step_sink(PROFILE_OP, ("stop", None, None))  # (after the leader's own stop: the same steps)
        self.last_run = latest_run(process_dir(self.config.profiler_dir, 0, self.num_processes))
        logger.info("profiler: %d engine steps traced into %s", self.steps, self.last_run)
        return self.last_run

    def after_step(self) -> None:
        """Count a traced step; end the trace at `max_steps`."""
        if not self.active:
            return
        self.steps += 1
        if self.config.max_steps and self.steps >= self.config.max_steps:
            self.stop()


def follow(action: str, profiler_dir: str | None, config: dict | None, process_id: int, num_processes: int) -> None:
    """A follower's side of the leader's start / stop (serving/multihost/follower.py); `config`:
    the leader's `ProfilerConfig` as a dict."""
    import jax

    if action == "start":
        cfg = ProfilerConfig(**config)
        out = process_dir(profiler_dir, process_id, num_processes)
        os.makedirs(out, exist_ok=True)
        jax.profiler.start_trace(out, create_perfetto_trace=cfg.create_perfetto_trace, profiler_options=cfg.options())
        logger.info("process %d: profiler tracing into %s", process_id, out)
    elif action == "stop":
        jax.profiler.stop_trace()
        logger.info("process %d: profiler trace written", process_id)
    else:
        raise ValueError(f"unknown profiler action {action!r}")
