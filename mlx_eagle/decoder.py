"""The decoding loop, draft -> verify -> accept, readable in one sitting.

State between rounds: the target's KV cache holds every committed token but the
last one, the *root*, which the target chose and which starts the next round. As
soon as the target commits tokens, the head reads their (feature, next token)
pairs into its cache and its output at the root grows the next round's tree: that
work is queued on the device before the round's tokens are handed out, so the
device drafts while the host streams them. Both caches live in a ``PromptCache``,
which a conversation keeps from turn to turn: a new prompt that begins with what
the caches hold is read from where they diverge.

One round: the context lookup's draft (see lookup.py) is grafted onto the head's
tree as one more branch; the target runs [root, tree] in one forward pass with a
tree mask; the longest agreeing path is accepted plus one bonus token from the
target; both caches keep only that path. The host waits for the device once per
round, for what the walk along the tree needs. Without a head the draft is a
chain, which needs no tree mask: the model's own forward pass verifies it where
target.py does not know the architecture, so any mlx-lm model can decode this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_lm_cache

from .errors import UserError
from .heads import Head
from .lookup import LookupDraft, LookupDrafter
from .target import (TargetOutput, check_target, drives, keep_cache_entries, lm_head, make_cache, target_forward,
                     tree_mask)
from .trees import DraftTree, TreeDrafter, TreeSpec
from .verify import Sampling, accept, sample

NO_TOKENS = mx.array([], dtype=mx.int32)


@dataclass
class PromptCache:
    """The target's and the draft head's KV caches, and the tokens they hold."""

    target: List
    draft: List
    tokens: List[int]  # committed tokens; the last (the root) is not in the target cache yet


def make_prompt_cache(model: nn.Module) -> PromptCache:
    """An empty cache for ``model``; pass it to every turn of one conversation."""
    return PromptCache(target=make_cache(model), draft=[mlx_lm_cache.KVCache()], tokens=[])


def common_prefix(a: List[int], b: List[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


@dataclass
class Round:
    tokens: List[int]  # the accepted draft tokens, then the bonus token
    drafted: int  # tree nodes the target verified


class SpeculativeDecoder:
    def __init__(self, target: nn.Module, head: Optional[Head], tree: TreeSpec,
                 sampling: Sampling, seed: Optional[int] = None, cache: Optional[PromptCache] = None,
                 lookup: Optional[LookupDrafter] = None):
        head = head if tree.kind != "none" else None
        if head is not None:
            check_target(target)
        # Verifying through target.py's compiled pieces where it knows the architecture;
        # any other mlx-lm model verifies chains through its own forward pass.
        self.drives_target = drives(target)
        self.target, self.head, self.sampling, self.lookup = target, head, sampling, lookup
        self.drafter = TreeDrafter(head, target, tree) if head is not None else None
        self.taps = head.taps(target.args.num_hidden_layers) if head is not None else None
        self.key = mx.random.key(seed) if seed is not None else None  # None: MLX's global generator
        self.state = cache if cache is not None else make_prompt_cache(target)
        self.target_cache, self.draft_cache = self.state.target, self.state.draft
        self.reused = 0  # prompt tokens the last prefill found already in the caches
        self.forwards = 0  # target forward passes, for tests and statistics
        self.root: Optional[int] = None
        self.drafted: Tuple[DraftTree, mx.array] = (DraftTree(), NO_TOKENS)  # the next round's head tree
        if not mlx_lm_cache.can_trim_prompt_cache(self.target_cache):
            raise UserError("this model's cache cannot be rewound, which speculative decoding needs; use mlx_lm")
        self.head_yield = 1.0  # tokens a round's head tree yields (running mean), for lookup's length

    @property
    def length(self) -> int:
        """Tokens committed so far, the root included."""
        return len(self.state.tokens)

    def _next_key(self) -> Optional[mx.array]:
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    def _choose(self, logits: mx.array) -> int:
        if self.sampling.greedy:
            return int(mx.argmax(logits).item())
        return int(sample(self.sampling.probabilities(logits), self._next_key()).item())

    def _forward(self, tokens: mx.array, positions, mask) -> TargetOutput:
        self.forwards += 1
        if not self.drives_target:  # only chains, starting where the cache ends: the model's own forward pass
            return TargetOutput(logits=self.target(tokens[None], cache=self.target_cache)[0], features=None)
        out = target_forward(self.target, tokens[None], self.target_cache, positions, mask, self.taps)
        return TargetOutput(logits=out.logits[0], features=out.features[0], hidden=out.hidden[0])

    def _reusable(self, prompt: List[int]) -> int:
        """How many leading prompt tokens the caches already hold; both caches are cut
        back to that. The head's entry at t pairs feature t with token t + 1, so it is
        still good only where token t + 1 is shared too."""
        common = common_prefix(self.state.tokens, prompt)
        draft_valid = min(self.draft_cache[0].offset, max(common - 1, 0))
        keep_cache_entries(self.draft_cache, draft_valid, [])
        # Never below draft_valid: the draft cache is never ahead of the target's.
        reuse = min(common, self.target_cache[0].offset, len(prompt) - 1)
        if self.head is not None:  # the head must read on from where its cache ends
            reuse = draft_valid
        keep_cache_entries(self.target_cache, reuse, [])
        return reuse

    def prefill(self, prompt: List[int], chunk: int = 512) -> int:
        """Read the prompt (what the caches do not already hold of it); returns the
        first generated token (the first root)."""
        self.reused = self._reusable(prompt)
        self.state.tokens = []  # until this returns, the caches hold nothing certain
        if self.head is None:  # as mlx-lm reads a prompt: only the last token's logits are computed
            for start in range(self.reused, len(prompt) - 1, chunk):
                self.forwards += 1
                self.target(mx.array([prompt[start:min(start + chunk, len(prompt) - 1)]]), cache=self.target_cache)
                mx.eval([layer_cache.state for layer_cache in self.target_cache])
            self.root = self._choose(self._forward(mx.array(prompt[-1:]), len(prompt) - 1, None).logits[-1])
        else:
            features = []
            for start in range(self.reused, len(prompt), chunk):
                block = prompt[start:start + chunk]
                out = self._forward(mx.array(block), start, "causal" if len(block) > 1 else None)
                features.append(out.features)
                mx.eval(out.features)  # the prompt's own logits are never needed: only the last
            self.root = self._choose(lm_head(self.target, out.hidden[-1]))
            self.drafted = self._draft(mx.concatenate(features), prompt[self.reused + 1:] + [self.root])
        self.state.tokens = list(prompt) + [self.root]
        if self.lookup is not None:
            self.lookup.index.reset(self.state.tokens)
        return self.root

    def _draft(self, features: mx.array, next_tokens: List[int]) -> Tuple[DraftTree, mx.array]:
        """The head reads the committed (feature, next token) pairs and grows the next
        round's tree, queued on the device; its tokens stay there."""
        tokens = mx.array(next_tokens)
        out = self.head.step(self.target, self.head.project(features)[None], tokens[None], self.draft_cache,
                             self.draft_cache[0].offset, "causal" if len(next_tokens) > 1 else None)
        tree, tokens = self.drafter.draft(out[:, -1], self.draft_cache, self.draft_cache[0].offset - 1)
        mx.async_eval(tokens)
        return tree, tokens

    def _head_tree(self, room: int) -> Tuple[DraftTree, mx.array]:
        """This round's head tree, no deeper than ``room``."""
        tree, tokens = self.drafted
        self.drafted = (DraftTree(), NO_TOKENS)
        if max(tree.depths, default=0) > room:  # near the end of the reply or the context: keep what fits
            tree = tree.shallower(room)
            tokens = tokens[:len(tree)]
        return tree, tokens

    def _graft_lookup(self, tree: DraftTree, tokens: mx.array, room: int) -> Tuple[LookupDraft, List[int], mx.array]:
        """The lookup draft for this round, grafted onto ``tree``: the draft, its nodes
        and the tree's tokens with it. Reads the head's tokens only when there is a
        draft to graft."""
        if self.lookup is None:
            return LookupDraft([], 0), [], tokens
        draft = self.lookup.propose(room, verified=1 + len(tree), expected=self.head_yield if len(tree) else 1.0)
        if not draft.tokens:
            return draft, [], tokens
        tree.tokens = tokens.tolist()
        nodes = tree.graft(draft.tokens)
        return draft, nodes, mx.array(tree.tokens, dtype=mx.int32)

    def _verify(self, tree: DraftTree, tokens: mx.array) -> TargetOutput:
        """The target's forward pass over [root, tree], appended to its cache."""
        start = self.target_cache[0].offset
        tokens = mx.concatenate([mx.array([self.root], dtype=mx.int32), tokens])
        if tree.is_chain():  # a chain is just a longer causal block
            return self._forward(tokens, start, "causal" if len(tree) else None)
        positions = start + mx.array([0] + tree.depths)
        return self._forward(tokens, positions, tree_mask(start, tree.ancestor_matrix()))

    def round(self, room: int) -> Round:
        """One round. ``room``: how many tokens past the root may still be produced.
        The host waits for the device once, in ``accept``."""
        committed, self.state.tokens = self.state.tokens, []  # an interrupted round leaves nothing certain
        tree, tokens = self._head_tree(room - 1)
        head_nodes = len(tree)
        lookup, lookup_nodes, tokens = self._graft_lookup(tree, tokens, room - 1)
        start = self.target_cache[0].offset
        out = self._verify(tree, tokens)
        verdict = accept(tree, tokens, out.logits, self.sampling, self._next_key())
        path, accepted, bonus = verdict.path, verdict.tokens, verdict.bonus
        kept = [0] + [n + 1 for n in path]
        keep_cache_entries(self.target_cache, start, kept)
        if lookup.tokens:
            self.lookup.record(lookup, common_prefix(path, lookup_nodes))
        if head_nodes:
            self.head_yield += 0.1 * (1 + sum(1 for n in path if n < head_nodes) - self.head_yield)
        if self.head is not None:
            self.drafted = self._draft(out.features[mx.array(kept)], accepted + [bonus])
        if self.lookup is not None:
            self.lookup.index.commit(accepted + [bonus])
        self.root = bonus
        self.state.tokens = committed + accepted + [bonus]
        return Round(tokens=accepted + [bonus], drafted=len(tree))
