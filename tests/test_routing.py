"""Where the router sends a prompt: the instance whose first token for it comes soonest."""

import pytest

from distserve.cluster.instance import InstanceInfo
from distserve.cluster.routing import InstanceState, Router
from distserve.core.config import EngineConfig
from distserve.core.errors import InstanceFailure
from distserve.core.role import Role

BLOCK = 16


def instance(name: str, load_tokens: int = 0, prefill_tokens: int = 0, num_blocks: int = 100) -> InstanceState:
    info = InstanceInfo(name, Role.COLOCATED, 1, 1, num_blocks, BLOCK, num_blocks, 0, 0, 0, 0, 0, 0, 0, None)
    return InstanceState(name, Role.COLOCATED, None, info, EngineConfig(), load_tokens, prefill_tokens)


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_a_prompt_goes_where_fewest_prompt_tokens_wait_not_where_load_is_least():
    # a decodes many requests (load 1200 tokens) but prefills nothing; b has one 500-token prompt left.
    a, b = instance("a", load_tokens=1200), instance("b", load_tokens=600, prefill_tokens=500)
    assert Router(BLOCK).pick_prefill([a, b], prompt(0, 300), 320) == (a, 300)
    # With as much to prefill on each, the less loaded one gets it.
    a.prefill_tokens = b.prefill_tokens
    assert Router(BLOCK).pick_prefill([a, b], prompt(0, 300), 320)[0] is b


def test_a_cached_prefix_counts_as_prefill_work_saved():
    router = Router(BLOCK)
    a, b = instance("a"), instance("b")
    assert router.pick_prefill([a, b], prompt(0, 160), 170) == (a, 160)
    a.prefill_tokens = 160
    # The same 160 tokens and 40 more: 10 blocks are cached at a, which has 160 + 40 to compute, against
    # b's 200.
    assert router.pick_prefill([a, b], prompt(0, 200), 210) == (a, 40)
    # A whole prompt sent before is computed again for its last token only.
    a.prefill_tokens = 0
    assert router.pick_prefill([a, b], prompt(0, 160), 170) == (a, 1)
    # Unless the queue there outweighs the prefix: b computes all 200, a's queue is 1000 tokens.
    a.prefill_tokens = 1000
    assert router.pick_prefill([a, b], prompt(0, 200), 210) == (b, 200)


def test_with_a_prefix_tier_a_prefix_sent_anywhere_counts_on_every_instance():
    router = Router(BLOCK)
    router.use_tier(capacity_blocks=12)
    a, b = instance("a"), instance("b")
    assert router.pick_prefill([a, b], prompt(0, 160), 170) == (a, 160)
    a.prefill_tokens = 160
    # Without the tier a would take it (40 to compute against 200); b reads the 10 blocks from the tier.
    assert router.pick_prefill([a, b], prompt(0, 200), 210) == (b, 40)
    # What a decode instance's answer filled is in the tier too.
    router.remember(instance("decode"), prompt(1000, 64))
    assert router.pick_prefill([a, b], prompt(1000, 80), 90) == (b, 16)
    # The tier holds 12 blocks: the first prompt's leading ones have gone; a's own cache still holds it.
    c = instance("c")
    assert router.pick_prefill([c], prompt(0, 160), 170) == (c, 160)
    assert router.pick_prefill([a], prompt(0, 160), 170) == (a, 1)


def test_an_instance_without_room_for_the_request_gets_it_only_when_none_has_room():
    full = instance("full", load_tokens=1500)  # 1600 tokens of KV
    busy = instance("busy", load_tokens=200, prefill_tokens=800)
    assert Router(BLOCK).pick_prefill([full, busy], prompt(0, 100), 200)[0] is busy
    busy.load_tokens = 1500
    assert Router(BLOCK).pick_prefill([full, busy], prompt(0, 100), 200)[0] is full


def test_a_chosen_instance_takes_the_prompt_and_an_empty_pool_is_a_failure():
    a, b = instance("a"), instance("b", prefill_tokens=5000)
    assert Router(BLOCK).pick_prefill([a, b], prompt(0, 100), 110, chosen=b) == (b, 100)
    with pytest.raises(InstanceFailure, match="no instance is available"):
        Router(BLOCK).pick_prefill([], prompt(0, 100), 110)


def test_what_other_api_servers_sent_counts_as_this_servers_own():
    # This server sent nothing to a; another server's requests there hold 900 tokens, 400 still to prefill.
    a, b = instance("a"), instance("b", load_tokens=300, prefill_tokens=100)
    assert Router(BLOCK).pick_prefill([a, b], prompt(0, 64), 80)[0] is a
    a.others_load_tokens, a.others_prefill_tokens = 900, 400
    assert Router(BLOCK).pick_prefill([a, b], prompt(0, 64), 80)[0] is b
    assert Router(BLOCK).pick_decode([a, b]) is b
    # Room counts them too: a holds 1600 tokens of the other's, too many for 100 more.
    a.others_load_tokens, a.others_prefill_tokens, b.prefill_tokens = 1550, 0, 1000
    assert Router(BLOCK).pick_prefill([a, b], prompt(0, 64), 100)[0] is b
