"""One distributed iterator per training dataset, kept across `fit` calls.

Keras 3's `fit` makes two multi-device iterators per call (one to read a
batch for `_maybe_symbolic_build`, one for the epochs); each costs 0.2-1 s
under a strategy (a MultiDeviceIterator with a prefetching function per
device), which makes short `fit` calls as slow as Keras's default loop.

For a model made by `tfmulti.keras.distributed`, `FitInput` keeps the
distributed dataset and its iterator of the last INFINITE training dataset
`fit` was given, and hands Keras that same iterator while `fit` is called
with the same dataset object: `fit(ds, epochs=1)` twice trains on the same
batches as `fit(ds, epochs=2)` (as the Trainer does with its iterator).
Finite datasets are left to Keras: each epoch is one pass, from a fresh
iterator. The symbolic build's probe batch is read only while something is
still unbuilt.

A kept iterator counts the batches read from it (`StreamPosition`): after a
restart, `BackupAndRestore` moves a new one to where the backup's epoch
began in the stream, so epoch E reads the batches it read in the
uninterrupted run, not the stream's first ones.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfmulti import compat
from tfmulti.training import loop as loop_lib

# Dynamic subclasses of each distributed dataset class, by base class.
_REUSING_CLASSES = {}


def _reusing_class(base):
    """A subclass of `base` (a TF distributed dataset class) whose instances
    delegate every attribute to the wrapped dataset but `__iter__`.

    A subclass, not a plain wrapper: Keras recognises distributed datasets
    by their TensorFlow classes (`isinstance` and the class names in the
    MRO), and then uses them without distributing again.
    """
    if base not in _REUSING_CLASSES:
        def __init__(self, dataset, fit_input):
            # Base __init__ not called: every attribute comes from `dataset`.
            self.__dict__["_tfmulti_dataset"] = dataset
            self.__dict__["_tfmulti_input"] = fit_input

        def __getattr__(self, name):
            return getattr(self.__dict__["_tfmulti_dataset"], name)

        def __iter__(self):
            return self.__dict__["_tfmulti_input"].iterator()

        _REUSING_CLASSES[base] = type(
            f"Reusing{base.__name__}", (base,),
            {"__init__": __init__, "__getattr__": __getattr__,
             "__iter__": __iter__, "__module__": __name__})
    return _REUSING_CLASSES[base]


def reusing(distributed, source):
    """`distributed` (a TF distributed dataset) as Keras sees it, but whose
    `iter()` is `source.iterator()`: Keras then trains from the iterator
    `source` keeps."""
    return _reusing_class(type(distributed))(distributed, source)


def _is_infinite(dataset) -> bool:
    if isinstance(dataset, tf.data.Dataset):
        cardinality = dataset.cardinality()
    else:
        cardinality = getattr(dataset, "cardinality", None)
        if cardinality is None:
            return False
    return int(cardinality) == int(tf.data.INFINITE_CARDINALITY)


class StreamPosition:
    """Batches read so far from one kept endless iterator.

    Attributes:
      iterator: returns the kept iterator (made on first use).
      batches: batches the train function (or a skip) has read from it.
    """

    def __init__(self, iterator):
        self.iterator = iterator
        self.batches = 0

    def read(self, iterator, batches: int) -> None:
        """Counts `batches` read from `iterator`, if it is the kept one."""
        if iterator is self.iterator():
            self.batches += batches

    def skip_to(self, batches: int) -> None:
        """Reads, without training, up to stream position `batches` (a
        no-op where the stream is already there or past it)."""
        if batches > self.batches:
            loop_lib.skip_batches(self.iterator(), batches - self.batches)
            self.batches = batches


class FitInput:
    """The training input of one model's `fit` calls.

    Attributes:
      iterators_made: distributed iterators this object has made, probes of
        the symbolic build included (the count tests and benchmarks read).
      position: the `StreamPosition` of the kept iterator.
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._source = None
        self._reusing = None
        self._iterator = None
        self._probing = False
        self.iterators_made = 0
        self.position = None

    def reusable(self, x, *, class_weight=None) -> bool:
        """Whether `fit(x, ...)` can continue from a kept iterator."""
        if class_weight is not None:
            # Keras maps the dataset with the weights: a new dataset.
            return False
        if not isinstance(x, (tf.data.Dataset,
                              tf.distribute.DistributedDataset)):
            return False
        return _is_infinite(x)

    def dataset_for(self, x):
        """What to give Keras's `fit` in place of `x` (reusable, see
        `reusable`): a distributed dataset whose iterator is made once."""
        if x is not self._source:
            distributed = x
            if isinstance(x, tf.data.Dataset):
                distributed = self._strategy.experimental_distribute_dataset(
                    x)
            self._source = x
            self._iterator = None
            self.position = StreamPosition(self.iterator)
            self._reusing = reusing(distributed, self)
        return self._reusing

    def iterator(self):
        """The kept iterator (made on first use); a throwaway one while
        Keras probes a batch for its symbolic build."""
        dataset = self._reusing.__dict__["_tfmulti_dataset"]
        if self._probing:
            self.iterators_made += 1
            return iter(dataset)
        if self._iterator is None:
            self.iterators_made += 1
            self._iterator = iter(dataset)
        return self._iterator

    @contextlib.contextmanager
    def probing(self):
        """Iterators made inside are throwaway ones (Keras reads one batch
        from them and drops them)."""
        self._probing = True
        try:
            yield
        finally:
            self._probing = False


def _spec_batch(element_spec):
    """One replica's batch spec: shapes and dtypes, no data."""
    return tf.nest.map_structure(
        compat.replica_spec, element_spec)


def maybe_symbolic_build(model, fit_input, iterator=None, data_batch=None):
    """Keras's symbolic build, only when something is left to build, and
    from the data's spec instead of a real batch.

    Keras 3.15's TF trainer reads one batch from a fresh iterator of the
    data (all-reducing it eagerly across workers), builds from it and drops
    the iterator, at every `fit` and `evaluate`, even when everything is
    built: each such iterator costs 0.2-1 s, its prefetching is cancelled
    ("Local rendezvous is aborting with status: CANCELLED"), a cache being
    filled is discarded ("did not fully read the dataset being cached"), and
    the eager reduction warns that the strategy is used eagerly. Only shapes
    and dtypes are needed, and the distributed dataset has them.
    """
    if not compat.needs_symbolic_build(model):
        return None
    dataset = compat.iterator_dataset(iterator)
    if data_batch is None and dataset is not None:
        with model.distribute_strategy.scope():
            return compat.symbolic_build(
                model, iterator=iterator,
                data_batch=_spec_batch(dataset.element_spec))
    with fit_input.probing():
        return compat.stock_symbolic_build(model, iterator=iterator,
                                           data_batch=data_batch)
