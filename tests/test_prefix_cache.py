"""The prefix cache's slots (prompt_cache.PromptCaches) on tiny models: a new conversation that
begins as a kept one did takes a copy of that one's target caches and of its drafters
(Drafter.branch), for every built-in drafter kind, reads only what it does not share, and
decodes plain decoding's tokens; the conversation it was copied from goes on unchanged."""

import pytest

from mlx_eagle.decoder import SpeculativeDecoder
from mlx_eagle.prompt_cache import PromptCaches
from mlx_eagle.drafters import Drafter
from mlx_eagle.drafters.composite import Composite
from mlx_eagle.drafters.dflash import DFlashDrafter, load as load_dflash
from mlx_eagle.drafters.draft_model import DraftModelDrafter
from mlx_eagle.drafters.eagle import EagleDrafter
from mlx_eagle.drafters.lookup import LookupDrafter
from mlx_eagle.heads import new_head
from mlx_eagle.plan import FreshPerConversation
from mlx_eagle.trees import parse_tree
from mlx_eagle.verify import Sampling
from checkpoints import tiny_target, write_dflash
from plain import plain_tokens

SHARED = [5, 17, 33, 5, 17, 60, 2, 9, 41, 17, 5, 17, 33, 8, 8, 12, 40, 41, 17, 5, 17, 33]  # a "system prompt"
FIRST, SECOND = SHARED + [70, 71, 5, 17], SHARED + [90, 5, 17, 33]


def flat(tokens: int) -> float:
    return 1.0


def drafters(target, tmp_path):
    """Every built-in kind, by name: a fresh one for each call."""
    write_dflash(tmp_path / "dflash", target, [1, 3])
    dflash = load_dflash(tmp_path / "dflash", target)
    head = new_head(target, "eagle3", seed=3)
    return {
        "eagle head": lambda: EagleDrafter(head, target, parse_tree("static:default")),
        "dflash": lambda: DFlashDrafter(dflash, target, flat),
        "draft model": lambda: DraftModelDrafter(target, flat, 0.0, max_tokens=4),
        "lookup": lambda: LookupDrafter(flat),
        "head and lookup": lambda: Composite([EagleDrafter(head, target, parse_tree("chain:3")), LookupDrafter(flat)]),
    }


def decode(target, slot, prompt, count):
    decoder = SpeculativeDecoder(target, slot.drafter, Sampling(), cache=slot)
    tokens = [decoder.prefill(prompt)]
    while len(tokens) < count:
        tokens += decoder.round(count - len(tokens)).tokens
    slot.drafter.finish()
    return tokens[:count], decoder.reused


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("kind", ["eagle head", "dflash", "draft model", "lookup", "head and lookup"])
def test_a_new_conversation_takes_a_copy_of_the_shared_beginning_and_its_drafters(target, tmp_path, kind):
    make = drafters(target, tmp_path)[kind]
    caches = PromptCaches(target, max_bytes=1 << 30)
    first = caches.take(FIRST)
    first.drafter = make()
    assert decode(target, first, FIRST, 24) == (plain_tokens(target, FIRST, 24), 0)

    second = caches.take(SECOND)
    assert second.drafter is not None and second.drafter is not first.drafter, "the drafters were copied"
    tokens, reused = decode(target, second, SECOND, 24)
    assert tokens == plain_tokens(target, SECOND, 24)
    assert reused >= len(SHARED) - 1, "the shared beginning was not read again"

    # The first conversation goes on from its own caches, untouched by the copy's rounds.
    continued = FIRST + plain_tokens(target, FIRST, 24) + [3, 4]
    again = caches.take(continued)
    assert again is first
    tokens, reused = decode(target, again, continued, 16)
    assert tokens == plain_tokens(target, continued, 16) and reused > len(FIRST)


def test_drafters_that_cannot_be_copied_start_fresh(target):
    """Your own drafter (fresh for every conversation), and any drafter without ``branch``."""
    assert Drafter().branch() is None
    made = []
    own = FreshPerConversation(lambda: made.append(Drafter()) or made[-1])
    twin = own.branch()
    assert twin.current is made[-1] and len(made) == 2
    assert Composite([LookupDrafter(flat), Drafter()]).branch() is None


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_a_hybrid_keeps_the_shared_beginning_for_the_next_conversations(name):
    """A recurrent state cannot be cut back to a shared beginning: the second conversation
    reads its prompt whole and keeps a copy of the caches where it leaves the first; the
    third starts from that copy (its drafters copied from the second's), and every reply
    is plain decoding's."""
    import hybrids
    from hybrids import text_model

    model = text_model(hybrids.build(name))
    head = new_head(model, "eagle3", seed=1)
    caches = PromptCaches(model, max_bytes=1 << 30)
    third = SHARED + [44, 45, 46, 5, 17]
    reused = []
    for prompt in (FIRST, SECOND, third):
        slot = caches.take(prompt)
        if slot.drafter is None:
            slot.drafter = Composite([EagleDrafter(head, model, parse_tree("chain:3")), LookupDrafter(flat)])
        tokens, count = decode(model, slot, prompt, 16)
        assert tokens == plain_tokens(model, prompt, 16)
        reused.append(count)
    assert reused[:2] == [0, 0] and reused[2] == len(SHARED) - 1
    assert caches.slots[1].beginning is caches.slots[2].beginning
    assert caches.slots[1].beginning.tokens == SHARED
