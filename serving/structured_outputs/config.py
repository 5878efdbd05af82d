"""`--structured-outputs-config` (vLLM's flag and keys): the server-wide settings of structured
outputs.

    {"backend": "guidance", "disable_any_whitespace": false, "disable_additional_properties": false,
     "enable_in_reasoning": false}

backend: "auto" or "guidance" (llguidance, the only one here; xgrammar, outlines and
lm-format-enforcer are refused naming the key). disable_any_whitespace: JSON constraints without
free whitespace (compact separators) for every request. disable_additional_properties: objects of
JSON schemas that do not say `additionalProperties` get `false`. enable_in_reasoning: constrain
the reasoning block too (default: the constraint starts after `</think>` when a reasoning parser
runs and the prompt opens the block). A request's own `structured_outputs` options add to these.

precompile (this engine's key, not vLLM's): compile the step variants constrained steps run in a
background thread once the engine has compiled its buckets (`serving.runner_variants`), so the
first constrained request of a bucket does not stop the engine for a step compile. Default: on in
the server (`python -m serving.run`), off in the offline `LLM` (which compiles what its batch
needs, on first use).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


class StructuredOutputsConfigError(ValueError):
    """A bad `--structured-outputs-config`; the message names the key."""


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "guidance"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    enable_in_reasoning: bool = False
    precompile: bool | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> StructuredOutputsConfig:
        """Parse the flag's JSON object (None: the defaults). Raises StructuredOutputsConfigError
        naming an unknown key or a bad value."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise StructuredOutputsConfigError("--structured-outputs-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key, value in d.items():
            if key not in known:
                raise StructuredOutputsConfigError(
                    f"--structured-outputs-config: unknown key {key!r} (known: {', '.join(sorted(known))})")
            if key != "backend" and not isinstance(value, bool):
                raise StructuredOutputsConfigError(f"--structured-outputs-config: {key} must be true or false")
        backend = d.get("backend", "guidance")
        if backend not in ("auto", "guidance"):
            raise StructuredOutputsConfigError(
                f"--structured-outputs-config: backend {backend!r} is not available; this build uses llguidance "
                '("guidance" or "auto")')
        return cls(**{**d, "backend": "guidance"})
