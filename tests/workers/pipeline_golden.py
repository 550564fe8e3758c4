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
import shutil
import sys
import time

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
            "optimizer_layout": trainer.runner.pipeline.optimizer_layout,
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


# (S:M:D) pipelines trained by Keras `fit` through tfmulti.keras.distributed.
KERAS_CASES = ["2:2:1", "2:2:2"]
KERAS_EPOCHS = 2


def keras_golden():
    """Plain Keras fit of the unsplit model on one device: per-epoch losses
    and accuracy, weights, evaluation and predictions after KERAS_EPOCHS;
    then the weights after one more epoch (the one-device process resumes
    the pipelined backup for it)."""
    with tf.device(DEVICES[0]):
        model = make_model("mlp")
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"])
        history = model.fit(dataset(), epochs=KERAS_EPOCHS,
                            steps_per_epoch=STEPS, verbose=0,
                            validation_data=dataset())
        result = {
            "history": history.history, "weights": model.get_weights(),
            "evaluate": model.evaluate(dataset(), verbose=0,
                                       return_dict=True),
            "predictions": model.predict(data()[0][0], verbose=0)}
        model.fit(dataset(), epochs=KERAS_EPOCHS + 1,
                  initial_epoch=KERAS_EPOCHS, steps_per_epoch=STEPS,
                  verbose=0)
        result["next_epoch_weights"] = model.get_weights()
    return result


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(a, b))


def keras_refusals(pipe, km):
    """The texts of what Keras fit of a pipeline refuses, by argument."""
    said = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as e:
            said[name] = str(e)

    catch("class_weight", lambda: km.fit(dataset(), class_weight={0: 2.0},
                                         verbose=0))
    catch("jit_compile", lambda: km.compile(jit_compile=True))
    catch("optimizer", lambda: km.compile(
        optimizer=keras.optimizers.SGD(0.1)))
    catch("x", lambda: km.fit(data()[0][0], data()[1][0], verbose=0))
    catch("drop_remainder", lambda: km.fit(
        tf.data.Dataset.from_tensor_slices(data()).unbatch().batch(5),
        verbose=0))
    catch("micro_batches", lambda: km.fit(
        tf.data.Dataset.from_tensor_slices(data()).unbatch().batch(
            6, drop_remainder=True), verbose=0))
    catch("distributed_jit_compile", lambda: tfmulti.keras.distributed(
        pipe, jit_compile=True))
    catch("inner_model", lambda: tfmulti.keras.distributed(pipe.model))
    return said


def keras_cases(cases, ckpt_dir):
    """Keras fit of PipelinedModels vs plain Keras fit on one device; the
    backup it wrote resumed by the Trainer over a new pipeline (and, in
    pipeline_restore.py, by one-device Keras fit)."""
    golden_run = keras_golden()
    results = {}
    for case in cases:
        S, M, D = (int(p) for p in case.split(":")[:3])
        pipe = pipeline.PipelinedModel(
            make_model("mlp"),
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=loss_fn(), num_stages=S, micro_batches=M, data_parallel=D,
            verbose=False)
        km = tfmulti.keras.distributed(pipe)
        # Two steps per call over 3-step epochs: a full and a short chunk.
        km.compile(metrics=["sparse_categorical_accuracy"],
                   steps_per_execution=2)
        backup_dir = f"{ckpt_dir}/keras_{case.replace(':', '_')}"
        history = km.fit(
            dataset(), epochs=KERAS_EPOCHS, steps_per_epoch=STEPS, verbose=0,
            validation_data=dataset(),
            callbacks=[tfmulti.keras.BackupAndRestore(
                backup_dir, delete_on_end=False)])
        evaluated = km.evaluate(dataset(), verbose=0, return_dict=True)
        predictions = km.predict(data()[0][0], verbose=0)
        g = golden_run
        results[case] = {
            "weight_diff": _max_diff(km.get_weights(), g["weights"]),
            "loss_diff": _max_diff(history.history["loss"],
                                   g["history"]["loss"]),
            "val_loss_diff": _max_diff(history.history["val_loss"],
                                       g["history"]["val_loss"]),
            "losses": history.history["loss"],
            "golden_losses": g["history"]["loss"],
            "accuracy_diff": _max_diff(
                history.history["sparse_categorical_accuracy"],
                g["history"]["sparse_categorical_accuracy"]),
            "evaluate_diff": max(abs(evaluated[k] - g["evaluate"][k])
                                 for k in g["evaluate"]),
            "predict_diff": _max_diff([predictions], [g["predictions"]]),
            "group_diff": max([0.0] + [
                _max_diff([v.numpy() for v in pipe._trainable[0][s]],
                          [v.numpy() for v in pipe._trainable[d][s]])
                for d in range(1, D) for s in range(S)]),
            "steps": int(km.optimizer.iterations.numpy()),
        }
    # The last case's backup, restored by the Trainer over a new pipeline:
    # it trains nothing more (step 6 of 6), predicts as `km` did and holds
    # the same optimizer state.
    trainer_pipe = pipeline.PipelinedModel(
        make_model("mlp"), optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=loss_fn(), num_stages=S, micro_batches=M, data_parallel=D,
        verbose=False)
    # A copy: pipeline_restore.py resumes the original with one-device fit.
    trainer_dir = shutil.copytree(backup_dir, f"{backup_dir}_trainer")
    trainer = tfmulti.Trainer(trainer_pipe, model_dir=trainer_dir)
    restored = trainer.fit(dataset().repeat(), steps=KERAS_EPOCHS * STEPS,
                           verbose=0)
    results[case]["trainer_steps_run"] = len(restored["step_loss"])
    results[case]["trainer_predict_diff"] = _max_diff(
        [trainer_pipe.predict(data()[0][0])], [predictions])
    results[case]["trainer_optimizer_diff"] = _max_diff(
        [v.numpy() for v in trainer.runner.pipeline.optimizer_view.variables],
        [v.numpy() for v in pipe.checkpoint_optimizer()[0].variables])
    # One more epoch's steps (the backup has no iterator: the Trainer skips
    # the 6 batches used) reach plain Keras's weights after epoch 3.
    trainer.fit(dataset().repeat(), steps=(KERAS_EPOCHS + 1) * STEPS,
                verbose=0)
    results[case]["trainer_next_epoch_weight_diff"] = _max_diff(
        trainer_pipe.model.get_weights(), g["next_epoch_weights"])
    # The reverse: the Trainer's step-9 checkpoint, resumed by Keras fit of
    # a new pipeline, is epoch 3 of 3: nothing left, plain Keras's weights.
    reverse_dir = shutil.copytree(trainer_dir, f"{backup_dir}_reverse")
    reverse = tfmulti.keras.distributed(pipeline.PipelinedModel(
        make_model("mlp"), optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=loss_fn(), num_stages=S, micro_batches=M, data_parallel=D,
        verbose=False))
    history = reverse.fit(
        dataset(), epochs=KERAS_EPOCHS + 1, steps_per_epoch=STEPS, verbose=0,
        callbacks=[tfmulti.keras.BackupAndRestore(reverse_dir)])
    results[case]["from_trainer_epochs_run"] = len(history.history.get(
        "loss", []))
    results[case]["from_trainer_step"] = int(
        reverse.optimizer.iterations.numpy())
    results[case]["from_trainer_weight_diff"] = _max_diff(
        reverse.get_weights(), g["next_epoch_weights"])
    np.save(f"{ckpt_dir}/keras_predictions.npy", predictions)
    np.savez(f"{ckpt_dir}/keras_next_epoch_weights.npz",
             *g["next_epoch_weights"])
    results["backup_dir"] = backup_dir
    results["refusals"] = keras_refusals(pipe, km)
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
    start = time.perf_counter()
    results[-1]["keras"] = keras_cases(KERAS_CASES, ckpt_dir)
    results[-1]["keras"]["seconds"] = time.perf_counter() - start
    print(json.dumps(results[-1]))
    for r in results[:-1]:
        print(json.dumps({k: r[k] for k in ("case", "cuts", "loss_diff",
                                             "weight_diff", "group_diff",
                                             "bytes_per_device")}))
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
