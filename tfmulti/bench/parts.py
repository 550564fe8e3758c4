"""One benchmark part in a fresh process, its figures as a JSON line.

TensorFlow fixes its devices (and a worker's collectives) once per process,
so `python -m tfmulti.bench` runs every device layout here:

    python -m tfmulti.bench.parts NAME '{"keyword": "arguments"}'

prints `RESULT_PREFIX` followed by the part's result as JSON on one line;
`run_part` is the parent's side: it starts such processes and reads them.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time

from tfmulti import launch_processes

RESULT_PREFIX = "TFMULTI_BENCH_RESULT "


def run_part(name, kwargs, *, timeout, envs=({},)):
    """Runs part `name` in one process per entry of `envs`, concurrently.

    Returns the parsed result of each process, in order. Every process is
    killed when the first fails, at `timeout`, or at the end.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    command = [sys.executable, "-m", "tfmulti.bench.parts", name,
               json.dumps(kwargs)]
    procs = []
    try:
        for extra in envs:
            # This tfmulti, whichever is installed; quiet TensorFlow logs.
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **extra)
            env["PYTHONPATH"] = os.pathsep.join(
                [root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
            procs.append(subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = []
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                out, _ = proc.communicate(
                    timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{name} {kwargs} ran past {timeout:.0f} s"
                                   " (--timeout)") from None
            if proc.returncode != 0:
                raise RuntimeError(f"{name} {kwargs} exited "
                                   f"{proc.returncode}:\n{out[-3000:]}")
            outputs.append(parse_result(out))
        return outputs
    finally:
        for proc in procs:
            launch_processes.kill_group(proc)


def _input_pipeline(*, replicas, **kwargs):
    import tfmulti
    devices = tfmulti.simulate_devices(replicas)
    from tfmulti.bench import input_pipeline
    strategy = tfmulti.create_strategy("mirrored", devices=devices)
    return input_pipeline.measure(strategy, **kwargs)


# name: (module of tfmulti.bench, its function), or a function here. The
# module is imported in the part's own process only (TensorFlow fixes its
# devices on first use).
PARTS = {
    "step_overhead": ("step_overhead", "run"),
    "step_overhead_layouts": ("step_overhead", "run_layouts"),
    "input_pipeline": _input_pipeline,
    "communication": ("communication", "worker_main"),
    "accumulation_memory": ("accumulation_memory", "measure"),
    "soak": ("soak", "run"),
    "pipeline_bubble": ("pipeline_bubble", "measure"),
    "communication_reduction": ("communication_reduction", "worker_main"),
    "balance": ("balance", "worker_main"),
    "data_service": ("data_service", "worker_main"),
    "sharding": ("sharding", "measure"),
}


def _part_function(name):
    part = PARTS[name]
    if callable(part):
        return part
    module, function = part
    return getattr(importlib.import_module(f"tfmulti.bench.{module}"),
                   function)


def parse_result(output: str) -> dict:
    """The result a part printed, from its whole output."""
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise ValueError("the part printed no result line; its output ends:\n"
                     + output[-3000:])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or argv[0] not in PARTS:
        raise SystemExit(f"usage: python -m tfmulti.bench.parts "
                         f"{{{','.join(PARTS)}}} ['<JSON kwargs>'], got "
                         f"{argv!r}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    kwargs = json.loads(argv[1]) if len(argv) == 2 else {}
    result = _part_function(argv[0])(**kwargs)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
