"""Device meshes for GLM-5.3 serving and the logical roles that model code uses instead of axes.

Physical mesh axes (docs/design.md §7): `dp` (attention replicas with their own requests and caches),
`pcp` (prefill context parallel: a prompt's tokens split across devices) and `tp` (tensor
parallel: attention heads and MLP columns). Expert parallelism and decode context parallelism add
no devices: EP spreads the routed experts over every device of the mesh (vLLM: EP size = DP × PCP
× TP), and DCP shards the KV cache round-robin by token over the devices of one attention group —
the TP devices, the PCP devices, or TP × PCP.

Model code never names `dp`/`pcp`/`tp`; it names a role (`TOKENS`, `ATTN_HEADS`, ...) and
`ParallelLayout.spec(...)` turns roles into a `PartitionSpec`. A new layout is an edit of
`ParallelLayout.role_axes`, not of the model.

Roles:
  TOKENS       the flat token axis of a step: split over DP replicas, then PCP ranks.
  REQUESTS     request rows (block tables): split over DP replicas only.
  ATTN_HEADS   attention heads (q_b_proj columns, W_UK/W_UV heads, o_proj rows): TP.
  MLP_COLS     dense/shared-expert intermediate columns: TP.
  VOCAB        lm_head columns: TP.
  EXPERTS      routed experts: every axis under EP, else none.
  EXPERT_COLS  routed-expert intermediate columns: TP without EP, else none.
  KV_CONTEXT   the token-interleaved DCP shard of the KV cache: the DCP axes (or none).
  KV_REPLICA   the per-replica KV arenas: DP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

AXES = ("dp", "pcp", "tp")

TOKENS = "tokens"
REQUESTS = "requests"
ATTN_HEADS = "attn_heads"
MLP_COLS = "mlp_cols"
VOCAB = "vocab"
EXPERTS = "experts"
EXPERT_COLS = "expert_cols"
KV_CONTEXT = "kv_context"
KV_REPLICA = "kv_replica"
ROLES = (TOKENS, REQUESTS, ATTN_HEADS, MLP_COLS, VOCAB, EXPERTS, EXPERT_COLS, KV_CONTEXT, KV_REPLICA)

DCP_COMM_BACKENDS = ("ag_rs", "a2a")


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel sizes, named like vLLM's flags.

    tensor_parallel_size (--tensor-parallel-size), data_parallel_size (--data-parallel-size),
    prefill_context_parallel_size (--prefill-context-parallel-size),
    decode_context_parallel_size (--decode-context-parallel-size; must equal the TP size or the
    PCP size: the KV is sharded over those devices), enable_expert_parallel
    (--enable-expert-parallel), dcp_comm_backend (--dcp-comm-backend: "ag_rs" all-gather +
    reduce-scatter, or "a2a" all-to-all), dcp_kv_cache_interleave_size
    (--dcp-kv-cache-interleave-size: token t lives on DCP rank `(t // I) % N`; must divide 64).

    The decode context parallel size must be the TP size, the PCP size or TP × PCP (the attention
    group the KV is sharded over); when TP == PCP == DCP the KV is sharded over TP.

    Raises ValueError (naming the flag) for sizes < 1, an unknown backend, a DCP size that matches
    no attention group, or an interleave that does not divide 64.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    dcp_comm_backend: str = "ag_rs"
    dcp_kv_cache_interleave_size: int = 1

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size", "prefill_context_parallel_size",
                     "decode_context_parallel_size", "dcp_kv_cache_interleave_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dcp_comm_backend not in DCP_COMM_BACKENDS:
            raise ValueError(f"--dcp-comm-backend must be one of {DCP_COMM_BACKENDS}, got {self.dcp_comm_backend!r}")
        dcp, tp, pcp = self.decode_context_parallel_size, self.tensor_parallel_size, self.prefill_context_parallel_size
        if dcp > 1 and dcp not in (tp, pcp, tp * pcp):
            raise ValueError(
                f"--decode-context-parallel-size {dcp} must equal the tensor parallel size ({tp}), the prefill "
                f"context parallel size ({pcp}) or their product ({tp * pcp}): the KV is sharded over the devices "
                "of one attention group")
        if 64 % self.dcp_kv_cache_interleave_size:
            raise ValueError(f"--dcp-kv-cache-interleave-size must divide 64, got {self.dcp_kv_cache_interleave_size}")

    @property
    def num_devices(self) -> int:
        return self.data_parallel_size * self.prefill_context_parallel_size * self.tensor_parallel_size

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"dp": self.data_parallel_size, "pcp": self.prefill_context_parallel_size,
                "tp": self.tensor_parallel_size}

    def describe(self) -> str:
        """One line for the start-up log, e.g. "DP 1 x PCP 2 x TP 1 = 2 devices, DCP 2 over PCP (ag_rs),
        EP off"."""
        line = (f"DP {self.data_parallel_size} x PCP {self.prefill_context_parallel_size} x TP "
                f"{self.tensor_parallel_size} = {self.num_devices} devices")
        if self.decode_context_parallel_size > 1:
            over = " x ".join(a.upper() for a in self.kv_context_axes)
            line += (f", DCP {self.decode_context_parallel_size} over {over} ({self.dcp_comm_backend}, interleave "
                     f"{self.dcp_kv_cache_interleave_size})")
        return line + f", EP {'on' if self.enable_expert_parallel else 'off'}"

    @property
    def kv_context_axes(self) -> tuple[str, ...]:
        """Mesh axes the KV cache is token-sharded over (DCP); TP wins when TP == PCP == DCP."""
        dcp = self.decode_context_parallel_size
        if dcp == 1:
            return ()
        if dcp == self.tensor_parallel_size:
            return ("tp",)
        return ("pcp",) if dcp == self.prefill_context_parallel_size else ("pcp", "tp")


def make_mesh(config: ParallelConfig, devices=None) -> Mesh:
    """A mesh with axes ("dp", "pcp", "tp") of the config's sizes over `devices` (default: the
    first `config.num_devices` of `jax.devices()`, which spans processes under jax.distributed).

    TP is the fastest-varying axis, so TP groups are neighbouring devices (one NVLink island on a
    node). Raises ValueError when there are too few devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = config.num_devices
    if len(devices) < n:
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} (set before JAX starts) "
                    f"simulates {n} devices")
        raise ValueError(f"the parallel layout needs {n} devices (dp × pcp × tp), only {len(devices)} available{hint}")
    sizes = config.axis_sizes
    arr = np.asarray(devices[:n], dtype=object).reshape(tuple(sizes[a] for a in AXES))
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def make_abstract_mesh(config: ParallelConfig) -> AbstractMesh:
    """A device-free mesh with the axes and sizes `make_mesh` would give (`jax.sharding.AbstractMesh`):
    enough for roles, `PartitionSpec`s, `NamedSharding.shard_shape` and memory planning of a layout
    larger than the machine (an 8-device layout on one CPU); not for placing arrays."""
    sizes = config.axis_sizes
    return AbstractMesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


@dataclass(frozen=True)
class ParallelLayout:
    """A mesh plus the role → axes table. Hashable (a static argument of jitted steps).

    Build with `ParallelLayout.create(config)` or `ParallelLayout(config, make_mesh(config))`;
    `ParallelLayout.abstract(config)` gives the same roles, sizes and specs without devices.
    """

    config: ParallelConfig
    mesh: Mesh | AbstractMesh = field(compare=True)

    @classmethod
    def create(cls, config: ParallelConfig | None = None, devices=None, **sizes) -> "ParallelLayout":
        """`ParallelLayout.create(ParallelConfig(...))` or `ParallelLayout.create(tensor_parallel_size=2)`."""
        config = config or ParallelConfig(**sizes)
        return cls(config, make_mesh(config, devices))

    @classmethod
    def abstract(cls, config: ParallelConfig | None = None, **sizes) -> "ParallelLayout":
        """The layout over `make_abstract_mesh(config)`: `size`, `spec`, `sharding(...).shard_shape`
        work on any machine (no devices needed); `constrain` and `device_put` need a real mesh."""
        config = config or ParallelConfig(**sizes)
        return cls(config, make_abstract_mesh(config))

    # ------------------------------------------------------------------ roles
    @property
    def role_axes(self) -> dict[str, tuple[str, ...]]:
        """Role → mesh axes (a tuple, possibly empty = replicated)."""
        c = self.config
        ep = c.enable_expert_parallel
        return {
            TOKENS: ("dp", "pcp"),
            REQUESTS: ("dp",),
            ATTN_HEADS: ("tp",),
            MLP_COLS: ("tp",),
            VOCAB: ("tp",),
            EXPERTS: AXES if ep else (),
            EXPERT_COLS: () if ep else ("tp",),
            KV_CONTEXT: c.kv_context_axes,
            KV_REPLICA: ("dp",),
        }

    def axes(self, *roles: str | None) -> tuple[str, ...]:
        """The mesh axes of one or several roles, in order, duplicates removed."""
        out: list[str] = []
        table = self.role_axes
        for r in roles:
            if r is None:
                continue
            if r not in table:
                raise KeyError(f"unknown sharding role {r!r}; roles are {ROLES}")
            out.extend(a for a in table[r] if a not in out)
        return tuple(out)

    def size(self, *roles: str | None) -> int:
        """Number of shards a dimension with these roles is split into."""
        return math.prod(self.mesh.shape[a] for a in self.axes(*roles))

    def spec(self, *dims) -> PartitionSpec:
        """PartitionSpec with one entry per array dimension; each entry is a role, a tuple of roles
        (combined, in order) or None (replicated)."""
        entries = []
        for d in dims:
            roles = d if isinstance(d, tuple) else (d,)
            axes = self.axes(*roles)
            entries.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        return PartitionSpec(*entries)

    def sharding(self, *dims) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*dims))

    def constrain(self, x: jax.Array, *dims) -> jax.Array:
        """`with_sharding_constraint` by roles (inside jit)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(*dims))

    # ------------------------------------------------------------------ sizes
    @property
    def dp(self) -> int:
        return self.config.data_parallel_size

    @property
    def pcp(self) -> int:
        return self.config.prefill_context_parallel_size

    @property
    def tp(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.config.decode_context_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.config.num_devices == 1


def single_device_layout(device=None) -> ParallelLayout:
    """The trivial layout (every role replicated) on one device."""
    return ParallelLayout.create(ParallelConfig(), devices=[device or jax.devices()[0]])


def constrain(x: jax.Array, layout: ParallelLayout | None, *dims) -> jax.Array:
    """`layout.constrain(x, *dims)`, or `x` unchanged when there is no layout (one device)."""
    if layout is None or layout.is_single_device:
        return x
    return layout.constrain(x, *dims)
