"""`--attention-config '{"hisparse_config": {...}}'`: Hybrid HiSparse settings and their start-up checks.

Keys (the reference deployment's names where it has them):

* `host_pool_gib` (required, > 0): the host pool per data-parallel replica, GiB; rounded up to
  whole host blocks (one host block = one MLA page: 64 tokens of every sparse-MLA layer).
* `device_buffer_size`: hot-buffer rows of a decoding request (a multiple of 64 after rounding
  up); default `(num_speculative_tokens + 2) × index_topk`; at least
  `(num_speculative_tokens + 1) × index_topk` (every query row of a step may miss all of its
  top-k at once, and each miss needs its own slot).
* `prefill_buffer_size`: the most hot-buffer rows a request may lease while it prefills with
  pages off the device (its chunk of C query rows needs C × index_topk rows, or every off-device
  row of the request if that is fewer); default max(device_buffer_size, 16 × index_topk).
* `prefill_buffer_max_size`: the most hot-buffer rows a prefilling request's lease may grow to
  when nothing else needs the device pool (it is the only running request and none waits);
  default `prefill_buffer_size` (no growth). The lease takes free pages and the request's own
  clean pages beyond `prefill_buffer_size` (keeping the watermark and its chunk's pages free), and
  gives them back at the next step once another request runs or waits. It is the width of the
  per-request hot state on the device (every prefill step resolves over it).
* `host_gather`: "auto" (default; `kernels.host_rows.default_mechanism`), "memory_kind" (the pool
  is a `pinned_host` `jax.Array`, in-program slices) or "callback" (a numpy pool behind host
  callbacks).
* `watermark`: fraction of the device pool kept free under pressure (default 0.1): when fewer
  pages are free, running requests release clean pages (docs/design.md §6.1).
* `prefill_sizing`: how many query rows a prefill step of a request with pages off the device
  gets. "adaptive" (default): as many as the rows its queries actually select are expected to
  fit the lease (learnt per request from its previous steps); a step whose selections overflow
  the lease is kept up to its first query row with a dropped selection and the rest of the chunk
  is recomputed (docs/hisparse.md "Long prefills"). "worst_case": at most
  `prefill_buffer_size // index_topk` rows, which can never overflow.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from kernels.host_rows import MECHANISMS

GiB = 2**30
KEYS = ("host_pool_gib", "device_buffer_size", "prefill_buffer_size", "prefill_buffer_max_size", "host_gather",
        "watermark", "prefill_sizing")
PREFILL_SIZINGS = ("adaptive", "worst_case")


class HiSparseConfigError(ValueError):
    """A `hisparse_config` value this engine cannot serve; the message names the key."""


@dataclass(frozen=True)
class HiSparseConfig:
    """Parsed `hisparse_config` (see the module docstring). Sizes in rows are None until
    `resolve` fills the defaults."""

    host_pool_gib: float
    device_buffer_size: int | None = None
    prefill_buffer_size: int | None = None
    host_gather: str = "auto"
    watermark: float = 0.1
    prefill_sizing: str = "adaptive"
    prefill_buffer_max_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HiSparseConfig":
        """Parse the JSON object. Raises HiSparseConfigError naming the key."""
        if not isinstance(d, dict):
            raise HiSparseConfigError(f"--attention-config hisparse_config must be an object, got {d!r}")
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise HiSparseConfigError(f"--attention-config hisparse_config: unknown key(s) {unknown} "
                                      f"(known: {', '.join(KEYS)})")
        if "host_pool_gib" not in d:
            raise HiSparseConfigError("--attention-config hisparse_config needs host_pool_gib")
        gib = d["host_pool_gib"]
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
            raise HiSparseConfigError(f"hisparse_config.host_pool_gib must be a positive number, got {gib!r}")
        for key in ("device_buffer_size", "prefill_buffer_size", "prefill_buffer_max_size"):
            v = d.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise HiSparseConfigError(f"hisparse_config.{key} must be a positive integer (rows), got {v!r}")
        gather = d.get("host_gather", "auto")
        if gather not in ("auto", *MECHANISMS):
            raise HiSparseConfigError(f"hisparse_config.host_gather must be one of auto, {', '.join(MECHANISMS)}; "
                                      f"got {gather!r}")
        wm = d.get("watermark", 0.1)
        if isinstance(wm, bool) or not isinstance(wm, (int, float)) or not 0 <= wm < 1:
            raise HiSparseConfigError(f"hisparse_config.watermark must be in [0, 1), got {wm!r}")
        sizing = d.get("prefill_sizing", "adaptive")
        if sizing not in PREFILL_SIZINGS:
            raise HiSparseConfigError(f"hisparse_config.prefill_sizing must be one of {', '.join(PREFILL_SIZINGS)}; "
                                      f"got {sizing!r}")
        return cls(float(gib), d.get("device_buffer_size"), d.get("prefill_buffer_size"), gather, float(wm), sizing,
                   d.get("prefill_buffer_max_size"))

    def resolve(self, *, index_topk: int, tokens_per_page: int, num_speculative_tokens: int = 0,
                backend: str | None = None) -> "ResolvedHiSparse":
        """Defaults filled and checked against the model (rows rounded up to whole pages).

        Raises HiSparseConfigError: device_buffer_size below (num_speculative_tokens + 1) ×
        index_topk, prefill_buffer_size below device_buffer_size, or prefill_buffer_max_size
        below prefill_buffer_size."""
        from kernels.host_rows import default_mechanism

        k = index_topk
        tpp = tokens_per_page
        least = (num_speculative_tokens + 1) * k
        dec = self.device_buffer_size if self.device_buffer_size is not None else (num_speculative_tokens + 2) * k
        if dec < least:
            raise HiSparseConfigError(
                f"hisparse_config.device_buffer_size {dec} is below (num_speculative_tokens + 1) × index_topk = "
                f"{least} rows: every query row of a decode step can miss its whole top-k at once")
        dec = math.ceil(dec / tpp) * tpp
        pre = self.prefill_buffer_size if self.prefill_buffer_size is not None else max(dec, 16 * k)
        pre = math.ceil(pre / tpp) * tpp
        if pre < dec:
            raise HiSparseConfigError(f"hisparse_config.prefill_buffer_size {pre} is below device_buffer_size {dec}")
        grow = self.prefill_buffer_max_size if self.prefill_buffer_max_size is not None else pre
        grow = math.ceil(grow / tpp) * tpp
        if grow < pre:
            raise HiSparseConfigError(f"hisparse_config.prefill_buffer_max_size {grow} is below prefill_buffer_size "
                                      f"{pre}")
        mech = default_mechanism(backend) if self.host_gather == "auto" else self.host_gather
        return ResolvedHiSparse(self, dec, grow, mech, pre, least)


@dataclass(frozen=True)
class ResolvedHiSparse:
    """`HiSparseConfig` with its defaults filled: hot rows of a decoding request, the largest
    lease (grown into free pages: `prefill_buffer_max_size`, = the hot state width), the
    host-gather mechanism and the largest lease a prefilling request is sure of
    (`prefill_buffer_size`: what admission and the planner count)."""

    config: HiSparseConfig
    device_buffer_rows: int
    max_hot_rows: int
    mechanism: str
    prefill_hot_rows: int  # = max_hot_rows without growth
    # The fewest hot rows a decode step can be sure of, (num_speculative_tokens + 1) × index_topk:
    # the lease a request is squeezed to when the alternative is a preemption (docs/hisparse.md
    # "Squeezed leases"); None: device_buffer_rows.
    least_decode_rows: int | None = None

    def host_blocks(self, host_block_bytes: int) -> int:
        """Host-pool blocks for `host_pool_gib`, rounded up to whole blocks, plus the null block."""
        return math.ceil(self.config.host_pool_gib * GiB / host_block_bytes) + 1


def available_host_memory() -> int | None:
    """Bytes of host memory the OS reports available (MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_pool(num_host_blocks: int, host_block_bytes: int, max_model_len: int, tokens_per_page: int,
                    available: int | None = None, replicas: int = 1) -> None:
    """Start-up checks of the rounded pool (one per data-parallel replica: `replicas` of them).
    Raises HiSparseConfigError naming host_pool_gib when it cannot hold one --max-model-len
    request or the replicas' pools exceed the available host memory."""
    usable = num_host_blocks - 1
    need = math.ceil(max_model_len / tokens_per_page)
    size = usable * host_block_bytes * replicas
    if usable < need:
        raise HiSparseConfigError(
            f"hisparse_config.host_pool_gib holds {usable} host blocks ({usable * host_block_bytes / GiB:.3f} GiB), "
            f"fewer than the {need} blocks ({need * host_block_bytes / GiB:.3f} GiB) one --max-model-len {max_model_len} request "
            "needs")
    if available is None:
        available = available_host_memory()
    if available is not None and size > available:
        raise HiSparseConfigError(
            f"hisparse_config.host_pool_gib = {size / GiB:.3f} GiB after rounding"
            f"{f' (x {replicas} data-parallel replicas)' if replicas > 1 else ''} exceeds the "
            f"{available / GiB:.3f} GiB of host memory available")
