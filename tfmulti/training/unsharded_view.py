"""The unsharded view of a sharded optimizer: its shards as the slots of an
ordinary optimizer built on the model's variables, the form checkpoints
keep, so a run resumes sharded or not on any number of replicas."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti import compat


def inner(optimizer):
    """The optimizer whose state is sharded: a LossScaleOptimizer's inner
    one, else `optimizer` itself."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


class UnshardedView:
    """Mixed into `optimizer_sharding.ShardedOptimizer`: reads and writes
    its state as an unsharded optimizer's (uses its `shards`, `optimizers`,
    `layout`, `_variables`, `_strategy`, `_local`, `_all_gather`,
    `_first_index`)."""

    def _scalar_names(self):
        # The shard optimizers' variables not built from the shard (the
        # step, the learning rate, Nadam's u_product) are shared scalars.
        prefix = self.shards[0].name + "_"
        return {v.name for v in self.optimizers[0].variables
                if not v.name.startswith(prefix)}

    def _scalars(self, optimizer):
        names = self._scalar_names()
        return [v for v in optimizer.variables if v.name in names]

    def _kinds(self):
        # The slot names of the shard optimizers ("momentum", "velocity").
        prefix = self.shards[0].name + "_"
        return [v.name[len(prefix):] for v in self.optimizers[0].variables
                if v.name.startswith(prefix)]

    def _local_slots(self, local):
        names = {v.name: v for v in self.optimizers[local].variables}
        return [names[f"{self.shards[local].name}_{k}"] for k in self._kinds()]

    def _full_slots(self, optimizer):
        # Keras names a slot "<variable path with _>_<kind>"; the
        # optimizer's variables correspond to ours by position.
        names = {v.name: v for v in optimizer.variables}
        built_on = compat.optimizer_built_variables(optimizer)
        if [tuple(v.shape) for v in built_on] != [
                tuple(v.shape) for v in self._variables]:
            raise ValueError(
                f"`optimizer` ({type(optimizer).__name__}) is built on "
                f"{len(built_on)} variables of other shapes than the "
                f"{len(self._variables)} sharded ones; build it with "
                "optimizer.build(model.trainable_variables).")
        out = []
        for kind in self._kinds():
            try:
                out.append([names[f"{v.path.replace('/', '_')}_{kind}"]
                            for v in built_on])
            except KeyError as e:
                raise ValueError(
                    f"`optimizer` ({type(optimizer).__name__}) has no slot "
                    f"{e} : build it on the same variables as the sharded "
                    "one (optimizer.build(model.trainable_variables)).") from e
        return out

    def gathered_slots(self):
        """Each slot kind as the full flat vector, gathered from all shards
        (call in cross-replica context; collective under multi-worker)."""
        if self._gather is None:
            @tf.function
            def gather():
                def replica():
                    context = tf.distribute.get_replica_context()
                    local, _ = self._local(context)
                    index = self._first_index() + local
                    return [self._all_gather(context, slot.value, index)
                            for slot in self._local_slots(local)]
                return self._strategy.run(replica)
            self._gather = gather
        per_replica = self._gather()
        return [self._strategy.experimental_local_results(p)[0]
                for p in per_replica]

    def assign_to(self, optimizer):
        """Writes the sharded state into `optimizer` (the same class, built on
        the model's variables), the unsharded form a checkpoint saves."""
        optimizer = inner(optimizer)
        full = self._full_slots(optimizer)
        flats = self.gathered_slots()
        for kind, flat in zip(full, flats):
            for slot, value in zip(kind, self.layout.unflatten(flat)):
                slot.assign(value)
        for mine, theirs in zip(self._scalars(self.optimizers[0]),
                                self._scalars(optimizer)):
            theirs.assign(mine.value)

    def load_from(self, optimizer):
        """Reads the state of `optimizer` (unsharded, built on the model's
        variables; e.g. restored from a checkpoint) into the shards."""
        optimizer = inner(optimizer)
        full = self._full_slots(optimizer)
        flats = [self.layout.flatten([s.value for s in kind]) for kind in full]
        scalars = [v.value for v in self._scalars(optimizer)]
        for local, opt in enumerate(self.optimizers):
            index = self._first_index() + local
            for slot, flat in zip(self._local_slots(local), flats):
                slot.assign(self.layout.shard(flat, index))
            for mine, value in zip(self._scalars(opt), scalars):
                mine.assign(value)
