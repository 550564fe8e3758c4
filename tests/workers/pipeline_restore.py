"""One device, one process: a pipelined checkpoint predicts as it did.

Usage: pipeline_restore.py CKPT_DIR OUT.json KERAS_BACKUP_DIR
"""

import json
import sys
import time

import keras
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import pipeline_golden  # noqa: E402  (its model and data)

import tensorflow as tf  # noqa: E402


def resume_trainer_checkpoint(ckpt_dir):
    """A one-device Trainer resumes the pipelined Trainer's step-2
    checkpoint (model, optimizer slots, data iterator) for step 3."""
    import tfmulti
    model_dir = f"{ckpt_dir}/for_one_device"
    x = pipeline_golden.data()[0][0]
    strategy = tfmulti.create_strategy("one_device")
    with strategy.scope():
        model = pipeline_golden.make_model("mlp")
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    trainer = tfmulti.Trainer(model, optimizer,
                              loss=pipeline_golden.loss_fn(),
                              model_dir=model_dir)
    # Restoring alone (no step yet) predicts as the pipeline did.
    restored = trainer.fit(pipeline_golden.dataset(), steps=2, verbose=0)
    predicted = model.predict(x, verbose=0)
    want = np.load(f"{ckpt_dir}/trainer_predictions.npy")
    trainer.fit(pipeline_golden.dataset(), steps=3, verbose=0)
    golden = np.load(f"{ckpt_dir}/golden_weights.npz")
    golden = [golden[f"arr_{i}"] for i in range(len(golden.files))]
    return {
        "trainer_final_step": trainer.step,
        "trainer_steps_run_after_restore": len(restored["step_loss"]),
        "trainer_checkpoint_prediction_diff": float(np.max(np.abs(
            predicted - want))),
        "trainer_resumed_weight_diff": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(model.get_weights(), golden)),
    }


def resume_keras_backup(ckpt_dir, backup_dir):
    """One-device Keras fit (tfmulti.keras.distributed) resumes the backup
    that Keras fit of the S=2, M=2, D=2 pipeline wrote after epoch 2: it
    predicts as the pipeline did, then epoch 3 reaches plain Keras's
    weights."""
    import tfmulti
    strategy = tfmulti.create_strategy("one_device")
    with strategy.scope():
        model = pipeline_golden.make_model("mlp")
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
    tfmulti.keras.distributed(model)
    epochs = pipeline_golden.KERAS_EPOCHS

    def fit(until):
        return model.fit(
            pipeline_golden.dataset(), epochs=until,
            steps_per_epoch=pipeline_golden.STEPS, verbose=0,
            callbacks=[tfmulti.keras.BackupAndRestore(
                backup_dir, delete_on_end=False)])

    restored = fit(epochs)  # restores epoch 2 of 2: trains nothing
    predicted = model.predict(pipeline_golden.data()[0][0], verbose=0)
    want = np.load(f"{ckpt_dir}/keras_predictions.npy")
    fit(epochs + 1)
    golden = np.load(f"{ckpt_dir}/keras_next_epoch_weights.npz")
    golden = [golden[f"arr_{i}"] for i in range(len(golden.files))]
    return {
        "keras_epochs_run_after_restore": len(restored.history.get(
            "loss", [])),
        "keras_checkpoint_prediction_diff": float(np.max(np.abs(
            predicted - want))),
        "keras_resumed_weight_diff": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(model.get_weights(), golden)),
        "keras_final_step": int(model.optimizer.iterations.numpy()),
    }


def main():
    ckpt_dir, out = sys.argv[1], sys.argv[2]
    with tf.device("/CPU:0"):
        model = pipeline_golden.make_model("mlp")
        model.load_weights(f"{ckpt_dir}/pipelined.weights.h5")
        got = model.predict(pipeline_golden.data()[0][0], verbose=0)
    want = np.load(f"{ckpt_dir}/pipelined_predictions.npy")
    devices = {v.value.device.rsplit("device:", 1)[-1] for v in model.weights}
    result = {"pipelined_to_single_diff": float(np.max(np.abs(got - want))),
              "devices": sorted(devices)}
    result.update(resume_trainer_checkpoint(ckpt_dir))
    start = time.perf_counter()
    result.update(resume_keras_backup(ckpt_dir, sys.argv[3]))
    result["keras_seconds"] = time.perf_counter() - start
    print(json.dumps(result))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    main()
