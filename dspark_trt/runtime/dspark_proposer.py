"""Drafting with a trained DSpark/DFlash drafter inside the step loop, batched over requests.

Per request the proposer keeps the drafter's *context*: for every backbone layer, the
keys/values of the fused target features of every position the target has committed. They
live in one `ContextPool` (a slot per request, like the target's KV pool) so that all
requests' blocks are drafted in one batched backbone pass:

    catch up: fuse the target features that arrived since this request last drafted and
              append their keys/values (skipped steps are caught up here, in one call)
    hidden = backbone([pending, MASK x (gamma-1)] at p .. p+gamma-1, context < p)   [N, gamma, d]
    U = hidden @ LM head (draft vocabulary)                                        [N, gamma, V_d]
    for k in 1..gamma:                      # the sequential head, left to right, batched over N
        p_k = softmax((U_k + B(x_{k-1})) / T)    x_k = argmax p_k  (T = 0)  or  x_k ~ p_k
        (with a prefix layer, U_k also gets + U(PrefixLayer.step(h_k, x_{k-1}, slots < k)))
        (with a copy bias, U_k also gets + alpha[k, n] on the token that followed the last n
         tokens earlier in the request: `models/copy_bias.py`, one `CopyIndex` per request)
    c = confidence(h, x_{0..gamma-1})                                              [N, gamma]
        (+ beta[k, n] where slot k had an n-gram copy candidate, + w[k] logit(max p_k): calibrated offsets)

With bf16 weights on a CPU where our kernels run, the catch-up and the backbone (with its LM
head) are one C call each (`_kernel_context`, `_kernel_backbone`), tested against the PyTorch
modules they replace (`_torch_context`, `_torch_backbone`). Wherever our kernels run, each slot's
Markov row, copy bias, argmax and top probability are one C call too (`cpu_kernels.draft_slot`),
bit-identical to the PyTorch ops it replaces (tested).

`observe` only queues features (cheap), so a step whose policy skips drafting costs the
drafter nothing; the queue is consumed before the request's next draft. The draft
distributions are returned over the full target vocabulary, so verification is exact.
"""

from __future__ import annotations

import torch

from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.copy_bias import BlockCopyBias, CopyIndex
from dspark_trt.models.drafter import TOP_PROBABILITY_LOGIT_CAP, DSparkDrafter, MarkovHead, top_probability_logit
from dspark_trt.models.linear import one_row_at_a_time
from dspark_trt.runtime.proposer import Draft, Proposer, draw_tokens, reads_draft_probs, to_target_vocab
from dspark_trt.runtime.sampling import greedy_tokens
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.threads import torch_on_calling_thread


class ContextCache:
    """Keys/values of one request's context, `[1, kv_heads, capacity, head_dim]` per layer
    (the EAGLE-style proposer keeps its per-request caches in these)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        count = per_layer[0][0].shape[2]
        for i, (k, v) in enumerate(per_layer):
            if self.keys[i] is None or self.length + count > self.keys[i].shape[2]:
                capacity = max(2 * (self.length + count), 64)
                grown_k = k.new_zeros(1, k.shape[1], capacity, k.shape[3])
                grown_v = torch.zeros_like(grown_k)
                if self.keys[i] is not None:
                    grown_k[:, :, : self.length] = self.keys[i][:, :, : self.length]
                    grown_v[:, :, : self.length] = self.values[i][:, :, : self.length]
                self.keys[i], self.values[i] = grown_k, grown_v
            self.keys[i][:, :, self.length : self.length + count] = k
            self.values[i][:, :, self.length : self.length + count] = v
        self.length += count

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values)]


class ContextPool:
    """Drafter context keys/values of every request: `[layers, slots, kv_heads, capacity, head_dim]`
    (the target's KV pool layout, so the C backbone pass reads it as it reads that one).

    Slots and capacity grow by doubling (copying) as requests arrive and contexts lengthen.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.keys = torch.zeros(num_layers, 0, num_kv_heads, 64, head_dim)
        self.values = torch.zeros_like(self.keys)
        self.lengths: list[int] = []
        self.slot_of: dict[str, int] = {}
        self.free: list[int] = []

    def slot(self, request_id: str) -> int:
        if request_id not in self.slot_of:
            if not self.free:
                old = len(self.lengths)
                self._grow(slots=max(2 * old, 4))
                self.free = list(range(len(self.lengths) - 1, old - 1, -1))
            slot = self.free.pop()
            self.slot_of[request_id] = slot
            self.lengths[slot] = 0
        return self.slot_of[request_id]

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.lengths[slot] = 0
            self.free.append(slot)

    def reserve(self, length: int) -> None:
        """Room for `length` positions in every slot."""
        if length > self.keys.shape[3]:
            self._grow(capacity=max(2 * self.keys.shape[3], length))

    def _grow(self, slots: int | None = None, capacity: int | None = None) -> None:
        layers, old_slots, kv_heads, old_capacity, head_dim = self.keys.shape
        slots, capacity = slots or old_slots, capacity or old_capacity
        for name in ("keys", "values"):
            grown = self.keys.new_zeros(layers, slots, kv_heads, capacity, head_dim)
            grown[:, :old_slots, :, :old_capacity] = getattr(self, name)
            setattr(self, name, grown)
        self.lengths.extend([0] * (slots - old_slots))

    def append(self, slot: int, per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append keys/values `[kv_heads, n, head_dim]` per layer at the end of `slot`'s context."""
        count = per_layer[0][0].shape[1]
        start = self.lengths[slot]
        self.reserve(start + count)
        for i, (k, v) in enumerate(per_layer):
            self.keys[i, slot, :, start : start + count] = k
            self.values[i, slot, :, start : start + count] = v
        self.lengths[slot] = start + count

    def gather(self, slots: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per-layer keys/values `[len(slots), kv_heads, max_len, head_dim]` and lengths `[len(slots)]`.

        Consecutive slots (the usual case: every running request drafts) are a view, no copy.
        """
        lengths = torch.tensor([self.lengths[s] for s in slots])
        max_len = max(int(lengths.max()), 1)
        if slots == list(range(slots[0], slots[0] + len(slots))):
            pick = slice(slots[0], slots[0] + len(slots))
        else:
            pick = torch.tensor(slots)
        views = [(self.keys[i, pick, :, :max_len], self.values[i, pick, :, :max_len]) for i in range(self.keys.shape[0])]
        return views, lengths


class MarkovRows:
    """The Markov head's bias `B(x) = W1[x] @ W2` `[V_d]` for each previous token x, kept once computed.

    B depends on the previous token alone, so it is a `[V_d + 1, V_d]` table. Computing a row
    reads all of W2 (`r x V_d`, 8 MB in fp32 at the defaults), which at gamma = 7 slots cost
    over 15% of a CPU draft; looking a row up reads 32 KB. The rows of the `warm_rows` most
    frequent tokens (the draft vocabulary is in frequency order) are computed up front in one
    GEMM, any other row alone on first use; either way a row's bits never depend on what else
    was drafted. The table is allocated empty, so the OS commits memory only for rows in use
    (32 KB each: 32 MB warm, at most 268 MB for 8,192 tokens). Assumes the drafter's weights
    do not change afterwards, as the context pool already does.
    """

    def __init__(self, drafter: DSparkDrafter, warm_rows: int = 1024):
        self.drafter = drafter  # rows come from its own head (`sequential_bias`), so they are its bias exactly
        vocab_size = drafter.draft_vocab.numel()
        self.rows = torch.empty(vocab_size + 1, vocab_size, dtype=drafter.sequential.w2.weight.dtype)  # [V_d + 1, V_d]
        warm = min(warm_rows, vocab_size + 1)
        with torch.no_grad():
            self.rows[:warm] = self._compute(torch.arange(warm))
        self.known: set[int] = set(range(warm))

    def _compute(self, previous_draft_ids: torch.Tensor) -> torch.Tensor:
        bias, _ = self.drafter.sequential_bias(None, previous_draft_ids)  # a Markov head ignores the hidden state
        return bias

    def ensure(self, previous_draft_ids: list[int]) -> torch.Tensor:
        """The table `[V_d + 1, V_d]`, its rows for `previous_draft_ids` computed. Call under
        no_grad/inference_mode (the proposer does)."""
        missing = sorted(set(previous_draft_ids) - self.known)
        if missing:
            with one_row_at_a_time():
                computed = self._compute(torch.tensor(missing))
            for index, row in zip(missing, computed):  # row copies: index_put into the table took ~0.5 ms each
                self.rows[index].copy_(row)
            self.known.update(missing)
        return self.rows


class DSparkProposer(Proposer):
    catches_up = True  # `observe` queues; `_catch_up` fuses what a request missed before its draft

    def __init__(self, drafter: DSparkDrafter):
        self.drafter = drafter.eval()
        config = drafter.config
        self.feature_layers = tuple(config.feature_layers)
        self.block_size = config.block_size
        self.has_confidence = drafter.confidence is not None
        self.pool = ContextPool(len(drafter.layers), config.num_kv_heads, config.head_dim)
        self.queued: dict[str, list[torch.Tensor]] = {}  # request id -> features not yet in the pool
        self.markov_rows = MarkovRows(drafter) if isinstance(drafter.sequential, MarkovHead) else None
        self.copy_indexes: dict[str, CopyIndex] = {}  # request id -> its n-gram lookup (with a copy bias)
        # list lookups, a few per request and slot: a PyTorch index costs more after a target step
        self.to_draft = drafter.to_draft.tolist()  # target id -> draft id (the vocabulary's size outside it)
        self.draft_vocab_list = drafter.draft_vocab.tolist()  # draft id -> target id

    def _head_bias(self, hidden: torch.Tensor, previous: torch.Tensor, state):
        """B_k `[N, V_d]` (or None without a head) and the RNN state; a Markov head's from its table."""
        if isinstance(self.drafter.sequential, MarkovHead):
            table = self._markov_table(previous.tolist())
            return table.index_select(0, previous), None  # 3x faster than table[previous] here
        return self.drafter.sequential_bias(hidden, previous, state)

    def _markov_table(self, previous_draft_ids: list[int]) -> torch.Tensor:
        """The Markov head's bias table `[V_d + 1, V_d]`, with the rows of `previous_draft_ids`."""
        if self.markov_rows is None:  # the head was attached after the proposer was built
            self.markov_rows = MarkovRows(self.drafter)
        return self.markov_rows.ensure(previous_draft_ids)

    @staticmethod
    def _top_probability_logit(logits: torch.Tensor) -> torch.Tensor:
        """`top_probability_logit` of logits `[N, gamma, V_d]` -> `[N, gamma]`: one C pass where our
        kernels run (PyTorch's ~8 ops over a block's logits took ~0.15 ms here), tested against it."""
        if logits.is_cpu and cpu_kernels.available():
            return cpu_kernels.top_probability_logit(logits, TOP_PROBABILITY_LOGIT_CAP)
        return top_probability_logit(logits)

    def observe(self, request: Request, features: torch.Tensor) -> None:
        """Queue the target features `[num_kept, m * d]` of the positions the last step kept for `request`."""
        if len(features):
            # Drafts on the CPU; `is_cpu` is an attribute, `.cpu()` a PyTorch call even when a no-op.
            self.queued.setdefault(request.request_id, []).append(features if features.is_cpu else features.cpu())

    def context_length(self, request_id: str) -> int:
        """Positions of this request's context the drafter has (in the pool or queued)."""
        slot = self.pool.slot_of.get(request_id)
        in_pool = self.pool.lengths[slot] if slot is not None else 0
        return in_pool + sum(f.shape[0] for f in self.queued.get(request_id, []))

    def release(self, request: Request) -> None:
        self.pool.release(request.request_id)
        self.queued.pop(request.request_id, None)
        self.copy_indexes.pop(request.request_id, None)

    def _copy_bias(self, requests: list[Request]) -> BlockCopyBias | None:
        """This block's copy bias (None without one), each request's lookup brought up to its
        committed tokens (prompt, then output: the pending token last)."""
        config = self.drafter.config
        if not config.copy_bias:
            return None
        indexes = []
        for request in requests:
            index = self.copy_indexes.setdefault(request.request_id, CopyIndex(config.copy_ngram))
            have, prompt = len(index.tokens), request.prompt_token_ids
            if have < len(prompt):
                index.extend(prompt[have:])
            index.extend(request.output_token_ids[max(have - len(prompt), 0) :])
            indexes.append(index)
        return BlockCopyBias(config.copy_bias, indexes, self.to_draft, self.drafter.draft_vocab.numel())

    @torch.inference_mode()
    def _catch_up(self, requests: list[Request]) -> None:
        """Fuse every queued feature of `requests` and append its keys/values, in one call."""
        pieces, positions, owners = [], [], []
        for request in requests:
            queued = self.queued.pop(request.request_id, [])
            if not queued:
                continue
            features = torch.cat(queued)
            slot = self.pool.slot(request.request_id)
            start = self.pool.lengths[slot]
            pieces.append(features)
            positions.append(torch.arange(start, start + features.shape[0]))
            owners.append((slot, features.shape[0]))
        if not pieces:
            return
        fused = self.drafter.kernel_context()
        if fused is not None:
            self._kernel_context(fused, torch.cat(pieces), torch.cat(positions), owners)
        else:
            self._torch_context(torch.cat(pieces), torch.cat(positions), owners)

    def _torch_context(self, features: torch.Tensor, positions: torch.Tensor, owners: list[tuple[int, int]]) -> None:
        """Features `[T, m * d]` of the `owners` (slot, count), in order, at `positions` `[T]`:
        fused into context states, and every layer's keys/values appended to the pool."""
        drafter = self.drafter
        context = drafter.fuse_features(features)  # [T, d]
        cos_table, sin_table = drafter.rope_table(int(positions.max()) + 1)  # the rows rope_tables computes
        cos, sin = cos_table[positions, None], sin_table[positions, None]  # [T, 1, head_dim]
        per_layer = drafter.context_keys_values_at(context, cos, sin)  # [kv, T, hd] each
        offset = 0
        for slot, count in owners:
            self.pool.append(slot, [(k[:, offset : offset + count], v[:, offset : offset + count]) for k, v in per_layer])
            offset += count

    def _kernel_context(self, fused, features: torch.Tensor, positions: torch.Tensor,
                        owners: list[tuple[int, int]]) -> None:
        """`_torch_context` as one C call that writes straight into the pool."""
        self.pool.reserve(int(positions.max()) + 1)
        cos, sin = self.drafter.rope_table(int(positions.max()) + 1)
        slots = torch.cat([torch.full((count,), slot) for slot, count in owners])
        fused.forward(features, slots, positions, cos, sin, self.pool.keys, self.pool.values)
        for slot, count in owners:
            self.pool.lengths[slot] += count

    def _torch_backbone(self, block: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `[N, gamma, d]` of the requests in `slots` -> hidden `[N, gamma, d]`, U `[N, gamma, V_d]`."""
        drafter, gamma = self.drafter, self.block_size
        context_kv, lengths = self.pool.gather(slots)
        max_len = context_kv[0][0].shape[2]
        # Block of request r at positions lengths[r] .. +gamma-1 (the pending token's position is
        # its context length); it sees its own context (< its length) and its whole block.
        positions = lengths[:, None] + torch.arange(gamma)  # [N, gamma]
        visible_context = torch.arange(max_len)[None] < lengths[:, None]  # [N, max_len]
        mask = torch.cat([visible_context[:, None].expand(-1, gamma, -1),
                          torch.ones(len(slots), gamma, gamma, dtype=torch.bool)], dim=-1)  # [N, gamma, ctx+gamma]
        hidden = drafter.backbone(block, positions, context_kv, mask)  # [N, gamma, d]
        return hidden, drafter.backbone_logits(hidden)

    def _kernel_backbone(self, fused, block: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`_torch_backbone` as one C pass: each block's keys/values are written into the pool
        just past its context (scratch: the context length does not move, so the next catch-up
        overwrites them), and every block token sees keys 0 .. length + gamma - 1 of its slot,
        i.e. its context and its whole block, as the torch path's mask says."""
        drafter, gamma = self.drafter, self.block_size
        num_requests, _, d = block.shape
        lengths = torch.tensor([self.pool.lengths[s] for s in slots])
        self.pool.reserve(int(lengths.max()) + gamma)
        positions = (lengths[:, None] + torch.arange(gamma)).reshape(-1)  # [N * gamma]
        visible = (lengths + gamma - 1).repeat_interleave(gamma)
        cos, sin = drafter.rope_table(int(positions.max()) + 1)
        hidden = torch.empty(num_requests, gamma, d)  # the final norm's output, which the LM head reads
        logits, _ = fused.forward(block.reshape(-1, d).contiguous(), self.pool.keys, self.pool.values,
                                  torch.tensor(slots).repeat_interleave(gamma), positions, cos, sin, (), None, visible,
                                  normed=hidden.view(-1, d))
        return hidden, logits.view(num_requests, gamma, -1)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        if not requests:
            return []
        self._catch_up(requests)
        drafter = self.drafter
        slots = [self.pool.slot(r.request_id) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: slots[i])  # slot order: contiguous views
        requests = [requests[i] for i in order]
        slots = [slots[i] for i in order]
        num_requests = len(requests)
        anchors = torch.tensor([r.pending_token for r in requests])
        block = drafter.block_inputs(anchors, (num_requests,))  # [N, gamma, d]
        fused = drafter.kernel_backbone()
        if fused is not None:
            hidden, backbone_logits = self._kernel_backbone(fused, block, slots)
        else:
            hidden, backbone_logits = self._torch_backbone(block, slots)
        # After a C call our kernels' workers hold the other cores for a moment: the block's small
        # ops stay on this thread (runtime/threads.py).
        with torch_on_calling_thread(fused is not None):
            blocks = self._draw_blocks(requests, slots, anchors, hidden, backbone_logits)
        drafts = [None] * num_requests
        for i, draft in zip(order, blocks):
            drafts[i] = draft
        return drafts

    def _draw_blocks(self, requests: list[Request], slots: list[int], anchors: torch.Tensor, hidden: torch.Tensor,
                     backbone_logits: torch.Tensor) -> list[Draft]:
        """The sequential head over each block, left to right, then its confidences: hidden
        `[N, gamma, d]` and backbone logits `[N, gamma, V_d]` of `requests` (in slot order) -> drafts.

        Where our kernels run, each slot's Markov row, copy bias, argmax and top probability are one
        C call (`cpu_kernels.draft_slot`): a draft follows a target step, which leaves the caches
        cold, and there each PyTorch op costs several times its warm ~10 us."""
        drafter, gamma = self.drafter, self.block_size
        num_requests = len(requests)
        in_kernel = (backbone_logits.is_cpu and backbone_logits.dtype == torch.float32
                     and backbone_logits.is_contiguous() and cpu_kernels.available())
        ids = torch.empty(gamma + 1, num_requests, dtype=torch.long)  # ids[k]: draft-vocab ids of x_{k-1}, x_0 the anchors
        id_rows = ids.numpy()  # the same memory: its rows read back as lists without a PyTorch op each
        id_rows[0] = [self.to_draft[r.pending_token] for r in requests]
        wants_top = drafter.confidence is not None and bool(drafter.config.confidence_top_prob)
        top = torch.empty(num_requests, gamma) if in_kernel and wants_top else None  # [N, gamma], filled slot by slot
        # The Markov head's rows go into the C call unless a prefix correction must come between them and the copy bias
        table_in_kernel = (in_kernel and isinstance(drafter.sequential, MarkovHead) and drafter.prefix is None
                           and drafter.sequential.w2.weight.dtype == torch.float32)
        if drafter.prefix is not None:  # block positions: each request's context length onwards
            lengths = torch.tensor([self.pool.lengths[s] for s in slots])
            cos_table, sin_table = drafter.rope_table(int(lengths.max()) + gamma)
        prefix_cache, previous_tokens = None, anchors  # the prefix layer's keys/values; target ids of x_{k-1}
        copy_bias = self._copy_bias(requests)
        samples = any(not r.params.greedy for r in requests)
        distributions, state = [], None
        for k in range(gamma):
            table = None
            if table_in_kernel:
                table = self._markov_table(id_rows[k].tolist())
            else:
                bias, state = self._head_bias(hidden[:, k], ids[k], state)
                if bias is not None:
                    backbone_logits[:, k].add_(bias)  # in place: U_k is not needed again
            if drafter.prefix is not None:  # U(h_k + correction) = U_k + U(correction): the LM head is linear
                rows = lengths + k
                correction, prefix_cache = drafter.prefix.step(
                    hidden[:, k], drafter.embed[previous_tokens], cos_table[rows][:, None, None],
                    sin_table[rows][:, None, None], prefix_cache)
                backbone_logits[:, k].add_(drafter.lm_head_logits(correction))
            if in_kernel:
                terms = copy_bias.terms(k) if copy_bias is not None else None
                cpu_kernels.draft_slot(backbone_logits, k, table, ids, terms, top, TOP_PROBABILITY_LOGIT_CAP)
            else:
                if copy_bias is not None:
                    copy_bias.add_to(backbone_logits[:, k], k)
                ids[k + 1] = greedy_tokens(backbone_logits[:, k])
            if samples:  # the rows that sample overwrite their argmax (a greedy block needs no distributions)
                _, probs = draw_tokens(backbone_logits[:, k], requests, k, drafter.draft_vocab, choice=ids[k + 1])
                distributions.append(probs)
            if drafter.prefix is not None:
                previous_tokens = drafter.draft_vocab[ids[k + 1]]
            if copy_bias is not None:
                copy_bias.advance([self.draft_vocab_list[i] for i in id_rows[k + 1].tolist()])
        previous_ids = ids[:-1].t()  # [N, gamma]: x_{k-1}
        # Confidences need only h_k and x_{k-1}: one batched call once the blocks are drafted.
        confidence = drafter.confidence_logits(hidden, previous_ids)
        if confidence is not None:  # what calibration learned the head cannot see (all known before x_k)
            if wants_top and top is None:
                # backbone_logits now holds each slot's final logits (every bias was added in place), so
                # p_k's top probability is read once for the whole block: one reduction, not gamma
                top = self._top_probability_logit(backbone_logits)
            confidence = drafter.confidence_offsets(confidence, top, copy_bias.candidates() if copy_bias else None)
        calibrated = drafter.calibrated_confidence(confidence) if confidence is not None else None
        tokens = [[self.draft_vocab_list[i] for i in row] for row in id_rows[1:].T.tolist()]  # [N][gamma] target ids
        sampled = samples and distributions[0] is not None  # a request reads distributions: every slot has them
        all_probs = torch.stack(distributions, 1) if sampled else None  # [N, gamma, V_d]

        drafts = []
        for i, request in enumerate(requests):
            full_probs = None
            if reads_draft_probs(request):  # verification compares them with the target's vocabulary
                full_probs = to_target_vocab(all_probs[i], drafter.draft_vocab, drafter.config.target_vocab_size)
            drafts.append(Draft(tokens[i], full_probs, None if calibrated is None else calibrated[i]))
        return drafts
