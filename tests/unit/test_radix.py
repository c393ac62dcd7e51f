import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_cache_server.prompt_cache.radix import (
    Node,
    PackedTokens,
    add_child,
    common_prefix_length,
    nearest,
    pack,
    split,
    unpack,
    walk,
)


def naive_lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_length_matches_naive(a, b):
    assert common_prefix_length(a, b) == naive_lcp(a, b)
    assert common_prefix_length(pack(a), pack(b)) // 4 == naive_lcp(a, b)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=600))
def test_pack_round_trips_at_any_length(seq):
    assert len(pack(seq)) == 4 * len(seq)
    assert unpack(pack(seq)) == seq


@pytest.mark.parametrize("bad", [[1, 2.5], [2**31], [-(2**31) - 1], [1, None], ["7"]])
def test_pack_refuses_what_is_not_an_int32_token(bad):
    with pytest.raises(ValueError, match="int32"):
        pack(bad)


@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300),
    st.integers(0, 700),
)
def test_packed_tokens_extend_and_cut_like_lists(a, b, n):
    packed = PackedTokens.of(a).extend(b)
    assert isinstance(packed, PackedTokens) and packed == pack(a + b)
    assert packed.n_tokens == len(a + b) and packed.tolist() == a + b
    assert packed.prefix(n) == pack((a + b)[:n]) and isinstance(packed.prefix(n), PackedTokens)


def test_packed_tokens_come_in_whole_tokens():
    with pytest.raises(ValueError, match="4-byte"):
        PackedTokens(b"abcde")
    with pytest.raises(ValueError, match="int32"):
        PackedTokens.of([1]).extend([2**31])


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40), st.data())
def test_walk_finds_the_common_prefix_of_any_tokens(seq, data):
    other = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40))
    query = seq[: data.draw(st.integers(0, len(seq)))] + other
    root = build(seq) if seq else Node(edge=b"")
    assert find(root, query).length == naive_lcp(seq, query)


def build(*seqs):
    root = Node(edge=b"")
    for seq in seqs:
        w = walk(root, pack(seq))
        parent = w.nodes[-1] if w.nodes else root
        if w.partial:
            parent = split(parent, w.length - parent.start)
        if w.length < len(seq):
            add_child(parent, pack(seq[w.length :]))
    return root


def find(root, seq):
    return walk(root, pack(seq))


def test_walk_exact_shorter_longer_and_miss():
    root = build([1, 2, 3, 4], [1, 2, 5])
    assert find(root, [1, 2, 3, 4]).length == 4
    assert not find(root, [1, 2, 3, 4]).partial
    w = find(root, [1, 2, 3, 4, 9])  # a stored sequence is a prefix
    assert w.length == 4 and not w.partial
    w = find(root, [1, 2, 3])  # cut inside the edge [3, 4]
    assert w.length == 3 and w.partial
    assert find(root, [7, 1]).length == 0 and find(root, [7]).nodes == []


def test_split_keeps_depths_and_children():
    root = build([1, 2, 3, 4, 5])
    (node,) = root.children.values()
    head = split(node, 2)
    assert head.tokens == [1, 2] and head.depth == 2 and head.parent is root
    assert node.tokens == [3, 4, 5] and node.depth == 5 and node.parent is head
    assert root.children[pack([1])] is head and head.children[pack([3])] is node
    assert find(root, [1, 2, 3, 4, 5]).nodes == [head, node]


def test_branching_creates_one_shared_prefix_node():
    root = build([1, 2, 3, 4], [1, 2, 9, 9], [1, 2, 3, 7])
    (shared,) = root.children.values()
    assert shared.tokens == [1, 2]
    assert sorted(c.tokens[0] for c in shared.children.values()) == [3, 9]
    assert sorted(c.tokens for c in shared.children[pack([3])].children.values()) == [[4], [7]]


def test_nearest_prefers_the_shallowest_match_across_branches():
    root = build([1, 2, 3, 4, 5, 6, 7], [1, 9])
    deep = find(root, [1, 2, 3, 4, 5, 6, 7]).nodes[-1]
    short = find(root, [1, 9]).nodes[-1]
    deep.terminal = short.terminal = True
    assert nearest(root, lambda n: n.terminal) is short
    short.terminal = False
    assert nearest(root, lambda n: n.terminal) is deep
    deep.terminal = False
    assert nearest(root, lambda n: n.terminal) is None
