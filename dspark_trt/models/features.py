"""Which target layers feed the drafter."""

from __future__ import annotations


def default_feature_layers(num_target_layers: int, count: int = 4) -> tuple[int, ...]:
    """`count` 0-based decoder layers spread evenly over [1, L-3] (the paper's released configs).

    Layer i's output is transformers' `hidden_states[i + 1]`. For SmolLM2-135M (L = 30) and
    count 4 this gives (1, 10, 18, 27): low, middle and high features, leaving the last layers,
    which specialise in the next token only.
    """
    low, high = 1, max(1, num_target_layers - 3)
    if count == 1:
        return (high,)
    return tuple(sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)}))
