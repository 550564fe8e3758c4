"""One device, one process: a pipelined checkpoint predicts as it did.

Usage: pipeline_restore.py CKPT_DIR OUT.json
"""

import json
import sys

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
    print(json.dumps(result))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    main()
