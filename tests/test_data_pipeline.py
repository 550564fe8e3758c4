"""build_pipeline on a grid of InputContexts: exact-once eval, disjoint train.

The pipeline is a pure function of a `tf.distribute.InputContext`, so every
(input pipelines x replicas per pipeline x dataset size) layout is checked
here without a cluster, by running each pipeline's dataset directly.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import files_dataset_fn
from tfmulti.data.pipeline import PipelineOptions, build_pipeline
from tfmulti.data import sharding

PER_REPLICA = 3
SIZES = (7, 13, 24, 31)  # primes, and one multiple of several batch layouts


def _range_fn(n):
    """Element k is (k as a float feature vector, k as the label)."""
    def dataset_fn(input_context):
        del input_context
        ids = tf.range(n, dtype=tf.int64)
        return tf.data.Dataset.from_tensor_slices(
            (tf.stack([tf.cast(ids, tf.float32)] * 2, axis=1), ids))
    return dataset_fn


def _contexts(pipelines, replicas_per_pipeline):
    return [tf.distribute.InputContext(
        num_input_pipelines=pipelines, input_pipeline_id=i,
        num_replicas_in_sync=pipelines * replicas_per_pipeline)
        for i in range(pipelines)]


def _eval_batches(dataset_fn, pipelines, replicas, **kwargs):
    options = PipelineOptions(
        global_batch_size=PER_REPLICA * pipelines * replicas, training=False,
        **kwargs)
    return [list(build_pipeline(dataset_fn, ctx, options).as_numpy_iterator())
            for ctx in _contexts(pipelines, replicas)]


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("pipelines", [1, 2, 3, 4])
def test_eval_sees_every_element_exactly_once(pipelines, replicas):
    for n in SIZES:
        per_pipeline = _eval_batches(_range_fn(n), pipelines, replicas)
        counts = {len(b) for b in per_pipeline}
        # Same number of batches everywhere, whole steps for the replicas of
        # each pipeline: no replica runs out before another.
        assert len(counts) == 1, (n, counts)
        assert counts.pop() % replicas == 0
        seen = []
        for batches in per_pipeline:
            for features, label, weight in batches:
                assert features.shape == (PER_REPLICA, 2)
                assert weight.dtype == np.float32
                assert set(np.unique(weight)) <= {0.0, 1.0}
                seen.extend(label[weight == 1.0].tolist())
                np.testing.assert_array_equal(features[weight == 0.0], 0.0)
                np.testing.assert_array_equal(features[:, 0], label * weight)
        assert sorted(seen) == list(range(n)), (pipelines, replicas, n)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("pipelines", [1, 2, 3, 4])
def test_train_pipelines_are_disjoint_with_full_batches(pipelines, replicas):
    for n in SIZES:
        options = PipelineOptions(
            global_batch_size=PER_REPLICA * pipelines * replicas, seed=5)
        parts = []
        for ctx in _contexts(pipelines, replicas):
            shard = len(range(ctx.input_pipeline_id, n, pipelines))
            # Two epochs of this pipeline: the stream repeats its own shard.
            steps = -(-2 * shard // PER_REPLICA)
            labels = []
            for features, label in build_pipeline(
                    _range_fn(n), ctx, options).take(steps):
                assert features.shape == (PER_REPLICA, 2)
                labels.extend(label.numpy().tolist())
            first_epoch = labels[:shard]
            assert len(set(first_epoch)) == shard
            assert set(labels) == set(first_epoch)
            parts.append(set(labels))
        assert sum(len(p) for p in parts) == n
        assert set().union(*parts) == set(range(n))


def test_train_shuffle_is_seeded_per_pipeline():
    ctx0, ctx1 = _contexts(2, 1)

    def first(ctx, seed):
        options = PipelineOptions(global_batch_size=2 * PER_REPLICA, seed=seed)
        return [b[1].tolist() for b in build_pipeline(
            _range_fn(200), ctx, options).take(10).as_numpy_iterator()]

    assert first(ctx0, 1) == first(ctx0, 1)
    assert first(ctx0, 1) != first(ctx0, 2)
    # Pipeline 1 holds the odd elements; shifted by one, a seed shared with
    # pipeline 0 would give the same order.
    assert [[x - 1 for x in b] for b in first(ctx1, 1)] != first(ctx0, 1)


def test_map_fn_runs_before_padding_and_weights_mask_it():
    def map_fn(features, label):
        return {"x": features * 2.0 + 1.0}, label

    [[*batches]] = _eval_batches(_range_fn(5), 1, 1, map_fn=map_fn)
    features, labels, weights = (np.concatenate(x) for x in zip(
        *[(b[0]["x"], b[1], b[2]) for b in batches]))
    assert weights.tolist() == [1.0] * 5 + [0.0]
    np.testing.assert_array_equal(features[:5, 0], labels[:5] * 2.0 + 1.0)
    np.testing.assert_array_equal(features[5], 0.0)


def test_eval_drop_remainder_keeps_whole_steps_only():
    per_pipeline = _eval_batches(_range_fn(31), 2, 2, drop_remainder=True)
    # Pipelines hold 16 and 15: one step is 2 replicas x 3 = 6 examples.
    assert [len(b) for b in per_pipeline] == [4, 4]
    assert all(w.all() for b in per_pipeline for _, _, w in b)


def test_indivisible_global_batch_gives_numbers_and_fix():
    with pytest.raises(ValueError) as e:
        build_pipeline(_range_fn(20), _contexts(1, 3)[0],
                       PipelineOptions(global_batch_size=10))
    msg = str(e.value)
    assert "`global_batch_size`=10" in msg
    assert "3 replicas" in msg and "10 % 3 = 1" in msg
    assert "e.g. 9 or 12" in msg


def test_too_few_elements_gives_numbers():
    with pytest.raises(ValueError) as e:
        build_pipeline(_range_fn(3), _contexts(4, 1)[0],
                       PipelineOptions(global_batch_size=4))
    msg = str(e.value)
    assert "3 element(s)" in msg and "4 input pipelines" in msg
    assert "at least 4 elements" in msg


def test_bad_options_and_elements_are_refused():
    with pytest.raises(ValueError, match=r"`drop_remainder`=False with "
                       r"`training`=True"):
        PipelineOptions(global_batch_size=8, drop_remainder=False)
    with pytest.raises(ValueError, match=r"`global_batch_size` should be a "
                       r"positive int .* got 0"):
        PipelineOptions(global_batch_size=0)
    with pytest.raises(ValueError, match=r"`shuffle_buffer` .* got -1"):
        PipelineOptions(global_batch_size=8, shuffle_buffer=-1)
    with pytest.raises(ValueError, match=r"`seed` should be a non-negative "
                       r"int, or None .* got -3"):
        PipelineOptions(global_batch_size=8, seed=-3)
    ctx = _contexts(1, 1)[0]
    with pytest.raises(ValueError, match=r"`dataset_fn` should give "
                       r"`\(features, label\)` elements"):
        build_pipeline(lambda _: tf.data.Dataset.range(4), ctx,
                       PipelineOptions(global_batch_size=2))
    with pytest.raises(ValueError, match="infinite dataset"):
        build_pipeline(lambda c: _range_fn(4)(c).repeat(), ctx,
                       PipelineOptions(global_batch_size=2, training=False))
    with pytest.raises(ValueError, match=r"`cache`=True but `dataset_fn` "
                       r"returned an infinite dataset"):
        build_pipeline(lambda c: _range_fn(4)(c).repeat(), ctx,
                       PipelineOptions(global_batch_size=2, cache=True))


def test_infinite_training_source_streams_and_batched_source_warns(caplog):
    ctx = _contexts(2, 1)[1]
    with caplog.at_level(logging.WARNING):
        infinite = build_pipeline(
            lambda c: _range_fn(5)(c).repeat(), ctx,
            PipelineOptions(global_batch_size=4, shuffle_buffer=0))
    # Pipeline 1 takes the odd positions of the repeated stream.
    labels = [l for _, b in infinite.take(6).as_numpy_iterator() for l in b]
    assert labels == [(2 * k + 1) % 5 for k in range(12)]
    assert "returned an infinite dataset" in caplog.text
    with pytest.raises(ValueError, match="returned a batched dataset"):
        build_pipeline(lambda c: _range_fn(8)(c).batch(4), ctx,
                       PipelineOptions(global_batch_size=4))
    caplog.clear()
    # Batched, then mapped: only the shapes tell, so a warning.
    with caplog.at_level(logging.WARNING):
        build_pipeline(lambda c: _range_fn(8)(c).batch(4).map(
            lambda f, l: (f, l)), ctx, PipelineOptions(global_batch_size=4))
    assert "elements look batched" in caplog.text


def test_unknown_cardinality_is_counted():
    def filtered(ctx):
        return _range_fn(40)(ctx).filter(lambda f, l: l % 3 == 0)

    per_pipeline = _eval_batches(filtered, 2, 1)
    seen = sorted(l for b in per_pipeline for _, label, w in b
                  for l in label[w == 1].tolist())
    assert seen == list(range(0, 40, 3))


def test_sharding_rule_and_its_log(caplog):
    with caplog.at_level(logging.INFO, logger=sharding.__name__):
        assert sharding.choose_sharding(
            num_files=8, num_input_pipelines=4) == "file"
        assert sharding.choose_sharding(
            num_files=4, num_input_pipelines=4) == "file"
        assert sharding.choose_sharding(
            num_files=3, num_input_pipelines=4) == "element"
        assert sharding.choose_sharding(
            num_files=8, num_input_pipelines=4, sharding="element") == "element"
    assert "sharding 8 file(s) over 4 input pipeline(s) by file" in caplog.text
    assert "sharding 3 file(s) over 4 input pipeline(s) by element" in (
        caplog.text)
    with pytest.raises(ValueError) as e:
        sharding.choose_sharding(num_files=3, num_input_pipelines=4,
                                 sharding="file")
    msg = str(e.value)
    assert "`sharding`='file'" in msg
    assert "3 file(s) for 4 input pipelines" in msg
    assert "DownloadConfig(num_shards=4)" in msg
    with pytest.raises(ValueError, match=r"`sharding` should be one of .* "
                       r"got 'files'"):
        sharding.choose_sharding(num_files=3, num_input_pipelines=1,
                                 sharding="files")


def _write_records(directory, lengths):
    """TFRecord files of serialized int64 ids, file k holding lengths[k]."""
    paths, start = [], 0
    for k, n in enumerate(lengths):
        path = str(directory / f"part-{k:02d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(start, start + n):
                writer.write(tf.io.serialize_tensor(
                    tf.constant(i, tf.int64)).numpy())
        paths.append(path)
        start += n
    return paths


def _parse(record):
    i = tf.io.parse_tensor(record, tf.int64)
    i.set_shape([])
    return tf.cast(tf.reshape(i, [1]), tf.float32), i


def test_files_shard_by_file_when_enough_else_by_element(tmp_path):
    lengths = [5, 9, 2, 7, 4]
    paths = _write_records(tmp_path, lengths)
    starts = np.cumsum([0] + lengths)
    fn = files_dataset_fn(str(tmp_path / "part-*.tfrecord"), parse_fn=_parse)
    assert fn.files == paths
    # 2 pipelines, 5 files: by file; pipeline 0 reads files 0, 2, 4.
    ctx0, ctx1 = _contexts(2, 1)
    got0 = sorted(int(l) for _, l in fn(ctx0).as_numpy_iterator())
    expected0 = sorted(i for k in (0, 2, 4)
                       for i in range(starts[k], starts[k + 1]))
    assert got0 == expected0
    assert fn.shard(ctx0)[1] == [11, 16]
    # Exact-once evaluation over files of unequal size.
    for pipelines in (2, 5, 6):
        per_pipeline = _eval_batches(fn, pipelines, 1)
        assert len({len(b) for b in per_pipeline}) == 1
        seen = sorted(l for b in per_pipeline for _, label, w in b
                      for l in label[w == 1].tolist())
        assert seen == list(range(sum(lengths))), pipelines
    # 6 pipelines, 5 files: by element, still disjoint.
    assert fn.shard(_contexts(6, 1)[0])[1] == [5, 5, 5, 4, 4, 4]
    with pytest.raises(ValueError, match=r"5 file\(s\) for 6 input"):
        files_dataset_fn(paths, parse_fn=_parse, sharding="file").shard(
            _contexts(6, 1)[0])
    with pytest.raises(ValueError, match=r"`files`='.*nothing-\*' matched "
                       r"no file"):
        files_dataset_fn(str(tmp_path / "nothing-*"))
