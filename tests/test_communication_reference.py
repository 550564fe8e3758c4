"""tfmulti's local SGD, DiLoCo and PowerSGD against independent numpy
references written from the papers (tests/communication_reference.py).

One pair of worker processes (2 workers x 2 simulated CPU replicas on
loopback) and, beside it, one process with 4 mirrored replicas each train
their cases through the Trainer (tests/workers/communication_reference.py)
for 24 updates on per-step, per-replica batches; the numpy references feed
their simulated replicas the same examples and must give every worker's
weights and every step's loss within 1e-5.
"""

import json
import threading

import numpy as np
import pytest

from tests import communication_reference as reference
from tests.subproc import run_python, run_workers

WORKER = "tests/workers/communication_reference.py"
# float32 (tfmulti) against float64 (reference) over 24 updates: measured at
# most 3.6e-6 (Adam's normalised step turns the relative float32 error of
# small gradient entries into absolute weight error; SGD-momentum cases at
# most 8e-7).
TOLERANCE = 1e-5
# A reference this far from synchronous training shows the case exercises
# the algorithm: the comparison could fail.
DIFFERENT = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("communication_reference")
    mirrored = {}
    # The mirrored process runs beside the worker pair (it is small).
    thread = threading.Thread(target=lambda: mirrored.update(result=run_python(
        [WORKER, "mirrored", str(out / "mirrored{index}.json")],
        timeout=600, check=False)))
    thread.start()
    try:
        run_workers([WORKER, "multi_worker", str(out / "worker{index}.json")],
                    2, timeout=600)
    finally:
        thread.join()
    rc, output = mirrored["result"]
    assert rc == 0, output[-4000:]
    return {"multi_worker": [json.loads((out / f"worker{i}.json").read_text())
                             for i in (0, 1)],
            "mirrored": [json.loads((out / "mirrored0.json").read_text())]}


def _optimizer(config):
    if config["class"] == "SGD":
        return lambda: reference.SGD(config["learning_rate"],
                                     momentum=config["momentum"],
                                     nesterov=config["nesterov"])
    assert config["class"] == "Adam", config
    return lambda: reference.Adam(config["learning_rate"],
                                  beta_1=config["beta_1"],
                                  beta_2=config["beta_2"],
                                  epsilon=config["epsilon"])


def _data(run):
    return reference.make_data(**run["settings"])


def run_reference(run, case):
    """The reference's (weights of each worker, loss per step) for `case`
    of a worker's results `run`, configured from the settings tfmulti ran
    with."""
    x, y = _data(run)
    config = run[case]
    initial = [np.array(w) for w in run["initial"]]
    make_optimizer = _optimizer(config["optimizer"])
    steps = run["settings"]["steps"]
    if "sync" in config:
        sync, outer = config["sync"], config["sync"]["outer_optimizer"]
        result = reference.local_sgd(
            initial, x, y, steps=steps, num_workers=run["layout"][0],
            every=sync["every"], warmup_steps=sync["warmup_steps"],
            make_optimizer=make_optimizer,
            outer_learning_rate=outer and outer["learning_rate"],
            outer_momentum=outer["momentum"] if outer else 0.0,
            outer_nesterov=outer["nesterov"] if outer else True)
        return result["workers"], result["loss"]
    options = config["compression"]
    assert options["warm_start"] and options["error_feedback"], options
    shapes = [w.shape for w in initial]
    compressed = [i for i, s in enumerate(shapes) if reference.compressed_rank(
        s, options["rank"], options["min_compression_rate"])]
    # The reference's choice of dense tensors must be tfmulti's.
    assert [[*reference.matrix_view(shapes[i]), reference.compressed_rank(
        shapes[i], options["rank"], options["min_compression_rate"])]
        for i in compressed] == config["compressed"]
    result = reference.powersgd(
        initial, x, y, steps=steps, make_optimizer=make_optimizer,
        rank=options["rank"],
        min_compression_rate=options["min_compression_rate"],
        start_iter=options["start_iter"],
        initial_q={i: np.array(q) for i, q in zip(compressed,
                                                   config["initial_q"])})
    return [result["weights"]] * run["layout"][0], result["loss"]


def synchronous_reference(run, case):
    """Plain synchronous data parallelism with the case's inner optimizer."""
    x, y = _data(run)
    result = reference.local_sgd(
        [np.array(w) for w in run["initial"]], x, y,
        steps=run["settings"]["steps"], num_workers=1, every=1,
        warmup_steps=0, make_optimizer=_optimizer(run[case]["optimizer"]))
    return result["workers"][0]


def max_difference(a, b):
    return max(np.abs(np.asarray(u, np.float64) - v).max()
               for u, v in zip(a, b))


CASES = {
    "multi_worker": ["local_h4_momentum", "diloco_h4_adam_warmup2",
                     "powersgd_r1_momentum_start3", "powersgd_r2_adam"],
    "mirrored": ["local_h4_adam_warmup2", "diloco_h4_momentum_warmup2",
                 "powersgd_r1_adam_start3", "powersgd_r2_momentum"],
}


@pytest.mark.slow
def test_layouts_and_data_placement(runs):
    """Each replica got the examples the reference feeds it."""
    assert [run["layout"] for run in runs["multi_worker"]] == [[2, 4]] * 2
    assert runs["mirrored"][0]["layout"] == [1, 4]
    for layout in runs.values():
        assert all(run["placement"] for run in layout)
        assert sorted(k for k in layout[0] if k in CASES["multi_worker"]
                      + CASES["mirrored"]) == sorted(
            CASES["multi_worker"] if len(layout) == 2 else CASES["mirrored"])


@pytest.mark.slow
@pytest.mark.parametrize("layout,case", [(layout, case) for layout, cases
                                         in CASES.items() for case in cases])
def test_equals_reference(runs, layout, case):
    workers, loss = run_reference(runs[layout][0], case)
    assert len(loss) >= 20
    for index, run in enumerate(runs[layout]):
        assert run[case]["replicas_equal"]
        assert max_difference(run[case]["weights"],
                               workers[index]) <= TOLERANCE, index
        assert max_difference([run[case]["loss"]], [loss]) <= TOLERANCE
    from_synchronous = max_difference(workers[0], synchronous_reference(
        runs[layout][0], case))
    if layout == "mirrored" and case.startswith("local_"):
        # One worker: nothing to average, local SGD is synchronous training
        # (as docs/communication.md says).
        assert from_synchronous <= 1e-12
    else:
        # Not synchronous training under another name: the comparison
        # could fail.
        assert from_synchronous > DIFFERENT


@pytest.mark.slow
def test_local_sgd_workers_apart_between_synchronisations(runs):
    """The 2-update warm-up case ends 2 updates after a synchronisation:
    the workers' weights differ, each as its reference worker's."""
    first, second = (run["diloco_h4_adam_warmup2"]["weights"]
                     for run in runs["multi_worker"])
    assert max_difference(first, [np.array(w) for w in second]) > DIFFERENT


@pytest.mark.slow
def test_diloco_on_one_worker_stays_on_the_worker(runs):
    """One worker: DiLoCo's outer step (above: equal to the reference's
    k=1) all-reduces the deltas over the local replicas after updates 6,
    10, ..., 22 (warm-up 2, H=4), besides the 24 gradient all-reduces;
    nothing goes between workers."""
    traffic = runs["mirrored"][0]["diloco_h4_momentum_warmup2"][
        "communication"]
    parameters = sum(np.size(w) for w in runs["mirrored"][0]["initial"])
    gradients = runs["mirrored"][0]["local_h4_adam_warmup2"]["communication"]
    assert gradients["all_reduce_calls"] == 24
    assert traffic["all_reduce_calls"] == 24 + 5
    assert traffic["all_reduce_bytes"] == gradients["all_reduce_bytes"] + (
        5 * 4 * parameters)
    assert traffic["inter_worker_calls"] == traffic["inter_worker_bytes"] == 0


def test_reference_gradient_is_the_derivative():
    """The reference's backward pass against central differences."""
    rng = np.random.default_rng(1)
    weights = [rng.normal(size=s) for s in ((3, 5), (5,), (5, 2), (2,))]
    x, y = rng.normal(size=(4, 3)), np.array([0, 1, 1, 0])
    _, grads = reference.mlp_losses_and_gradients(weights, x, y)
    for i, w in enumerate(weights):
        numeric = np.zeros_like(w)
        for index in np.ndindex(w.shape):
            for sign in (1, -1):
                shifted = [v.copy() for v in weights]
                shifted[i][index] += sign * 1e-6
                numeric[index] += sign * reference.mlp_losses_and_gradients(
                    shifted, x, y)[0].mean() / 2e-6
        np.testing.assert_allclose(grads[i], numeric, atol=1e-8)


def test_reference_powersgd_full_rank_is_the_mean():
    """At rank min(m, n) the projection is exact: PowerSGD sends the mean
    and leaves no error; at rank 1 it does not, and the error holds the
    rest."""
    rng = np.random.default_rng(2)
    grads = [[rng.normal(size=(6, 4)), rng.normal(size=(4,))]
             for _ in range(3)]
    mean = [np.mean([g[i] for g in grads], axis=0) for i in range(2)]
    for rank, exact in ((4, True), (1, False)):
        reducer = reference.PowerSGDReducer(
            [(6, 4), (4,)], replicas=3, rank=rank, min_compression_rate=0.1,
            start_iter=0, initial_q={0: rng.normal(size=(4, rank))})
        out = reducer.reduce(grads)
        np.testing.assert_allclose(out[1], mean[1])
        assert np.allclose(out[0], mean[0]) == exact
        assert np.linalg.matrix_rank(out[0]) == rank
        # Every replica's error is what its share lost: they sum to the
        # dropped part of the sum.
        np.testing.assert_allclose(
            np.sum([e[0] for e in reducer.errors], axis=0),
            3 * (mean[0] - out[0]), atol=1e-12)
