"""The KV arena's groups for each model preset and cache dtype, with and without the MTP layer:
layers, tokens per page and bytes per token of each group, and the page size (`glm53.kv_layout`).

    PYTHONPATH=. .venv/bin/python scripts/kv_layout_table.py > docs/results/kv_layout/groups.txt

With MTP speculation the MTP layer is one more layer of each group, so the groups' tokens per page
shift (every page is the same size in bytes); the widest page sets where a prefix-cache hit can end.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53.config import preset
from glm53.kv_layout import build_kv_layout


def table() -> list[str]:
    """One line per (preset, cache dtype, MTP), then one per group."""
    lines = []
    for name in ("tiny", "glm-5.3"):
        cfg = preset(name)
        for dtype in ("bfloat16", "fp8"):
            for with_mtp in (False, True):
                lay = build_kv_layout(cfg, dtype, with_mtp=with_mtp)
                lines.append(f"{name} {dtype} {'with MTP' if with_mtp else 'without MTP'}: page {lay.page_bytes:,} B")
                for g in lay.groups:
                    layers = sum(c.num_layers for c in g.components)
                    lines.append(f"  {g.name:<8} {layers:>3} layers  {g.tokens_per_page:>6,} tokens/page  "
                                 f"{g.bytes_per_token:>7,} B/token")
    return lines


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print("\n".join(table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
