"""Pipelined training vs one device, several (S, M, D) cases in one process.

Usage: pipeline_golden.py OUT.json CASES CKPT_DIR
CASES is a comma list of S:M:D[:schedule[:model]] (model "mlp", "seq" or
"residual"). Writes, per case, the largest weight and loss difference from a
one-device run of the same steps, and parameter bytes per device. Then the
checkpoint interchange: the last case's pipelined model saves its weights and
predictions to CKPT_DIR (pipeline_restore.py loads them in a one-device
process), and a one-device checkpoint loads into a fresh pipelined model.
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

import tfmulti
from tfmulti import pipeline
from tfmulti.pipeline import placement

# Set first thing in main(): pipeline_restore.py imports this module's model
# and data into a one-device process.
DEVICES = None

STEPS = 3
BATCH = 16
# (S:M:D) pipelines trained by tfmulti.Trainer (resumed too).
TRAINER_CASES = ["2:2:1", "2:2:2"]


def make_model(kind):
    keras.utils.set_random_seed(7)
    if kind == "seq":
        return keras.Sequential(
            [keras.Input((12,))] +
            [keras.layers.Dense(24, activation="tanh", name=f"d{i}")
             for i in range(6)] + [keras.layers.Dense(5, name="logits")],
            name="seq")
    inputs = keras.Input((12,))
    x = inputs
    if kind == "residual":
        x = keras.layers.Dense(24, activation="tanh", name="d0")(x)
        skip = x
        x = keras.layers.Dense(24, activation="tanh", name="d1")(x)
        x = keras.layers.Dense(24, activation="tanh", name="d2")(x)
        x = keras.layers.Add(name="add")([x, skip])
    else:
        for i, width in enumerate([32, 24, 24, 16, 16, 16, 16]):
            x = keras.layers.Dense(width, activation="tanh", name=f"d{i}",
                                   kernel_regularizer=keras.regularizers.L2(
                                       1e-3) if i == 1 else None)(x)
    outputs = keras.layers.Dense(5, name="logits")(x)
    return keras.Model(inputs, outputs, name=kind)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=None)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, BATCH, 12)).astype("float32")
    y = rng.integers(0, 5, size=(STEPS, BATCH)).astype("int32")
    return x, y


def golden(kind):
    with tf.device(DEVICES[0]):
        model = make_model(kind)
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        opt.build(model.trainable_variables)
        loss = loss_fn()

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                value = tf.reduce_mean(loss(y, model(x, training=True)))
                if model.losses:
                    value += tf.add_n(model.losses)
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return value

        xs, ys = data()
        losses = [float(step(x, y)) for x, y in zip(xs, ys)]
    return losses, [w.copy() for w in model.get_weights()]


def run(case, goldens):
    parts = case.split(":")
    S, M, D = (int(p) for p in parts[:3])
    schedule = parts[3] if len(parts) > 3 else "gpipe"
    kind = parts[4] if len(parts) > 4 else "mlp"
    model = make_model(kind)
    cuts = ["d0"] if kind == "residual" else None
    pipe = pipeline.PipelinedModel(
        model, optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn(),
        num_stages=S, micro_batches=M, data_parallel=D, schedule=schedule,
        cuts=cuts, carry_skips=kind == "residual")
    xs, ys = data()
    losses = [float(pipe.train_step(x, y)) for x, y in zip(xs, ys)]
    if kind not in goldens:
        goldens[kind] = golden(kind)
    g_losses, g_weights = goldens[kind]
    weight_diff = max(float(np.max(np.abs(a - b)))
                      for a, b in zip(model.get_weights(), g_weights))
    # Every group's copy must equal group 0's (the model's).
    group_diff = 0.0
    for d in range(1, D):
        for s in range(S):
            for a, b in zip(pipe._trainable[0][s], pipe._trainable[d][s]):
                group_diff = max(group_diff, float(np.max(np.abs(
                    a.numpy() - b.numpy()))))
    # Where each stage's variables and optimizer slots live.
    placement_ok = True
    for d in range(D):
        for s in range(S):
            want = pipe.devices[d][s]
            for v in pipe._trainable[d][s] + pipe._non_trainable[d][s]:
                placement_ok &= placement.same_device(
                    v.value.device, want)
    for d in range(D):
        for s in range(S):
            opt = pipe.optimizers[d][s]
            if (d, s) != (0, 0):  # the caller's optimizer: where it was made
                placement_ok &= placement.same_device(
                    opt.iterations.value.device, pipe.devices[d][s])
            for v in pipe._trainable[d][s]:
                for slot in [opt.momentums[opt._get_variable_index(v)]]:
                    placement_ok &= placement.same_device(
                        slot.value.device, pipe.devices[d][s])
    layer_bytes = max(placement.variable_bytes(l.weights)
                      for l in model.layers)
    total_bytes = placement.variable_bytes(model.weights)
    return {
        "case": case, "cuts": list(pipe.cuts),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, g_losses)),
        "weight_diff": weight_diff, "group_diff": group_diff,
        "losses": losses, "golden_losses": g_losses,
        "placement_ok": bool(placement_ok),
        "bytes_per_device": pipe.parameter_bytes_per_device(),
        "optimizer_bytes_per_device": pipe.optimizer_bytes_per_device(),
        "largest_layer_bytes": layer_bytes, "total_bytes": total_bytes,
        "stage_bytes": [placement.variable_bytes(st.model.weights)
                        for st in pipe.stages],
    }


def interchange(case, ckpt_dir):
    """Pipelined -> file for the one-device process; one device -> pipeline."""
    S, M, D = (int(p) for p in case.split(":")[:3])
    x = data()[0][0]
    model = make_model("mlp")
    pipe = pipeline.PipelinedModel(
        model, optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=loss_fn(), num_stages=S, micro_batches=M, data_parallel=D)
    xs, ys = data()
    for xb, yb in zip(xs, ys):
        pipe.train_step(xb, yb)
    pipe.save_weights(f"{ckpt_dir}/pipelined.weights.h5")
    np.save(f"{ckpt_dir}/pipelined_predictions.npy", pipe.predict(x))
    # The reverse: a one-device model's checkpoint into a new pipeline.
    with tf.device(DEVICES[0]):
        single = make_model("mlp")
        keras.utils.set_random_seed(3)
        single.set_weights([np.random.normal(size=w.shape).astype("float32")
                            for w in single.get_weights()])
        single.save_weights(f"{ckpt_dir}/single.weights.h5")
        expected = single.predict(x, verbose=0)
    fresh = pipeline.PipelinedModel(
        make_model("mlp"), optimizer=keras.optimizers.SGD(0.1),
        loss=loss_fn(), num_stages=S, micro_batches=M, data_parallel=D,
        verbose=False)
    fresh.load_weights(f"{ckpt_dir}/single.weights.h5")
    group_diff = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for d in range(1, D) for s in range(S)
        for a, b in zip(fresh._trainable[0][s], fresh._trainable[d][s]))
    return {"single_to_pipelined_diff": float(np.max(np.abs(
        fresh.predict(x) - expected))), "loaded_group_diff": group_diff}


def dataset():
    xs, ys = data()
    return tf.data.Dataset.from_tensor_slices((xs, ys))


def trainer_fit(case, model_dir, steps, *, stop_at=None):
    """A fresh PipelinedModel trained by tfmulti.Trainer up to `steps`
    (first to `stop_at`, then by a second Trainer from `model_dir`)."""
    S, M, D = (int(p) for p in case.split(":")[:3])

    def fit(until):
        pipe = pipeline.PipelinedModel(
            make_model("mlp"),
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=loss_fn(), num_stages=S, micro_batches=M, data_parallel=D,
            verbose=False)
        trainer = tfmulti.Trainer(pipe, model_dir=model_dir, steps_per_loop=2,
                                  metrics=["sparse_categorical_accuracy"])
        history = trainer.fit(dataset(), steps=until, eval_data=dataset(),
                              verbose=0)
        return pipe, trainer, history

    losses = []
    if stop_at is not None:
        losses += fit(stop_at)[2]["step_loss"]
    pipe, trainer, history = fit(steps)
    return pipe, trainer, losses + history["step_loss"], history


def trainer_cases(cases, goldens, ckpt_dir):
    """The Trainer over a PipelinedModel vs one device; a resumed run vs an
    uninterrupted one; a checkpoint for the one-device process."""
    g_losses, g_weights = goldens.setdefault("mlp", golden("mlp"))
    # One device's evaluation of its 3-step weights on the same data.
    with tf.device(DEVICES[0]):
        reference = make_model("mlp")
        reference.set_weights(g_weights)
        xs, ys = data()
        g_val_loss = float(np.mean(loss_fn()(
            ys.reshape(-1), reference(xs.reshape(-1, 12), training=False))))
    results = {}
    for case in cases:
        pipe, trainer, losses, history = trainer_fit(
            case, f"{ckpt_dir}/trainer_{case.replace(':', '_')}", STEPS)
        results[case] = {
            "weight_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(
                pipe.model.get_weights(), g_weights)),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, g_losses)),
            "steps": trainer.step,
            "val_loss_diff": abs(history["val_loss"][-1] - g_val_loss),
            "train_accuracy": history["sparse_categorical_accuracy"][-1],
            "optimizer_layout": trainer._pipeline.optimizer_layout,
        }
    # Resumed from a checkpoint by a second Trainer over a new
    # PipelinedModel, the last case must equal its uninterrupted run.
    resumed, _, r_losses, _ = trainer_fit(
        case, f"{ckpt_dir}/resumed", STEPS, stop_at=1)
    results[case]["resume_weight_diff"] = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(resumed.model.get_weights(), pipe.model.get_weights()))
    results[case]["resume_loss_diff"] = max(
        abs(a - b) for a, b in zip(r_losses, losses))
    # The one-device process resumes this 2-step pipelined checkpoint with
    # a one-device Trainer and must reach the golden 3-step weights.
    pipe, *_ = trainer_fit(cases[-1], f"{ckpt_dir}/for_one_device", 2)
    np.save(f"{ckpt_dir}/trainer_predictions.npy", pipe.predict(data()[0][0]))
    np.savez(f"{ckpt_dir}/golden_weights.npz", *g_weights)
    return results


def main():
    global DEVICES
    DEVICES = tfmulti.simulate_devices(8)
    out, cases, ckpt_dir = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    goldens = {}
    results = [run(case, goldens) for case in cases]
    trainer_results = trainer_cases(TRAINER_CASES, goldens, ckpt_dir)
    results.append(interchange(cases[-1], ckpt_dir))
    results[-1]["trainer"] = trainer_results
    print(json.dumps(results[-1]))
    for r in results[:-1]:
        print(json.dumps({k: r[k] for k in ("case", "cuts", "loss_diff",
                                             "weight_diff", "group_diff",
                                             "bytes_per_device")}))
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
