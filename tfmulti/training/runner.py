"""How the Trainer finds the runner of a model that brings its own way of
training (a `tfmulti.pipeline.PipelinedModel`).

The Trainer sits below the packages that define such models (the layer
order in README's "Layout" section), so it cannot import them. A package
registers, at its import, a predicate for its models and the factory of
their runner; a model of that kind cannot exist before its package is
imported, so the Trainer always finds the runner of the model it is given.
A fourth way of training registers the same way instead of adding a branch
to the Trainer.
"""

from __future__ import annotations

from typing import Any, Callable

_MODEL_RUNNERS: list[tuple[Callable[[Any], bool], Callable[..., Any]]] = []


def register_model_runner(accepts: Callable[[Any], bool],
                          factory: Callable[..., Any]) -> None:
    """Registers `factory(model, **trainer_options)` for models `accepts`
    answers True for (once per pair; registering again is a no-op)."""
    if (accepts, factory) not in _MODEL_RUNNERS:
        _MODEL_RUNNERS.append((accepts, factory))


def model_runner(model, **trainer_options):
    """The runner registered for `model`'s kind, built with the Trainer's
    options; None for a plain Keras model (the Trainer's own step)."""
    for accepts, factory in _MODEL_RUNNERS:
        if accepts(model):
            return factory(model, **trainer_options)
    return None
