"""`tfmulti doctor`: is this install, machine and cluster fit to train?

    tfmulti doctor [--replicas N] [--tolerance T] [--only CHECK ...]
    python -m tfmulti.doctor ...

Checks, in order, each printed as one `ok` / `FAIL` line:

- versions: TensorFlow, Keras, TFDS, absl against the ranges tfmulti
  declares (its installed requirements);
- devices: CPUs, GPUs, whether TensorFlow was built with CUDA (NCCL), and
  GPUs that the driver shows but TensorFlow does not;
- cluster: the cluster this process would join (TF_CONFIG, SLURM or
  Kubernetes, read by `tfmulti.cluster`), whether every address resolves and
  whether this task's port is free;
- trainer, fit: a 1-vs-N-replica self-check on this install: the same few
  steps of a small model on one device and on N replicas (N GPUs, else N
  simulated CPU devices), with `tfmulti.Trainer` and with Keras `fit`
  through `tfmulti.keras.distributed`; the max weight difference must be
  within the tolerance, and training must have moved the weights (an
  update that does nothing would otherwise match itself). Each device
  layout runs in its own process (TensorFlow fixes it once per process),
  both at once.

Exit status 0 only when every check passes; otherwise 1, and the last line
names the failed checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from tfmulti import quiet_logging

CHECKS = ("versions", "devices", "cluster", "trainer", "fit")
_PACKAGES = ("tensorflow", "keras", "tensorflow-datasets", "absl-py")
# Environment variables that describe a cluster: the self-check processes
# run alone, whatever cluster this one would join.
_CLUSTER_ENV = ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS",
                "TFMULTI_NUM_WORKERS")
_SELFCHECK_STEPS = 8
_SELFCHECK_BATCH = 16
_SELFCHECK_TIMEOUT_SECONDS = 150
_SELFCHECK_LEARNING_RATE = 0.1
# The self-check's 8 SGD steps move some weight by ~0.1 (measured); an
# update that moves none by this much did nothing.
_MIN_WEIGHT_CHANGE = 1e-3


@dataclasses.dataclass(frozen=True)
class Result:
    """One check: its name, whether it holds, and what was found."""

    name: str
    ok: bool
    detail: str


def _requirements() -> dict[str, str]:
    """tfmulti's declared version ranges, by package name."""
    try:
        lines = importlib.metadata.requires("tfmulti") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    ranges = {}
    for line in lines:
        if ";" in line:  # extras ("; extra == 'test'")
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", line).group(0)
        ranges[name.lower().replace("_", "-")] = line[len(name):].strip()
    return ranges


def _satisfies(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    return SpecifierSet(spec).contains(version, prereleases=True)


def check_versions(ranges: dict[str, str] | None = None) -> Result:
    """Installed versions against tfmulti's declared ranges (or `ranges`:
    {package: specifier})."""
    ranges = _requirements() if ranges is None else ranges
    found, bad = [], []
    for package in _PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            bad.append(f"{package} is not installed")
            continue
        found.append(f"{package} {version}")
        spec = ranges.get(package)
        if spec and not _satisfies(version, spec):
            bad.append(f"{package} {version} is outside {spec}")
    supported = ", ".join(f"{p}{ranges[p]}" for p in _PACKAGES if p in ranges)
    detail = ", ".join(found) + (
        f" (supported: {supported})" if supported
        else " (tfmulti is not installed, so no declared ranges to check)")
    if bad:
        return Result("versions", False, "; ".join(bad) + ". Install a "
                      f"supported pair: pip install -e . ({supported})")
    return Result("versions", True, detail)


def _driver_gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def check_devices() -> Result:
    """Devices TensorFlow sees, CUDA/NCCL, and GPUs it misses."""
    import tensorflow as tf
    cpus = len(tf.config.list_physical_devices("CPU"))
    gpus = len(tf.config.list_physical_devices("GPU"))
    cuda = tf.test.is_built_with_cuda()
    nccl = ("NCCL available (CUDA build)" if cuda and gpus else
            "NCCL: not used (no GPU)" if not gpus else
            "NCCL: unavailable (TensorFlow built without CUDA)")
    detail = (f"{cpus} CPU, {gpus} GPU; {os.cpu_count()} cores; "
              f"built with CUDA: {cuda}; {nccl}")
    driver = _driver_gpus()
    if driver > gpus:
        return Result("devices", False, f"{detail}. nvidia-smi lists "
                      f"{driver} GPU(s) that TensorFlow does not see: install "
                      "tensorflow[and-cuda] (pip install -e '.[gpu]') or "
                      "check CUDA_VISIBLE_DEVICES.")
    return Result("devices", True, detail)


def _source(environ) -> str:
    if environ.get("TF_CONFIG", "").strip():
        return "TF_CONFIG"
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return "SLURM"
    if "TFMULTI_NUM_WORKERS" in environ:
        return "Kubernetes (TFMULTI_NUM_WORKERS)"
    return None


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _is_local(host: str) -> bool:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if address.startswith("127."):
        return True
    return host in (socket.gethostname(), socket.getfqdn())


def check_cluster(environ=None) -> Result:
    """The cluster this process would join, its addresses and its port."""
    from tfmulti import cluster as cluster_lib
    environ = os.environ if environ is None else environ
    source = _source(environ)
    if source is None:
        return Result("cluster", True, "single process (no TF_CONFIG, SLURM "
                      "or Kubernetes variables)")
    try:
        config = cluster_lib.cluster_config(environ=environ)
    except ValueError as e:
        return Result("cluster", False, f"{source}: {e}")
    problems = []
    for address in config.worker_addresses:
        host, _, port = address.rpartition(":")
        try:
            socket.getaddrinfo(host, int(port))
        except OSError as e:
            problems.append(f"{address} does not resolve ({e.strerror or e})")
    mine = config.tf_config()["cluster"].get(config.task_type, [])
    if config.task_index < len(mine):
        host, _, port = mine[config.task_index].rpartition(":")
        if _is_local(host) and not _port_free("", int(port)):
            problems.append(f"this task's port {port} is in use (another "
                            "job, or a stale worker of this one)")
    detail = (f"{source}: task {config.task_type}:{config.task_index} of "
              f"{config.num_workers} worker(s), chief: {config.is_chief}, "
              f"workers {', '.join(config.worker_addresses)}")
    if problems:
        return Result("cluster", False, f"{detail}; " + "; ".join(problems))
    return Result("cluster", True, detail)


def _selfcheck_worker(replicas: int, use_gpus: bool, out: str,
                      learning_rate: float = _SELFCHECK_LEARNING_RATE
                      ) -> None:
    """Trains the self-check model with the Trainer and with fit; saves the
    weights before (`<name>0_<i>`) and after (`<name>_<i>`) each."""
    from tfmulti import devices
    if replicas > 1 and not use_gpus:
        devices.simulate_devices(replicas)
    import keras
    import numpy as np
    import tensorflow as tf
    from tfmulti import data, keras as tfmulti_keras, strategies, training

    if replicas == 1:
        strategy = strategies.create_strategy(
            "one_device", devices=["/gpu:0" if use_gpus else "/cpu:0"])
    else:
        strategy = strategies.create_strategy(
            "mirrored", **({"num_gpus": replicas} if use_gpus else {}))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = rng.integers(0, 4, size=256).astype("int32")

    def dataset_fn(input_context):
        del input_context
        return tf.data.Dataset.from_tensor_slices((x, y))

    def batches():
        return data.distribute_dataset(
            strategy, dataset_fn, global_batch_size=_SELFCHECK_BATCH,
            shuffle_buffer=0)

    def model_and_optimizer():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)])
        return model, keras.optimizers.SGD(learning_rate, momentum=0.9)

    results = {}
    with strategy.scope():
        model, optimizer = model_and_optimizer()
    results["trainer0"] = model.get_weights()
    training.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=4,
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)).fit(
        batches(), steps=_SELFCHECK_STEPS, verbose=0)
    results["trainer"] = model.get_weights()
    with strategy.scope():
        model, optimizer = model_and_optimizer()
        model.compile(optimizer=optimizer, steps_per_execution=4,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    results["fit0"] = model.get_weights()
    tfmulti_keras.distributed(model).fit(
        batches(), epochs=1, steps_per_epoch=_SELFCHECK_STEPS, verbose=0)
    results["fit"] = model.get_weights()
    np.savez(out, **{f"{k}_{i}": w for k, ws in results.items()
                     for i, w in enumerate(ws)})


def _gpu_count() -> int:
    import tensorflow as tf
    return len(tf.config.list_physical_devices("GPU"))


def _moved(weights, name):
    """Largest change of any weight of run `name` between before and after."""
    import numpy as np
    return max(float(np.max(np.abs(weights[k] - weights[f"{name}0_" + k[
        len(name) + 1:]]))) for k in weights.files
        if k.startswith(f"{name}_"))


def check_equivalence(replicas: int, tolerance: float,
                      names=("trainer", "fit"), *,
                      learning_rates=None) -> list[Result]:
    """The self-check: one device vs `replicas`, in two processes at once.

    Args:
      replicas: N, the replicas compared with one device.
      tolerance: the largest weight difference allowed.
      names: which self-checks ("trainer", "fit").
      learning_rates: {1: lr, N: lr}, to break a run on purpose (doctor's
        own test); default the self-check's 0.1 for both.
    """
    import numpy as np
    gpus = _gpu_count()
    use_gpus = gpus >= replicas > 1
    layout = (f"{replicas} GPUs" if use_gpus else
              f"{replicas} simulated CPU replicas")
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_ENV}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory(prefix="tfmulti-doctor-") as tmp:
        outs = {n: os.path.join(tmp, f"{n}.npz") for n in (1, replicas)}
        procs = {n: subprocess.Popen(
            [sys.executable, "-m", "tfmulti.doctor", "_selfcheck", str(n),
             str(int(use_gpus)), out, str((learning_rates or {}).get(
                 n, _SELFCHECK_LEARNING_RATE))], env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for n, out in outs.items()}
        failures = {}
        try:
            for n, proc in procs.items():
                try:
                    output, _ = proc.communicate(
                        timeout=_SELFCHECK_TIMEOUT_SECONDS)
                except subprocess.TimeoutExpired:
                    failures[n] = (f"timed out after "
                                   f"{_SELFCHECK_TIMEOUT_SECONDS} s")
                    continue
                if proc.returncode:
                    tail = output.strip().splitlines()[-1:] or [""]
                    failures[n] = f"exited {proc.returncode}: {tail[0]}"
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                proc.wait()
        if failures:
            detail = "; ".join(f"the {n}-replica run {why}"
                               for n, why in failures.items())
            return [Result(name, False, detail) for name in names]
        golden, distributed = (np.load(outs[1]), np.load(outs[replicas]))
        results = []
        for name in names:
            keys = [k for k in golden.files if k.startswith(f"{name}_")]
            diff = max(float(np.max(np.abs(golden[k] - distributed[k])))
                       for k in keys)
            moved = {n: _moved(w, name) for n, w in ((1, golden),
                                                      (replicas, distributed))}
            still = [f"{n} device(s): {m:.1e}" for n, m in moved.items()
                     if not m >= _MIN_WEIGHT_CHANGE]
            detail = (f"{layout} vs 1 device, {_SELFCHECK_STEPS} steps: max "
                      f"weight difference {diff:.1e} (tolerance "
                      f"{tolerance:.0e}); weights moved by up to "
                      f"{moved[1]:.1e}")
            if diff > tolerance:
                detail += (f". The {replicas} replicas train differently from "
                           "one device: this install's distributed step is "
                           "wrong (see docs/conformance.md)")
            if still:
                detail += (f". Training did not move the weights (largest "
                           f"change on {', '.join(still)}; at least "
                           f"{_MIN_WEIGHT_CHANGE:g} expected): an update that "
                           "does nothing would pass the comparison, so it "
                           "proves nothing")
            results.append(Result(name, diff <= tolerance and not still,
                                  detail))
    return results


def run(*, only=CHECKS, replicas: int = 2, tolerance: float = 1e-5,
        stream=None) -> list[Result]:
    """Runs the checks in `only`, printing one line each."""
    stream = stream or sys.stdout
    results = []

    def report(result):
        results.append(result)
        print(f"  {'ok  ' if result.ok else 'FAIL'}  {result.name}: "
              f"{result.detail}", file=stream, flush=True)

    for name, check in (("versions", check_versions),
                        ("devices", check_devices),
                        ("cluster", check_cluster)):
        if name in only:
            try:
                report(check())
            except Exception as e:  # a check that crashes has failed
                report(Result(name, False, f"{type(e).__name__}: {e}"))
    selfchecks = tuple(n for n in ("trainer", "fit") if n in only)
    if selfchecks:
        for result in check_equivalence(replicas, tolerance, selfchecks):
            report(result)
    return results


def _parser():
    parser = argparse.ArgumentParser(
        prog="tfmulti doctor",
        description="Check the install, devices and cluster, and that N "
        "replicas train like one device here. Exit 0 only if all hold.")
    parser.add_argument("--replicas", type=int, default=2,
                        help="replicas of the self-check (GPUs if there are "
                        "that many, else simulated CPU devices) (default: "
                        "%(default)s)")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest weight difference allowed between one "
                        "device and N replicas (default: %(default)s)")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=CHECKS,
                        metavar="CHECK", help=f"run only these of {CHECKS}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tfmulti` (subcommand `doctor`) and of this module."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_selfcheck"]:
        _selfcheck_worker(int(argv[1]), bool(int(argv[2])), argv[3],
                          *map(float, argv[4:5]))
        return 0
    if argv[:1] == ["doctor"]:
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        print(f"tfmulti: unknown command {argv[0]!r}; the command is "
              "`tfmulti doctor` (see --help).", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    # Before the checks import TensorFlow: its start-up lines off.
    quiet_logging.quiet([])
    if args.replicas < 2:
        _parser().error(f"`--replicas` is {args.replicas}; the self-check "
                        "compares N >= 2 replicas with one device.")
    began = time.monotonic()
    print("tfmulti doctor", flush=True)
    results = run(only=args.only, replicas=args.replicas,
                  tolerance=args.tolerance)
    failed = [r.name for r in results if not r.ok]
    seconds = time.monotonic() - began
    if failed:
        print(f"FAILED: {', '.join(failed)} ({len(failed)} of "
              f"{len(results)} checks, {seconds:.0f} s)", flush=True)
        return 1
    print(f"all {len(results)} checks passed in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
