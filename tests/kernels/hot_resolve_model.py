"""A plain-Python model of the hot-buffer resolver contract (kernels/hot_resolve/reference.py's
docstring), written loop by loop for the tests: one batch row at a time, candidates in query-row
then top-k order, the LRU as a sorted list."""

from __future__ import annotations

from collections import Counter

import numpy as np


def resolve_model(topk, req_idx, block_table, host_table, hot_table, state_row, reset_from, host_row, rank,
                  num_host_blocks, tpp):
    """Same arguments as `hot_resolve_reference` (numpy arrays); batch rows must appear in
    non-decreasing token order. → (slots [T, K], [(host row, slot)] copies, (hits, misses,
    dropped), host_row, rank)."""
    topk = np.asarray(topk)
    T, K = topk.shape
    B, P = block_table.shape
    H = hot_table.shape[1]
    host_row = np.array(host_row, copy=True)
    rank = np.array(rank, copy=True)
    S, M = host_row.shape
    nhr = num_host_blocks * tpp
    slots = np.full((T, K), -1, np.int64)
    copies = []
    hits = misses = dropped = 0

    def hot_slot(b, j):
        return int(hot_table[b, j // tpp]) * tpp + j % tpp

    for b in range(B):
        toks = [t for t in range(T) if req_idx[t] == b]
        s = int(state_row[b])
        has = 0 <= s < S
        if has:
            st = [int(v) for v in host_row[s]]
            rk = [int(v) for v in rank[s]]
            usable = [j // tpp < H and hot_table[b, j // tpp] > 0 for j in range(M)]
            for j in range(M):
                if j >= reset_from[b] or not usable[j] or not tpp <= st[j] < nhr:
                    st[j] = -1
            count = Counter(v for v in st if v >= 0)
            st = [v if v < 0 or count[v] == 1 else -1 for v in st]
            where = {v: j for j, v in enumerate(st) if v >= 0}
        wanted: list[tuple[int, int, int]] = []  # (t, k, host row)
        order_rows: list[int] = []
        for t in toks:
            for k in range(K):
                p = int(topk[t, k])
                if p < 0 or p // tpp >= P:
                    continue
                i, o = divmod(p, tpp)
                if block_table[b, i] > 0:
                    slots[t, k] = int(block_table[b, i]) * tpp + o
                    continue
                hb = int(host_table[b, i])
                if not (has and 0 < hb and hb * tpp < nhr):
                    continue
                h = hb * tpp + o
                wanted.append((t, k, h))
                if h not in order_rows:
                    order_rows.append(h)
        if not has:
            continue
        hit_js = {where[h] for h in order_rows if h in where}
        miss_rows = [h for h in order_rows if h not in where]
        hits += len(hit_js)
        key = lambda j: (0 if st[j] < 0 else 1, rk[j], j)  # noqa: E731
        evict = sorted((j for j in range(M) if usable[j] and j not in hit_js), key=key)
        assigned = {}
        for n, h in enumerate(miss_rows):
            if n < len(evict):
                assigned[h] = evict[n]
                copies.append((h, hot_slot(b, evict[n])))
                misses += 1
            else:
                dropped += 1
        taken = evict[: len(assigned)]
        new_order = (evict[len(assigned):] + taken + sorted(hit_js, key=key)
                     + sorted((j for j in range(M) if not usable[j]), key=key))
        for h, j in assigned.items():
            st[j] = h
        for t, k, h in wanted:
            j = where.get(h, assigned.get(h))
            if j is not None:
                slots[t, k] = hot_slot(b, j)
        new_rank = [0] * M
        for n, j in enumerate(new_order):
            new_rank[j] = n
        host_row[s] = st
        rank[s] = new_rank
    return slots, copies, (hits, misses, dropped), host_row, rank
