"""Routing among engine replicas (``engine/replica_routing.py``): prefix affinity within a load margin,
sleepers and failed replicas avoided while another can serve. Plain ``Replica`` records, no processes."""

from agentjet_server.engine.replica_routing import BLOCK, REMEMBERED_BLOCKS, Replica, choose, prefix_blocks


def _replicas(n: int) -> list[Replica]:
    return [Replica(i, "cpu", state="ready") for i in range(n)]


def test_prefix_blocks_are_equal_exactly_for_equal_prefixes():
    a = list(range(100))
    b = a[:70] + [999] * 30
    assert prefix_blocks(a)[:2] == prefix_blocks(b)[:2] and prefix_blocks(a)[2] != prefix_blocks(b)[2]
    assert len(prefix_blocks(a)) == 100 // BLOCK and prefix_blocks(a[: BLOCK - 1]) == []


def test_a_prompt_goes_where_its_longest_prefix_was_seen_while_the_load_is_close():
    replicas = _replicas(3)
    episode = prefix_blocks(list(range(4 * BLOCK)))
    replicas[2].remember(episode[:2])
    replicas[1].remember(episode[:1])
    replicas[2].in_flight = 2  # within the margin (2) of the least loaded
    chosen = choose(replicas, episode, avoid=set())
    assert chosen is replicas[2] and chosen.in_flight == 3 and chosen.requests == 1
    assert chosen.matched(episode) == len(episode)  # it remembers the whole prompt now
    replicas[2].in_flight = 10  # far over the margin: the longest prefix among the others wins
    assert choose(replicas, episode, avoid=set()) is replicas[1]


def test_among_equal_prefixes_the_least_loaded_then_the_one_remembering_least_is_chosen():
    replicas = _replicas(2)
    replicas[0].remember(prefix_blocks(list(range(1000, 1000 + 3 * BLOCK))))
    fresh = prefix_blocks(list(range(5 * BLOCK)))
    assert choose(replicas, fresh, avoid=set()) is replicas[1]
    other = prefix_blocks(list(range(7000, 7000 + 2 * BLOCK)))
    assert choose(replicas, other, avoid=set()) is replicas[0]  # replica 1 has one in flight now


def test_sleepers_and_avoided_replicas_serve_only_when_no_other_is_ready():
    replicas = _replicas(2)
    replicas[0].asleep = True
    assert choose(replicas, [], avoid=set()) is replicas[1]
    assert choose(replicas, [], avoid={1}) is replicas[0]  # the only one not avoided, asleep or not
    replicas[1].state = "restarting"
    assert choose(replicas, [], avoid={0}) is replicas[0]  # avoided, but the only one ready
    replicas[0].state = "restarting"
    assert choose(replicas, [], avoid=set()) is None


def test_a_replica_forgets_its_oldest_blocks_first():
    replica = Replica(0, "cpu")
    replica.remember(list(range(REMEMBERED_BLOCKS)))
    replica.remember([0])  # seen again: the most recent now
    replica.remember([-1])
    assert len(replica.blocks) == REMEMBERED_BLOCKS
    assert 0 in replica.blocks and 1 not in replica.blocks and -1 in replica.blocks
