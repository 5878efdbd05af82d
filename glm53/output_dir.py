"""Where a checkpoint conversion may write: never over its own source.

`scripts/convert_checkpoint.py`, `scripts/quantize_checkpoint.py` and `glm53.orbax_checkpoint.save`
replace an existing output directory with `--overwrite` / `overwrite=True`. An output that is the
source, holds it, or lies inside it would delete the source (for GLM-5.3 a ≈ 700 GiB download),
so it is refused before anything is read or removed.
"""

from __future__ import annotations

import os


def check_output_dir(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = True) -> None:
    """Raise ValueError when `dst` is `src`, contains it, or lies inside it (symbolic links and
    relative paths resolved), or — with `overwrite` False — when it exists (the message names
    `--overwrite`, the scripts' flag)."""
    s, d = os.path.realpath(os.fspath(src)), os.path.realpath(os.fspath(dst))
    if d == s:
        raise ValueError(f"the output directory {dst} is the source checkpoint {src}: choose another directory")
    if os.path.commonpath([s, d]) == d:
        raise ValueError(f"the output directory {dst} contains the source checkpoint {src}, which replacing it "
                         "would delete: choose another directory")
    if os.path.commonpath([s, d]) == s:
        raise ValueError(f"the output directory {dst} is inside the source checkpoint {src}: choose a directory "
                         "outside it")
    if not overwrite and os.path.exists(d):
        raise ValueError(f"{dst} already exists (pass --overwrite to replace it)")
