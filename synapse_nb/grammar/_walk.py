"""The one Numba kernel of the grammar matcher: a pass over a vocabulary's token trie.

Nodes are numbered so that a node's parent has a smaller number; node_state[i] is the grammar
state after the code points on the path to node i: trans[node_state[parent], cls[i]], with -1 a
dead state (no stack survives) and -2 a transition not computed yet. Such (state, class) pairs
are listed for the caller (Python computes them and runs the pass again).
"""

from numba import njit


@njit(cache=True)
def walk(parent, cls, trans, root_state, node_state, pending, miss_s, miss_c):
    """Fill node_state; returns (number of nodes whose state is unknown, number of missing
    (state, class) pairs written to miss_s / miss_c, at most their length)."""
    n = parent.shape[0]
    node_state[0] = root_state
    n_unknown = 0
    n_miss = 0
    cap = miss_s.shape[0]
    for i in range(1, n):
        ps = node_state[parent[i]]
        if ps < 0:
            node_state[i] = ps
            if ps == -2:
                n_unknown += 1
            continue
        c = cls[i]
        t = trans[ps, c]
        if t == -2:
            n_unknown += 1
            if pending[ps, c] == 0 and n_miss < cap:
                pending[ps, c] = 1
                miss_s[n_miss] = ps
                miss_c[n_miss] = c
                n_miss += 1
        node_state[i] = t
    return n_unknown, n_miss


@njit(cache=True)
def gather(node_state, end_node, out):
    for t in range(end_node.shape[0]):
        e = end_node[t]
        out[t] = node_state[e] if e >= 0 else -1
    return out
