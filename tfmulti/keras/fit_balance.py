"""`distributed(model, balance=...)`: Keras `fit` with uneven shares.

The Trainer's load balancing (`tfmulti.training.balancing`) under Keras's
own loop: each call of the train function reads the global batch from a
`tfmulti.data.balanced.BalancedIterator` (every replica cuts its share in
replica context from a share variable), the step times each replica's
forward and backward, and after the call the shares move under "auto".
Keras is handed a distributed dataset whose `iter()` is that kept
iterator, so its epochs, callbacks and evaluation are unchanged; the
update is the even split's (TrainStep weights each replica's loss by its
real examples), and a share change is a variable assignment: nothing is
retraced.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.data import balanced as balanced_lib
from tfmulti.keras import fit_input as fit_input_lib
from tfmulti.training import balancing

# What a `distributed` model's train function accepts from Keras.
ITERATOR_TYPES = (tf.distribute.DistributedIterator,
                  balanced_lib.BalancedIterator)


class FitBalance:
    """The shares of one model's `fit` calls, and the iterator they cut.

    Attributes:
      balancer: the `balancing.Balancer` (policy, share variable, timer).
      position: the `fit_input.StreamPosition` of the kept iterator.
    """

    def __init__(self, balancer):
        self.balancer = balancer
        self._source = None
        self._dataset = None
        self._iterator = None
        self.position = None
        # Steps trained by this model's balanced `fit` calls: the step the
        # shares history records.
        self._step = 0

    @property
    def timer(self):
        return self.balancer.timer

    @property
    def history(self) -> list[dict]:
        """Per train-function call: the step reached, the counts it used,
        each replica's compute seconds per step, the idle fraction."""
        return list(self.balancer.shares_history)

    def dataset_for(self, x, *, steps_per_epoch):
        """What Keras's `fit` gets in place of `x`, and the epoch length:
        a distributed dataset whose iterator is the kept `BalancedIterator`
        over `x` (the same one while `fit` is given the same `x`, as
        `fit_input` does), and `steps_per_epoch`.

        An endless `x` needs `steps_per_epoch`. A finite `x` of known length
        without it is read as `x.repeat()` with epochs of one pass each:
        the batches of Keras's epochs, from one iterator (a new iterator
        each epoch would retrace the train function and restart "auto").
        """
        if not isinstance(x, tf.data.Dataset):
            raise ValueError(
                "With `balance`, `fit` takes `x` as a tf.data.Dataset of "
                f"GLOBAL batches; got {type(x).__name__}. A distributed "
                "dataset is already split evenly and cannot be re-split; "
                "arrays: pass tf.data.Dataset.from_tensor_slices((x, y))"
                ".batch(global_batch, drop_remainder=True).")
        cardinality = int(x.cardinality())
        stream = x
        if cardinality != int(tf.data.INFINITE_CARDINALITY):
            if steps_per_epoch or cardinality < 1:
                # Unknown length (a filter), or epochs that do not end
                # with the data: where Keras's epoch ends is not known here.
                raise ValueError(
                    f"With `balance`, `x` should be a dataset of known "
                    f"length without `steps_per_epoch` (one pass per epoch),"
                    f" or an endless stream with it; got cardinality "
                    f"{cardinality} and steps_per_epoch={steps_per_epoch!r}."
                    " Drop steps_per_epoch, or add .repeat() to the dataset "
                    "and pass steps_per_epoch=<examples per epoch> // "
                    "global_batch_size, or .apply(tf.data.experimental."
                    "assert_cardinality(n)) after a filter.")
            steps_per_epoch, stream = cardinality, x.repeat()
        # (An endless `x` without `steps_per_epoch` is refused by `fit`.)
        if x is not self._source:
            self._iterator = self.balancer.iterator(stream)
            self.position = fit_input_lib.StreamPosition(self.iterator)
            self._source = x
            self._dataset = fit_input_lib.reusing(self._iterator.distributed,
                                                  self)
        return self._dataset, steps_per_epoch

    def iterator(self):
        """The kept iterator (what `iter()` of `dataset_for`'s result is)."""
        return self._iterator

    def after_call(self, steps: int, logs: dict) -> dict:
        """`logs` of a train-function call of `steps` steps, with each
        replica's share and compute seconds per step and the idle fraction
        (a collective: every worker calls it after every call); moves the
        shares under "auto"."""
        self._step += steps
        return {**logs, **self.balancer.after_loop(self._step)}


def for_model(strategy, balance, *, jit_compile: bool,
              pipelined: bool = False) -> FitBalance | None:
    """The `FitBalance` of `distributed(model, balance=balance)`, or None
    (an even split).

    Raises:
      ValueError: a bad `balance`, or one that cannot work here (a
        pipelined model, jit_compile), naming the argument.
    """
    balancer = balancing.for_trainer(strategy, balance, pipelined=pipelined,
                                     asynchronous=False,
                                     jit_compile=jit_compile)
    return None if balancer is None else FitBalance(balancer)


def timer_of(balance: FitBalance | None):
    """The step's replica timer under `balance`, else None."""
    return None if balance is None else balance.timer


def logs_after(balance: FitBalance | None, steps: int, logs):
    """A train function's logs, with the balance logs when balanced."""
    return logs if balance is None else balance.after_call(steps, logs)


def refuse_pipelined(balance) -> None:
    """A pipelined model splits by stage, not by batch: no `balance`."""
    if balance is not None:
        raise ValueError(
            f"`balance`={balance!r} is not supported for a PipelinedModel: "
            "its stages split the model, not the batch. Pass balance=None.")
