"""A request as the runtime sees it: tokens, pages, sampling parameters and finish rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.vocabulary import FinishReason, finish_dead_end, finish_length, finish_stop
from pdserve.runtime.grammar.matcher import GrammarMatcher
from pdserve.runtime.request_state import RequestState, check_transition
from pdserve.sampling_params import SamplingParams

__all__ = ["Request", "RequestState"]


@dataclass
class Request:
    # The room id: the global id the gateway gives each leg (`room` on the wire, pdserve/protocol/
    # gateway.py; the offline engine makes its own). Never the client's `rid`, which stays in the gateway.
    room: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    # Tokens whose KV is in `pages` (prompt chunks done, then every token but the newest).
    num_computed: int = 0
    # Prompt tokens whose KV came from the prefix cache at admission (whole pages).
    cached_tokens: int = 0
    # Prompt logprobs from `params.logprob_start_len` on (prefill node; runtime/prompt_logprobs.py).
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_retractions: int = 0
    # The output constraint's matcher (runtime/grammar/), fed every appended token; None: free text.
    grammar: GrammarMatcher | None = None
    # False once its KV may mix weight versions (a weight update came while it lived, or its KV came
    # from a node on other weights), or when its request said so (GenerateRequest.use_prefix_cache: it
    # then reads no cached prefix either): its pages never enter a prefix cache.
    kv_cacheable: bool = True
    _state: RequestState = field(default=RequestState.QUEUED, init=False)

    @property
    def state(self) -> RequestState:
        return self._state

    @state.setter
    def state(self, new: RequestState) -> None:
        self.transition(new)

    def transition(self, new: RequestState) -> None:
        """Move to `new`; raises IllegalTransition for a move the table in request_state.py lacks.

        Assigning `state` does the same: there is no unchecked way to change it."""
        check_transition(self.room, self._state, new)
        self._state = new

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def newest_logprobs(self, n: int) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
        """(logprobs, top logprobs) of the newest `n` output tokens as an output reports them: None for
        what the request did not ask for (the prefill's first token and the decode's steps alike)."""
        p = self.params
        want = p.logprobs or p.top_logprobs_num > 0
        lps = self.output_logprobs[-n:] if want and n and self.output_logprobs else None
        tops = (
            self.output_top_logprobs[-n:] if p.top_logprobs_num and n and self.output_top_logprobs else None
        )
        return lps, [list(t) for t in tops] if tops is not None else None

    def append_token(
        self, token: int, logprob: float | None = None, top: list[tuple[int, float]] | None = None
    ) -> bool:
        """Add a generated token; returns True when it finishes the request."""
        self.output_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        p = self.params
        if self.grammar is not None:
            if not self.grammar.accept(token):
                # Only reachable when the mask allowed nothing: the grammar has no way forward.
                self.finish_reason = finish_dead_end()
                return True
            if self.grammar.is_terminated():  # the grammar's end (its stop token) ends it like EOS
                self.finish_reason = finish_stop(token)
                return True
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish_reason = finish_stop(token)
        elif len(self.output_ids) >= p.max_new_tokens:
            self.finish_reason = finish_length(len(self.output_ids))
        return self.finished
