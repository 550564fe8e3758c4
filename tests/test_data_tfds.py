"""TFDS sources: a mocked real dataset, and the embedded `tfmulti_shapes`
prepared from scratch into a temporary directory and read back by file."""

import hashlib
import json

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import tfmulti
from tests.subproc import run_workers
from tfmulti.data import shapes
from tfmulti.data.pipeline import PipelineOptions, build_pipeline


def _contexts(pipelines):
    return [tf.distribute.InputContext(num_input_pipelines=pipelines,
                                       input_pipeline_id=i,
                                       num_replicas_in_sync=pipelines)
            for i in range(pipelines)]


def _digest(image):
    return hashlib.sha1(np.asarray(image).tobytes()).hexdigest()


def _write_mnist_metadata(data_dir, shard_lengths):
    """Metadata of a prepared `mnist` (no records): what mock_data reads."""
    builder = tfds.builder("mnist", data_dir=data_dir)
    template = tfds.core.ShardedFileTemplate(
        data_dir=builder.data_path, dataset_name="mnist", split="train",
        filetype_suffix="tfrecord")
    builder.info.set_splits(tfds.core.SplitDict([tfds.core.SplitInfo(
        name="train", shard_lengths=shard_lengths, num_bytes=0,
        filename_template=template)]))
    builder.data_path.mkdir(parents=True, exist_ok=True)
    builder.info.write_to_directory(builder.data_path)


def test_mnist_under_mock_data_through_distribute_pipeline(tmp_path):
    # mock_data yields `num_examples` per as_dataset call, i.e. per input
    # pipeline when sharding by file: two files of 7 match that.
    _write_mnist_metadata(tmp_path, [7, 7])
    with tfds.testing.mock_data(num_examples=7, data_dir=str(tmp_path),
                                policy=tfds.testing.MockPolicy.USE_FILES):
        fn = tfmulti.tfds_dataset_fn("mnist", "train", data_dir=str(tmp_path))
        assert fn.file_lengths() == [7, 7]

        def normalise(image, label):
            return tf.cast(image, tf.float32) / 255.0, label

        for ctx in _contexts(2):
            dataset, sizes = fn.shard(ctx)
            assert sizes == [7, 7]
            train = build_pipeline(fn, ctx, PipelineOptions(
                global_batch_size=8, map_fn=normalise))
            for image, label in train.take(5):
                assert image.shape == (4, 28, 28, 1)
                assert image.dtype == tf.float32 and label.dtype == tf.int64
            batches = list(build_pipeline(fn, ctx, PipelineOptions(
                global_batch_size=8, training=False,
                map_fn=normalise)).as_numpy_iterator())
            assert len(batches) == 2
            assert sum(w.sum() for _, _, w in batches) == 7


def test_unprepared_dataset_and_bad_split_are_clear(tmp_path, prepared):
    with pytest.raises(ValueError) as e:
        tfmulti.tfds_dataset_fn("mnist", "train", data_dir=str(tmp_path))
    assert "`name`='mnist' is not prepared in" in str(e.value)
    assert "never downloads" in str(e.value)
    with pytest.raises(ValueError, match=r"`split`='validation' is not a "
                       r"split of tfmulti_shapes; it has \['test', 'train'\]"):
        tfmulti.tfds_dataset_fn(shapes.NAME, "validation",
                                data_dir=prepared.data_dir_root)


@pytest.fixture(scope="module")
def prepared(shapes_builder):
    return shapes_builder


def test_embedded_dataset_is_prepared_into_several_files(prepared):
    for split, size in shapes.SPLIT_SIZES.items():
        info = prepared.info.splits[split]
        assert info.num_shards == shapes.NUM_SHARDS
        assert sum(info.shard_lengths) == size
        assert len(tf.io.gfile.glob(
            f"{prepared.data_dir}/{shapes.NAME}-{split}.tfrecord-*")) == 8
    assert prepared.info.features["label"].names == list(shapes.CLASS_NAMES)
    # Preparing again reuses the files; a plain TFDS builder finds them.
    again = shapes.prepare_default(prepared.data_dir_root)
    assert again.data_dir == prepared.data_dir
    assert tfds.builder(shapes.NAME, data_dir=prepared.data_dir_root
                        ).is_prepared()


def test_generator_is_deterministic_balanced_and_not_blank():
    a, la = shapes.generate(200, seed=3)
    b, lb = shapes.generate(200, seed=3)
    c, _ = shapes.generate(200, seed=4)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)
    assert not np.array_equal(a, c)
    assert np.bincount(la).tolist() == [20] * 10
    assert a.shape == (200, 32, 32, 3) and a.dtype == np.uint8
    # Per class, the mean image differs from the others': shapes are drawn.
    means = np.stack([a[la == k].astype(np.float32).std(axis=-1).mean(0)
                      for k in range(10)])
    assert np.ptp(means, axis=0).max() > 1.0


def test_two_pipelines_read_disjoint_files(prepared):
    fn = tfmulti.tfds_dataset_fn(shapes.NAME, "test",
                                 data_dir=prepared.data_dir_root)
    files = sorted(tf.io.gfile.glob(
        f"{prepared.data_dir}/{shapes.NAME}-test.tfrecord-*"))
    features = prepared.info.features

    def digests_of(paths):
        records = tf.data.TFRecordDataset(paths).map(
            features.deserialize_example)
        return {_digest(ex["image"]) for ex in records.as_numpy_iterator()}

    seen = []
    for ctx in _contexts(2):
        dataset, sizes = fn.shard(ctx)
        assert sizes == [2000, 2000]
        got = [_digest(image) for image, _ in dataset.as_numpy_iterator()]
        assert len(got) == len(set(got)) == 2000
        # Pipeline k reads exactly files k, k + 2, k + 4, k + 6.
        assert set(got) == digests_of(files[ctx.input_pipeline_id::2])
        seen.append(set(got))
    assert not seen[0] & seen[1]


def test_three_pipelines_evaluate_every_test_example_once(prepared):
    fn = tfmulti.tfds_dataset_fn(shapes.NAME, "test",
                                 data_dir=prepared.data_dir_root)
    options = PipelineOptions(global_batch_size=3 * 64, training=False)
    lengths, digests = [], []
    for ctx in _contexts(3):
        assert fn.shard(ctx)[1] == [1500, 1500, 1000]
        batches = list(build_pipeline(fn, ctx, options).as_numpy_iterator())
        lengths.append(len(batches))
        for images, _, weights in batches:
            digests.extend(_digest(im) for im in images[weights == 1.0])
    assert lengths == [24, 24, 24]  # ceil(1500 / 64) on every pipeline
    assert len(digests) == len(set(digests)) == 4000


@pytest.mark.slow
def test_workers_preparing_at_once_all_read_one_copy(tmp_path):
    results = run_workers(["tests/workers/data_prepare_worker.py",
                           str(tmp_path)], 2, timeout=240)
    sizes = {"train": [50] * 8, "test": [20] * 8}
    for _, out in results:
        line = [l for l in out.splitlines() if l.startswith("SIZES ")][-1]
        assert json.loads(line[len("SIZES "):]) == sizes
    versions = list((tmp_path / shapes.NAME).iterdir())
    assert [v.name for v in versions] == ["1.0.0"]
    assert len(list(versions[0].glob("*.tfrecord-*"))) == 16
