"""Pipeline schedules: the order each stage runs its micro-batch work in.

GPipe (Huang et al. 2019): every stage runs all M forwards, then all M
backwards; a stage holds the activations of all M micro-batches at once.
1F1B (PipeDream-Flush, Narayanan et al. 2021; torch.distributed.pipelining's
`Schedule1F1B`): stage s runs S - s forwards, then alternates one backward
and one forward, so it holds at most S - s micro-batches' activations. Both
give the same gradients (summed over micro-batches); only the order, hence
peak activation memory, differs. The bubble, (S - 1) / (M + S - 1) of a
step, is the same for both.

Inside one `tf.function` the order is imposed by control dependencies
between consecutive actions of a stage; `emission_order` gives an order of
creating the ops in which every data and control input already exists.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Action(NamedTuple):
    """One unit of work: stage `stage` runs `kind` ("F" or "B") on a
    micro-batch."""

    kind: str
    stage: int
    micro_batch: int


def stage_order(schedule: str, num_stages: int, micro_batches: int,
                stage: int) -> list[Action]:
    """The actions of one stage, in the order the stage runs them."""
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` is {schedule!r}; valid values are "
                         f"{list(SCHEDULES)}.")
    m_all = range(micro_batches)
    if schedule == "gpipe":
        return ([Action("F", stage, m) for m in m_all] +
                [Action("B", stage, m) for m in m_all])
    warmup = min(num_stages - stage, micro_batches)
    order = [Action("F", stage, m) for m in range(warmup)]
    next_forward = warmup
    for m in m_all:
        order.append(Action("B", stage, m))
        if next_forward < micro_batches:
            order.append(Action("F", stage, next_forward))
            next_forward += 1
    return order


def emission_order(schedule: str, num_stages: int,
                   micro_batches: int) -> list[Action]:
    """All actions in an order that respects data and schedule order.

    F(s, m) needs F(s - 1, m); B(s, m) needs F(s, m) and B(s + 1, m); each
    action also follows the previous action of its stage.
    """
    orders = [stage_order(schedule, num_stages, micro_batches, s)
              for s in range(num_stages)]
    done = set()
    emitted = []
    position = [0] * num_stages
    total = sum(len(o) for o in orders)
    while len(emitted) < total:
        progressed = False
        for s in range(num_stages):
            if position[s] == len(orders[s]):
                continue
            action = orders[s][position[s]]
            if action.kind == "F":
                ready = s == 0 or ("F", s - 1, action.micro_batch) in done
            else:
                ready = (s == num_stages - 1 or
                         ("B", s + 1, action.micro_batch) in done)
            if ready:
                emitted.append(action)
                done.add(tuple(action))
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks for "
                               f"{num_stages} stages, {micro_batches} "
                               "micro-batches")
    return emitted


def peak_live_micro_batches(schedule: str, num_stages: int,
                            micro_batches: int, stage: int) -> int:
    """Most micro-batches whose activations `stage` holds at once."""
    live = peak = 0
    for action in stage_order(schedule, num_stages, micro_batches, stage):
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def theoretical_bubble(num_stages: int, micro_batches: int) -> float:
    """Idle fraction of a step with equal stages: (S - 1) / (M + S - 1)."""
    return (num_stages - 1) / (micro_batches + num_stages - 1)
