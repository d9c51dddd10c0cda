"""Sampling and speculative verification: the one place these terms are defined.

- `SamplingParams`: what a request asks for (validated on construction).
- `target_probs`: logits -> the distribution a request samples from (temperature, top-k, top-p);
  a temperature below `GREEDY_BELOW` (0 included) is greedy and gives a point mass on the argmax.
- `target_logprobs`: the same distribution in log space, what a request reports as logprobs
  (OpenAI's `logprobs`; vLLM's "processed logprobs"). A greedy request reports the model's own
  distribution (temperature 1, no top-k/top-p): its point mass would say nothing but the argmax.
- `verify_draft`: the lossless speculative rule. Draft tokens `x_1..x_l` are checked against the
  target distributions `p_1..p_{l+1}`; token `x_k` is accepted with probability
  `min(1, p_k(x_k) / q_k(x_k))`; the first rejection is resampled from the normalised residual
  `max(p_k - q_k, 0)`; if all pass, a bonus token is sampled from `p_{l+1}`. A draft given as
  point masses (no `q`) has `q_k(x_k) = 1`. Under greedy decoding this reduces exactly to
  "accept the longest prefix that matches the target's argmax, then emit the argmax".

Every request owns a `torch.Generator`, so its random choices do not depend on what else is in
the batch.

A *seeded* sampled request goes further: its tokens do not depend on how many drafts were
verified either, so the same seed gives the same text under any policy, load or drafter (given
the same target logits). Its token at output position i is `argmax(logprobs_i + g_i)` (the
Gumbel-max trick: exactly a sample from `p_i`), with noise `g_i` a hash of (seed, i) and the token
id alone (`PositionNoise`, `gumbel_noise`); a constant shift of a row of `logprobs_i` changes no
argmax, so the tempered logits serve as well (`coupled_inputs`). Plain decoding emits that token;
verification (`verify_draft_coupled`) accepts a draft token iff it *is* that token and otherwise
emits it, so the output is the same function of the noise either way, hence lossless. The drafter proposes
`argmax(log q_i + g_i)` with the same noise, so it agrees with the target whenever q is close to
p (acceptance >= (1 - TV) / (1 + TV), against the 1 - TV of the rule above: the price of
reproducibility, paid only by seeded requests). The rejection rule's outputs, in contrast,
depend on which positions were drafted, which the load-aware policies decide from measured time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from dspark_trt.errors import InvalidRequestError

# Below this temperature sampling is greedy: logits / 1e-38 overflow float32 to inf, the softmax
# turns into NaN and every "sample" is the last vocabulary id. At 1e-5 a 1-logit gap is already
# e^100000 in probability, so greedy is the distribution such a temperature asks for. (vLLM's
# _SAMPLING_EPS is the same 1e-5.)
GREEDY_BELOW = 1e-5
# What `torch.Generator.manual_seed` takes: any signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The most alternatives a request may ask logprobs for at each position (OpenAI's chat limit).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # generation ends before the first stop string
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends at (and includes) any of these
    ignore_eos: bool = False
    # Logprobs of each generated token, with this many most likely alternatives (None: off).
    logprobs: int | None = None
    # Logprobs of each prompt token after the first, with this many alternatives (None: off).
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}",
                                          name)
        # max_tokens 0 only makes sense when the prompt itself is scored (lm-eval's loglikelihood).
        fewest = 0 if self.prompt_logprobs is not None else 1
        if (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                or self.max_tokens < fewest):
            wanted = ">= 1 (0 only with prompt_logprobs)" if fewest else ">= 0"
            raise InvalidRequestError(f"max_tokens must be an integer {wanted}, got {self.max_tokens!r}",
                                      "max_tokens")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not 0 <= self.temperature < math.inf):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                      "temperature")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequestError(f"seed must be a 64-bit integer, in [{SEED_MIN}, {SEED_MAX}]", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings", "stop")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be a list of token ids (integers >= 0)", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def seeded_sampling(self) -> bool:
        """Sampled with a seed: its tokens come from per-position noise (the module docstring)."""
        return self.seed is not None and not self.greedy

    def make_generator(self) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else random.getrandbits(63))
        return generator


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax `[n]` of `[n, vocab]` (the first maximum, as `torch.argmax`), through our
    CPU kernel where it runs: PyTorch's CPU argmax took ~0.6 ms over 8 rows of a 49k vocabulary
    here, more than a tenth of a verification step's sampling budget (measured)."""
    if logits.is_cpu and logits.dim() == 2 and logits.dtype == torch.float32:
        from dspark_trt.kernels import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.argmax(logits)
    return logits.argmax(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
               noise_key: int | None = None) -> int:
    """The token a request emits from its logits `[vocab]`: the argmax when greedy, else a sample
    (`coupled_token` with the position's noise key, for a seeded request)."""
    if params.greedy:
        return int(greedy_tokens(logits[None])[0])
    if noise_key is not None:
        scores, scale = coupled_inputs(logits[None], params)
        return coupled_token(scores[0], noise_key, scale)
    return sample(target_probs(logits[None], params)[0], generator)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits `[n, vocab]` -> sampling distributions `[n, vocab]` (float32, rows sum to 1)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, greedy_tokens(logits)[:, None], 1.0)
    probs = torch.softmax(_tempered_top_k(logits, params), dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(~_nucleus(probs, params.top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def target_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits `[n, vocab]` -> log of the distribution `target_probs` samples from `[n, vocab]`
    (float32; -inf where top-k or top-p leaves a token out), computed in log space so that
    unlikely tokens keep their value instead of underflowing. Greedy: the model's own
    distribution, `log_softmax(logits)` (see the module docstring)."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    tempered = _tempered_top_k(logits, params)
    logprobs = torch.log_softmax(tempered, dim=-1)
    if params.top_p < 1.0:
        keep = _nucleus(torch.softmax(tempered, dim=-1), params.top_p)  # the very tokens target_probs keeps
        kept_mass = torch.logsumexp(logprobs.masked_fill(~keep, float("-inf")), dim=-1, keepdim=True)
        logprobs = (logprobs - kept_mass).masked_fill(~keep, float("-inf"))
    return logprobs


def _tempered_top_k(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits divided by the temperature, -inf outside the top k (when top-k is on)."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens top-p keeps `[n, vocab]` (bool): the smallest most-likely prefix whose mass
    reaches top_p (the token that crosses it stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a distribution `[vocab]` (need not be normalised).

    Inverse-CDF sampling: the first token whose cumulative mass exceeds u * total. A
    zero-probability token is never chosen (its cumulative mass equals its predecessor's).
    ~14x faster than `torch.multinomial` over a 49k vocabulary on CPU (measured).
    """
    cdf = probs.cumsum(0)
    threshold = torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1]
    return min(int(torch.searchsorted(cdf, threshold, right=True)), probs.shape[0] - 1)


def verify_draft(draft_tokens: list[int], draft_probs: torch.Tensor | None, probs: torch.Tensor,
                 generator: torch.Generator, greedy: bool) -> tuple[int, int]:
    """Check a draft block against the target.

    draft_tokens: `[l]` proposed tokens. draft_probs: `[l, vocab]` the drafter's distributions,
    or None for point-mass drafts. probs: `[l + 1, vocab]` target distributions at the anchor and
    after each draft token; when `greedy`, only their argmax is read, so the target's logits
    serve as well (and skip building point masses). Returns (number of accepted draft tokens a,
    the token emitted after them: the correction at position a+1, or the bonus token when a == l).
    """
    if greedy:  # exact integer comparison, no floating-point acceptance test
        target_tokens = greedy_tokens(probs).tolist()
        for k, token in enumerate(draft_tokens):
            if token != target_tokens[k]:
                return k, target_tokens[k]
        return len(draft_tokens), target_tokens[len(draft_tokens)]

    for k, token in enumerate(draft_tokens):
        p = probs[k]
        q_token = 1.0 if draft_probs is None else float(draft_probs[k, token])
        p_token = float(p[token])
        # u < p/q  <=>  u * q < p (no division; q may be 0 for a token the drafter never proposes)
        u = float(torch.rand((), generator=generator))
        if u * q_token < p_token:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[k]).clamp_min_(0.0)
        mass = float(residual.sum())
        # mass == 0 only when p <= q everywhere, i.e. p == q, where rejection has probability 0;
        # guard against rounding anyway by falling back to p.
        return k, sample(residual / mass if mass > 0 else p, generator)
    return len(draft_tokens), sample(probs[len(draft_tokens)], generator)


# ---- seeded requests: one noise vector per output position ---------------------------------------


def mixed_seed(seed: int, index: int) -> int:
    """A 64-bit seed from `seed` and an index (splitmix64's finaliser), so that neighbouring seeds
    and indices give unrelated streams."""
    mixed = (seed + 0x9E3779B97F4A7C15 * (index + 1)) % 2**64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) % 2**64
    return mixed ^ (mixed >> 31)


def gumbel_noise(key: int, ids: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of token ids `[n]` under a 64-bit key -> `[n]` float64: the definition, which
    our CPU kernel computes in one vector pass (`kernels/cpu_kernels.c`, ~0.1 ms over a 49k
    vocabulary against ~1 ms for a seeded generator's float64 stream). A counter-based hash, so each
    token's noise is its own (the drafter's smaller vocabulary reads the target's values):
    h1 = fmix32(id ^ key_lo), h2 = fmix32(h1 ^ key_hi), h3 = fmix32(h2 + 0x9E3779B9) (murmur3's
    finaliser), u = ((h2 << 20 | h3 >> 12) + 1/2) / 2^52 in [2^-53, 1 - 2^-53], g = -log(-log u).
    52 bits reach g = 36.7: a token e^-36 below the top one can still be drawn."""
    mask = 0xFFFFFFFF

    def fmix32(h: torch.Tensor) -> torch.Tensor:  # uint32 arithmetic in int64 (products wrap; the low bits are exact)
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & mask
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & mask
        return h ^ (h >> 16)

    ids = ids.to(torch.int64) & mask
    h2 = fmix32(fmix32(ids ^ (key & mask)) ^ (key >> 32))
    h3 = fmix32((h2 + 0x9E3779B9) & mask)
    uniform = (((h2 << 20) | (h3 >> 12)).double() + 0.5) * 2.0**-52
    return uniform.log().neg_().log_().neg_()


class PositionNoise:
    """The noise keys of a seeded request's output positions: position i's Gumbel noise is
    `gumbel_noise(key(i), ids)`, a function of (seed, i) only, so the drafter and the verification
    read the same values whenever and in whatever order they ask."""

    def __init__(self, seed: int):
        self.seed = seed

    def key(self, position: int) -> int:
        return mixed_seed(self.seed, position)


def coupled_inputs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, float]:
    """What a seeded request's Gumbel-max reads at positions with logits `[n, vocab]`: (scores,
    scale) whose `scores * scale` is the log of the distribution it samples up to a constant per
    row, which the argmax does not see. Without top-k or top-p that is the raw logits and 1 /
    temperature (no log-softmax to compute: ~0.1 ms a row over the 49k vocabulary); with them, the
    log-probabilities (`target_logprobs`, -inf where they cut) and 1."""
    if params.top_k or params.top_p < 1.0:
        return target_logprobs(logits, params), 1.0
    return logits.float(), 1.0 / params.temperature


def coupled_tokens(scores: torch.Tensor, keys: list[int], ids: torch.Tensor | None = None,
                   scales: list[float] | None = None) -> list[int]:
    """The token a seeded request emits at each of some positions: `argmax(scores[k] * scales[k] +
    noise_k)` over `[n, vocab]` (scales default 1: log-probabilities), noise_k =
    `gumbel_noise(keys[k], ids)` (`ids`: the token ids of the columns, default 0..vocab-1), in
    float64. Our CPU kernel where it runs, else PyTorch: the same noise up to the last bits of the
    logs, so a tie that close is the only way the two could part."""
    scales = [1.0] * len(keys) if scales is None else scales
    if scores.is_cpu:
        from dspark_trt.kernels import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.gumbel_argmax(scores, keys, ids, scales)
    ids = torch.arange(scores.shape[-1]) if ids is None else ids.cpu()
    return [int(torch.argmax(row.double().cpu() * scale + gumbel_noise(key, ids)))
            for row, key, scale in zip(scores, keys, scales)]


def coupled_token(scores: torch.Tensor, key: int, scale: float = 1.0) -> int:
    """`coupled_tokens` at one position: scores `[vocab]`."""
    return coupled_tokens(scores[None], [key], scales=[scale])[0]


def verify_draft_coupled(draft_tokens: list[int], scores: torch.Tensor, keys: list[int],
                         scale: float = 1.0) -> tuple[int, int]:
    """`verify_draft` for a seeded request: scores `[l + 1, vocab]` and scale (`coupled_inputs`;
    log-probabilities and 1 will do) and the noise keys of those `l + 1` output positions. Accepts
    the drafts that equal the request's own sample at their position; returns (number accepted, the
    sample at the first mismatch or after the last). Position by position: a mismatch ends it, and
    no later position's noise is drawn."""
    for k, token in enumerate(draft_tokens):
        target = coupled_token(scores[k], keys[k], scale)
        if token != target:
            return k, target
    return len(draft_tokens), coupled_token(scores[len(draft_tokens)], keys[len(draft_tokens)], scale)
