"""The ZeRO stage a run asks for with `shard_optimizer_state`: 0 (off), 1
(the optimizer state sharded over the replicas) or 2 (the reduced gradient
too). True is stage 1, as it was before stage 2 existed."""

from __future__ import annotations

STAGES = (0, 1, 2)
# What the recipe flag accepts; the Python API takes bools and ints.
_WORDS = {"0": 0, "1": 1, "2": 2, "false": 0, "true": 1}


def parse(value, *, name: str = "`shard_optimizer_state`",
          words: bool = False) -> int:
    """The stage `value` asks for.

    Args:
      value: False/True, 0, 1 or 2; with `words`, also "0", "1", "2",
        "true", "false" (any case).
      name: how the error names the setting.
      words: accept the strings a flag gives.

    Raises:
      ValueError: naming `name` and the value received.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value in STAGES:
        return value
    if words and isinstance(value, str) and value.strip().lower() in _WORDS:
        return _WORDS[value.strip().lower()]
    accepted = ("0, 1, 2, true or false" if words
                else "False, True (stage 1), 1 or 2")
    raise ValueError(
        f"{name} should be {accepted} (the ZeRO stage: 1 shards the "
        f"optimizer state, 2 also the reduced gradient), got {value!r}.")
