"""vLLM's ``ExampleConnector`` without its short-prompt bug: the KV connector of
``eldr cluster`` and the end-to-end tests (the CPU stand-in for NIXL).

vLLM 0.32's ``ExampleConnector`` keys a prompt's stored KV by the hash of a block-aligned
prefix, but computes that prefix two different ways (docs/failures.md, "The CPU
connector's short-prompt bug"):

- on lookup (``get_num_new_matched_tokens``, ``_found_match_for_prompt``) as
  ``align_to_block_size(n - 1, b)`` = ``(n - 2) // b * b``: −b for a one-token prompt, so
  the engine is told −b tokens are already computed and its worker dies in
  ``_prepare_inputs`` (``IndexError``), taking the whole engine down;
- on save and load (``ReqMeta.make_meta``) as ``(n - 1) // b * b``: 0 for every prompt of at
  most one block, all of which are stored under one key (the hash of no tokens) with no KV
  in it; a prompt of ``k·b + 1`` tokens looks up another key than the one it was stored
  under.

:class:`EldrExampleConnector` uses one rule for all three,
:func:`eldr.deploy.local.kv_prefix_tokens`: the longest whole-block prefix that leaves at
least one token to compute, and nothing at all (no lookup, no store) for a prompt of at
most one block. It changes nothing else: same files, same store layout, same roles.

vLLM loads it by module path (``kv_connector_module_path``, see
:func:`eldr.deploy.local.connector_config`), in every engine process, from the
``PYTHONPATH`` that :func:`eldr.deploy.local.plugin_pythonpath` gives the engines. This
module imports vLLM and torch at import time: nothing else in eldr imports it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from vllm.logger import init_logger

from eldr.deploy.local import kv_prefix_tokens

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["EldrExampleConnector"]

logger = init_logger(f"vllm.{__name__}")  # vLLM's log configuration covers 'vllm.*' only


class EldrExampleConnector(ExampleConnector):
    """``ExampleConnector`` whose lookup, store and load all use
    :func:`~eldr.deploy.local.kv_prefix_tokens` (vLLM 0.32's disagree, and its lookup
    goes negative for a one-token prompt)."""

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load beyond the ``num_computed_tokens`` computed locally: the stored
        prefix less those, never negative, 0 when nothing is stored for the prompt (the
        scheduler adds the result to the request's computed tokens, so a negative count
        is what killed the stock connector's engines)."""
        prefix = kv_prefix_tokens(len(request.prompt_token_ids or []), self._block_size)
        if prefix <= num_computed_tokens or not self._found_match_for_request(request):
            return 0, False
        logger.info("External cache hit: %d tokens stored, %d computed locally",
                    prefix, num_computed_tokens)
        return prefix - num_computed_tokens, False

    def _found_match_for_prompt(self, prompt_token_ids: list[int],
                                mm_hashes: list[str]) -> bool:
        """Whether the prompt's prefix is stored, under the key its save used.

        The stock connector calls this for both the lookup and the decision to store (a
        prompt found is not stored again); a prompt with no whole-block prefix to store
        has nothing to find."""
        prefix = kv_prefix_tokens(len(prompt_token_ids), self._block_size)
        if prefix == 0:
            return False
        folder = self._generate_foldername_debug(
            torch.tensor(prompt_token_ids)[:prefix], mm_hashes, create_folder=False)
        return os.path.exists(folder)

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> ExampleConnectorMetadata:
        """The stock step's loads and stores, less the stores of no tokens.

        The stock connector stores every new prompt it did not find, a prompt of at most
        one block too: zero tokens under the hash of the empty prefix, a key every such
        prompt shares. Dropping those entries stores nothing for them. (A load of no
        tokens cannot occur: :meth:`get_num_new_matched_tokens` matched none.)"""
        meta = super().build_connector_meta(scheduler_output)
        meta.requests = [r for r in meta.requests if r.token_ids.numel() > 0]
        return meta
